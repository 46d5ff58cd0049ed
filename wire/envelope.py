"""Signed message envelopes: sealing a payload, and deciding whether to accept one.

Every payload between coordinator and silos (tasks, results, joins) travels with an `Envelope`:
deployment, round, task id, sender, a random nonce, the digest (BLAKE3-256, wire/payload.py) and
size of the payload, the send time, and the sender's Ed25519 signature over all of these. `seal`
makes one; `EnvelopeVerifier` accepts it or raises `EnvelopeRejected`, whose `reason` is one of
the stable label values in `REJECTION_REASONS` (for metrics). A verifier given a `ReplayMemory`
writes every accepted message to it before accepting, and recalls the ones still fresh when it
is made, so replay protection survives a restart.
"""

from __future__ import annotations

import dataclasses
import heapq
import json
import math
import os
import struct
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Protocol

from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from fedsilo.wire.payload import DIGEST_BYTES, AnyPayload, as_payload
from fedsilo.wire.tensors import WireError

SIGNATURE_DOMAIN = b"fedsilo-envelope-v1"
MAX_AGE_S = 300.0  # how old (or how far ahead of the receiver's clock) a message may be
NONCE_BYTES = 16
SIGNATURE_BYTES = 64

UNKNOWN_SENDER = "unknown_sender"
WRONG_DEPLOYMENT = "wrong_deployment"
BAD_SIGNATURE = "bad_signature"
STALE = "stale"
FROM_THE_FUTURE = "from_the_future"
REPLAY = "replay"
DIGEST_MISMATCH = "digest_mismatch"
SIZE_MISMATCH = "size_mismatch"
OVERSIZED = "oversized"
REJECTION_REASONS = (
    UNKNOWN_SENDER,
    WRONG_DEPLOYMENT,
    BAD_SIGNATURE,
    STALE,
    FROM_THE_FUTURE,
    REPLAY,
    DIGEST_MISMATCH,
    SIZE_MISMATCH,
    OVERSIZED,
)

Clock = Callable[[], float]

_TEXT_FIELDS = ("deployment", "task_id", "sender")
_COUNT_FIELDS = ("round", "payload_size")
_BYTE_FIELDS = {"nonce": NONCE_BYTES, "payload_digest": DIGEST_BYTES, "signature": SIGNATURE_BYTES}
_LENGTH = struct.Struct(">I")
_U64 = struct.Struct(">Q")
_F64 = struct.Struct(">d")


@dataclass(frozen=True)
class Envelope:
    """Who sent which payload, for which deployment, round and task, when; and the signature.

    Constructing one checks the shape of every field (types, byte lengths, ranges) and raises
    `WireError` for a malformed one; whether to *accept* it is `EnvelopeVerifier`'s decision.
    """

    deployment: str
    round: int
    task_id: str
    sender: str
    nonce: bytes
    payload_digest: bytes
    payload_size: int
    sent_at: float
    signature: bytes

    def __post_init__(self) -> None:
        _check_text_fields(self)
        _check_count_fields(self)
        _check_byte_fields(self)
        _check_sent_at(self.sent_at)

    def signed_fields(self) -> bytes:
        """The bytes the signature covers: the domain tag, then every field but the signature.

        Strings and byte strings are length-prefixed (4-byte big-endian), integers are 8-byte
        big-endian unsigned, the send time an 8-byte big-endian IEEE double, so no two
        different envelopes encode alike.
        """
        return b"".join(
            (
                SIGNATURE_DOMAIN,
                _length_prefixed(self.deployment.encode()),
                _U64.pack(self.round),
                _length_prefixed(self.task_id.encode()),
                _length_prefixed(self.sender.encode()),
                _length_prefixed(self.nonce),
                _length_prefixed(self.payload_digest),
                _U64.pack(self.payload_size),
                _F64.pack(self.sent_at),
            )
        )

    def to_json(self) -> str:
        """Compact JSON with byte fields hex-encoded, for protobuf string fields and logs."""
        fields = {
            name: value.hex() if isinstance(value, bytes) else value
            for name, value in dataclasses.asdict(self).items()
        }
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes) -> Envelope:
        """Parse `to_json`'s output; raise `WireError` for anything malformed."""
        try:
            raw = json.loads(text)
        except ValueError as exc:
            raise WireError(f"envelope is not JSON: {exc}") from exc
        if not isinstance(raw, dict):
            raise WireError("envelope JSON must be an object")
        expected = {f.name for f in dataclasses.fields(cls)}
        if set(raw) != expected:
            raise WireError(
                f"envelope fields differ: missing {sorted(expected - set(raw))}, "
                f"unexpected {sorted(set(raw) - expected)}"
            )
        try:
            byte_fields = {name: bytes.fromhex(raw[name]) for name in _BYTE_FIELDS}
        except (TypeError, ValueError) as exc:
            raise WireError(f"envelope byte field is not hex: {exc}") from exc
        return cls(**{**raw, **byte_fields})


