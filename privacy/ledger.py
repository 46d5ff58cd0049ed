"""The per-silo privacy ledger: an append-only, hash-chained JSONL file in which a silo books
every release it sends (deployment, round, task, mechanism, epsilon, payload digest), and
`verify`, the audit that proves the file untouched and its epsilon values right.

One record per line, in canonical JSON (fields in a fixed order, no spaces, ASCII), so that a
privacy officer can read it and every byte matters: a record's `hash` is BLAKE2b-256 over the
canonical JSON of all its other fields, and its `prev` is the hash of the record before it
(`GENESIS` for the first). `verify` re-encodes every record it parses and compares bytes, so
any edit is caught even where the JSON would parse to the same values; a deleted or swapped
record breaks `seq` and `prev`. The chain is unkeyed, so it proves internal consistency only: a
ledger cut after its last records, or rewritten whole with its hashes recomputed, is a valid
chain. What proves it against the releases themselves are the signed receipts the coordinator
keeps (`receipts.py`, `receipt_audit.py`); `verify(anchor=...)` checks one head the coordinator
was shown and says, when it is missing, that it cannot tell a deletion from a rewrite.

A record names the job it was booked for (`job`: the digest of the signed policy the silo
accepted; absent in records written before jobs were booked, and where no policy is pinned):
`booking(deployment, job, task_id)` is how a silo finds that a task was already answered.

A torn last line (the silo was killed while booking: the line was never fsynced, so its answer
never left) is repaired when a `PrivacyLedger` opens the file: the torn bytes are moved aside to
`<ledger>.torn-<time>` (never deleted), the file is cut back to its intact records, and a repair
record is booked in the `REPAIRS` deployment (public, no epsilon; its task names the file the
bytes went to), which the audit lists. A damaged line anywhere else is an error the audit names.

Epsilon is booked per deployment, under the delta and accountant of its first record:
`epsilon_cumulative` is what all of that deployment's releases compose to (`accounting.epsilon`)
and `epsilon_increment` the rise over the record before. A release without noise (`none`) in
such a deployment books `inf` and leaves the deployment at `inf` for good. A deployment whose
policy asks for no DP books with `delta` None: its records carry no epsilon (JSON null) and no
cap applies to it; the ledger still holds the digest of everything it sent. Infinity is written
as the string "inf", so every line stays standard JSON. A silo books each job of its consortium
as its own deployment (the job id), so one ledger spans every job; `spent_elsewhere` adds up
what the other jobs spent (sequential composition), for a site's cap over all jobs.

`append` writes, flushes and fsyncs its line before it returns: a payload is sent only once
its release is on disk. One process (the silo agent) appends; threads are serialised by a lock,
processes by `flock` on the file, and a ledger that grew under another process is re-verified
before the next booking.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import math
import os
import re
import threading
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import IO, Any

from fedsilo.privacy import accounting
from fedsilo.privacy.accounting import (
    Accountant,
    AccountingError,
    Mechanism,
    check_accounting,
    epsilon,
)
from fedsilo.wire.durable import fsync_folder, write_atomically
from fedsilo.wire.payload import Payload, digest_of

DIGEST_BYTES = 32
GENESIS = "0" * (2 * DIGEST_BYTES)
RELATIVE_TOLERANCE = 1e-9
EDITED = "edited"
DELETED = "deleted or reordered"
NOT_JSON = "not JSON"
TRUNCATED = "truncated tail"
ANCHOR_MISSING = "anchor not held"
REPAIRS = "ledger-repairs"  # the deployment repair records are booked in
REPAIR_TASK = "repair/"  # a repair record's task id: this, then the file the torn bytes went to
_HEX_DIGEST = re.compile(f"[0-9a-f]{{{2 * DIGEST_BYTES}}}")


class LedgerError(ValueError):
    """A ledger that cannot be used or a booking that cannot be made; the message says why."""


def payload_digest(payload: bytes | Payload) -> str:
    """The digest a record keeps of an outbound payload (also when held as parts), hex: the
    channel's payload digest, BLAKE3-256 (wire/payload.py), a tenth of BLAKE2b's time on a
    model. Records written before protocol version 2 hold BLAKE2b-256 digests here; nothing
    recomputes them, an audit compares them with the receipts'."""
    return digest_of(payload.parts if isinstance(payload, Payload) else (payload,)).hex()


