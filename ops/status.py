"""`fedsilo status`: where a consortium and its jobs stand, read from the coordinator's state
file (safe to run beside a live coordinator: SQLite readers do not block it) or asked of a
running coordinator (`consortium_document`, which both forms print as `--json`).

The job shown is the running one, else the one that ended last (whatever its status, also one
that ran no round: refused, or failed before its setup), with its rounds when it ran any. The
document's shape is versioned (`STATUS_SCHEMA`) and documented in docs/how-to/operator.md
("Scripting the admin CLI").
"""

from __future__ import annotations

import math
import sqlite3
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedsilo.coordinator.engine import RoundRecord
from fedsilo.coordinator.jobs import ABORTED, ENDED, QUEUED, RUNNING, JobInfo, recorded_jobs
from fedsilo.coordinator.state import StateError, StateStore
from fedsilo.ops.epsilon import epsilon_by_round, final_epsilons
from fedsilo.ops.shown_metrics import MetricDisplay
from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.privacy.certificate_files import CertificateError, days_left, read_certificate

STATUS_SCHEMA = 1  # the version of the `--json` shapes of `status`, `job list`, `job status`
FROM_COORDINATOR, FROM_STATE_FILE = "coordinator", "state file"  # a document's `source`


@dataclass(frozen=True)
class DeploymentStatus:
    deployment: str
    rounds_planned: int | None
    last_round: int
    last_status: str
    participants: dict[str, tuple[str, str]]
    last_evaluation: dict[str, dict[str, float]]
    evaluated_round: int | None
    dropouts: dict[str, int]  # silo -> rounds in which it dropped at least once (not revoked)
    failed_rounds: int
    epsilon: dict[str, float] = field(default_factory=dict)  # silo -> last epsilon it reported
    epsilon_cap: float | None = None  # the policy's cap per silo (a site may set a lower one)
    # a DP policy: every metric a silo reports carries Gaussian noise; `last_evaluation` holds
    # them as shown, clipped into each metric's range (ops/shown_metrics.py)
    noised: bool = False

    def to_json(self) -> dict[str, Any]:
        """The `progress` of `fedsilo status --json`: standard JSON (an undefined metric is
        null, an epsilon without noise the string "inf")."""
        silos = sorted({*self.participants, *self.dropouts, *self.epsilon, *self.last_evaluation})
        return {
            "deployment": self.deployment,
            "rounds_planned": self.rounds_planned,
            "last_round": self.last_round,
            "last_status": self.last_status,
            "failed_rounds": self.failed_rounds,
            "evaluated_round": self.evaluated_round,
            "epsilon_cap": self.epsilon_cap,
            "noised": self.noised,
            "silos": {
                silo: {
                    "status": self.participants.get(silo, (None, ""))[0],
                    "reason": self.participants.get(silo, (None, ""))[1],
                    "rounds_with_a_dropout": self.dropouts.get(silo, 0),
                    "epsilon": _epsilon_json(self.epsilon.get(silo)),
                    "metrics": {
                        name: value if math.isfinite(value) else None
                        for name, value in self.last_evaluation.get(silo, {}).items()
                    },
                }
                for silo in silos
            },
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> DeploymentStatus:
        silos: Mapping[str, Mapping[str, Any]] = data["silos"]
        return cls(
            deployment=data["deployment"],
            rounds_planned=data["rounds_planned"],
            last_round=data["last_round"],
            last_status=data["last_status"],
            participants={
                s: (str(v["status"]), str(v["reason"]))
                for s, v in silos.items()
                if v["status"] is not None
            },
            last_evaluation={
                s: {m: float(x) for m, x in v["metrics"].items() if x is not None}
                for s, v in silos.items()
                if v["metrics"]
            },
            evaluated_round=data["evaluated_round"],
            dropouts={
                s: int(v["rounds_with_a_dropout"])
                for s, v in silos.items()
                if v["rounds_with_a_dropout"]
            },
            failed_rounds=data["failed_rounds"],
            epsilon={s: float(v["epsilon"]) for s, v in silos.items() if v["epsilon"] is not None},
            epsilon_cap=data["epsilon_cap"],
            noised=data["noised"],
        )


def deployment_status(state: Path, consortium: str, job: JobInfo | None = None) -> DeploymentStatus:
    """Where `job` stands (by default the consortium's latest job or, in a state file written
    before jobs, its one deployment), with the consortium's revocations. A silo that dropped
    because the operator aborted the job did not drop out."""
    if not state.is_file():
        raise StateError(f"{state}: no state file (has the coordinator started?)")
    with StateStore(state) as store:
        deployment = consortium
        if job is not None:
            deployment = job.job_id
        elif store.last_round(consortium) is None:
            deployment = store.latest_job(consortium) or consortium
        saved = store.last_round(deployment)
        participants = store.participants(deployment) if saved is not None else {}
        if deployment != consortium:
            revoked = store.participants(consortium)
            participants.update({s: why for s, why in revoked.items() if why[0] == "revoked"})
        policy = store.deployment_policy(deployment) or {}
    if saved is None:
        raise StateError(f"{state}: deployment {deployment!r} has not started")
    records = saved.records
    evaluated = next((r for r in reversed(records) if r.get("evaluation")), None)
    privacy = PrivacyConfig.model_validate(policy.get("privacy") or {})
    aborted = {job.error} if job is not None and job.status == ABORTED else set()
    return DeploymentStatus(
        deployment=deployment,
        rounds_planned=policy.get("rounds"),
        last_round=saved.round,
        last_status=saved.status,
        participants=participants,
        last_evaluation=MetricDisplay.of(privacy).evaluation(evaluated["evaluation"]) or {}
        if evaluated
        else {},
        evaluated_round=evaluated["round"] if evaluated else None,
        dropouts=_dropouts(records, aborted),
        failed_rounds=sum(1 for r in records if r.get("status") == "failed"),
        epsilon=final_epsilons(epsilon_by_round(RoundRecord.from_json(r) for r in records)),
        epsilon_cap=privacy.epsilon_cap,
        noised=privacy.differentially_private,
    )


def shown_job(jobs: Sequence[JobInfo]) -> JobInfo | None:
    """The job `fedsilo status` shows: the running one, else the one that ended last."""
    running = [job for job in jobs if job.status == RUNNING]
    ended = [job for job in jobs if job.status in ENDED]
    if running:
        return running[0]
    return max(ended, key=lambda job: job.finished_at or 0.0) if ended else None


def consortium_document(
    consortium: str,
    silos: Mapping[str, Mapping[str, Any]],
    jobs: Sequence[JobInfo],
    state: Path,
    source: str,
) -> dict[str, Any]:
    """What `fedsilo status --json` prints: the consortium's silos (`connected` is null when
    read from the state file), its running and queued jobs, the job shown (`shown_job`; from
    a state file without jobs, none) and that job's rounds (its `progress`; null when it ran
    none)."""
    job = shown_job(jobs)
    try:
        progress: DeploymentStatus | None = (
            deployment_status(state, consortium, job) if job is not None or not jobs else None
        )
    except StateError:
        progress = None
    return {
        "schema": STATUS_SCHEMA,
        "consortium": consortium,
        "source": source,
        "silos": {silo: dict(silos[silo]) for silo in sorted(silos)},
        "running": next((j.job_id for j in jobs if j.status == RUNNING), None),
        "queued": [j.job_id for j in jobs if j.status == QUEUED],
        "job": None if job is None else job.to_json(),
        "progress": None if progress is None else progress.to_json(),
    }


def state_file_document(state: Path, consortium: str, silos: Iterable[str]) -> dict[str, Any]:
    """`consortium_document` read from the state file (`connected` unknown: null); a state file
    without jobs (`coordinator start`'s) whose deployment has not started is refused."""
    if not state.is_file():
        raise StateError(f"{state}: no state file (has the coordinator started?)")
    try:
        jobs = recorded_jobs(state)
    except sqlite3.DatabaseError as exc:
        raise StateError(f"{state} is not a readable SQLite state file: {exc}") from None
    if not jobs:
        deployment_status(state, consortium)  # says why there is nothing to show
    with StateStore(state) as store:
        revoked = {
            silo: why
            for silo, (status, why) in store.participants(consortium).items()
            if status == "revoked"
        }
    known = {
        silo: {"connected": None, "revoked": silo in revoked, "reason": revoked.get(silo, "")}
        for silo in silos
    }
    return consortium_document(consortium, known, jobs, state, FROM_STATE_FILE)


def certificate_status(party: str, path: Path) -> dict[str, Any]:
    """The `certificate` a status document adds: the given kit's own TLS certificate, when it
    expires and in how many days (negative once it has); `problem` when it does not read."""
    try:
        certificate = read_certificate(path)
    except CertificateError as exc:
        return {"party": party, "path": str(path), "problem": str(exc)}
    return {
        "party": party,
        "path": str(path),
        "valid_until": certificate.not_valid_after_utc.isoformat(),
        "days_left": round(days_left(certificate), 3),
    }


def _epsilon_json(value: float | None) -> float | str | None:
    return "inf" if value == math.inf else value


def _dropouts(records: list[dict[str, Any]], not_dropouts: set[str]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for record in records:
        dropped = {
            s
            for phase in record.get("phases", {}).values()
            for s, why in phase.get("dropped", {}).items()
            if why not in not_dropouts
        } - set(record.get("revoked", ()))
        for silo in dropped:
            counts[silo] = counts.get(silo, 0) + 1
    return counts
