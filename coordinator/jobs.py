"""The coordinator's job queue: every signed policy submitted to a long-running coordinator
(`fedsilo coordinator serve`), in the `jobs` table of its SQLite state file, so the queue and
the running job outlive a restart.

A job moves `queued -> running -> completed | failed | refused | aborted` (`refused`: too few
silos accepted its policy and some refused it, each saying why); a queued job may also be
aborted before it starts. Jobs run one at a time, oldest submission first; a coordinator
restarted while a job runs finds it `running` and resumes it before taking the next. A job's
id is the policy's name, a short digest of the signed policy and, from the second attempt on,
the attempt (ops/job_id.py is the one rule), so the same signed policy is queued once: a job
that ran is never silently run again under the same task ids. A job that ended failed, refused
or aborted is run again only as a new attempt (`retry`), which the operator signs
(privacy/policy_signing.py `sign_attempt`) and every silo checks.

The table sits beside `StateStore`'s (coordinator/state.py), through a connection of its own,
like the replay memory's (coordinator/replay_store.py); a table written before attempts and
refusals were recorded is rebuilt with them when the queue opens it, its jobs kept.
"""

from __future__ import annotations

import json
import sqlite3
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

QUEUED, RUNNING, COMPLETED = "queued", "running", "completed"
FAILED, REFUSED, ABORTED = "failed", "refused", "aborted"
JOB_STATUSES = (QUEUED, RUNNING, COMPLETED, FAILED, REFUSED, ABORTED)
ENDED = (COMPLETED, FAILED, REFUSED, ABORTED)
RETRYABLE = (FAILED, REFUSED, ABORTED)  # what `job submit --retry` runs again

_SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL UNIQUE,
    name TEXT NOT NULL,
    policy_digest TEXT NOT NULL,
    policy_text TEXT NOT NULL,
    signature TEXT NOT NULL,
    attempt INTEGER NOT NULL DEFAULT 1 CHECK (attempt >= 1),
    attempt_signature TEXT NOT NULL DEFAULT '',
    submitted_by TEXT NOT NULL,
    status TEXT NOT NULL CHECK (
        status IN ('queued', 'running', 'completed', 'failed', 'refused', 'aborted')
    ),
    abort_requested INTEGER NOT NULL DEFAULT 0,
    error TEXT NOT NULL DEFAULT '',
    refusals TEXT NOT NULL DEFAULT '{}',
    submitted_at REAL NOT NULL,
    started_at REAL,
    finished_at REAL,
    UNIQUE (policy_digest, attempt)
)
"""
# The columns of a jobs table written before attempts and refusals were recorded.
_FIRST_COLUMNS = (
    "seq, job_id, name, policy_digest, policy_text, signature, submitted_by, status, "
    "abort_requested, error, submitted_at, started_at, finished_at"
)


class JobError(ValueError):
    """A request about jobs that cannot be met (unknown job, a duplicate, an ended job)."""


@dataclass(frozen=True)
class JobInfo:
    """One job as the queue knows it (the policy's text and signature stay in the table).
    `error`: why it failed, was refused or aborted, one line; `refusals`: each silo that
    refused its policy, and why."""

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
    attempt: int = 1
    refusals: Mapping[str, str] = field(default_factory=dict)

    @property
    def note(self) -> str:
        """The one line a table shows beside the job ("" when there is nothing to say)."""
        if self.status == RUNNING and self.abort_requested:
            return "abort requested"
        return self.error

    def to_json(self) -> dict[str, Any]:
        """The job as `fedsilo job list --json` shows it (docs/how-to/operator.md, "Scripting
        the admin CLI")."""
        return {**asdict(self), "refusals": dict(self.refusals), "note": self.note}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> JobInfo:
        known = {name: data[name] for name in cls.__dataclass_fields__ if name in data}
        return cls(**known)


@dataclass(frozen=True)
class QueuedPolicy:
    """What running a job needs: its id, the operator-signed policy exactly as submitted, and
    which attempt at it this is (from the second on, with the operator's signature of it)."""

    job_id: str
    text: str
    signature: str
    digest: str
    attempt: int = 1
    attempt_signature: str = ""


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
        _create_or_upgrade(self._db)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def submit(self, job_id: str, name: str, policy: QueuedPolicy, submitted_by: str) -> JobInfo:
        """Queue a verified, signed policy as job `job_id`; a policy submitted before is
        refused (its latest attempt named, which `retry` may run again)."""
        with self._lock:
            latest = self._latest_attempt(policy.digest)
            if latest is not None or self._row(job_id) is not None:
                known = latest if latest is not None else self._require(job_id)
                raise JobError(
                    f"job {known['job_id']} was already submitted ({known['status']}): the same "
                    "signed policy runs once; to run it again after it failed, was refused or "
                    f"aborted: `fedsilo job submit --retry {known['job_id']}`; to run it anew, "
                    "change the policy's name or seed and sign it again"
                )
            self._insert(job_id, name, policy, submitted_by)
            return self._info(job_id)

    def retry(
        self, job_id: str, new_job_id: str, attempt_signature: str, submitted_by: str
    ) -> JobInfo:
        """Queue the next attempt at job `job_id`'s signed policy as `new_job_id`, with the
        operator's signature of that attempt (checked by the caller and by every silo): only
        the policy's latest attempt, and only once it ended failed, refused or aborted."""
        with self._lock:
            row = self._require(job_id)
            latest = self._latest_attempt(row["policy_digest"])
            assert latest is not None  # `row` is one of its attempts
            if latest["job_id"] != job_id:
                raise JobError(
                    f"job {job_id} was retried already: the latest attempt at its policy is "
                    f"{latest['job_id']} ({latest['status']})"
                )
            if row["status"] not in RETRYABLE:
                raise JobError(
                    f"job {job_id} is {row['status']}: --retry runs again only a job that "
                    "failed, was refused or was aborted"
                )
            policy = QueuedPolicy(
                new_job_id,
                row["policy_text"],
                row["signature"],
                row["policy_digest"],
                row["attempt"] + 1,
                attempt_signature,
            )
            self._insert(new_job_id, row["name"], policy, submitted_by)
            return self._info(new_job_id)

    def jobs(self) -> list[JobInfo]:
        """Every job, in submission order."""
        with self._lock:
            rows = self._db.execute("SELECT * FROM jobs ORDER BY seq").fetchall()
        return [_info(row) for row in rows]

    def job(self, job_id: str) -> JobInfo:
        with self._lock:
            return self._info(job_id)

    def count_by_status(self) -> dict[str, int]:
        """How many jobs are in each status (every status named, 0 when none is)."""
        with self._lock:
            rows = self._db.execute("SELECT status, COUNT(*) FROM jobs GROUP BY status").fetchall()
        counts = dict.fromkeys(JOB_STATUSES, 0)
        counts.update({str(status): int(n) for status, n in rows})
        return counts

    def policy(self, job_id: str) -> QueuedPolicy:
        with self._lock:
            row = self._require(job_id)
        return QueuedPolicy(
            job_id,
            row["policy_text"],
            row["signature"],
            row["policy_digest"],
            row["attempt"],
            row["attempt_signature"],
        )

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

    def mark_ended(
        self,
        job_id: str,
        status: str,
        error: str = "",
        refusals: Mapping[str, str] | None = None,
    ) -> JobInfo:
        """Record how the job ended: `error` one line, `refusals` each refusing silo's reason."""
        if status not in ENDED:
            raise ValueError(f"a job ends as one of {', '.join(ENDED)}, not {status!r}")
        with self._lock:
            self._db.execute(
                "UPDATE jobs SET status = ?, error = ?, refusals = ?, finished_at = ? "
                "WHERE job_id = ?",
                (status, error, json.dumps(dict(refusals or {})), time.time(), job_id),
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

    def _insert(self, job_id: str, name: str, policy: QueuedPolicy, submitted_by: str) -> None:
        self._db.execute(
            "INSERT INTO jobs (job_id, name, policy_digest, policy_text, signature, attempt, "
            "attempt_signature, submitted_by, status, submitted_at) "
            "VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (
                job_id,
                name,
                policy.digest,
                policy.text,
                policy.signature,
                policy.attempt,
                policy.attempt_signature,
                submitted_by,
                QUEUED,
                time.time(),
            ),
        )

    def _latest_attempt(self, policy_digest: str) -> sqlite3.Row | None:
        return self._db.execute(
            "SELECT * FROM jobs WHERE policy_digest = ? ORDER BY attempt DESC LIMIT 1",
            (policy_digest,),
        ).fetchone()

    def _row(self, job_id: str) -> sqlite3.Row | None:
        return self._db.execute("SELECT * FROM jobs WHERE job_id = ?", (job_id,)).fetchone()

    def _require(self, job_id: str) -> sqlite3.Row:
        row = self._row(job_id)
        if row is None:
            raise JobError(f"no job {job_id!r} on this coordinator (see `fedsilo job list`)")
        return row

    def _info(self, job_id: str) -> JobInfo:
        return _info(self._require(job_id))


def recorded_jobs(path: Path) -> list[JobInfo]:
    """Every job in the state file at `path`, in submission order, read without writing (for
    `fedsilo status` beside a running coordinator); none where no coordinator served jobs."""
    db = sqlite3.connect(f"{Path(path).resolve().as_uri()}?mode=ro", uri=True, timeout=30.0)
    db.row_factory = sqlite3.Row
    try:
        if db.execute("SELECT 1 FROM sqlite_master WHERE name = 'jobs'").fetchone() is None:
            return []
        return [_info(row) for row in db.execute("SELECT * FROM jobs ORDER BY seq")]
    finally:
        db.close()


def _create_or_upgrade(db: sqlite3.Connection) -> None:
    """Create the jobs table, or rebuild one written before attempts and refusals were
    recorded (SQLite cannot widen a CHECK in place), in one transaction."""
    db.execute("BEGIN IMMEDIATE")
    try:
        columns = {row["name"] for row in db.execute("PRAGMA table_info(jobs)")}
        if columns and "attempt" not in columns:
            db.execute("ALTER TABLE jobs RENAME TO jobs_before_attempts")
            db.execute(_SCHEMA)
            db.execute(
                f"INSERT INTO jobs ({_FIRST_COLUMNS}) "
                f"SELECT {_FIRST_COLUMNS} FROM jobs_before_attempts"
            )
            db.execute("DROP TABLE jobs_before_attempts")
        else:
            db.execute(_SCHEMA)
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise


def _info(row: sqlite3.Row) -> JobInfo:
    columns = row.keys()  # a read-only reader may meet a table written before attempts
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
        attempt=row["attempt"] if "attempt" in columns else 1,
        refusals=json.loads(row["refusals"]) if "refusals" in columns else {},
    )