def _record_digest(data: bytes) -> str:
    """A record's hash, chaining the ledger: BLAKE2b-256, hex (the ledger's format)."""
    return hashlib.blake2b(data, digest_size=DIGEST_BYTES).hexdigest()


@dataclass(frozen=True)
class LedgerRecord:
    """One booked release, as one line of the ledger."""

    seq: int
    time: str
    deployment: str
    round: int
    task_id: str
    mechanism: Mechanism
    delta: float | None
    accountant: Accountant | None
    epsilon_increment: float | None
    epsilon_cumulative: float | None
    payload_digest: str
    prev: str
    hash: str
    job: str | None = None  # the accepted policy's digest; None in records without a job

    def body(self) -> dict[str, Any]:
        """Every field but `hash`, JSON-ready, in the order they are written (`job` only where
        the record has one)."""
        job = {} if self.job is None else {"job": self.job}
        return {
            "seq": self.seq,
            "time": self.time,
            "deployment": self.deployment,
            "round": self.round,
            "task_id": self.task_id,
            **job,
            "mechanism": self.mechanism.to_json(),
            "delta": self.delta,
            "accountant": self.accountant,
            "epsilon_increment": _epsilon_to_json(self.epsilon_increment),
            "epsilon_cumulative": _epsilon_to_json(self.epsilon_cumulative),
            "payload_digest": self.payload_digest,
            "prev": self.prev,
        }

    def to_json(self) -> dict[str, Any]:
        return {**self.body(), "hash": self.hash}

    def line(self) -> bytes:
        """The record's exact bytes in the ledger, newline included."""
        return _canonical(self.to_json()) + b"\n"

    def computed_hash(self) -> str:
        """What `hash` must be: BLAKE2b-256 over the canonical JSON of `body()`."""
        return _record_digest(_canonical(self.body()))

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> LedgerRecord:
        """The inverse of `to_json`; raises `LedgerError` naming the first field that is wrong."""
        expected = [*_BODY_FIELDS, "hash"]
        with_job = [*expected[:5], "job", *expected[5:]]
        if list(data) not in (expected, with_job):
            raise LedgerError(f"fields {list(data)}, expected {with_job}")
        job = data.get("job")
        _require(job is None or (isinstance(job, str) and job != ""), "job must be a text")
        _require(_is_int(data["seq"]) and data["seq"] >= 1, "seq must be an integer >= 1")
        _require(_is_int(data["round"]) and data["round"] >= 0, "round must be an integer >= 0")
        for name in ("time", "deployment", "task_id"):
            _require(isinstance(data[name], str) and data[name] != "", f"{name} must be a text")
        for name in ("payload_digest", "prev", "hash"):
            _require(_is_digest(data[name]), f"{name} must be {2 * DIGEST_BYTES} hex digits")
        try:
            mechanism = Mechanism.from_json(data["mechanism"])
            if data["delta"] is not None:
                check_accounting(data["delta"], data["accountant"])
        except AccountingError as exc:
            raise LedgerError(str(exc)) from None
        accounted = data["delta"] is not None
        increment = _epsilon_from_json(data["epsilon_increment"], accounted, "epsilon_increment")
        cumulative = _epsilon_from_json(data["epsilon_cumulative"], accounted, "epsilon_cumulative")
        _require(accounted or data["accountant"] is None, "accountant must be null without delta")
        return cls(
            seq=data["seq"],
            time=data["time"],
            deployment=data["deployment"],
            round=data["round"],
            task_id=data["task_id"],
            mechanism=mechanism,
            delta=data["delta"],
            accountant=data["accountant"],
            epsilon_increment=increment,
            epsilon_cumulative=cumulative,
            payload_digest=data["payload_digest"],
            prev=data["prev"],
            hash=data["hash"],
            job=job,
        )