def seal(
    payload: bytes | AnyPayload,
    *,
    signing_key: SigningKey,
    sender: str,
    deployment: str,
    round: int,
    task_id: str,
    clock: Clock = time.time,
    nonce: bytes | None = None,
) -> Envelope:
    """Sign an envelope for `payload` as `sender`; a fresh random nonce unless one is given."""
    unsigned = Envelope(
        deployment=deployment,
        round=round,
        task_id=task_id,
        sender=sender,
        nonce=os.urandom(NONCE_BYTES) if nonce is None else nonce,
        payload_digest=_digest(payload),
        payload_size=len(payload),
        sent_at=float(clock()),
        signature=bytes(SIGNATURE_BYTES),
    )
    signature = signing_key.sign(unsigned.signed_fields()).signature
    return dataclasses.replace(unsigned, signature=signature)


class ReplayMemory(Protocol):
    """Durable storage of accepted messages' (sent_at, sender, task_id), for a verifier."""

    def recall(self, since: float) -> Iterable[tuple[float, str, str]]:
        """Every message remembered that was sent at or after `since`."""
        ...

    def remember(self, sent_at: float, sender: str, task_id: str) -> None:
        """Store one accepted message durably before returning."""
        ...


class EnvelopeRejected(Exception):
    """A message refused by `EnvelopeVerifier`; `reason` is one of `REJECTION_REASONS`."""

    def __init__(self, reason: str, envelope: Envelope, detail: str) -> None:
        super().__init__(
            f"rejected message from sender {envelope.sender!r} for task {envelope.task_id!r} "
            f"({reason}): {detail}"
        )
        self.reason = reason
        self.sender = envelope.sender
        self.task_id = envelope.task_id


