"""`fedsilo coordinator start`: the coordinator of a provisioned consortium as a service.

It verifies the operator's signature on the policy, opens the state store (resuming a
deployment that was interrupted), serves mTLS gRPC on the kit's address (no insecure port),
waits for the silos to join and accept the policy, runs the rounds, and tells the silos when
the deployment is complete. Messages it accepted are remembered in the state file, so a
restarted coordinator refuses their replay. A consortium (less revoked silos) smaller than
`participants.min_silos` is refused before serving, and a run in which every round failed is
an error (nothing is written to `--out`). Revocations written to the state store by
`fedsilo coordinator revoke` take effect within a second, also in a running coordinator, and
`fedsilo_silos_connected` follows agents that come and go within a second too. The server's
certificate is read again when its file changes (ops/server_credentials.py: a renewed
certificate serves new connections, the job goes on), its days left are the gauge
`fedsilo_certificate_expiry_days{party="coordinator"}`, and an expired one is refused at start.

The consortium and the job are separate: the wire (envelopes, joining) and revocations belong
to the consortium, while the rounds, checkpoints, participants, task ids and metric labels
belong to the job (`ops/job_id.py`: the policy's name and a short digest of the signed policy),
so one state file holds every job of the consortium and a new policy starts a new job.
`coordinator serve` (ops/coordinator_serve.py) runs job after job through the same pieces:
`open_serving` (what lives as long as the process), `prepare_job`, `check_job` and `run_job`.

A job that ends failed or aborted after at least one completed round still gets results
(`write_partial_results`): the model of its last completed round and the history as the state
store holds it (every saved round, failed ones too, so each silo's epsilon is the last it
reported), with results.json marked partial under the top-level key `ended`:
`{"status": "failed" | "aborted", "reason": ..., "partial": true, "model_round": K,
"last_round": L, "rounds": N}` (K: the last completed round, whose model it holds; L: the last
round saved, completed or failed; N: the rounds the policy planned).
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import grpc

from fedsilo.coordinator.engine import (
    EngineObserver,
    QuorumWait,
    RoundEngine,
    RoundRecord,
    RunAborted,
    RunHistory,
)
from fedsilo.coordinator.grpc_transport import GrpcTransport
from fedsilo.coordinator.hub import DEFAULT_HEARTBEAT_WINDOW_S, SiloHub
from fedsilo.coordinator.replay_store import ReplayStore
from fedsilo.coordinator.service import CoordinatorService, SignedPolicy, handler
from fedsilo.coordinator.staggered_sends import StaggeredSends
from fedsilo.coordinator.state import StateStore
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.strategies.base import Strategy
from fedsilo.coordinator.strategies.references import Central
from fedsilo.ops.epsilon import ledger_anchors
from fedsilo.ops.job_id import job_id
from fedsilo.ops.memory import make_room_for
from fedsilo.ops.metrics import CoordinatorMetrics, MetricsServer, serve_metrics
from fedsilo.ops.provision import CoordinatorKit, load_coordinator_kit
from fedsilo.ops.report import MARKER, atomic_directory, write_deployment_results
from fedsilo.ops.server_credentials import reloading_server_credentials
from fedsilo.ops.shown_metrics import MetricDisplay, ShownRounds
from fedsilo.ops.synthetic import snapshots_for
from fedsilo.ops.tracking import TrackTarget, deployment_tracking
from fedsilo.policies.loading import parse_policy_text
from fedsilo.policies.model import with_init_folder
from fedsilo.policies.schema import Policy
from fedsilo.privacy.certificate_files import TlsFileWatch
from fedsilo.privacy.identity import noise_secret
from fedsilo.privacy.policy_signing import signature_path, verify_policy
from fedsilo.wire.envelope import MAX_AGE_S, EnvelopeVerifier

log = logging.getLogger("fedsilo.coordinator")

REVOKED = "revoked"


class DeploymentError(RuntimeError):
    """The deployment cannot start or go on (unsigned policy, too few silos, ...)."""


class JobRefused(DeploymentError):
    """Too few silos accepted the job's policy, and some refused it: `refusals` holds each
    refusing silo's reason, the message one short line naming them."""

    def __init__(
        self, accepted: int, wanted: int, min_silos: int, refusals: Mapping[str, str]
    ) -> None:
        self.refusals = dict(sorted(refusals.items()))
        super().__init__(
            f"refused by {', '.join(self.refusals)}: {accepted} of {wanted} silos accepted the "
            f"policy, min_silos is {min_silos}"
        )