_BODY_FIELDS = (
    "seq",
    "time",
    "deployment",
    "round",
    "task_id",
    "mechanism",
    "delta",
    "accountant",
    "epsilon_increment",
    "epsilon_cumulative",
    "payload_digest",
    "prev",
)


@dataclass(frozen=True)
class ChainProblem:
    """The first record (1-based line) where the chain breaks, and how."""

    line: int
    seq: int | None
    problem: str  # EDITED | DELETED | NOT_JSON | TRUNCATED
    detail: str

    def __str__(self) -> str:
        seq = f" (seq {self.seq})" if self.seq is not None else ""
        return f"line {self.line}{seq}: {self.problem}: {self.detail}"

    def to_json(self) -> dict[str, Any]:
        return {"line": self.line, "seq": self.seq, "problem": self.problem, "detail": self.detail}


@dataclass(frozen=True)
class DeploymentAudit:
    """One deployment's booked epsilon next to the epsilon recomputed from its mechanisms."""

    deployment: str
    records: int
    delta: float | None
    accountant: Accountant | None
    booked: float | None
    recomputed: float | None
    cap: float | None  # the audit's cap; None without one, or where no DP is booked
    problem: str | None  # the first record whose booking does not hold, or None
    epsilon_at: Mapping[int, float | None] = field(default_factory=dict)  # seq -> recomputed

    @property
    def remaining(self) -> float | None:
        """What the cap leaves (never below 0), or None without a cap."""
        if self.cap is None or self.booked is None:
            return None
        return max(self.cap - self.booked, 0.0)

    def to_json(self) -> dict[str, Any]:
        return {
            "deployment": self.deployment,
            "records": self.records,
            "delta": self.delta,
            "accountant": self.accountant,
            "booked": _epsilon_to_json(self.booked),
            "recomputed": _epsilon_to_json(self.recomputed),
            "cap": self.cap,
            "remaining": self.remaining,
            "problem": self.problem,
        }


@dataclass(frozen=True)
class AuditReport:
    """What `verify` found: the intact records (all of them unless the chain breaks), the first
    break, and each deployment's accounting over the intact records."""

    path: Path
    records: tuple[LedgerRecord, ...]
    problem: ChainProblem | None
    deployments: tuple[DeploymentAudit, ...]

    @property
    def head(self) -> str:
        return self.records[-1].hash if self.records else GENESIS

    @property
    def ok(self) -> bool:
        return self.reason is None

    @property
    def repairs(self) -> tuple[LedgerRecord, ...]:
        """The repair records: each says where the bytes of a torn last line were kept."""
        return tuple(r for r in self.records if r.deployment == REPAIRS)

    def epsilon_at(self, record: LedgerRecord) -> float | None:
        """The epsilon recomputed for `record`'s deployment up to and including `record`."""
        for audit in self.deployments:
            if audit.deployment == record.deployment:
                return audit.epsilon_at.get(record.seq)
        return None

    @property
    def reason(self) -> str | None:
        """Why the audit fails, in one line, or None."""
        if self.problem is not None:
            return f"{self.path}: {self.problem}"
        for audit in self.deployments:
            if audit.problem is not None:
                return f"{self.path}: deployment {audit.deployment}: {audit.problem}"
        return None

    def to_json(self) -> dict[str, Any]:
        return {
            "ledger": str(self.path),
            "ok": self.ok,
            "reason": self.reason,
            "records": len(self.records),
            "head": self.head,
            "problem": self.problem.to_json() if self.problem else None,
            "deployments": [audit.to_json() for audit in self.deployments],
            "repairs": [
                {"seq": r.seq, "time": r.time, "torn_bytes_kept_in": r.task_id[len(REPAIR_TASK) :]}
                for r in self.repairs
            ],
        }


