"""The coordinator's durable state: deployments, finished rounds, participants, the message
audit and the silos' signed release receipts in one SQLite file, and the server states' tensors
as content-addressed checkpoints. The same file also holds the envelope verifier's replay
window (table `accepted_envelopes`, owned by coordinator/replay_store.py).

Layout: `<name>.db` (WAL journal, `synchronous=FULL`, foreign keys on) and beside it the folder
`<name>.checkpoints/`, one safetensors file per distinct state, named by the BLAKE3-256 of its
bytes (the payload digest, wire/payload.py; a file named by its BLAKE2b-256, as state files
before BLAKE3 named them, still loads), so identical states (a failed round keeps the previous
one) are stored once and a file that changed on disk is caught when it is loaded. A round is
saved checkpoint first (written to a temporary file, fsynced, renamed), then its row in one
transaction: a crash in between leaves at worst an orphan checkpoint, never a latest row
naming a missing file. Only each deployment's latest state is kept (a deployment resumes from
it, and nothing reads an earlier one): once a round's row is in, the checkpoint it supersedes
is deleted unless it is another deployment's latest too. An earlier round's row keeps its
record and the hash of the state it ended with. (Under model lineage a state holds the last
aggregation's evidence beside the model, k masked inputs: kept for every round, a job's
checkpoints would grow by that much each round.)

Thread safety: one connection shared by every thread (`check_same_thread=False`) behind a
lock. SQLite runs one writer at a time anyway, so per-thread connections would only add
lock contention inside SQLite and connections that outlive their threads; with one connection
`close()` closes everything and each method's transaction is atomic with respect to the
others. Files are created readable by their owner only: they hold the consortium's models.
"""

from __future__ import annotations

import hashlib
import json
import os
import sqlite3
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from types import TracebackType
from typing import Any

import torch

from fedsilo.coordinator.strategies.base import ServerState
from fedsilo.policies.schema import Policy
from fedsilo.wire.durable import make_private_folder, write_atomically
from fedsilo.wire.payload import digest_of
from fedsilo.wire.tensors import ParameterSpec, decode_tensors, encode_payload, tensor_block

SCHEMA_VERSION = 1
SETUP_ROUND = 0
ROUND_STATUSES = ("setup", "completed", "failed")
PARTICIPANT_STATUSES = ("active", "retired", "revoked", "refused")
DIRECTIONS = ("to_silo", "from_silo")

_SCHEMA = (
    "CREATE TABLE schema_version (version INTEGER NOT NULL)",
    """CREATE TABLE deployments (
        deployment_id TEXT PRIMARY KEY,
        policy_digest TEXT NOT NULL,
        policy_json TEXT NOT NULL,
        created_at TEXT NOT NULL
    )""",
    """CREATE TABLE rounds (
        deployment_id TEXT NOT NULL REFERENCES deployments(deployment_id),
        round INTEGER NOT NULL CHECK (round >= 0),
        status TEXT NOT NULL CHECK (status IN ('setup', 'completed', 'failed')),
        record_json TEXT NOT NULL,
        checkpoint_hash TEXT NOT NULL,
        spec_json TEXT NOT NULL,
        extra_json TEXT NOT NULL,
        finished_at TEXT NOT NULL,
        PRIMARY KEY (deployment_id, round),
        CHECK ((round = 0) = (status = 'setup'))
    )""",
    """CREATE TABLE participants (
        deployment_id TEXT NOT NULL REFERENCES deployments(deployment_id),
        silo TEXT NOT NULL,
        status TEXT NOT NULL CHECK (status IN ('active', 'retired', 'revoked', 'refused')),
        reason TEXT NOT NULL,
        updated_at TEXT NOT NULL,
        PRIMARY KEY (deployment_id, silo)
    )""",
    """CREATE TABLE message_audit (
        id INTEGER PRIMARY KEY,
        deployment_id TEXT NOT NULL REFERENCES deployments(deployment_id),
        round INTEGER NOT NULL,
        direction TEXT NOT NULL CHECK (direction IN ('to_silo', 'from_silo')),
        silo TEXT NOT NULL,
        kind TEXT NOT NULL,
        bytes INTEGER NOT NULL CHECK (bytes >= 0),
        digest TEXT NOT NULL,
        at TEXT NOT NULL
    )""",
    "CREATE INDEX message_audit_by_round ON message_audit (deployment_id, round)",
)
# Added after version 1 shipped: created in older files too when they are opened.
_RECEIPTS = """CREATE TABLE IF NOT EXISTS receipts (
    deployment_id TEXT NOT NULL REFERENCES deployments(deployment_id),
    silo TEXT NOT NULL,
    task_id TEXT NOT NULL,
    ledger_head TEXT NOT NULL,
    receipt_json TEXT NOT NULL,
    received_at TEXT NOT NULL,
    PRIMARY KEY (deployment_id, silo, task_id, ledger_head)
)"""