@dataclass(frozen=True)
class CoordinatorOptions:
    kit: Path
    policy: Path
    state: Path
    metrics_port: int | None = None
    join_timeout_s: float = 600.0
    poll_seconds: float = 5.0
    heartbeat_window_s: float = DEFAULT_HEARTBEAT_WINDOW_S
    max_payload_bytes: int = 1 << 30
    linger_s: float = 0.0  # keep serving (metrics, "finished" to silos) after the last round
    out: Path | None = None  # where the final model and history are written
    overwrite: bool = False  # replace earlier fedsilo results in `out` (never anything else)
    track: tuple[TrackTarget, ...] = ()  # where the job is tracked (ops/tracking.py)
    sends: str = "concurrent"  # or "staggered": coordinator/staggered_sends.py


def run_coordinator(options: CoordinatorOptions, stop: threading.Event | None = None) -> RunHistory:
    stop = stop or threading.Event()
    kit = load_coordinator_kit(options.kit)
    job = prepare_job(
        signed_policy(options.policy, kit), str(options.policy), options.policy.parent
    )
    serving = open_serving(
        kit,
        options.state,
        options.metrics_port,
        options.poll_seconds,
        options.max_payload_bytes,
        job.signed,
        workers=2 * len(kit.silos) + 8,
        heartbeat_window_s=options.heartbeat_window_s,
        sends=options.sends,
    )
    serving.metrics.deployment = job.id
    serving.metrics.set_privacy(
        job.policy.privacy.epsilon_cap, job.policy.privacy.differentially_private
    )
    try:
        check_job(serving, job)
        threading.Thread(
            target=watch,
            args=(stop, serving.revocations, serving.connections, serving.certificate),
            daemon=True,
            name="watchers",
        ).start()
        serving.server.start()
        log.info(
            "coordinator of %s serving mTLS gRPC on %s (job %s)",
            kit.consortium,
            kit.address,
            job.id,
        )
        with deployment_tracking(
            options.track, kit.consortium, job.id, job.policy, job.signed.digest
        ) as tracking:
            history, snapshots = run_job(serving, job, options.join_timeout_s, observers=[tracking])
            serving.hub.finish()
            require_a_completed_round(history)
            if options.out is not None:
                write_deployment_results(
                    options.out, job.policy, history, snapshots, options.overwrite, job.id
                )
            tracking.finish(history, options.out)
        log.info("job %s complete at round %d", job.id, history.final.round)
        log_audit_anchors(job.id, history)
        stop.wait(max(options.poll_seconds + 1.0, options.linger_s))  # silos hear "finished"
        return history
    finally:
        stop.set()
        close_serving(serving)


def log_audit_anchors(job: str, history: RunHistory) -> None:
    """The rounds that failed, if any (never lost silently), and each silo's last reported
    ledger head: the anchor a privacy officer audits its ledger against (`fedsilo privacy
    audit --ledger FILE --anchor HEAD`)."""
    failed = history.failed_note()
    if failed is not None:
        log.warning("job %s: %s", job, failed)
    for silo, (round_no, head) in ledger_anchors([*history.records, history.final]).items():
        log.info(
            "job %s: silo %s's audit anchor (its ledger head at round %d): %s",
            job,
            silo,
            round_no,
            head,
        )


@dataclass(frozen=True)
class Job:
    """One signed policy to run, checked and parsed, with its id (ops/job_id.py)."""

    id: str
    signed: SignedPolicy
    policy: Policy
    strategy: Strategy


