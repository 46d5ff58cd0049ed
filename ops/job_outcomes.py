"""How a serving coordinator's ended job is counted in its metrics: the status it ended with
and one reason of the fixed set `JOB_END_REASONS` (ops/metrics.py), so the label's values stay
few whatever a failure says. A failure's reason is read from the kind of error it ended with,
never from its text: `consortium` (too few silos joined in time, or the consortium cannot run
the policy: `DeploymentError`), `rounds` (its rounds kept missing their quorum, or its setup
failed: `RunAborted`), `policy` (its policy does not parse or check: `ValueError`), `storage`
(the state file or its results could not be read or written: `StateError`, `OSError`,
`sqlite3.Error`) and `internal` (anything else: a bug worth a report).
"""

from __future__ import annotations

import sqlite3

from fedsilo.coordinator.engine import RunAborted
from fedsilo.coordinator.jobs import ABORTED, COMPLETED, FAILED, REFUSED
from fedsilo.coordinator.state import StateError
from fedsilo.ops.coordinator_process import DeploymentError, JobRefused
from fedsilo.ops.metrics import CoordinatorMetrics

# the one reason of each status that is not a failure
PLAIN_REASONS = {COMPLETED: "none", REFUSED: "silos", ABORTED: "operator"}


def failure_reason(exc: BaseException) -> str:
    """The bucket of a failed job's error (the module's docstring lists them)."""
    if isinstance(exc, RunAborted):
        return "rounds"
    if isinstance(exc, (StateError, OSError, sqlite3.Error)):
        return "storage"
    if isinstance(exc, DeploymentError) and not isinstance(exc, JobRefused):
        return "consortium"
    if isinstance(exc, ValueError):
        return "policy"
    return "internal"


def count_ended(metrics: CoordinatorMetrics, status: str, exc: BaseException | None = None) -> None:
    """Count one job that ended `status`; `exc`: what a failed job failed with."""
    if status == FAILED:
        reason = failure_reason(exc) if exc is not None else "internal"
    else:
        reason = PLAIN_REASONS[status]
    metrics.count_job_ended(status, reason)