class EnvelopeVerifier:
    """Accepts a message only from a roster member, for this deployment, fresh, signed, once.

    `check_header` refuses a message on its envelope alone (so a streaming receiver can refuse
    it before reading the payload); `check_payload` compares the payload with the envelope;
    `verify` does both and then records the message as accepted. Only `verify` records, so a
    forged or tampered message never uses up the task id of the genuine one.

    Replay protection: each accepted (sender, task_id) pair is accepted only once. The
    verifier remembers at most `replay_window` pairs; when full, it forgets the pair with the
    oldest `sent_at` and moves its *replay horizon* up to that time. From then on every
    envelope sent at or before the horizon is rejected as REPLAY, because a replay of a
    forgotten pair could no longer be told apart; forgetting never reopens a replay. Eviction
    goes by send time, not arrival, so a silo whose clock runs ahead cannot drag the horizon
    forward. With a window well above the number of messages accepted per `max_age_s`, the
    horizon stays behind the freshness limit and rejects nothing that STALE would not.

    With a `memory`, every accepted pair is also written to it (durably, before `verify`
    returns), and a new verifier recalls every pair sent within `max_age_s` of now: a message
    accepted before a restart is a REPLAY after it, and older ones are STALE anyway.

    Thread-safe: the roster and the replay memory are guarded by one lock; signatures are
    checked outside it. A revocation applies to every check that starts after it returns.
    """

    def __init__(
        self,
        deployment: str,
        roster: Mapping[str, VerifyKey],
        max_age_s: float = MAX_AGE_S,
        max_payload_bytes: int = 2**31,
        clock: Clock = time.time,
        replay_window: int = 100_000,
        memory: ReplayMemory | None = None,
    ) -> None:
        if max_age_s < 0 or max_payload_bytes < 0 or replay_window < 1:
            raise ValueError(
                "max_age_s and max_payload_bytes must be non-negative, replay_window positive"
            )
        self._deployment = deployment
        self._max_age_s = max_age_s
        self._max_payload_bytes = max_payload_bytes
        self._clock = clock
        self._replay_window = replay_window
        self._lock = threading.Lock()
        self._roster = _checked_roster(roster)
        self._accepted: set[tuple[str, str]] = set()
        self._accepted_by_age: list[tuple[float, str, str]] = []
        self._replay_horizon = -math.inf
        self._memory = memory
        if memory is not None:
            for sent_at, sender, task_id in memory.recall(since=clock() - max_age_s):
                self._remember_in_memory(sent_at, sender, task_id)

    def set_roster(self, roster: Mapping[str, VerifyKey]) -> None:
        """Replace the roster; the replay memory is kept, so re-admitted senders cannot replay."""
        checked = _checked_roster(roster)
        with self._lock:
            self._roster = checked

    def revoke(self, sender: str) -> None:
        """Remove `sender` from the roster; raise KeyError if it is not on it."""
        with self._lock:
            if sender not in self._roster:
                raise KeyError(f"cannot revoke {sender!r}: not on the roster")
            del self._roster[sender]

    def check_header(self, envelope: Envelope) -> None:
        """Refuse an envelope on its own: deployment, sender, size, freshness, signature, replay."""
        if envelope.deployment != self._deployment:
            raise EnvelopeRejected(
                WRONG_DEPLOYMENT,
                envelope,
                f"addressed to deployment {envelope.deployment!r}, this is {self._deployment!r}",
            )
        verify_key = self._verify_key(envelope)
        if envelope.payload_size > self._max_payload_bytes:
            raise EnvelopeRejected(
                OVERSIZED,
                envelope,
                f"payload of {envelope.payload_size} bytes exceeds the limit of "
                f"{self._max_payload_bytes}",
            )
        self._check_fresh(envelope)
        _check_signature(envelope, verify_key)
        with self._lock:
            self._check_not_replayed(envelope)

    def check_payload(self, envelope: Envelope, payload: bytes | AnyPayload) -> None:
        """Refuse a payload whose size or digest differs from the envelope's."""
        if len(payload) != envelope.payload_size:
            raise EnvelopeRejected(
                SIZE_MISMATCH,
                envelope,
                f"payload has {len(payload)} bytes, the envelope says {envelope.payload_size}",
            )
        if _digest(payload) != envelope.payload_digest:
            raise EnvelopeRejected(
                DIGEST_MISMATCH, envelope, "payload digest differs from the signed one"
            )

    def verify(self, envelope: Envelope, payload: bytes | AnyPayload) -> None:
        """Check header and payload, then record (sender, task_id) as accepted, atomically."""
        self.check_header(envelope)
        self.check_payload(envelope, payload)
        with self._lock:
            self._check_not_replayed(envelope)
            self._remember(envelope)

    def _verify_key(self, envelope: Envelope) -> VerifyKey:
        with self._lock:
            verify_key = self._roster.get(envelope.sender)
        if verify_key is None:
            raise EnvelopeRejected(UNKNOWN_SENDER, envelope, "sender is not on the roster")
        return verify_key

    def _check_fresh(self, envelope: Envelope) -> None:
        age = self._clock() - envelope.sent_at
        if age > self._max_age_s:
            raise EnvelopeRejected(
                STALE, envelope, f"sent {age:.3f} s ago, the limit is {self._max_age_s} s"
            )
        if -age > self._max_age_s:
            raise EnvelopeRejected(
                FROM_THE_FUTURE,
                envelope,
                f"sent {-age:.3f} s in the future, beyond the {self._max_age_s} s tolerance "
                "(clock skew?)",
            )

    def _check_not_replayed(self, envelope: Envelope) -> None:
        """Call with the lock held."""
        if (envelope.sender, envelope.task_id) in self._accepted:
            raise EnvelopeRejected(REPLAY, envelope, "task id already accepted from this sender")
        if envelope.sent_at <= self._replay_horizon:
            raise EnvelopeRejected(
                REPLAY,
                envelope,
                f"sent at {envelope.sent_at}, not after the replay horizon "
                f"{self._replay_horizon}: the replay window no longer reaches back that far",
            )

    def _remember(self, envelope: Envelope) -> None:
        """Call with the lock held: the durable memory first, so nothing is accepted that a
        restart would forget."""
        if self._memory is not None:
            self._memory.remember(envelope.sent_at, envelope.sender, envelope.task_id)
        self._remember_in_memory(envelope.sent_at, envelope.sender, envelope.task_id)

    def _remember_in_memory(self, sent_at: float, sender: str, task_id: str) -> None:
        self._accepted.add((sender, task_id))
        heapq.heappush(self._accepted_by_age, (sent_at, sender, task_id))
        while len(self._accepted_by_age) > self._replay_window:
            oldest, forgotten_sender, forgotten_task = heapq.heappop(self._accepted_by_age)
            self._accepted.discard((forgotten_sender, forgotten_task))
            self._replay_horizon = max(self._replay_horizon, oldest)