def prepare_job(signed: SignedPolicy, source: str, folder: Path | None = None) -> Job:
    """The job that runs `signed` (its signature, and its attempt's, already verified); a
    policy whose fields do not check, or that only a simulation may run, is refused.
    `folder`: the policy file's, which a relative `model.init.file` is read from (a submitted
    job has none)."""
    policy = with_init_folder(parse_policy_text(signed.text, source=source), folder)
    strategy = make_strategy(policy)
    if isinstance(strategy, Central):
        raise DeploymentError(
            "algorithm 'central' pools every silo's data: a simulation reference only"
        )
    return Job(job_id(policy.name, signed.digest, signed.attempt), signed, policy, strategy)


@dataclass
class Serving:
    """What a coordinator holds while it serves its consortium, one job or many: the state
    store, the replay memory, the hub, the envelope verifier, the gRPC service and server,
    the metrics and the watchers of revocations, connections and the server's certificate."""

    kit: CoordinatorKit
    store: StateStore
    replays: ReplayStore
    hub: SiloHub
    verifier: EnvelopeVerifier
    service: CoordinatorService
    metrics: CoordinatorMetrics
    metrics_server: MetricsServer | None
    server: grpc.Server
    revocations: RevocationWatcher
    connections: ConnectionGauge
    certificate: TlsFileWatch

    def use_kit(self, kit: CoordinatorKit) -> None:
        """Take the kit's roster as it is now (a silo enrolled since joins the next job);
        revoked silos stay out."""
        self.kit = kit
        self.hub.set_roster(sorted(kit.silos))
        self.service.roster = kit.roster
        self.revocations.kit = kit
        self.revocations.sync()


def open_serving(
    kit: CoordinatorKit,
    state: Path,
    metrics_port: int | None,
    poll_seconds: float,
    max_payload_bytes: int,
    policy: SignedPolicy | None,
    workers: int,
    heartbeat_window_s: float = DEFAULT_HEARTBEAT_WINDOW_S,
    listen: str | None = None,
    metrics_host: str = "127.0.0.1",
    sends: str = "concurrent",
) -> Serving:
    """Everything but the server's start; `policy`: the one job's (None: jobs come later); a
    silo silent for `heartbeat_window_s` is gone (coordinator/hub.py); the server listens on
    `listen` (None: the kit's address) and the metrics on `metrics_host`; `sends`: whether
    large tasks leave side by side or one at a time (coordinator/staggered_sends.py). An
    expired server certificate is refused first (`CertificateError`)."""
    certificate = server_certificate(kit)
    store = StateStore(state)
    try:
        store.open_consortium(kit.consortium)
    except BaseException:
        store.close()
        raise
    replays = ReplayStore(state, MAX_AGE_S)
    metrics = CoordinatorMetrics()
    metrics.watch_certificate("coordinator", certificate.days_left)
    hub = SiloHub(sorted(kit.silos), heartbeat_window_s=heartbeat_window_s)
    metrics.watch_silos(hub.heard_ages, heartbeat_window_s, lambda: frozenset(hub.revoked))
    verifier = EnvelopeVerifier(
        kit.consortium,
        {name: silo.verify_key for name, silo in kit.silos.items()},
        max_age_s=MAX_AGE_S,
        max_payload_bytes=max_payload_bytes,
        memory=replays,
    )
    service = CoordinatorService(
        kit.consortium,
        hub,
        verifier,
        kit.signing_key,
        policy,
        metrics,
        max_payload_bytes,
        poll_seconds,
        more_jobs=policy is None,
        roster=kit.roster,
        sends=StaggeredSends() if sends == "staggered" else None,
    )
    server = grpc_server(kit, service, workers, certificate, listen)
    metrics_server = (
        serve_metrics(metrics.registry, metrics_port, metrics_host)
        if metrics_port is not None
        else None
    )
    return Serving(
        kit,
        store,
        replays,
        hub,
        verifier,
        service,
        metrics,
        metrics_server,
        server,
        RevocationWatcher(store, kit.consortium, hub, verifier, kit, metrics),
        ConnectionGauge(hub, metrics),
        certificate,
    )


def server_certificate(kit: CoordinatorKit) -> TlsFileWatch:
    """The kit's server certificate, key and CA, read again when renewed."""
    return TlsFileWatch(
        kit.tls.ca_certificate, kit.tls.certificate, kit.tls.private_key, "coordinator", log
    )


