"""The per-silo privacy ledger: every release is booked on disk before it leaves, the chain
betrays any changed, deleted or reordered byte, and epsilon is booked as Opacus computes it."""

import fcntl
import hashlib
import json
import math
import threading
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from opacus.accountants import RDPAccountant

from fedsilo.privacy import ledger as ledger_module
from fedsilo.privacy.accounting import Mechanism, epsilon
from fedsilo.privacy.ledger import (
    ANCHOR_MISSING,
    DELETED,
    EDITED,
    GENESIS,
    NOT_JSON,
    REPAIRS,
    TRUNCATED,
    LedgerError,
    LedgerRecord,
    PrivacyLedger,
    payload_digest,
    verify,
)

DELTA = 1e-5
# Full-batch releases (sample rate 1) keep Opacus' RDP maths to a fraction of a millisecond.
TRAIN = Mechanism.dp_sgd(noise_multiplier=2.0, sample_rate=1.0, steps=5, max_grad_norm=1.0)
REPORT = Mechanism.gaussian(sensitivity=1.0, noise_std=4.0)


def book(
    ledger: PrivacyLedger,
    count: int,
    deployment: str = "heart",
    mechanism: Mechanism | None = None,
    delta: float | None = DELTA,
    accountant: str = "rdp",
) -> list[LedgerRecord]:
    """Book `count` releases: training runs and loss reports in turn, unless `mechanism`."""
    return [
        ledger.append(
            deployment=deployment,
            round=i // 2,
            task_id=f"{deployment}-task-{i}",
            mechanism=mechanism or (TRAIN if i % 2 == 0 else REPORT),
            payload_digest=payload_digest(f"payload {i}".encode()),
            delta=delta,
            accountant=accountant,
        )
        for i in range(count)
    ]


@pytest.fixture
def path(tmp_path: Path) -> Path:
    return tmp_path / "silo-a.ledger.jsonl"


@pytest.fixture
def four(path: Path) -> Path:
    """A ledger of four records."""
    book(PrivacyLedger(path), 4)
    return path


def lines(path: Path) -> list[bytes]:
    return path.read_bytes().splitlines(keepends=True)


# Booking


def test_each_record_books_the_deployments_epsilon_as_opacus_composes_it(path: Path) -> None:
    records = book(PrivacyLedger(path), 4)
    history = [(2.0, 1.0, 10), (4.0, 1.0, 2)]  # two runs of 5 steps, two reports
    opacus = RDPAccountant()
    opacus.history = history
    assert records[-1].epsilon_cumulative == opacus.get_epsilon(DELTA)
    mechanisms = [r.mechanism for r in records]
    previous = 0.0
    for count, record in enumerate(records, start=1):
        assert record.epsilon_cumulative == epsilon(mechanisms[:count], DELTA)
        assert record.epsilon_increment == record.epsilon_cumulative - previous
        previous = record.epsilon_cumulative


def test_records_are_chained_and_each_hash_covers_every_other_field(path: Path) -> None:
    records = book(PrivacyLedger(path), 3)
    assert [r.seq for r in records] == [1, 2, 3]
    assert [r.prev for r in records] == [GENESIS, records[0].hash, records[1].hash]
    for line in lines(path):
        document = json.loads(line)
        body = {k: v for k, v in document.items() if k != "hash"}
        canonical = json.dumps(body, separators=(",", ":")).encode()
        assert document["hash"] == hashlib.blake2b(canonical, digest_size=32).hexdigest()


def test_the_ledger_is_one_readable_json_line_per_release(path: Path) -> None:
    record = book(PrivacyLedger(path), 1)[0]
    (line,) = lines(path)
    assert json.loads(line) == {
        "seq": 1,
        "time": record.time,
        "deployment": "heart",
        "round": 0,
        "task_id": "heart-task-0",
        "mechanism": {
            "kind": "dp_sgd",
            "noise_multiplier": 2.0,
            "sample_rate": 1.0,
            "steps": 5,
            "max_grad_norm": 1.0,
        },
        "delta": DELTA,
        "accountant": "rdp",
        "epsilon_increment": record.epsilon_cumulative,
        "epsilon_cumulative": record.epsilon_cumulative,
        "payload_digest": payload_digest(b"payload 0"),
        "prev": GENESIS,
        "hash": record.hash,
    }
    assert datetime.fromisoformat(record.time).utcoffset() == timedelta(0)
    assert LedgerRecord.from_json(json.loads(line)) == record