def verify(path: Path | str, anchor: str | None = None, cap: float | None = None) -> AuditReport:
    """Audit the ledger at `path`: the chain (JSON per line, canonical bytes, hashes, `seq`,
    `prev`), the `anchor` (a record hash the coordinator was shown, which the chain must still
    hold), then each deployment's epsilon, recomputed record by record from the mechanisms and
    held against `cap` (if given) wherever DP is booked."""
    path = Path(path)
    if anchor is not None and not _is_digest(anchor):
        raise LedgerError(f"anchor must be {2 * DIGEST_BYTES} hex digits, not {anchor!r}")
    if cap is not None and not cap > 0:
        raise LedgerError(f"cap must be a positive epsilon, not {cap!r}")
    try:
        with open(path, "rb") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_SH)  # never read half an append
            data = handle.read()
    except OSError as exc:
        raise LedgerError(f"{path}: cannot read the ledger: {exc.strerror or exc}") from None
    records, problem = _read_chain(data)
    if problem is None and anchor is not None and anchor != GENESIS:
        problem = _anchor_problem(records, anchor)
    deployments = tuple(
        _audit_deployment(name, booked, cap) for name, booked in _by_deployment(records).items()
    )
    return AuditReport(path, tuple(records), problem, deployments)


class PrivacyLedger:
    """A silo's ledger file: books releases and answers what a deployment has spent and would
    reach. Opening an existing file repairs a torn last line, verifies the chain and refuses a
    broken one."""

    def __init__(self, path: Path | str) -> None:
        self.path = Path(path)
        self._lock = threading.Lock()
        self._records: list[LedgerRecord] = []
        self._deployments: dict[str, list[LedgerRecord]] = {}
        self._bookings: dict[tuple[str, str | None, str], LedgerRecord] = {}
        self._size = 0
        if not self.path.parent.is_dir():
            raise LedgerError(f"{self.path}: folder {self.path.parent} does not exist")
        with self._lock:
            self._repair_torn_tail()
            self._refresh()

    def append(
        self,
        *,
        deployment: str,
        round: int,
        task_id: str,
        mechanism: Mechanism,
        payload_digest: str,
        delta: float | None,
        accountant: Accountant = "rdp",
        job: str | None = None,
    ) -> LedgerRecord:
        """Book one release and return its record once it is on disk (fsynced): only then may
        the payload with this digest be sent. `delta` None books a deployment without DP;
        `job`: the digest of the policy the release was made under."""
        _check_booking(deployment, round, task_id, mechanism, payload_digest)
        if job is not None and (not isinstance(job, str) or not job):
            raise LedgerError(f"job must be a non-empty text, not {job!r}")
        if delta is not None:
            _checked_accounting(delta, accountant)
        with self._lock, self._appending() as handle:
            cumulative = self._reach(deployment, [mechanism], delta, accountant)
            record = _sealed(
                seq=len(self._records) + 1,
                time=datetime.now(timezone.utc).isoformat(timespec="microseconds"),
                deployment=deployment,
                round=round,
                task_id=task_id,
                mechanism=mechanism,
                delta=delta,
                accountant=accountant if delta is not None else None,
                epsilon_increment=(
                    None if delta is None else _increment(self._spent(deployment), cumulative)
                ),
                epsilon_cumulative=cumulative,
                payload_digest=payload_digest,
                prev=self._head(),
                job=job,
            )
            self._write(handle, record)
        return record

    def booking(self, deployment: str, job: str | None, task_id: str) -> LedgerRecord | None:
        """The last record booked for `task_id` of `job` in `deployment`, or None."""
        with self._lock:
            self._refresh()
            return self._bookings.get((deployment, job, task_id))

    def spent(self, deployment: str) -> float | None:
        """The deployment's booked cumulative epsilon: 0.0 before its first record, None for a
        deployment booked without DP."""
        with self._lock:
            self._refresh()
            return self._spent(deployment)

    def spent_elsewhere(self, deployment: str) -> float:
        """What every deployment but `deployment` has spent, added up (0.0 where none booked DP;
        `inf` once one did without noise): with this deployment's epsilon, the silo's total."""
        with self._lock:
            self._refresh()
            return accounting.total(
                booked[-1].epsilon_cumulative
                for name, booked in self._deployments.items()
                if name != deployment
            )

    def would_reach(
        self,
        deployment: str,
        extra: Sequence[Mechanism],
        delta: float,
        accountant: Accountant = "rdp",
    ) -> float:
        """The epsilon `deployment` would reach after also releasing `extra`: a silo refuses a
        task (`budget_exhausted`) when this exceeds its cap."""
        _checked_accounting(delta, accountant)
        with self._lock:
            self._refresh()
            return self._reach(deployment, extra, delta, accountant)

    def records(self) -> tuple[LedgerRecord, ...]:
        with self._lock:
            self._refresh()
            return tuple(self._records)

    def head(self) -> str:
        """The last record's hash (`GENESIS` while empty): what a silo reports to the
        coordinator with each result, and what an audit's anchor is."""
        with self._lock:
            self._refresh()
            return self._head()

    def _head(self) -> str:
        return self._records[-1].hash if self._records else GENESIS

    def _spent(self, deployment: str) -> float | None:
        booked = self._deployments.get(deployment)
        return booked[-1].epsilon_cumulative if booked else 0.0

    def _reach(
        self,
        deployment: str,
        extra: Sequence[Mechanism],
        delta: float | None,
        accountant: Accountant,
    ) -> float | None:
        booked = self._deployments.get(deployment, [])
        wanted = (delta, accountant if delta is not None else None)
        if booked and (booked[0].delta, booked[0].accountant) != wanted:
            raise LedgerError(
                f"deployment {deployment!r} is booked at delta {booked[0].delta} with accountant "
                f"{booked[0].accountant}, not at delta {delta} with {wanted[1]}"
            )
        if delta is None:
            return None
        try:
            return accounting.would_reach([r.mechanism for r in booked], extra, delta, accountant)
        except AccountingError as exc:
            raise LedgerError(str(exc)) from None

    def _add(self, record: LedgerRecord) -> None:
        self._records.append(record)
        self._deployments.setdefault(record.deployment, []).append(record)
        self._bookings[(record.deployment, record.job, record.task_id)] = record

    def _write(self, handle: IO[bytes], record: LedgerRecord) -> None:
        """Append `record`'s line at the end of `handle` (flocked) and fsync it."""
        line = record.line()
        handle.seek(0, os.SEEK_END)
        handle.write(line)
        handle.flush()
        os.fsync(handle.fileno())
        if self._size == 0:
            fsync_folder(self.path.parent)
        self._size += len(line)
        self._add(record)

    def _repair_torn_tail(self) -> None:
        """Set a torn last line aside and book the repair (see the module docstring). A file
        with any other damage is left as it is, for `_refresh` to refuse. Call with `_lock`."""
        if not self.path.exists():
            return
        with open(self.path, "r+b") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            data = handle.read()
            records, problem = _read_chain(data)
            if problem is None or problem.problem != TRUNCATED:
                return
            intact = data.rfind(b"\n") + 1
            now = datetime.now(timezone.utc)
            aside = self.path.with_name(f"{self.path.name}.torn-{now:%Y%m%dT%H%M%S%fZ}")
            write_atomically(aside, [data[intact:]])
            handle.truncate(intact)
            handle.flush()
            os.fsync(handle.fileno())
            for record in records:
                self._add(record)
            self._size = intact
            repair = _sealed(
                seq=len(records) + 1,
                time=now.isoformat(timespec="microseconds"),
                deployment=REPAIRS,
                round=0,
                task_id=f"{REPAIR_TASK}{aside.name}",
                mechanism=Mechanism.public(),
                delta=None,
                accountant=None,
                epsilon_increment=None,
                epsilon_cumulative=None,
                payload_digest=payload_digest(data[intact:]),
                prev=records[-1].hash if records else GENESIS,
            )
            self._write(handle, repair)

    def _refresh(self) -> None:
        """Catch up with records another process appended. Call with `_lock` held."""
        try:
            with open(self.path, "rb") as handle:
                fcntl.flock(handle.fileno(), fcntl.LOCK_SH)
                self._catch_up_with(handle)
        except FileNotFoundError:
            self._catch_up(b"")

    @contextmanager
    def _appending(self) -> Iterator[IO[bytes]]:
        """The ledger file opened for appending (created if missing), flocked exclusively and
        caught up. Call with `_lock` held."""
        with open(self.path, "a+b") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            self._catch_up_with(handle)
            yield handle

    def _catch_up_with(self, handle: IO[bytes]) -> None:
        if os.fstat(handle.fileno()).st_size != self._size:
            handle.seek(0)
            self._catch_up(handle.read())

    def _catch_up(self, data: bytes) -> None:
        """Adopt the file's records if they continue the ones this process knows."""
        if len(data) == self._size:
            return
        records, problem = _read_chain(data)
        if problem is not None:
            raise LedgerError(f"{self.path}: {problem}; refusing to book on a broken chain")
        known = len(self._records)
        if len(data) < self._size or (known and records[known - 1].hash != self._head()):
            raise LedgerError(
                f"{self.path}: records this process booked (up to seq {known}) are no longer in "
                "the file; refusing to book on a ledger that was cut or replaced"
            )
        for record in records[known:]:
            self._add(record)
        self._size = len(data)


