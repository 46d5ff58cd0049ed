"""Release receipts: what a silo signs, with its provisioned Ed25519 identity, for every answer
it books, and what the coordinator keeps so that a privacy officer can hold the silo's ledger
against what actually left it.

A receipt names the deployment, the job (the digest of the signed policy the silo accepted),
the task, the digest of the answer's body (the encoded result without its receipt, which is
what the ledger books, so neither depends on the other), and the ledger after the booking: the
seq and hash of the answer's last record and the deployment's epsilon there. Because the head
is the one AFTER the booking, every release is anchored by its own receipt, the last included.
The signature covers the canonical JSON of every other field, under a fixed context string.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

CONTEXT = b"fedsilo release receipt v1\x00"
_HEX_64 = re.compile("[0-9a-f]{64}")
_FIELDS = (
    "silo",
    "deployment",
    "job",
    "task_id",
    "payload_digest",
    "seq",
    "ledger_head",
    "epsilon",
)


class ReceiptError(ValueError):
    """A receipt or a receipts file that cannot be read; the message names the field."""


@dataclass(frozen=True)
class Receipt:
    """One booked answer, as the silo signed it (`signature` empty until `signed`)."""

    silo: str
    deployment: str
    job: str  # the accepted policy digest ("" where the silo pinned none)
    task_id: str
    payload_digest: str  # of the answer's body: the result encoded without its receipt
    seq: int  # the answer's last ledger record
    ledger_head: str  # that record's hash: the ledger head after the booking
    epsilon: float | None  # the deployment's epsilon after the booking (None: no DP)
    signature: str = ""

    def message(self) -> bytes:
        """The bytes the signature covers."""
        body = {name: getattr(self, name) for name in _FIELDS}
        body["epsilon"] = _epsilon_to_json(self.epsilon)
        return CONTEXT + json.dumps(body, separators=(",", ":"), sort_keys=True).encode()

    def signed(self, identity: SigningKey) -> Receipt:
        return replace(self, signature=identity.sign(self.message()).signature.hex())

    def signed_by(self, key: VerifyKey) -> bool:
        try:
            key.verify(self.message(), bytes.fromhex(self.signature))
        except (BadSignatureError, ValueError):
            return False
        return True

    def to_json(self) -> dict[str, Any]:
        document = {name: getattr(self, name) for name in _FIELDS}
        return {**document, "epsilon": _epsilon_to_json(self.epsilon), "signature": self.signature}

    @classmethod
    def from_json(cls, data: Any) -> Receipt:
        """The inverse of `to_json`; raises `ReceiptError` naming the first wrong field."""
        if not isinstance(data, Mapping):
            raise ReceiptError(f"a receipt is a JSON object, not {type(data).__name__}")
        missing = [name for name in (*_FIELDS, "signature") if name not in data]
        if missing:
            raise ReceiptError(f"receipt lacks {missing}")
        for name in ("silo", "deployment", "job", "task_id", "signature"):
            _require(isinstance(data[name], str), f"receipt field {name} must be a text")
        for name in ("payload_digest", "ledger_head"):
            _require(
                isinstance(data[name], str) and _HEX_64.fullmatch(data[name]) is not None,
                f"receipt field {name} must be 64 hex digits",
            )
        seq = data["seq"]
        _require(
            isinstance(seq, int) and not isinstance(seq, bool) and seq >= 1,
            "receipt field seq must be an integer >= 1",
        )
        return cls(
            silo=data["silo"],
            deployment=data["deployment"],
            job=data["job"],
            task_id=data["task_id"],
            payload_digest=data["payload_digest"],
            seq=seq,
            ledger_head=data["ledger_head"],
            epsilon=_epsilon_from_json(data["epsilon"]),
            signature=data["signature"],
        )


def receipts_document(receipts: Sequence[Receipt]) -> dict[str, Any]:
    """What `fedsilo privacy receipts` writes: every receipt, by silo then ledger seq."""
    ordered = sorted(receipts, key=lambda r: (r.silo, r.deployment, r.seq, r.task_id))
    return {"format": "fedsilo-receipts-1", "receipts": [r.to_json() for r in ordered]}


def read_receipts_document(text: str, source: str) -> list[Receipt]:
    """The receipts of a `receipts_document`; a bad file is one `ReceiptError` naming it."""
    try:
        document = json.loads(text)
    except ValueError as exc:
        raise ReceiptError(f"{source}: not JSON: {exc}") from None
    if not isinstance(document, dict) or not isinstance(document.get("receipts"), list):
        raise ReceiptError(f"{source}: not a receipts file (no 'receipts' list)")
    receipts = []
    for index, entry in enumerate(document["receipts"]):
        try:
            receipts.append(Receipt.from_json(entry))
        except ReceiptError as exc:
            raise ReceiptError(f"{source}: receipts[{index}]: {exc}") from None
    return receipts


def _epsilon_to_json(value: float | None) -> float | str | None:
    return "inf" if value == math.inf else value


def _epsilon_from_json(value: Any) -> float | None:
    if value is None:
        return None
    if value == "inf":
        return math.inf
    _require(
        isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value),
        "receipt field epsilon must be a number, inf or null",
    )
    return float(value)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ReceiptError(message)