def close_serving(serving: Serving) -> None:
    serving.hub.finish()
    serving.server.stop(grace=1.0).wait()
    serving.replays.close()
    serving.store.close()
    if serving.metrics_server is not None:
        serving.metrics_server.close()


def check_job(serving: Serving, job: Job) -> None:
    """Open the job in the state store (a job saved earlier resumes) and refuse it when the
    consortium, less its revoked silos, cannot meet its quorum or secure aggregation (its
    group, and the key holder and decryptor it names)."""
    policy = job.policy
    serving.store.open_deployment(job.id, job.signed.digest, policy.model_dump_json())
    serving.revocations.sync()
    members_left = sorted(set(serving.kit.silos) - serving.hub.revoked)
    if len(members_left) < policy.participants.min_silos:
        raise DeploymentError(
            f"participants.min_silos is {policy.participants.min_silos}, but the consortium "
            f"has {len(members_left)} silo(s) not revoked ({', '.join(members_left)}): no "
            "round could reach its quorum; lower participants.min_silos or provision more"
        )
    problem = policy.secure_aggregation_problem(
        len(members_left)
    ) or policy.secure_aggregation.roster_problem(members_left)
    if problem:
        raise DeploymentError(problem)


def run_job(
    serving: Serving,
    job: Job,
    join_timeout_s: float,
    should_stop: Callable[[], str | None] = lambda: None,
    observers: Sequence[EngineObserver] = (),
) -> tuple[RunHistory, dict[int, Any]]:
    """Wait for the silos to accept the job's policy and run its rounds (resuming saved ones),
    each round also handed to `observers` (the job's tracking); returns the history and the
    snapshots its results include (FedEvg's synthetic set)."""
    kit, hub, store, metrics, policy = (
        serving.kit,
        serving.hub,
        serving.store,
        serving.metrics,
        job.policy,
    )
    wanted = len(kit.silos) - len(hub.revoked)
    members = hub.wait_for_members(wanted, join_timeout_s, policy.participants.min_silos)
    stopping = should_stop()
    if stopping is not None:
        raise RunAborted(stopping)
    refusals = dict(hub.refused)
    for silo, reason in refusals.items():
        metrics.set_silo_status(silo, "refused")
        store.set_participant(job.id, silo, "refused", reason)
        log.warning("silo %s is not participating: %s", silo, reason)
    min_silos = policy.participants.min_silos
    if len(members) < min_silos and refusals:
        raise JobRefused(len(members), wanted, min_silos, refusals)
    if len(members) < min_silos:
        gone = sorted(set(hub.offline()) - hub.revoked)
        raise DeploymentError(
            f"{len(members)} of {wanted} silos accepted the policy within "
            f"{join_timeout_s:.0f}s, min_silos is {min_silos}; none refused it; gone (no "
            f"heartbeat for {hub.heartbeat_window_s:g}s): {', '.join(gone) or 'none'}"
        )
    earlier = store.participants(job.id)  # a resumed job keeps its retirements
    for silo in members:
        if earlier.get(silo, ("", ""))[0] == "retired":
            metrics.set_silo_status(silo, "retired")
            continue
        metrics.set_silo_status(silo, "active")
        store.set_participant(job.id, silo, "active")
    snapshots = snapshots_for(policy)
    display = MetricDisplay.of(policy.privacy)
    engine = RoundEngine(
        job.strategy,
        GrpcTransport(hub),
        policy,
        members,
        observers=[
            ShownRounds(metrics, display),
            ShownRounds(_RoundLog(display), display),
            *([snapshots] if snapshots else []),
            *observers,
        ],
        deployment=job.id,
        store=store,
        policy_digest=job.signed.digest,
        secret=noise_secret(kit.signing_key),
        handoff_keys={name: bytes(silo.sealing_public_key) for name, silo in kit.silos.items()},
        should_stop=should_stop,
        make_room=make_room_for,
        wait_for_quorum=quorum_wait(hub, should_stop),
    )
    history = engine.run()
    return history, (snapshots.taken if snapshots else {})


