"""The coordinator's job queue: every signed policy submitted to a long-running coordinator
(`fedsilo coordinator serve`), in the `jobs` table of its SQLite state file, so the queue and
the running job outlive a restart.

A job moves `queued -> running -> completed | failed | aborted`; a queued job may also be
aborted before it starts. Jobs run one at a time, oldest submission first; a coordinator
restarted while a job runs finds it `running` and resumes it before taking the next. A job's
id is the policy's name and a short digest of the signed policy (ops/job_id.py is the one
rule), so the same signed policy cannot be queued twice: a job that ran is never silently run
again under the same task ids.

The table sits beside `StateStore`'s (coordinator/state.py), through a connection of its own,
like the replay memory's (coordinator/replay_store.py).
"""

from __future__ import annotations

import sqlite3
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

QUEUED, RUNNING, COMPLETED, FAILED, ABORTED = "queued", "running", "completed", "failed", "aborted"
JOB_STATUSES = (QUEUED, RUNNING, COMPLETED, FAILED, ABORTED)
ENDED = (COMPLETED, FAILED, ABORTED)

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL UNIQUE,
    name TEXT NOT NULL,
    policy_digest TEXT NOT NULL,
    policy_text TEXT NOT NULL,
    signature TEXT NOT NULL,
    submitted_by TEXT NOT NULL,
    status TEXT NOT NULL CHECK (status IN ('queued', 'running', 'completed', 'failed', 'aborted')),
    abort_requested INTEGER NOT NULL DEFAULT 0,
    error TEXT NOT NULL DEFAULT '',
    submitted_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL
);
"""


class JobError(ValueError):
    """A request about jobs that cannot be met (unknown job, a duplicate, an ended job)."""


@dataclass(frozen=True)
class JobInfo:
    """One job as the queue knows it (the policy's text and signature stay in the table)."""

    job_id: str
    name: str
    policy_digest: str
    status: str
    submitted_by: str
    submitted_at: float
    started_at: float | None
    finished_at: float | None
    abort_requested: bool
    error: str

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> JobInfo:
        return cls(**{name: data[name] for name in cls.__dataclass_fields__})


@dataclass(frozen=True)
class QueuedPolicy:
    """What running a job needs: its id and the operator-signed policy exactly as submitted."""

    job_id: str
    text: str
    signature: str
    digest: str


class JobQueue:
    """The `jobs` table of the state file at `path`."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            self.path, timeout=30.0, isolation_level=None, check_same_thread=False
        )
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def submit(self, job_id: str, name: str, policy: QueuedPolicy, submitted_by: str) -> JobInfo:
        """Queue a verified, signed policy as job `job_id`; a job id already known is refused."""
        with self._lock:
            known = self._row(job_id)
            if known is not None:
                raise JobError(
                    f"job {job_id} was already submitted ({known['status']}): the same signed "
                    "policy runs once; change the policy's name or seed and sign it again"
                )
            self._db.execute(
                "INSERT INTO jobs (job_id, name, policy_digest, policy_text, signature, "
                "submitted_by, status, submitted_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    job_id,
                    name,
                    policy.digest,
                    policy.text,
                    policy.signature,
                    submitted_by,
                    QUEUED,
                    time.time(),
                ),
            )
            return self._info(job_id)

    def jobs(self) -> list[JobInfo]:
        """Every job, in submission order."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs ORDER BY seq").fetchall()
        return [_info(row) for row in rows]

    def job(self, job_id: str) -> JobInfo:
        with self._lock:
            return self._info(job_id)

    def policy(self, job_id: str) -> QueuedPolicy:
        with self._lock:
            row = self._require(job_id)
        return QueuedPolicy(job_id, row["policy_text"], row["signature"], row["policy_digest"])

    def next_to_run(self) -> str | None:
        """The job to run now: one left `running` by an interrupted coordinator (resumed
        first), else the oldest queued one; None when there is nothing to run."""
        with self._lock:
            row = self._db.execute(
                "SELECT job_id FROM jobs WHERE status IN (?, ?) "
                "ORDER BY status = ? DESC, seq LIMIT 1",
                (RUNNING, QUEUED, RUNNING),
            ).fetchone()
        return None if row is None else str(row["job_id"])

    def mark_running(self, job_id: str) -> JobInfo:
        with self._lock:
            self._db.execute(
                "UPDATE jobs SET status = ?, started_at = COALESCE(started_at, ?) WHERE job_id = ?",
                (RUNNING, time.time(), job_id),
            )
            return self._info(job_id)

    def mark_ended(self, job_id: str, status: str, error: str = "") -> JobInfo:
        if status not in ENDED:
            raise ValueError(f"a job ends as one of {', '.join(ENDED)}, not {status!r}")
        with self._lock:
            self._db.execute(
                "UPDATE jobs SET status = ?, error = ?, finished_at = ? WHERE job_id = ?",
                (status, error, time.time(), job_id),
            )
            return self._info(job_id)

    def request_abort(self, job_id: str) -> JobInfo:
        """Abort a queued job at once; ask a running one to stop (its runner ends it as
        `aborted` at the next check); an ended job is refused."""
        with self._lock:
            row = self._require(job_id)
            if row["status"] in ENDED:
                raise JobError(f"job {job_id} has already ended ({row['status']})")
            if row["status"] == QUEUED:
                self._db.execute(
                    "UPDATE jobs SET status = ?, abort_requested = 1, finished_at = ?, "
                    "error = 'aborted by the operator before it started' WHERE job_id = ?",
                    (ABORTED, time.time(), job_id),
                )
            else:
                self._db.execute("UPDATE jobs SET abort_requested = 1 WHERE job_id = ?", (job_id,))
            return self._info(job_id)

    def abort_requested(self, job_id: str) -> bool:
        with self._lock:
            return bool(self._require(job_id)["abort_requested"])

    def _row(self, job_id: str) -> sqlite3.Row | None:
        return self._db.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()

    def _require(self, job_id: str) -> sqlite3.Row:
        row = self._row(job_id)
        if row is None:
            raise JobError(f"no job {job_id!r} on this coordinator (see `fedsilo job list`)")
        return row

    def _info(self, job_id: str) -> JobInfo:
        return _info(self._require(job_id))


def _info(row: sqlite3.Row) -> JobInfo:
    return JobInfo(
        job_id=row["job_id"],
        name=row["name"],
        policy_digest=row["policy_digest"],
        status=row["status"],
        submitted_by=row["submitted_by"],
        submitted_at=row["submitted_at"],
        started_at=row["started_at"],
        finished_at=row["finished_at"],
        abort_requested=bool(row["abort_requested"]),
        error=row["error"],
    )