class StateError(RuntimeError):
    """The state file cannot be used as asked; the message names the file and what is wrong."""


@dataclass(frozen=True)
class SavedRound:
    """The last round saved for a deployment, with what a restarted coordinator resumes from.

    `state` is the state after `round` (the unchanged previous state for a failed round);
    `records` are the saved round records of rounds 1..round, in order; `setup` is the record
    of round 0 (it names the consortium the deployment started with).
    """

    round: int
    status: str
    state: ServerState
    records: list[dict[str, Any]]
    setup: dict[str, Any]


def content_hash(data: bytes) -> str:
    """BLAKE2b-256 of `data`, hex: the name a checkpoint is stored under."""
    return hashlib.blake2b(data, digest_size=32).hexdigest()


def _file_hash(path: Path) -> str:
    """A checkpoint's name for a file's bytes, read a few MiB at a time."""
    with path.open("rb") as file:
        return digest_of(iter(lambda: file.read(1 << 22), b"")).hex()


def digest_policy(policy: Policy) -> str:
    """The digest a deployment's state is bound to: BLAKE2b-256 of the policy's JSON."""
    return content_hash(policy.model_dump_json().encode())


class Checkpoints:
    """Server-state tensors as safetensors files named by the hash of their bytes."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def path_of(self, digest: str) -> Path:
        return self.folder / f"{digest}.safetensors"

    def save(self, tensors: Mapping[str, torch.Tensor]) -> str:
        """Store `tensors` durably (unless an intact identical file exists); their hash.

        Written from the encoded parts, without joining them, so saving a model costs one
        encoded copy of it."""
        data = encode_payload(tensor_block(_unshared(tensors)), {"names": list(tensors)})
        digest = data.digest().hex()
        path = self.path_of(digest)
        if not (path.exists() and _file_hash(path) == digest):
            make_private_folder(self.folder)
            write_atomically(path, data.parts)
        return digest

    def load(self, digest: str) -> dict[str, torch.Tensor]:
        """The tensors stored under `digest`, in their saved order, after checking the hash."""
        path = self.path_of(digest)
        try:
            data = path.read_bytes()
        except FileNotFoundError as exc:
            raise StateError(f"checkpoint {path} is missing") from exc
        actual = digest_of([data]).hex()
        if digest not in (actual, content_hash(data)):
            raise StateError(
                f"checkpoint {path} is corrupted: its content hashes to {actual}, not {digest}"
            )
        tensors, header = decode_tensors(data)
        return {name: tensors[name] for name in header["names"]}


def _unshared(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`tensors` on the CPU, copying only those whose memory another one shares (safetensors
    refuses shared memory)."""
    seen: set[int] = set()
    out = {}
    for name, tensor in tensors.items():
        tensor = tensor.detach().to("cpu")
        storage = tensor.untyped_storage().data_ptr()
        if storage in seen:
            tensor = tensor.clone(memory_format=torch.contiguous_format)
        seen.add(tensor.untyped_storage().data_ptr())
        out[name] = tensor
    return out