def quorum_wait(hub: SiloHub, should_stop: Callable[[], str | None]) -> QuorumWait:
    """The engine's wait for a quorum of members (`RoundEngine.wait_for_quorum`) through
    `hub`, logging whom it waits for."""

    def wait(silos: Sequence[str], quorum: int, timeout_s: float) -> dict[str, str]:
        missing = hub.wait_for_quorum(silos, quorum, 0)
        if not missing:
            return {}
        log.warning(
            "%d of %d silos can take part, min_silos is %d: waiting up to %gs for %s to come back",
            len(silos) - len(missing),
            len(silos),
            quorum,
            timeout_s,
            ", ".join(missing),
        )
        missing = hub.wait_for_quorum(silos, quorum, timeout_s, should_stop)
        if not missing:
            log.info("the quorum is back: the job goes on")
        return {silo: hub.why_missing(silo) for silo in missing}

    return wait


ENDED_KEY = "ended"  # results.json's key marking the results of a job that did not complete


def saved_history(store: StateStore, job: str) -> RunHistory | None:
    """Job `job`'s history rebuilt from the state store (what a resumed job goes on from):
    every saved round after the setup, the state after the last of them (a failed round keeps
    the state before it, so the model of the last completed round) and, as `final`, the last
    evaluated round (else a record of the last completed round, unevaluated); None when no
    round completed."""
    saved = store.last_round(job)
    if saved is None:
        return None
    records = [RoundRecord.from_json(r) for r in saved.records]
    completed = [r for r in records if r.status == "completed"]
    if not completed:
        return None
    final = next(
        (r for r in reversed(completed) if r.evaluation is not None),
        RoundRecord(completed[-1].round, "final", 0.0),
    )
    return RunHistory(records, saved.state, final)


def write_partial_results(
    out: Path, policy: Policy, store: StateStore, job: str, status: str, reason: str
) -> int | None:
    """Write the results of job `job`, which ended `status` ("failed" or "aborted") for
    `reason`, as of its last completed round to `out` (`write_deployment_results`' layout,
    replacing what is there), results.json marked partial under `ENDED_KEY`; the last completed
    round, or None (nothing written) when no round completed."""
    history = saved_history(store, job)
    if history is None:
        return None
    model_round = max(r.round for r in history.records if r.status == "completed")
    ended = {
        "status": status,
        "reason": reason,
        "partial": True,
        "model_round": model_round,
        "last_round": history.records[-1].round,
        "rounds": policy.rounds,
    }
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix=f".{out.name}.partial.", dir=out.parent) as scratch:
        written = Path(scratch) / "results"
        write_deployment_results(written, policy, history, job=job)
        results = json.loads((written / "results.json").read_text())
        (written / "results.json").write_text(json.dumps({ENDED_KEY: ended, **results}, indent=2))
        with atomic_directory(out, overwrite=True) as staging:
            for path in sorted(written.rglob("*")):
                name = path.relative_to(written)
                if path.is_file() and name.as_posix() != MARKER:
                    (staging / name).parent.mkdir(parents=True, exist_ok=True)
                    shutil.copyfile(path, staging / name)
    return model_round


def require_a_completed_round(history: RunHistory) -> None:
    """Refuse a run in which no round was applied: its "final model" is the initial one, so
    nothing is written to `--out` (the state store keeps every failed round's record)."""
    if history.records and all(r.status == "failed" for r in history.records):
        raise DeploymentError(
            f"every round failed ({len(history.records)} of them), so no model was trained and "
            f"nothing was written to --out; the last failure: {history.records[-1].error}"
        )


class _RoundLog:
    """One log line a round, its metrics as shown (`ShownRounds`: marked when noised)."""

    def __init__(self, display: MetricDisplay) -> None:
        self.display = display

    def on_round(self, record: RoundRecord, total_rounds: int) -> None:
        dropped = {s: why for p in record.phases.values() for s, why in p["dropped"].items()}
        summary = ""
        if record.summary:
            metric = next(iter(record.summary))
            summary = f" mean {self.display.label(metric)} {record.summary[metric]['mean']:.4f}"
        log.info(
            "round %d/%d %s in %.2fs%s%s",
            record.round,
            total_rounds,
            record.status,
            record.seconds,
            summary,
            f" dropped {dropped}" if dropped else "",
        )


