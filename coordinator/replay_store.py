"""The coordinator's replay memory on disk: every silo message its envelope verifier accepted
(sender, task id, send time), in the `accepted_envelopes` table of the coordinator's SQLite
state file, so a restarted coordinator still refuses a message it accepted before.

Each acceptance is committed (`synchronous=FULL`) before the message is used; rows older than
the freshness window are deleted, since any replay of them is refused as stale. The table sits
beside `StateStore`'s (coordinator/state.py), through a connection of its own.
"""

from __future__ import annotations

import sqlite3
import threading
import time
from pathlib import Path

PRUNE_EVERY = 1024  # acceptances between deletions of rows past the freshness window

_SCHEMA = """
CREATE TABLE IF NOT EXISTS accepted_envelopes (
    sender TEXT NOT NULL,
    task_id TEXT NOT NULL,
    sent_at REAL NOT NULL,
    PRIMARY KEY (sender, task_id)
);
CREATE INDEX IF NOT EXISTS accepted_envelopes_by_age ON accepted_envelopes (sent_at);
"""


class ReplayStore:
    """A `ReplayMemory` (wire/envelope.py) in the SQLite file at `path`; rows are kept for
    `retention_s` after their send time (the verifier's freshness limit)."""

    def __init__(self, path: Path, retention_s: float) -> None:
        self.retention_s = retention_s
        self._lock = threading.Lock()
        self._db = sqlite3.connect(
            Path(path), timeout=30.0, isolation_level=None, check_same_thread=False
        )
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.executescript(_SCHEMA)
        self._since_pruned = 0

    def recall(self, since: float) -> list[tuple[float, str, str]]:
        with self._lock:
            self._forget_before(since)
            return self._db.execute(
                "SELECT sent_at, sender, task_id FROM accepted_envelopes WHERE sent_at >= ?",
                (since,),
            ).fetchall()

    def remember(self, sent_at: float, sender: str, task_id: str) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO accepted_envelopes (sender, task_id, sent_at) "
                "VALUES (?, ?, ?)",
                (sender, task_id, sent_at),
            )
            self._since_pruned += 1
            if self._since_pruned >= PRUNE_EVERY:
                self._forget_before(time.time() - self.retention_s)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def _forget_before(self, cutoff: float) -> None:
        """Call with the lock held."""
        self._db.execute("DELETE FROM accepted_envelopes WHERE sent_at < ?", (cutoff,))
        self._since_pruned = 0