class StateStore:
    """One coordinator's SQLite state file and its checkpoint folder."""

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.checkpoints = Checkpoints(self.path.with_name(f"{self.path.stem}.checkpoints"))
        self._lock = threading.Lock()
        self._db = _open_database(self.path)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def __enter__(self) -> StateStore:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    # -- deployments and rounds -------------------------------------------------------------

    def open_deployment(self, deployment_id: str, policy_digest: str, policy_json: str) -> None:
        """Create the deployment, or check that it was created under the same policy."""
        with self._transaction() as db:
            row = db.execute(
                "SELECT policy_digest FROM deployments WHERE deployment_id = ?", (deployment_id,)
            ).fetchone()
            if row is None:
                db.execute(
                    "INSERT INTO deployments VALUES (?, ?, ?, ?)",
                    (deployment_id, policy_digest, policy_json, _now()),
                )
            elif row["policy_digest"] != policy_digest:
                raise StateError(
                    f"{self.path}: deployment {deployment_id!r} was started with policy digest "
                    f"{row['policy_digest']}, not {policy_digest}: this state belongs to another "
                    "policy; use a new --state file or the original policy"
                )

    def open_consortium(self, consortium: str) -> None:
        """Create the consortium's own row, which holds what outlives its jobs (revocations);
        a state file whose consortium row a single-policy deployment once created keeps it."""
        with self._transaction() as db:
            db.execute(
                "INSERT OR IGNORE INTO deployments VALUES (?, '', '{}', ?)", (consortium, _now())
            )

    def latest_job(self, consortium: str) -> str | None:
        """The job (deployment other than the consortium's own row) opened last, or None."""
        with self._transaction("DEFERRED") as db:
            row = db.execute(
                "SELECT deployment_id FROM deployments WHERE deployment_id != ? "
                "ORDER BY created_at DESC, rowid DESC LIMIT 1",
                (consortium,),
            ).fetchone()
        return None if row is None else row["deployment_id"]

    def deployment_policy(self, deployment_id: str) -> dict[str, Any] | None:
        """The policy (as JSON) the deployment was opened with; None for an unknown one."""
        with self._transaction("DEFERRED") as db:
            row = db.execute(
                "SELECT policy_json FROM deployments WHERE deployment_id = ?", (deployment_id,)
            ).fetchone()
        return None if row is None else json.loads(row["policy_json"])

    def save_round(
        self,
        deployment_id: str,
        round: int,
        status: str,
        state: ServerState,
        record_json: dict[str, Any],
    ) -> None:
        """Save a finished round (round 0 is the setup): checkpoint, then the row.

        Rounds are saved in order, each once; anything else means two coordinators share
        this file, and is refused. `record_json` and `state.extra` are stored as JSON (so a
        tuple comes back as a list).
        """
        _require_choice(status, ROUND_STATUSES, "round status")
        if (round == SETUP_ROUND) != (status == "setup"):
            raise ValueError(f"round {round} has status {status!r}; only round 0 is the setup")
        record_text = json.dumps(record_json)  # refuses what is not JSON before any file is written
        spec_text, extra_text = json.dumps(state.spec.to_json()), json.dumps(dict(state.extra))
        digest = self.checkpoints.save(state.tensors)
        with self._transaction() as db:
            self._require_deployment(db, deployment_id)
            expected = _next_round(db, deployment_id)
            if round != expected:
                raise StateError(
                    f"{self.path}: deployment {deployment_id!r} saves round {expected} next, "
                    f"not {round}; is another coordinator using this state file?"
                )
            superseded = _latest_checkpoint(db, deployment_id)
            db.execute(
                "INSERT INTO rounds VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (deployment_id, round, status, record_text, digest, spec_text, extra_text, _now()),
            )
            kept = _latest_checkpoints(db)
        if superseded is not None and superseded not in kept:
            self.checkpoints.path_of(superseded).unlink(missing_ok=True)

    def saved_round(self, deployment_id: str) -> int | None:
        """The number of the deployment's last saved round (0: its setup), without loading its
        checkpoint; None before setup."""
        with self._transaction("DEFERRED") as db:
            row = db.execute(
                "SELECT MAX(round) AS last FROM rounds WHERE deployment_id = ?", (deployment_id,)
            ).fetchone()
        return None if row is None else row["last"]

    def last_evaluated(self, deployment_id: str) -> dict[str, Any] | None:
        """The record of the deployment's last round that evaluated (its cross-silo `summary`),
        without loading a checkpoint; None before one did."""
        with self._transaction("DEFERRED") as db:
            for row in db.execute(
                "SELECT record_json FROM rounds WHERE deployment_id = ? ORDER BY round DESC",
                (deployment_id,),
            ):
                record = json.loads(row["record_json"])
                if record.get("summary"):
                    return record
        return None

    def last_round(self, deployment_id: str) -> SavedRound | None:
        """The last saved round and everything needed to go on after it; None before setup."""
        with self._transaction("DEFERRED") as db:
            last = db.execute(
                "SELECT * FROM rounds WHERE deployment_id = ? ORDER BY round DESC LIMIT 1",
                (deployment_id,),
            ).fetchone()
            records = db.execute(
                "SELECT record_json FROM rounds WHERE deployment_id = ? ORDER BY round",
                (deployment_id,),
            ).fetchall()
        if last is None:
            return None
        state = ServerState(
            self.checkpoints.load(last["checkpoint_hash"]),
            ParameterSpec.from_json(json.loads(last["spec_json"])),
            json.loads(last["extra_json"]),
        )
        setup, *rounds = (json.loads(r["record_json"]) for r in records)
        return SavedRound(last["round"], last["status"], state, rounds, setup)

    # -- participants -----------------------------------------------------------------------

    def set_participant(self, deployment_id: str, silo: str, status: str, reason: str = "") -> None:
        _require_choice(status, PARTICIPANT_STATUSES, "participant status")
        with self._transaction() as db:
            self._require_deployment(db, deployment_id)
            db.execute(
                "INSERT INTO participants VALUES (?, ?, ?, ?, ?) "
                "ON CONFLICT (deployment_id, silo) DO UPDATE SET "
                "status = excluded.status, reason = excluded.reason, "
                "updated_at = excluded.updated_at",
                (deployment_id, silo, status, reason, _now()),
            )

    def participants(self, deployment_id: str) -> dict[str, tuple[str, str]]:
        """silo -> (status, reason), in silo order."""
        with self._transaction("DEFERRED") as db:
            rows = db.execute(
                "SELECT silo, status, reason FROM participants WHERE deployment_id = ? "
                "ORDER BY silo",
                (deployment_id,),
            ).fetchall()
        return {row["silo"]: (row["status"], row["reason"]) for row in rows}

    # -- message audit ----------------------------------------------------------------------

    def audit(
        self,
        deployment_id: str,
        round: int,
        direction: str,
        silo: str,
        kind: str,
        nbytes: int,
        digest: str,
    ) -> None:
        """Record that a message of `nbytes` with `digest` went to or came from `silo`."""
        _require_choice(direction, DIRECTIONS, "message direction")
        with self._transaction() as db:
            self._require_deployment(db, deployment_id)
            db.execute(
                "INSERT INTO message_audit "
                "(deployment_id, round, direction, silo, kind, bytes, digest, at) "
                "VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (deployment_id, round, direction, silo, kind, nbytes, digest, _now()),
            )

    def audit_rows(self, deployment_id: str) -> list[dict[str, Any]]:
        """Every audited message of the deployment, oldest first, as column -> value."""
        with self._transaction("DEFERRED") as db:
            rows = db.execute(
                "SELECT * FROM message_audit WHERE deployment_id = ? ORDER BY id",
                (deployment_id,),
            ).fetchall()
        return [dict(row) for row in rows]

    # -- release receipts -------------------------------------------------------------------

    def save_receipts(
        self, deployment_id: str, receipts: Sequence[tuple[str, Mapping[str, Any]]]
    ) -> None:
        """Keep silos' signed receipts of booked releases (`privacy/receipts.py`), (silo,
        receipt) pairs in one transaction, each once: the same answer sent again (a retry, a
        resumed round) carries the same receipt."""
        if not receipts:
            return
        with self._transaction() as db:
            self._require_deployment(db, deployment_id)
            db.executemany(
                "INSERT OR IGNORE INTO receipts VALUES (?, ?, ?, ?, ?, ?)",
                [
                    (
                        deployment_id,
                        silo,
                        str(receipt["task_id"]),
                        str(receipt["ledger_head"]),
                        json.dumps(dict(receipt), sort_keys=True),
                        _now(),
                    )
                    for silo, receipt in receipts
                ],
            )

    def receipts(
        self, deployment_id: str | None = None, silo: str | None = None
    ) -> list[dict[str, Any]]:
        """The kept receipts (of one deployment or silo, if given), in the order received."""
        with self._transaction("DEFERRED") as db:
            rows = db.execute(
                "SELECT receipt_json FROM receipts WHERE (?1 IS NULL OR deployment_id = ?1) "
                "AND (?2 IS NULL OR silo = ?2) ORDER BY rowid",
                (deployment_id, silo),
            ).fetchall()
        return [json.loads(row["receipt_json"]) for row in rows]

    # -- plumbing ---------------------------------------------------------------------------

    @contextmanager
    def _transaction(self, mode: str = "IMMEDIATE") -> Iterator[sqlite3.Connection]:
        """One transaction of this store's connection, under its lock."""
        with self._lock, _transaction(self._db, mode):
            yield self._db

    def _require_deployment(self, db: sqlite3.Connection, deployment_id: str) -> None:
        known = db.execute(
            "SELECT 1 FROM deployments WHERE deployment_id = ?", (deployment_id,)
        ).fetchone()
        if known is None:
            raise StateError(f"{self.path}: unknown deployment {deployment_id!r}; open it first")