def _read_chain(data: bytes) -> tuple[list[LedgerRecord], ChainProblem | None]:
    """The records of an intact chain, up to the first line that breaks it."""
    *lines, tail = data.split(b"\n")
    records: list[LedgerRecord] = []
    for number, raw in enumerate(lines, start=1):
        record, problem = _check_line(number, raw, records[-1] if records else None)
        if problem is not None:
            return records, problem
        records.append(record)
    if tail:
        detail = "the last line does not end in a newline (an interrupted write, whose payload "
        detail += "was never sent, or an edit)"
        return records, ChainProblem(len(lines) + 1, _claimed_seq(tail), TRUNCATED, detail)
    return records, None


def _check_line(
    number: int, raw: bytes, previous: LedgerRecord | None
) -> tuple[LedgerRecord | None, ChainProblem | None]:
    try:
        data = json.loads(raw.decode("utf-8"))
    except ValueError:
        return None, ChainProblem(number, None, NOT_JSON, "the line is not a JSON document")
    seq = _claimed_seq(raw)
    if not isinstance(data, dict):
        return None, ChainProblem(number, None, EDITED, "the line is not a ledger record")
    try:
        record = LedgerRecord.from_json(data)
    except LedgerError as exc:
        return None, ChainProblem(number, seq, EDITED, f"not a valid record: {exc}")
    if record.line() != raw + b"\n":
        detail = "its bytes differ from the canonical form every record is written in"
        return None, ChainProblem(number, seq, EDITED, detail)
    if record.hash != record.computed_hash():
        return None, ChainProblem(number, seq, EDITED, "its hash does not match its content")
    expected_seq = previous.seq + 1 if previous else 1
    if record.seq != expected_seq:
        detail = f"seq {record.seq} where seq {expected_seq} belongs"
        return None, ChainProblem(number, seq, DELETED, detail)
    if record.prev != (previous.hash if previous else GENESIS):
        detail = "its prev is not the hash of the record before it"
        return None, ChainProblem(number, seq, DELETED, detail)
    return record, None


