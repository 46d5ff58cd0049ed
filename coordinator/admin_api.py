"""What a long-running coordinator offers its operator: the contract between the admin channel
(coordinator/admin_service.py: mTLS gRPC, the operator's certificate, signed requests) and the
coordinator that serves jobs (ops/coordinator_serve.py), which implements it.

Every method either answers or raises `AdminError` with one line the operator reads as is
(an unknown job, a duplicate, an unsigned policy, ...).
"""

from __future__ import annotations

from typing import Any, Protocol

from fedsilo.coordinator.jobs import JobInfo

OPERATOR = "operator"  # the common name of the operator's TLS certificate, its envelope sender


class AdminError(ValueError):
    """An admin request that cannot be met; its message is the whole answer."""


class AdminBackend(Protocol):
    def submit(self, policy_text: str, signature: str, submitted_by: str) -> JobInfo:
        """Verify the operator's signature and the policy's fields, then queue it as a job."""
        ...

    def retry(self, job_id: str, attempt: int, signature: str, submitted_by: str) -> JobInfo:
        """Queue attempt `attempt` at ended job `job_id`'s signed policy as a new job, once the
        operator's `signature` of that attempt verifies."""
        ...

    def jobs(self) -> list[JobInfo]: ...

    def job(self, job_id: str) -> JobInfo: ...

    def awaiting(self, job_id: str) -> list[dict[str, Any]]:
        """Whom job `job_id` waits for now, if it runs (coordinator/hub.py `Awaited`), as
        {"silo": str, "task_id": str or None (its join), "since": unix s, "until": unix s}."""
        ...

    def progress(self, job_id: str) -> dict[str, Any] | None:
        """How far job `job_id` got: {"round": its last saved round, "rounds": the rounds its
        policy plans (int or None)}; None before its first round was saved."""
        ...

    def abort(self, job_id: str) -> JobInfo: ...

    def logs(self, job_id: str, tail: int | None) -> str:
        """The job's coordinator log (its last `tail` lines when given)."""
        ...

    def log_lines(self, job_id: str, offset: int) -> dict[str, Any]:
        """The job's coordinator log from byte `offset` on, whole lines only: {"text": str,
        "offset": where the next request reads from, "status": the job's status, "ended": bool,
        true once the job has ended (its log then grows no more)}."""
        ...

    def results(self, job_id: str) -> dict[str, bytes]:
        """The files of an ended job's results folder, by path relative to it."""
        ...

    def cross_site(self, job_id: str) -> dict[str, Any]:
        """Job `job_id`'s cross-site validation matrix from the state file, as `fedsilo job
        validate --json` prints it (ops/cross_site_view.py `job_cross_site`); AdminError when
        its policy asks for none (`evaluation.cross_site`) or it has none yet."""
        ...

    def roster(self) -> dict[str, str]:
        """The coordinator's signed roster as {"roster": text, "signature": hex}; AdminError
        when its kit has none (provisioned before rosters were signed)."""
        ...

    def install_roster(self, text: str, signature: str) -> dict[str, Any]:
        """Take a newer roster the operator signed, keep it in the kit and apply its revocations
        as `fedsilo coordinator revoke` does; {"version": int, "silos": [...], "revoked":
        {silo: reason}}."""
        ...

    def consortium_status(self) -> dict[str, Any]:
        """The consortium now, as `fedsilo status --json` prints it (`consortium_document` in
        ops/status.py; docs/how-to/operator.md, "Scripting the admin CLI")."""
        ...