def signed_policy(path: Path, kit: CoordinatorKit) -> SignedPolicy:
    """The policy at `path` with its signature, after checking the operator signed it."""
    if not path.is_file():
        raise DeploymentError(f"{path}: policy file not found")
    data, signature = path.read_bytes(), _signature(path)
    digest = verify_policy(data, signature, kit.operator_verify_key)
    return SignedPolicy(data.decode(), signature, digest)


def _signature(policy: Path) -> str:
    sig = signature_path(policy)
    if not sig.is_file():
        raise DeploymentError(
            f"{policy} is not signed: run `fedsilo policy sign {policy} --key operator.key`"
        )
    return sig.read_text().strip()


def grpc_server(
    kit: CoordinatorKit,
    service: CoordinatorService,
    workers: int,
    certificate: TlsFileWatch,
    address: str | None = None,
) -> grpc.Server:
    """The mTLS server on `address` (None: the kit's), serving `certificate` as it is renewed.
    A container or a Kubernetes pod listens on 0.0.0.0:PORT while the silos reach it by the
    name its certificate is issued for (the kit's address)."""
    address = address or kit.address
    credentials = reloading_server_credentials(certificate)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="grpc"),
        options=[
            ("grpc.keepalive_permit_without_calls", 1),
            ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
            # Without BDP probing gRPC keeps its default per-stream receive window instead of
            # growing it to the link's bandwidth-delay product, which on loopback let every
            # uploading silo's whole model sit in gRPC's buffers (bench/transport: peak RSS at
            # 1e7 x 10 silos fell from 1.0 GB to 0.75 GB, round time unchanged).
            ("grpc.http2.bdp_probe", 0),
        ],
    )
    server.add_generic_rpc_handlers((handler(service),))
    if server.add_secure_port(address, credentials) == 0:
        raise DeploymentError(
            f"cannot listen on {address} (in use, or not an address of this host)"
        )
    return server


@dataclass
class RevocationWatcher:
    """Applies revocations to the running coordinator: those written to the state store
    (`fedsilo coordinator revoke`) and those of the kit's signed roster (`fedsilo consortium
    revoke`), which it writes to the state store first, as `coordinator revoke` would."""

    store: StateStore
    deployment: str
    hub: SiloHub
    verifier: EnvelopeVerifier
    kit: CoordinatorKit
    metrics: CoordinatorMetrics

    def sync(self) -> None:
        participants = self.store.participants(self.deployment)
        revoked = {s for s, (status, _) in participants.items() if status == REVOKED}
        signed = {} if self.kit.roster is None else self.kit.roster.document.revoked
        for silo, reason in signed.items():
            if silo not in revoked:
                self.store.set_participant(self.deployment, silo, REVOKED, reason)
                revoked.add(silo)
        for silo in revoked - self.hub.revoked:
            self.hub.revoke(silo)
            self.metrics.set_silo_status(silo, REVOKED)
            log.warning("silo %s is revoked: its messages are refused from now on", silo)
        self.verifier.set_roster(
            {n: s.verify_key for n, s in self.kit.silos.items() if n not in self.hub.revoked}
        )


@dataclass(frozen=True)
class ConnectionGauge:
    """Takes every silo silent for its heartbeat window for gone (its tasks fail at once as
    dropouts, coordinator/hub.py) and keeps `fedsilo_silos_connected` at the silos heard from
    within it, so it drops when an agent leaves."""

    hub: SiloHub
    metrics: CoordinatorMetrics

    def sync(self) -> None:
        self.hub.reap()
        self.metrics.set_connected(len(self.hub.connected()))


class Watcher(Protocol):
    def sync(self) -> None: ...


def watch(stop: threading.Event, *watchers: Watcher) -> None:
    """Bring every watcher up to date once a second until `stop`."""
    while not stop.wait(1.0):
        for watcher in watchers:
            watcher.sync()


def revoke(state: Path, deployment: str, silo: str, reason: str) -> None:
    """Revoke `silo` consortium-wide (`deployment`: the consortium), for every later job too."""
    with StateStore(state) as store:
        store.open_consortium(deployment)
        store.set_participant(deployment, silo, REVOKED, reason)