def _open_database(path: Path) -> sqlite3.Connection:
    """Connect, configure for durability, and create or check the schema."""
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        os.close(os.open(path, os.O_CREAT | os.O_WRONLY, 0o600))
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.row_factory = sqlite3.Row
    try:
        db.execute("PRAGMA journal_mode = WAL")
        db.execute("PRAGMA synchronous = FULL")
        db.execute("PRAGMA foreign_keys = ON")
        _create_or_check_schema(db, path)
    except sqlite3.DatabaseError as exc:
        db.close()
        raise StateError(f"{path} is not a readable SQLite state file: {exc}") from exc
    except StateError:
        db.close()
        raise
    return db


def _create_or_check_schema(db: sqlite3.Connection, path: Path) -> None:
    with _transaction(db, "IMMEDIATE"):
        tables = {
            row["name"] for row in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")
        }
        if not tables:
            for statement in _SCHEMA:
                db.execute(statement)
            db.execute("INSERT INTO schema_version VALUES (?)", (SCHEMA_VERSION,))
            db.execute(_RECEIPTS)
        elif "schema_version" not in tables:
            raise StateError(
                f"{path} is an SQLite database but not a fedsilo state file "
                "(it has no schema_version table)"
            )
        else:
            versions = [row["version"] for row in db.execute("SELECT version FROM schema_version")]
            if versions != [SCHEMA_VERSION]:
                raise StateError(
                    f"{path} holds state schema version {versions}; this fedsilo reads version "
                    f"{SCHEMA_VERSION} only"
                )
            db.execute(_RECEIPTS)