def test_a_record_is_fsynced_before_append_returns(path: Path, monkeypatch) -> None:
    on_disk_at_fsync: list[bytes] = []
    real_fsync = ledger_module.os.fsync

    def spy(descriptor: int) -> None:
        real_fsync(descriptor)
        if path.exists():
            on_disk_at_fsync.append(path.read_bytes())

    monkeypatch.setattr(ledger_module.os, "fsync", spy)
    record = book(PrivacyLedger(path), 1)[0]
    assert any(record.line() in data for data in on_disk_at_fsync)


def test_would_reach_is_what_booking_the_release_then_books(path: Path) -> None:
    ledger = PrivacyLedger(path)
    book(ledger, 3)
    extra = Mechanism.gaussian(sensitivity=1.0, noise_std=2.0)
    reach = ledger.would_reach("heart", [extra], DELTA)
    assert len(ledger.records()) == 3  # asking books nothing
    assert book(ledger, 1, mechanism=extra)[0].epsilon_cumulative == reach
    assert ledger.spent("heart") == reach


def test_spent_before_the_first_release_is_zero(path: Path) -> None:
    ledger = PrivacyLedger(path)
    assert ledger.spent("heart") == 0.0
    assert ledger.would_reach("heart", [TRAIN], DELTA) == epsilon([TRAIN], DELTA)
    assert ledger.head() == GENESIS
    assert not path.exists()


def test_deployments_are_accounted_separately(path: Path) -> None:
    ledger = PrivacyLedger(path)
    book(ledger, 4, deployment="heart")
    book(ledger, 1, deployment="cancer")
    assert ledger.spent("cancer") == epsilon([TRAIN], DELTA)
    assert ledger.spent("heart") == epsilon([TRAIN, REPORT, TRAIN, REPORT], DELTA)
    assert [r.seq for r in ledger.records()] == [1, 2, 3, 4, 5]  # one chain for the silo


def test_a_deployment_keeps_the_delta_and_accountant_of_its_first_record(path: Path) -> None:
    ledger = PrivacyLedger(path)
    book(ledger, 1)
    with pytest.raises(LedgerError, match="delta 1e-05"):
        book(ledger, 1, delta=1e-6)
    with pytest.raises(LedgerError, match="accountant rdp"):
        ledger.would_reach("heart", [TRAIN], DELTA, "prv")
    assert len(ledger.records()) == 1


def test_a_release_without_noise_leaves_a_dp_deployment_unbounded(path: Path) -> None:
    ledger = PrivacyLedger(path)
    book(ledger, 1)
    raw = book(ledger, 1, mechanism=Mechanism.none())[0]
    after = book(ledger, 1)[0]
    assert raw.epsilon_increment == raw.epsilon_cumulative == math.inf
    assert (after.epsilon_increment, after.epsilon_cumulative) == (0.0, math.inf)
    assert json.loads(lines(path)[1])["epsilon_cumulative"] == "inf"  # standard JSON
    assert ledger.would_reach("heart", [TRAIN], DELTA) == math.inf
    assert verify(path).ok


def test_a_deployment_without_dp_books_its_releases_without_epsilon(path: Path) -> None:
    ledger = PrivacyLedger(path)
    record = book(ledger, 1, deployment="open", delta=None, mechanism=Mechanism.none())[0]
    assert (record.delta, record.accountant) == (None, None)
    assert (record.epsilon_increment, record.epsilon_cumulative) == (None, None)
    assert ledger.spent("open") is None
    with pytest.raises(LedgerError, match="delta None"):
        ledger.would_reach("open", [TRAIN], DELTA)
    (audit,) = verify(path).deployments
    assert (audit.booked, audit.recomputed) == (None, None)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"deployment": ""}, "deployment"),
        ({"round": -1}, "round"),
        ({"task_id": ""}, "task_id"),
        ({"mechanism": (2.0, 1.0, 5)}, "Mechanism"),
        ({"payload_digest": "ab" * 31}, "payload_digest"),
        ({"delta": 2.0}, "delta"),
        ({"accountant": "gdp"}, "accountant"),
    ],
)
def test_invalid_bookings_are_refused_and_write_nothing(path: Path, change, message) -> None:
    booking = {
        "deployment": "heart",
        "round": 0,
        "task_id": "t",
        "mechanism": TRAIN,
        "payload_digest": payload_digest(b"x"),
        "delta": DELTA,
        **change,
    }
    with pytest.raises(LedgerError, match=message):
        PrivacyLedger(path).append(**booking)
    assert not path.exists()


# Reopening and concurrency


