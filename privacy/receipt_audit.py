"""A silo's ledger held against the receipts the coordinator kept: what proves that the ledger
books every release that left the silo, as it left, at the epsilon the silo signed.

For each receipt (signed with the silo's identity, checked first) the ledger must still hold
the record it anchors: the record of that seq must have the receipt's hash, task, job and body
digest, and the epsilon recomputed up to it must be the signed one. A missing seq is a deleted
or truncated record; a seq whose hash differs is an edited or rewritten one (hashes recomputed
or not: the receipt's hash is signed). A task booked again after its receipt's record (a forged
or appended record for a release the coordinator received) is named too. Records after the last
receipt are releases no receipt covers (e.g. an answer that arrived after its deadline): they
are listed, and they can only add to the epsilon the ledger books.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from nacl.signing import VerifyKey

from fedsilo.privacy.ledger import AuditReport, LedgerRecord
from fedsilo.privacy.receipts import Receipt

RELATIVE_TOLERANCE = 1e-9


@dataclass(frozen=True)
class ReceiptAudit:
    """What the receipts prove about a ledger: findings (empty when it holds), how many
    receipts were checked, and the records no receipt covers."""

    receipts: int
    problems: tuple[str, ...]
    uncovered: tuple[int, ...]  # seqs after the last receipt's record

    @property
    def ok(self) -> bool:
        return not self.problems


def audit_receipts(
    report: AuditReport, receipts: Sequence[Receipt], key: VerifyKey
) -> ReceiptAudit:
    """Check `receipts` (one silo's, signed by `key`) against the audited ledger `report`."""
    by_seq = {record.seq: record for record in report.records}
    problems: list[str] = []
    anchored: dict[tuple[str, str | None, str], int] = {}
    vouched = 0  # the last seq a receipt still vouches for
    for receipt in sorted(receipts, key=lambda r: r.seq):
        if not receipt.signed_by(key):
            problems.append(
                f"receipt for task {receipt.task_id}: the signature is not this silo's "
                "(a forged receipt, or the wrong --verify-key)"
            )
            continue
        problem = _anchor_problem(report, by_seq.get(receipt.seq), receipt, vouched)
        if problem is None:
            vouched = receipt.seq
        else:
            problems.append(problem)
        anchored[(receipt.deployment, receipt.job or None, receipt.task_id)] = receipt.seq
    for record in report.records:
        seq = anchored.get((record.deployment, record.job, record.task_id))
        if seq is not None and record.seq > seq:
            problems.append(
                f"seq {record.seq} books task {record.task_id} again after seq {seq}, the record "
                "its receipt anchors: a record appended or forged for a release the "
                "coordinator received"
            )
    last = max((r.seq for r in receipts), default=0)
    uncovered = tuple(r.seq for r in report.records if r.seq > last)
    return ReceiptAudit(len(receipts), tuple(problems), uncovered)


def _anchor_problem(
    report: AuditReport, record: LedgerRecord | None, receipt: Receipt, vouched: int
) -> str | None:
    task = f"receipt for task {receipt.task_id} (seq {receipt.seq})"
    if record is None:
        last = report.records[-1].seq if report.records else 0
        lost = f"seqs {last + 1}-{receipt.seq} were"
        if receipt.seq == last + 1:
            lost = f"seq {receipt.seq} was"
        return f"{task}: the ledger ends at seq {last}; {lost} deleted or truncated"
    if record.hash != receipt.ledger_head:
        return (
            f"{task}: the ledger's seq {receipt.seq} has hash {record.hash}, the signed one is "
            f"{receipt.ledger_head}: a record from seq {vouched + 1} to seq {receipt.seq} was "
            "edited, or the ledger rewritten from there (hashes recomputed or not)"
        )
    held = (record.deployment, record.job or "", record.task_id, record.payload_digest)
    signed = (receipt.deployment, receipt.job, receipt.task_id, receipt.payload_digest)
    if held != signed:
        return f"{task}: the record anchored books {held}, the receipt signs {signed}"
    recomputed = report.epsilon_at(record)
    if not _same(recomputed, receipt.epsilon):
        return (
            f"{task}: the silo signed epsilon {receipt.epsilon}, the ledger recomputes "
            f"{recomputed} up to seq {record.seq}"
        )
    return None


def _same(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is b
    return a == b or math.isclose(a, b, rel_tol=RELATIVE_TOLERANCE)