def _anchor_problem(records: Sequence[LedgerRecord], anchor: str) -> ChainProblem | None:
    if any(record.hash == anchor for record in records):
        return None
    last = records[-1].seq if records else 0
    detail = (
        f"no record has the anchored hash {anchor} (the ledger ends at seq {last}): the "
        "record the coordinator was shown was deleted, or rewritten with its hashes "
        "recomputed; a bare hash cannot tell which (audit with --receipts to find out)"
    )
    return ChainProblem(len(records) + 1, None, ANCHOR_MISSING, detail)


def _audit_deployment(
    name: str, booked: Sequence[LedgerRecord], cap: float | None
) -> DeploymentAudit:
    delta, accountant = booked[0].delta, booked[0].accountant
    recomputed = None if delta is None else 0.0
    problems: list[str] = []
    epsilon_at: dict[int, float | None] = {}
    for count, record in enumerate(booked, start=1):
        if (record.delta, record.accountant) != (delta, accountant):
            problems.append(
                f"seq {record.seq} is booked at delta {record.delta} with {record.accountant}, "
                f"the deployment at delta {delta} with {accountant}"
            )
            continue
        if delta is None:
            continue
        before = recomputed
        recomputed = epsilon([r.mechanism for r in booked[:count]], delta, accountant)
        increment = _increment(before, recomputed)
        booked_right = _same(record.epsilon_cumulative, recomputed)
        if not (booked_right and _same(record.epsilon_increment, increment)):
            problems.append(
                f"seq {record.seq} books epsilon +{record.epsilon_increment} = "
                f"{record.epsilon_cumulative}, recomputed +{increment} = {recomputed}"
            )
        epsilon_at[record.seq] = recomputed
        if cap is not None and before <= cap < recomputed:
            problems.append(f"seq {record.seq} takes epsilon to {recomputed}, over the cap {cap}")
    return DeploymentAudit(
        deployment=name,
        records=len(booked),
        delta=delta,
        accountant=accountant,
        booked=booked[-1].epsilon_cumulative,
        recomputed=recomputed,
        cap=cap if delta is not None else None,
        problem=problems[0] if problems else None,
        epsilon_at=epsilon_at,
    )