def test_a_reopened_ledger_continues_the_chain(four: Path) -> None:
    first = PrivacyLedger(four)
    again = PrivacyLedger(four)
    assert again.records() == first.records()
    assert again.head() == first.head()
    assert again.spent("heart") == first.spent("heart")
    fifth = book(again, 1)[0]
    assert (fifth.seq, fifth.prev) == (5, first.records()[3].hash)
    assert verify(four).ok


def test_a_tampered_ledger_is_refused_when_opened(four: Path) -> None:
    data = bytearray(four.read_bytes())
    data[len(lines(four)[0]) + 40] ^= 0x01  # a byte of the second record
    four.write_bytes(bytes(data))
    with pytest.raises(LedgerError, match=r"line 2 \(seq 2\): edited.*refusing to book"):
        PrivacyLedger(four)


def test_a_ledger_cut_under_an_open_ledger_refuses_the_next_booking(four: Path) -> None:
    ledger = PrivacyLedger(four)
    four.write_bytes(b"".join(lines(four)[:3]))
    with pytest.raises(LedgerError, match="no longer in the file"):
        book(ledger, 1)
    four.unlink()
    with pytest.raises(LedgerError, match="no longer in the file"):
        ledger.spent("heart")


def test_an_interrupted_write_is_set_aside_and_repaired_when_the_ledger_opens(four: Path) -> None:
    good = four.read_bytes()
    torn = b'{"seq":5,"time":"2'
    four.write_bytes(good + torn)
    assert verify(four).problem.problem == TRUNCATED  # the audit names it until a silo opens it
    ledger = PrivacyLedger(four)
    (aside,) = four.parent.glob(f"{four.name}.torn-*")
    assert aside.read_bytes() == torn  # kept, never deleted
    repair = ledger.records()[-1]
    assert (repair.seq, repair.deployment, repair.task_id) == (5, REPAIRS, f"repair/{aside.name}")
    assert repair.payload_digest == payload_digest(torn) and repair.epsilon_cumulative is None
    assert four.read_bytes().startswith(good)
    assert book(ledger, 1)[0].seq == 6
    report = verify(four)
    assert report.ok and report.repairs == (repair,)


def test_a_damaged_line_before_the_last_is_not_repaired(four: Path) -> None:
    damaged = b"".join(lines(four)[:2]) + b'{"seq":3,"ti\n' + lines(four)[3]
    four.write_bytes(damaged)
    with pytest.raises(LedgerError, match="line 3: not JSON"):
        PrivacyLedger(four)
    assert four.read_bytes() == damaged and not list(four.parent.glob("*.torn-*"))