@contextmanager
def _transaction(db: sqlite3.Connection, mode: str) -> Iterator[None]:
    """BEGIN (IMMEDIATE takes the write lock at once, DEFERRED at the first write), then
    COMMIT, or ROLLBACK when anything fails, the COMMIT included."""
    db.execute(f"BEGIN {mode}")
    try:
        yield
        db.execute("COMMIT")
    finally:
        if db.in_transaction:
            db.execute("ROLLBACK")


def _latest_checkpoint(db: sqlite3.Connection, deployment_id: str) -> str | None:
    """The checkpoint of `deployment_id`'s latest round, or None before its setup."""
    row = db.execute(
        "SELECT checkpoint_hash FROM rounds WHERE deployment_id = ? ORDER BY round DESC LIMIT 1",
        (deployment_id,),
    ).fetchone()
    return None if row is None else row[0]


def _latest_checkpoints(db: sqlite3.Connection) -> set[str]:
    """The checkpoints some deployment resumes from: each one's latest round's."""
    rows = db.execute(
        "SELECT checkpoint_hash FROM rounds AS r WHERE round = "
        "(SELECT MAX(round) FROM rounds WHERE deployment_id = r.deployment_id)"
    ).fetchall()
    return {hash_ for (hash_,) in rows}


def _next_round(db: sqlite3.Connection, deployment_id: str) -> int:
    (last,) = db.execute(
        "SELECT MAX(round) FROM rounds WHERE deployment_id = ?", (deployment_id,)
    ).fetchone()
    return SETUP_ROUND if last is None else last + 1


def _require_choice(value: str, allowed: tuple[str, ...], what: str) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {what} {value!r}; use one of {', '.join(allowed)}")


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds")