def _digest(payload: bytes | AnyPayload) -> bytes:
    return as_payload(payload).digest()


def _length_prefixed(data: bytes) -> bytes:
    return _LENGTH.pack(len(data)) + data


def _check_signature(envelope: Envelope, verify_key: VerifyKey) -> None:
    try:
        verify_key.verify(envelope.signed_fields(), envelope.signature)
    except BadSignatureError:
        raise EnvelopeRejected(
            BAD_SIGNATURE, envelope, "signature does not verify under the sender's roster key"
        ) from None


def _checked_roster(roster: Mapping[str, VerifyKey]) -> dict[str, VerifyKey]:
    for sender, verify_key in roster.items():
        if not isinstance(verify_key, VerifyKey):
            raise TypeError(
                f"roster entry {sender!r} is a {type(verify_key).__name__}, not a VerifyKey"
            )
    return dict(roster)


def _check_text_fields(envelope: Envelope) -> None:
    for name in _TEXT_FIELDS:
        value = getattr(envelope, name)
        if not isinstance(value, str):
            raise WireError(f"envelope {name} must be a string, not {type(value).__name__}")
        try:
            value.encode()
        except UnicodeEncodeError as exc:
            raise WireError(f"envelope {name} is not valid UTF-8: {exc}") from exc


def _check_count_fields(envelope: Envelope) -> None:
    for name in _COUNT_FIELDS:
        value = getattr(envelope, name)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**64:
            raise WireError(f"envelope {name} must be an integer in [0, 2**64), got {value!r}")


def _check_byte_fields(envelope: Envelope) -> None:
    for name, length in _BYTE_FIELDS.items():
        value = getattr(envelope, name)
        if not isinstance(value, bytes) or len(value) != length:
            raise WireError(f"envelope {name} must be {length} bytes")


def _check_sent_at(sent_at: float) -> None:
    if isinstance(sent_at, bool) or not isinstance(sent_at, int | float):
        raise WireError(f"envelope sent_at must be a number, not {type(sent_at).__name__}")
    if not math.isfinite(sent_at):
        raise WireError(f"envelope sent_at must be finite, got {sent_at!r}")
