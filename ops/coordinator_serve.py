"""`fedsilo coordinator serve`: a long-running coordinator that runs the jobs its operator submits.

One gRPC server (the silos' `Exchange` and the operator's admin channel, both mTLS), one hub,
one envelope verifier and one metrics server live as long as the process; revocations and
connections are watched all the time. Jobs (signed policies, `coordinator/jobs.py`) run one at
a time, in submission order, each exactly as `coordinator start` runs its one policy
(ops/coordinator_process.py: `check_job`, `run_job`); silo agents stay connected between jobs
and join each in turn. A job's results go to `<jobs dir>/<job>/results/` and its log lines to
`<jobs dir>/<job>/coordinator.log` (the jobs dir defaults to `<state stem>.jobs/` beside the
state file). A job that fails ends `failed` with the one-line reason and the next one runs; one
too few silos accept, some refusing it, ends `refused` with each refusal's reason; an aborted
job stops before its next round (its waiting tasks fail at once) and ends `aborted`, its rounds
so far kept in the state file. A job that ends failed or aborted after at least one completed
round still gets results: those of its last completed round, rebuilt from the state file and
marked partial in results.json (`ended`, ops/coordinator_process.py: `write_partial_results`),
so the epsilon its silos spent is on record; one that fails before any round completed, or is
refused, has none. A job that ended failed, refused or aborted runs again as a new
attempt the operator signs (`fedsilo job submit --retry JOB`), a job of its own. The
coordinator kit is read again as soon as its kit.yaml or its signed roster.json changes (and
before each job), so a silo enrolled meanwhile (`fedsilo consortium add-silo`) is admitted
within a second and takes part in the next job; revoked silos stay out. The operator replaces
the signed roster over the admin channel (`fedsilo consortium revoke`: `install_roster`): a
newer version only, kept in the kit, its revocations applied as `fedsilo coordinator revoke`
applies them. Restarted with the same command, the coordinator resumes the job that was
running (bit-identical, from the state file) and keeps the queue.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fedsilo.coordinator.admin_api import AdminError
from fedsilo.coordinator.admin_service import admin_handler
from fedsilo.coordinator.engine import RunAborted
from fedsilo.coordinator.hub import DEFAULT_HEARTBEAT_WINDOW_S, SiloHub
from fedsilo.coordinator.jobs import (
    ABORTED,
    COMPLETED,
    ENDED,
    FAILED,
    REFUSED,
    RUNNING,
    JobError,
    JobInfo,
    JobQueue,
    QueuedPolicy,
)
from fedsilo.coordinator.service import SignedPolicy
from fedsilo.coordinator.state import StateError, StateStore
from fedsilo.ops.coordinator_process import (
    REVOKED,
    DeploymentError,
    Job,
    JobRefused,
    Serving,
    check_job,
    close_serving,
    log_audit_anchors,
    open_serving,
    prepare_job,
    require_a_completed_round,
    signed_policy,
    watch,
    write_partial_results,
)
from fedsilo.ops.coordinator_process import run_job as run_job_rounds
from fedsilo.ops.cross_site_view import job_cross_site
from fedsilo.ops.health import HealthFile
from fedsilo.ops.job_id import job_id as attempt_id
from fedsilo.ops.job_outcomes import count_ended
from fedsilo.ops.memory import give_back_freed_memory
from fedsilo.ops.provision import (
    KIT_FILE,
    CoordinatorKit,
    KitError,
    install_roster,
    load_coordinator_kit,
)
from fedsilo.ops.report import write_deployment_results
from fedsilo.ops.shown_metrics import last_metrics
from fedsilo.ops.status import FROM_COORDINATOR, consortium_document
from fedsilo.ops.tracking import JobTracking, TrackTarget, deployment_tracking
from fedsilo.policies.loading import parse_policy_text
from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.privacy.policy_signing import PolicySignatureError, verify_attempt, verify_policy
from fedsilo.privacy.roster import ROSTER_FILE, RosterError, not_older, verify_roster

log = logging.getLogger("fedsilo.coordinator")

IDLE_WAIT_S = 0.5  # how often an idle coordinator looks at its queue
ABORTED_BY_OPERATOR = "aborted by the operator"
JOB_LOG = "coordinator.log"
MAX_LOG_CHUNK = 1 << 20  # the most of a job's log one `log_lines` reply carries, in bytes
RESULTS = "results"


@dataclass(frozen=True)
class ServeOptions:
    kit: Path
    state: Path
    metrics_port: int | None = None
    poll_seconds: float = 5.0
    join_timeout_s: float = 600.0  # per job
    heartbeat_window_s: float = DEFAULT_HEARTBEAT_WINDOW_S
    max_payload_bytes: int = 1 << 30
    jobs_dir: Path | None = None  # default: `<state stem>.jobs/` beside the state file
    listen: str | None = None  # default: the kit's address
    metrics_host: str = "127.0.0.1"
    health_file: Path | None = None  # ops/health.py
    track: tuple[TrackTarget, ...] = ()  # where each job is tracked (ops/tracking.py)
    sends: str = "concurrent"  # or "staggered": coordinator/staggered_sends.py

    @property
    def jobs_folder(self) -> Path:
        return self.jobs_dir or self.state.with_name(f"{self.state.stem}.jobs")


def serve_coordinator(options: ServeOptions, stop: threading.Event | None = None) -> None:
    """Serve the consortium and run its queued jobs until `stop`."""
    stop = stop or threading.Event()
    kit = load_coordinator_kit(options.kit)
    serving = open_serving(
        kit,
        options.state,
        options.metrics_port,
        options.poll_seconds,
        options.max_payload_bytes,
        None,
        workers=2 * len(kit.silos) + 16,  # room for silos enrolled while serving
        heartbeat_window_s=options.heartbeat_window_s,
        listen=options.listen,
        metrics_host=options.metrics_host,
        sends=options.sends,
    )
    queue = JobQueue(options.state)  # after the StateStore made (or checked) the file
    serving.metrics.watch_jobs(queue.count_by_status)
    health: HealthFile | None = None
    try:
        backend = ServeBackend(serving, queue, options.jobs_folder, options.state)
        serving.server.add_generic_rpc_handlers(
            (
                admin_handler(
                    backend,
                    kit.consortium,
                    kit.operator_verify_key,
                    kit.signing_key,
                    serving.replays,
                    options.max_payload_bytes,
                ),
            )
        )
        aborts = AbortWatcher(queue, serving.hub)
        enrolments = KitWatcher(serving, options.kit)
        threading.Thread(
            target=watch,
            args=(
                stop,
                enrolments,
                serving.revocations,
                serving.connections,
                aborts,
                serving.certificate,
            ),
            daemon=True,
            name="watchers",
        ).start()
        serving.revocations.sync()
        serving.server.start()
        if options.health_file is not None:  # ready from now on: the server is serving
            health = HealthFile(options.health_file, "coordinator", time.time).start()
        log.info(
            "coordinator of %s serving mTLS gRPC on %s; jobs in %s",
            kit.consortium,
            options.listen or kit.address,
            options.jobs_folder,
        )
        while not stop.is_set():
            job = queue.next_to_run()
            if job is None:
                stop.wait(IDLE_WAIT_S)
                continue
            run_queued_job(serving, queue, job, options, stop, enrolments)
    finally:
        stop.set()
        if health is not None:
            health.stop()
        queue.close()
        close_serving(serving)


def run_queued_job(
    serving: Serving,
    queue: JobQueue,
    job_id: str,
    options: ServeOptions,
    stop: threading.Event,
    enrolments: KitWatcher,
) -> None:
    """Run job `job_id` to its end and record how it ended; a job that fails, or is aborted,
    is recorded so and returns. Stopping the coordinator leaves it `running`, to resume. The
    job starts with the coordinator kit as it is on disk then (`enrolments`, which also keeps a
    newer signed roster over an older file)."""
    folder = options.jobs_folder / job_id
    folder.mkdir(parents=True, exist_ok=True)
    handler = _job_log(folder / JOB_LOG)
    hub = serving.hub
    job: Job | None = None
    tracking = JobTracking()  # the job's, once it starts

    def should_stop() -> str | None:
        return "the coordinator is stopping" if stop.is_set() else hub.aborted

    try:
        resumed = queue.job(job_id).status == RUNNING
        queue.mark_running(job_id)
        enrolments.sync()
        job = prepare_job(_signed(queue.policy(job_id)), f"job {job_id}")
        serving.metrics.deployment = job.id
        serving.metrics.set_privacy(
            job.policy.privacy.epsilon_cap, job.policy.privacy.differentially_private
        )
        serving.service.set_job(job.signed, job.id)
        log.info("job %s %s", job.id, "resumes" if resumed else "starts")
        check_job(serving, job)
        tracking = deployment_tracking(
            options.track, serving.kit.consortium, job.id, job.policy, job.signed.digest
        )
        history, snapshots = run_job_rounds(
            serving, job, options.join_timeout_s, should_stop, observers=[tracking]
        )
        require_a_completed_round(history)
        write_deployment_results(
            folder / RESULTS, job.policy, history, snapshots, overwrite=True, job=job.id
        )
        tracking.finish(history, folder / RESULTS)
        log.info("job %s complete at round %d", job.id, history.final.round)
        log_audit_anchors(job.id, history)
        # a job that ran without a silo that refused it still says who did, and why
        queue.mark_ended(job_id, COMPLETED, refusals=_refusals(hub, job_id))
        count_ended(serving.metrics, COMPLETED)
    except Exception as exc:  # noqa: BLE001 (a failing job never stops the server)
        if stop.is_set():
            log.info("job %s stays running: the coordinator is stopping", job_id)
            tracking.end(ABORTED)  # its run goes on when the job resumes
        elif queue.abort_requested(job_id):
            log.warning("job %s aborted by the operator", job_id)
            _keep_partial_results(serving, job, folder / RESULTS, ABORTED, ABORTED_BY_OPERATOR)
            tracking.end(ABORTED, folder / RESULTS)
            queue.mark_ended(job_id, ABORTED, ABORTED_BY_OPERATOR)
            count_ended(serving.metrics, ABORTED)
        elif isinstance(exc, JobRefused):
            log.error("job %s %s", job_id, exc)
            tracking.end(REFUSED)
            queue.mark_ended(job_id, REFUSED, str(exc), exc.refusals)
            count_ended(serving.metrics, REFUSED)
        else:
            reason = _one_line(exc)
            log.error("job %s failed: %s", job_id, reason, exc_info=not _expected(exc))
            _keep_partial_results(serving, job, folder / RESULTS, FAILED, reason)
            tracking.end(FAILED, folder / RESULTS)
            queue.mark_ended(job_id, FAILED, reason, _refusals(hub, job_id))
            count_ended(serving.metrics, FAILED, exc)
    finally:
        serving.service.clear_job()
        logging.getLogger("fedsilo").removeHandler(handler)
        handler.close()
        give_back_freed_memory()  # the job's buffers, kept for its rounds (ops/memory.py)


def _keep_partial_results(
    serving: Serving, job: Job | None, out: Path, status: str, reason: str
) -> None:
    """Write the results of `job`'s last completed round to `out`, marked partial, before the
    job is marked `status` (so its results are there once it reads ended); nothing when no
    round completed. A failure to write them is logged: the job still ends."""
    if job is None:  # its policy never parsed: no round ran
        return
    try:
        model_round = write_partial_results(out, job.policy, serving.store, job.id, status, reason)
    except Exception as exc:  # noqa: BLE001 (the job ends as it did, results or not)
        log.error("job %s: its partial results were not written: %s", job.id, _one_line(exc))
        return
    if model_round is not None:
        log.warning(
            "job %s ended %s: results of its last completed round %d of %d kept in %s",
            job.id,
            status,
            model_round,
            job.policy.rounds,
            out,
        )


def _refusals(hub: SiloHub, job_id: str) -> dict[str, str]:
    """Each silo that refused job `job_id`'s policy (as it joined), and why; none when the job
    ended before the hub started it (its refusals are still the last job's)."""
    return dict(sorted(hub.refused.items())) if hub.job == job_id else {}


@dataclass
class AbortWatcher:
    """Stops the running job within a second of the operator's abort: its waiting tasks fail
    at once and the engine stops before its next round."""

    queue: JobQueue
    hub: SiloHub

    def sync(self) -> None:
        job = self.hub.job
        if job is not None and self.hub.aborted is None and self.queue.abort_requested(job):
            log.warning("job %s: abort requested; stopping it", job)
            self.hub.abort(ABORTED_BY_OPERATOR)


class KitWatcher:
    """Admits a silo as soon as it is enrolled: the coordinator kit is read again whenever its
    kit.yaml or its signed roster.json changes (`consortium add-silo` replaces each atomically);
    a kit that does not read is logged and the roster kept as it was."""

    def __init__(self, serving: Serving, folder: Path) -> None:
        self.serving = serving
        self.paths = (folder / KIT_FILE, folder / ROSTER_FILE)
        self.read_at = self._changed_at()
        self._lock = threading.Lock()  # the watchers' thread and a job's start both sync

    def _changed_at(self) -> tuple[int, ...]:
        return tuple(_modified_ns(path) for path in self.paths)

    def sync(self) -> None:
        with self._lock:
            changed_at = self._changed_at()
            if changed_at != self.read_at:
                self.read_at = changed_at
                self._read_again()

    def _read_again(self) -> None:
        try:
            kit = load_coordinator_kit(self.paths[0].parent)
        except (KitError, OSError) as exc:
            log.error("the coordinator kit changed but does not read (%s); roster kept", exc)
            return
        held = self.serving.kit.roster
        if held is not None and (kit.roster is None or kit.roster.version < held.version):
            log.error(
                "the coordinator kit's roster.json is now %s, older than version %d: roster kept",
                "gone" if kit.roster is None else f"version {kit.roster.version}",
                held.version,
            )
            return
        enrolled = sorted(set(kit.silos) - set(self.serving.kit.silos))
        self.serving.use_kit(kit)
        if enrolled:
            log.info("enrolled silo(s) admitted: %s", ", ".join(enrolled))


class ServeBackend:
    """What the admin channel asks of a serving coordinator (coordinator/admin_api.py)."""

    def __init__(self, serving: Serving, queue: JobQueue, jobs_folder: Path, state: Path) -> None:
        self.serving = serving
        self.queue = queue
        self.jobs_folder = jobs_folder
        self.state = state
        self._roster_lock = threading.Lock()

    def submit(self, policy_text: str, signature: str, submitted_by: str) -> JobInfo:
        return submit_job(self.queue, self.serving.kit, policy_text, signature, submitted_by)

    def retry(self, job_id: str, attempt: int, signature: str, submitted_by: str) -> JobInfo:
        ended = self.job(job_id)
        if attempt != ended.attempt + 1:
            raise AdminError(
                f"job {job_id} is attempt {ended.attempt}: its retry is attempt "
                f"{ended.attempt + 1}, not {attempt}"
            )
        try:
            verify_attempt(
                ended.policy_digest, attempt, signature, self.serving.kit.operator_verify_key
            )
            new_id = attempt_id(ended.name, ended.policy_digest, attempt)
            return self.queue.retry(job_id, new_id, signature, submitted_by)
        except (PolicySignatureError, JobError) as exc:
            raise AdminError(str(exc)) from None

    def jobs(self) -> list[JobInfo]:
        return self.queue.jobs()

    def job(self, job_id: str) -> JobInfo:
        try:
            return self.queue.job(job_id)
        except JobError as exc:
            raise AdminError(str(exc)) from None

    def awaiting(self, job_id: str) -> list[dict[str, Any]]:
        hub = self.serving.hub
        return [dataclasses.asdict(a) for a in hub.awaited()] if hub.job == job_id else []

    def progress(self, job_id: str) -> dict[str, Any] | None:
        with StateStore(self.state) as store:
            saved = store.saved_round(job_id)
            policy = store.deployment_policy(job_id) or {}
            evaluated = store.last_evaluated(job_id)
        if not saved:
            return None
        progress: dict[str, Any] = {"round": saved, "rounds": policy.get("rounds")}
        if evaluated is not None:
            privacy = PrivacyConfig.model_validate(policy.get("privacy") or {})
            progress["metrics"] = last_metrics(evaluated, privacy)
        return progress

    def abort(self, job_id: str) -> JobInfo:
        try:
            info = self.queue.request_abort(job_id)
        except JobError as exc:
            raise AdminError(str(exc)) from None
        if info.status == ABORTED:  # a queued job ends at once; a running one as it stops
            count_ended(self.serving.metrics, ABORTED)
        return info

    def logs(self, job_id: str, tail: int | None) -> str:
        self.job(job_id)
        path = self.jobs_folder / job_id / JOB_LOG
        if not path.is_file():
            return ""
        lines = path.read_text(errors="replace").splitlines(keepends=True)
        return "".join(lines[-tail:] if tail is not None and tail > 0 else lines)

    def log_lines(self, job_id: str, offset: int) -> dict[str, Any]:
        info = self.job(job_id)  # its status before the read: an ended job's log is whole
        if offset < 0:
            raise AdminError(f"log offset {offset}: not a byte offset")
        path = self.jobs_folder / job_id / JOB_LOG
        chunk = b""
        if path.is_file():
            with path.open("rb") as log_file:
                log_file.seek(offset)
                chunk = log_file.read(MAX_LOG_CHUNK)
        ended = info.status in ENDED
        at_end = len(chunk) < MAX_LOG_CHUNK
        # a line still being written comes next time; an ended job's log is whole
        whole = chunk if ended and at_end else chunk[: chunk.rfind(b"\n") + 1]
        return {
            "text": whole.decode(errors="replace"),
            "offset": offset + len(whole),
            "status": info.status,
            "ended": ended and at_end,
        }

    def results(self, job_id: str) -> dict[str, bytes]:
        info = self.job(job_id)
        if info.status not in ENDED:
            raise AdminError(f"job {job_id} has not ended ({info.status}): no results yet")
        folder = self.jobs_folder / job_id / RESULTS
        if not folder.is_dir():
            raise AdminError(f"job {job_id} ended {info.status} without results")
        return {
            path.relative_to(folder).as_posix(): path.read_bytes()
            for path in sorted(folder.rglob("*"))
            if path.is_file()
        }

    def cross_site(self, job_id: str) -> dict[str, Any]:
        info = self.job(job_id)
        policy = parse_policy_text(self.queue.policy(job_id).text)
        with StateStore(self.state) as store:
            record = store.last_evaluated(job_id)
        return job_cross_site(info, policy, record)

    def roster(self) -> dict[str, str]:
        kit = self.serving.kit
        if kit.roster is None:
            raise AdminError(
                f"the coordinator kit {kit.folder} has no signed roster (provisioned before "
                "rosters were signed): `fedsilo consortium add-silo` writes its first; until "
                "then revoke on the coordinator's host with `fedsilo coordinator revoke`"
            )
        return kit.roster.to_json()

    def install_roster(self, text: str, signature: str) -> dict[str, Any]:
        with self._roster_lock:
            kit = self.serving.kit
            try:
                roster = verify_roster(text, signature, kit.operator_verify_key, kit.consortium)
                not_older(roster, kit.roster)
                if kit.roster is not None and roster.version == kit.roster.version:
                    raise RosterError(f"roster version {roster.version} is installed already")
                revoked = set(kit.roster.document.revoked) if kit.roster is not None else set()
                if reinstated := sorted(revoked & set(roster.document.silos)):
                    raise RosterError(f"a revoked silo stays revoked: {', '.join(reinstated)}")
                kit = install_roster(kit.folder, roster)
            except (RosterError, KitError, OSError) as exc:
                raise AdminError(f"roster refused: {_one_line(exc)}") from None
            self.serving.use_kit(kit)  # its revocations go to the state file, as revoke's
        document = roster.document
        log.warning(
            "roster version %d installed; revoked: %s",
            document.version,
            ", ".join(f"{s} ({why})" for s, why in sorted(document.revoked.items())) or "none",
        )
        return {
            "version": document.version,
            "silos": sorted(document.silos),
            "revoked": dict(document.revoked),
        }

    def consortium_status(self) -> dict[str, Any]:
        kit, hub = self.serving.kit, self.serving.hub
        connected = set(hub.connected())
        with StateStore(self.state) as store:
            reasons = {
                silo: why
                for silo, (status, why) in store.participants(kit.consortium).items()
                if status == REVOKED
            }
        silos = {
            silo: {
                "connected": silo in connected,
                "revoked": silo in hub.revoked,
                "reason": reasons.get(silo, ""),
            }
            for silo in kit.silos
        }
        return consortium_document(
            kit.consortium, silos, self.queue.jobs(), self.state, FROM_COORDINATOR
        )


def submit_job(
    queue: JobQueue, kit: CoordinatorKit, policy_text: str, signature: str, submitted_by: str
) -> JobInfo:
    """Queue a policy the operator signed, once its signature and fields check."""
    try:
        digest = verify_policy(policy_text.encode(), signature, kit.operator_verify_key)
        job = prepare_job(SignedPolicy(policy_text, signature, digest), "the submitted policy")
        return queue.submit(
            job.id,
            job.policy.name,
            QueuedPolicy(job.id, policy_text, signature, digest),
            submitted_by,
        )
    except (ValueError, DeploymentError) as exc:  # signature, fields, duplicate, 'central'
        raise AdminError(_one_line(exc)) from None


def submit_local(state: Path, kit: Path, policy: Path, submitted_by: str = "operator") -> JobInfo:
    """Queue the signed policy file `policy` (POLICY.sig beside it) straight into the state
    file of a coordinator on this host (tests, and scripts beside the coordinator)."""
    coordinator_kit = load_coordinator_kit(kit)
    signed = signed_policy(policy, coordinator_kit)
    with StateStore(state):  # makes (or checks) the state file before the queue's table
        pass
    queue = JobQueue(state)
    try:
        return submit_job(queue, coordinator_kit, signed.text, signed.signature, submitted_by)
    finally:
        queue.close()


def _modified_ns(path: Path) -> int:
    try:
        return path.stat().st_mtime_ns
    except OSError:
        return 0


def _signed(queued: QueuedPolicy) -> SignedPolicy:
    return SignedPolicy(
        queued.text, queued.signature, queued.digest, queued.attempt, queued.attempt_signature
    )


def _job_log(path: Path) -> logging.Handler:
    """A handler that copies the "fedsilo" logger's lines to the job's log for its duration."""
    root = logging.getLogger("fedsilo")
    handler = logging.FileHandler(path)
    formatter = next((h.formatter for h in root.handlers if h.formatter is not None), None)
    handler.setFormatter(formatter or logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    root.addHandler(handler)
    return handler


def _one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__


def _expected(exc: Exception) -> bool:
    """An error a job may end with (its policy, its silos, its quorum), not a bug."""
    return isinstance(exc, (DeploymentError, RunAborted, ValueError, StateError, OSError))