def _by_deployment(records: Sequence[LedgerRecord]) -> dict[str, list[LedgerRecord]]:
    grouped: dict[str, list[LedgerRecord]] = {}
    for record in records:
        grouped.setdefault(record.deployment, []).append(record)
    return grouped


def _sealed(**fields: Any) -> LedgerRecord:
    unsealed = LedgerRecord(**fields, hash=GENESIS)
    return LedgerRecord(**fields, hash=unsealed.computed_hash())


def _increment(before: float, after: float) -> float:
    """The rise of a cumulative epsilon; 0.0 where it stays put, including at `inf`."""
    return 0.0 if after == before else after - before


def _same(booked: float | None, recomputed: float | None) -> bool:
    if booked is None or recomputed is None:
        return booked is recomputed
    return math.isclose(booked, recomputed, rel_tol=RELATIVE_TOLERANCE)


def _canonical(document: Mapping[str, Any]) -> bytes:
    return json.dumps(document, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode(
        "ascii"
    )


def _epsilon_to_json(value: float | None) -> float | str | None:
    return "inf" if value == math.inf else value


def _epsilon_from_json(value: Any, accounted: bool, name: str) -> float | None:
    """An epsilon as written: null without delta, else a finite number or "inf". (An increment
    may be slightly negative: PRV's numerical bound need not grow with every release.)"""
    if not accounted:
        _require(value is None, f"{name} must be null without delta")
        return None
    if value == "inf":
        return math.inf
    _require(isinstance(value, float) and math.isfinite(value), f"{name} must be a number or inf")
    return value


def _claimed_seq(raw: bytes) -> int | None:
    """The seq a damaged line claims, if it can still be read: it helps to name the record."""
    match = re.match(rb'\{"seq":(\d+),', raw)
    return int(match.group(1)) if match else None


def _check_booking(
    deployment: str, round: int, task_id: str, mechanism: Mechanism, digest: str
) -> None:
    if not isinstance(deployment, str) or not deployment:
        raise LedgerError(f"deployment must be a non-empty text, not {deployment!r}")
    if not _is_int(round) or round < 0:
        raise LedgerError(f"round must be an integer >= 0, not {round!r}")
    if not isinstance(task_id, str) or not task_id:
        raise LedgerError(f"task_id must be a non-empty text, not {task_id!r}")
    if not isinstance(mechanism, Mechanism):
        raise LedgerError(f"mechanism must be a Mechanism, not {mechanism!r}")
    if not _is_digest(digest):
        raise LedgerError(f"payload_digest must be {2 * DIGEST_BYTES} lowercase hex digits")


def _checked_accounting(delta: float, accountant: str) -> None:
    try:
        check_accounting(delta, accountant)
    except AccountingError as exc:
        raise LedgerError(str(exc)) from None


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise LedgerError(message)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_digest(value: Any) -> bool:
    return isinstance(value, str) and _HEX_DIGEST.fullmatch(value) is not None