def test_threads_of_one_process_append_one_at_a_time(path: Path) -> None:
    ledger = PrivacyLedger(path)
    threads = [threading.Thread(target=book, args=(ledger, 5, f"deployment-{n}")) for n in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    report = verify(path)
    assert report.ok
    assert [r.seq for r in report.records] == list(range(1, 31))


def test_appends_wait_for_the_file_lock_and_continue_each_others_chain(four: Path) -> None:
    # flock locks belong to an open file, so two ledgers on one file contend like two processes.
    first, second = PrivacyLedger(four), PrivacyLedger(four)
    booked = []
    with open(four, "rb") as other_process:
        fcntl.flock(other_process, fcntl.LOCK_EX)
        waiting = threading.Thread(target=lambda: booked.extend(book(second, 1)))
        waiting.start()
        waiting.join(timeout=0.3)
        assert waiting.is_alive() and not booked  # blocked while another holds the lock
    waiting.join()
    assert booked[0].seq == 5
    assert book(first, 1)[0].seq == 6  # first caught up with second's record
    assert verify(four).ok


# Audit


def test_the_audit_of_an_intact_ledger_recomputes_every_booked_epsilon(path: Path) -> None:
    ledger = PrivacyLedger(path)
    book(ledger, 4)
    book(ledger, 2, deployment="cancer", accountant="prv")
    report = verify(path, anchor=ledger.head())
    assert report.ok and report.reason is None and report.problem is None
    assert report.head == ledger.head()
    for audit in report.deployments:
        assert audit.recomputed == audit.booked == ledger.spent(audit.deployment)
        assert audit.problem is None
    assert {a.deployment: a.records for a in report.deployments} == {"heart": 4, "cancer": 2}


@pytest.mark.parametrize("mask", [0x01, 0x20])  # 0x20 turns 1e-05 into 1E-05: same JSON value
def test_changing_any_byte_is_detected_and_names_its_line(four: Path, mask: int) -> None:
    original = four.read_bytes()
    for position in range(len(original)):
        tampered = bytearray(original)
        tampered[position] ^= mask
        four.write_bytes(bytes(tampered))
        report = verify(four)
        assert not report.ok, f"byte {position} changed undetected"
        assert report.problem.line == original[:position].count(b"\n") + 1, position


def test_a_deleted_record_is_named(four: Path) -> None:
    records = lines(four)
    four.write_bytes(b"".join(records[:1] + records[2:]))
    problem = verify(four).problem
    assert (problem.line, problem.seq, problem.problem) == (2, 3, DELETED)
    assert str(problem) == "line 2 (seq 3): deleted or reordered: seq 3 where seq 2 belongs"


def test_swapped_records_are_named(four: Path) -> None:
    first, second, third, fourth = lines(four)
    four.write_bytes(first + third + second + fourth)
    problem = verify(four).problem
    assert (problem.line, problem.seq, problem.problem) == (2, 3, DELETED)


def test_an_edited_record_is_named(four: Path) -> None:
    records = lines(four)
    records[2] = records[2].replace(b'"round":1', b'"round":7')
    four.write_bytes(b"".join(records))
    problem = verify(four).problem
    assert (problem.line, problem.seq, problem.problem) == (3, 3, EDITED)
    assert "hash does not match" in problem.detail


def test_a_line_that_is_not_json_is_named(four: Path) -> None:
    records = lines(four)
    four.write_bytes(b"".join([*records[:3], b"hello\n", records[3]]))
    problem = verify(four).problem
    assert (problem.line, problem.problem) == (4, NOT_JSON)


def test_a_truncated_tail_is_named(four: Path) -> None:
    four.write_bytes(four.read_bytes()[:-30])
    problem = verify(four).problem
    assert (problem.line, problem.seq, problem.problem) == (4, 4, TRUNCATED)


def test_a_deleted_last_record_is_caught_by_the_coordinators_anchor(four: Path) -> None:
    anchor = PrivacyLedger(four).head()
    earlier = PrivacyLedger(four).records()[1].hash
    four.write_bytes(b"".join(lines(four)[:3]))
    assert verify(four).ok  # the chain alone cannot tell
    assert verify(four, anchor=earlier).ok  # a ledger may grow after what the coordinator saw
    report = verify(four, anchor=anchor)
    assert (report.problem.line, report.problem.problem) == (4, ANCHOR_MISSING)
    # A bare hash cannot tell a deletion from a rewrite, and the audit does not guess.
    assert "deleted, or rewritten with its hashes recomputed" in report.reason


def test_a_rewritten_chain_with_a_false_epsilon_fails_the_recomputation(four: Path) -> None:
    records = PrivacyLedger(four).records()
    forged, prev = [], GENESIS
    for record in records:
        cumulative = record.epsilon_cumulative / 2 if record.seq == 3 else record.epsilon_cumulative
        unsealed = replace(record, epsilon_cumulative=cumulative, prev=prev)
        forged.append(replace(unsealed, hash=unsealed.computed_hash()))
        prev = forged[-1].hash
    four.write_bytes(b"".join(r.line() for r in forged))
    report = verify(four)
    assert report.problem is None  # a consistent chain ...
    assert not report.ok  # ... whose numbers do not hold
    assert report.reason.endswith(
        f"deployment heart: seq 3 books epsilon +{records[2].epsilon_increment} = "
        f"{records[2].epsilon_cumulative / 2}, recomputed +{records[2].epsilon_increment} = "
        f"{records[2].epsilon_cumulative}"
    )
    assert not verify(four, anchor=records[-1].hash).ok  # and the anchor betrays the rewrite


def test_the_audit_holds_each_deployment_against_a_cap(four: Path) -> None:
    spent = PrivacyLedger(four).spent("heart")
    (roomy,) = verify(four, cap=spent + 1).deployments
    assert roomy.remaining == pytest.approx(1.0)
    report = verify(four, cap=spent / 2)
    assert not report.ok
    assert "over the cap" in report.reason
    assert report.deployments[0].remaining == 0.0


def test_auditing_a_missing_ledger_or_with_a_malformed_anchor_is_an_error(path: Path) -> None:
    with pytest.raises(LedgerError, match="cannot read"):
        verify(path)
    path.write_bytes(b"")
    assert verify(path).ok  # an empty ledger is a valid one
    with pytest.raises(LedgerError, match="anchor"):
        verify(path, anchor="not-a-hash")
