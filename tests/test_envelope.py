"""Signed envelopes: sealed messages verify once; forged, stale, replayed or mismatched do not."""

from __future__ import annotations

import dataclasses
import math
import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
from nacl.signing import SigningKey

from fedsilo.wire.envelope import (
    BAD_SIGNATURE,
    DIGEST_MISMATCH,
    FROM_THE_FUTURE,
    OVERSIZED,
    REJECTION_REASONS,
    REPLAY,
    SIGNATURE_DOMAIN,
    SIZE_MISMATCH,
    STALE,
    UNKNOWN_SENDER,
    WRONG_DEPLOYMENT,
    Envelope,
    EnvelopeRejected,
    EnvelopeVerifier,
    seal,
)
from fedsilo.wire.tensors import WireError

NOW = 1_700_000_000.0
DEPLOYMENT = "heart-study"
PAYLOAD = b"encoded task " * 100
SILO_A = SigningKey(bytes([1]) * 32)
SILO_B = SigningKey(bytes([2]) * 32)
INTRUDER = SigningKey(bytes([3]) * 32)
SIGNED_FIELDS = [f.name for f in dataclasses.fields(Envelope) if f.name != "signature"]


class FakeClock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def sealed(
    task_id: str = "task-1",
    *,
    payload: bytes = PAYLOAD,
    key: SigningKey = SILO_A,
    sender: str = "silo-a",
    deployment: str = DEPLOYMENT,
    sent_at: float = NOW,
) -> Envelope:
    return seal(
        payload,
        signing_key=key,
        sender=sender,
        deployment=deployment,
        round=3,
        task_id=task_id,
        clock=lambda: sent_at,
        nonce=bytes(range(16)),
    )


def verifier(clock: FakeClock | None = None, **options: float) -> EnvelopeVerifier:
    roster = {"silo-a": SILO_A.verify_key, "silo-b": SILO_B.verify_key}
    return EnvelopeVerifier(DEPLOYMENT, roster, clock=clock or FakeClock(), **options)


def rejection(check: EnvelopeVerifier, envelope: Envelope, payload: bytes = PAYLOAD) -> str:
    with pytest.raises(EnvelopeRejected) as info:
        check.verify(envelope, payload)
    return info.value.reason


def flipped(value: str | int | float | bytes) -> str | int | float | bytes:
    """The same value with its lowest-order bit changed."""
    if isinstance(value, str):
        return value[:-1] + chr(ord(value[-1]) ^ 1)
    if isinstance(value, bytes):
        return value[:-1] + bytes([value[-1] ^ 1])
    if isinstance(value, float):
        return math.nextafter(value, math.inf)
    return value ^ 1


def test_a_sealed_envelope_verifies_and_records_its_fields() -> None:
    envelope = sealed()
    verifier().verify(envelope, PAYLOAD)
    assert (envelope.sender, envelope.task_id, envelope.round) == ("silo-a", "task-1", 3)
    assert envelope.payload_size == len(PAYLOAD) and envelope.sent_at == NOW
    assert len(envelope.payload_digest) == 32 and len(envelope.signature) == 64


def test_an_envelope_survives_a_json_round_trip() -> None:
    envelope = sealed()
    text = envelope.to_json()
    assert Envelope.from_json(text) == envelope
    assert envelope.nonce.hex() in text
    verifier().verify(Envelope.from_json(text), PAYLOAD)


def test_seal_draws_a_fresh_random_nonce_unless_given_one() -> None:
    first, second = (
        seal(PAYLOAD, signing_key=SILO_A, sender="s", deployment="d", round=0, task_id="t")
        for _ in range(2)
    )
    assert len(first.nonce) == 16 and first.nonce != second.nonce


@pytest.mark.parametrize(
    "change",
    [
        {"round": -1},
        {"payload_size": 1.5},
        {"nonce": bytes(15)},
        {"payload_digest": bytes(31)},
        {"signature": "00" * 64},
        {"sent_at": math.nan},
        {"task_id": 7},
        {"sender": "\ud800"},
    ],
)
def test_an_envelope_with_a_malformed_field_cannot_be_built(change: dict) -> None:
    with pytest.raises(WireError):
        dataclasses.replace(sealed(), **change)


@pytest.mark.parametrize(
    "text",
    [
        "not json",
        "[1, 2]",
        '{"round": 3}',
        sealed().to_json().replace(sealed().nonce.hex(), "zz" * 16),
        sealed().to_json().replace('"round":3', '"round":"3"'),
        sealed().to_json()[:-1] + ',"extra":1}',
    ],
)
def test_malformed_envelope_json_raises_a_wire_error(text: str) -> None:
    with pytest.raises(WireError):
        Envelope.from_json(text)


def test_signed_fields_start_with_the_domain_tag() -> None:
    assert sealed().signed_fields().startswith(SIGNATURE_DOMAIN)
    assert SIGNATURE_DOMAIN == b"fedsilo-envelope-v1"


def test_signed_fields_are_unambiguous_where_strings_meet() -> None:
    one = dataclasses.replace(sealed(), deployment="ab", task_id="c")
    other = dataclasses.replace(sealed(), deployment="a", task_id="bc")
    assert one.signed_fields() != other.signed_fields()


@pytest.mark.parametrize("field", SIGNED_FIELDS)
def test_a_flipped_bit_in_any_signed_field_breaks_the_signature(field: str) -> None:
    genuine = sealed()
    forged = dataclasses.replace(genuine, **{field: flipped(getattr(genuine, field))})
    # A verifier that would take the forged deployment and sender: only the signature refuses.
    lenient = EnvelopeVerifier(
        forged.deployment,
        {genuine.sender: SILO_A.verify_key, forged.sender: SILO_A.verify_key},
        clock=FakeClock(),
    )
    with pytest.raises(EnvelopeRejected) as info:
        lenient.check_header(forged)
    assert info.value.reason == BAD_SIGNATURE


@pytest.mark.parametrize("position", [0, 31, 63])
def test_a_flipped_signature_byte_breaks_the_signature(position: int) -> None:
    genuine = sealed()
    signature = bytearray(genuine.signature)
    signature[position] ^= 0x01
    forged = dataclasses.replace(genuine, signature=bytes(signature))
    assert rejection(verifier(), forged) == BAD_SIGNATURE


def test_a_message_signed_with_another_key_is_rejected() -> None:
    assert rejection(verifier(), sealed(key=INTRUDER)) == BAD_SIGNATURE


def test_an_unknown_sender_is_rejected() -> None:
    assert rejection(verifier(), sealed(key=INTRUDER, sender="silo-x")) == UNKNOWN_SENDER


def test_a_revoked_sender_is_rejected_and_a_new_roster_admits_its_members() -> None:
    check = verifier()
    check.revoke("silo-a")
    assert rejection(check, sealed("task-1")) == UNKNOWN_SENDER
    check.set_roster({"silo-a": SILO_A.verify_key})
    check.verify(sealed("task-1"), PAYLOAD)
    assert rejection(check, sealed("task-2", key=SILO_B, sender="silo-b")) == UNKNOWN_SENDER


def test_revoking_a_sender_not_on_the_roster_is_an_error() -> None:
    with pytest.raises(KeyError, match="silo-x"):
        verifier().revoke("silo-x")


def test_a_roster_of_anything_but_verify_keys_is_refused() -> None:
    with pytest.raises(TypeError, match="VerifyKey"):
        verifier().set_roster({"silo-a": bytes(SILO_A.verify_key)})


def test_an_envelope_for_another_deployment_is_rejected() -> None:
    assert rejection(verifier(), sealed(deployment="other-study")) == WRONG_DEPLOYMENT


def test_an_envelope_exactly_max_age_old_or_ahead_is_still_fresh() -> None:
    check = verifier(max_age_s=60.0)
    check.verify(sealed("old", sent_at=NOW - 60.0), PAYLOAD)
    check.verify(sealed("ahead", sent_at=NOW + 60.0), PAYLOAD)


def test_an_envelope_older_than_max_age_is_stale() -> None:
    clock = FakeClock()
    envelope = sealed()
    clock.now += 60.5
    assert rejection(verifier(clock, max_age_s=60.0), envelope) == STALE


def test_an_envelope_from_beyond_max_age_ahead_is_from_the_future() -> None:
    envelope = sealed(sent_at=NOW + 60.5)
    assert rejection(verifier(max_age_s=60.0), envelope) == FROM_THE_FUTURE


def test_a_replayed_envelope_is_rejected() -> None:
    check = verifier()
    check.verify(sealed(), PAYLOAD)
    assert rejection(check, sealed()) == REPLAY


def test_a_task_id_is_accepted_once_per_sender_even_when_resealed() -> None:
    check = verifier()
    check.verify(sealed("task-1"), PAYLOAD)
    assert rejection(check, sealed("task-1", sent_at=NOW + 1.0, payload=b"other")) == REPLAY
    check.verify(sealed("task-1", key=SILO_B, sender="silo-b"), PAYLOAD)


def test_a_flipped_payload_byte_is_a_digest_mismatch() -> None:
    tampered = bytearray(PAYLOAD)
    tampered[500] ^= 0x80
    assert rejection(verifier(), sealed(), bytes(tampered)) == DIGEST_MISMATCH


def test_a_payload_of_another_size_is_a_size_mismatch() -> None:
    assert rejection(verifier(), sealed(), PAYLOAD + b"!") == SIZE_MISMATCH


def test_an_oversized_payload_is_refused_on_the_header_alone() -> None:
    with pytest.raises(EnvelopeRejected) as info:
        verifier(max_payload_bytes=len(PAYLOAD) - 1).check_header(sealed())
    assert info.value.reason == OVERSIZED


def test_a_rejected_forgery_does_not_burn_the_genuine_task_id() -> None:
    check = verifier()
    assert rejection(check, sealed(key=INTRUDER)) == BAD_SIGNATURE
    assert rejection(check, sealed(), b"x" * len(PAYLOAD)) == DIGEST_MISMATCH
    check.verify(sealed(), PAYLOAD)


def test_checking_the_header_alone_does_not_record_the_task_id() -> None:
    check = verifier()
    check.check_header(sealed())
    check.check_header(sealed())
    check.verify(sealed(), PAYLOAD)
    with pytest.raises(EnvelopeRejected, match="already accepted"):
        check.check_header(sealed())


def test_a_full_replay_window_forgets_the_oldest_and_refuses_anything_that_old() -> None:
    check = verifier(replay_window=2)
    for task_id, sent_at in [("t1", NOW - 3), ("t2", NOW - 2), ("t3", NOW - 1)]:
        check.verify(sealed(task_id, sent_at=sent_at), PAYLOAD)
    with pytest.raises(EnvelopeRejected, match="replay horizon") as evicted:
        check.verify(sealed("t1", sent_at=NOW - 3), PAYLOAD)
    assert evicted.value.reason == REPLAY
    assert rejection(check, sealed("new-but-as-old", sent_at=NOW - 3)) == REPLAY
    assert rejection(check, sealed("t2", sent_at=NOW - 2)) == REPLAY
    check.verify(sealed("new", sent_at=NOW), PAYLOAD)


def test_the_replay_window_evicts_by_send_time_not_arrival() -> None:
    check = verifier(replay_window=2)
    check.verify(sealed("ahead", sent_at=NOW + 100), PAYLOAD)
    check.verify(sealed("early", sent_at=NOW - 5), PAYLOAD)
    check.verify(sealed("mid", sent_at=NOW - 2), PAYLOAD)
    assert rejection(check, sealed("ahead", sent_at=NOW + 100)) == REPLAY
    check.verify(sealed("later", sent_at=NOW - 4), PAYLOAD)


class ListMemory:
    """A `ReplayMemory` in a list; `broken` makes every write fail (a full disk)."""

    def __init__(self, *remembered: tuple[float, str, str], broken: bool = False) -> None:
        self.remembered = list(remembered)
        self.broken = broken
        self.asked_since: float | None = None

    def recall(self, since: float) -> list[tuple[float, str, str]]:
        self.asked_since = since
        return [r for r in self.remembered if r[0] >= since]

    def remember(self, sent_at: float, sender: str, task_id: str) -> None:
        if self.broken:
            raise OSError("disk full")
        self.remembered.append((sent_at, sender, task_id))


def test_a_verifier_with_a_memory_refuses_what_it_remembers_from_within_max_age() -> None:
    memory = ListMemory((NOW - 10, "silo-a", "task-1"), (NOW - 301, "silo-a", "old"))
    check = verifier(memory=memory)
    assert memory.asked_since == NOW - 300
    assert rejection(check, sealed("task-1", sent_at=NOW - 10)) == REPLAY
    assert rejection(check, sealed("old", sent_at=NOW - 301)) == STALE


def test_a_verifier_writes_to_its_memory_before_accepting() -> None:
    memory = ListMemory()
    verifier(memory=memory).verify(sealed(), PAYLOAD)
    assert memory.remembered == [(NOW, "silo-a", "task-1")]
    assert rejection(verifier(memory=memory), sealed()) == REPLAY


def test_a_message_the_memory_cannot_store_is_not_accepted() -> None:
    check = verifier(memory=ListMemory(broken=True))
    with pytest.raises(OSError, match="disk full"):
        check.verify(sealed(), PAYLOAD)
    check.check_header(sealed())  # not recorded as accepted either


def test_the_rejection_names_sender_task_and_a_metric_label() -> None:
    with pytest.raises(EnvelopeRejected, match=r"'silo-a'.*'task-9'.*bad_signature") as info:
        verifier().verify(sealed("task-9", key=INTRUDER), PAYLOAD)
    assert (info.value.sender, info.value.task_id) == ("silo-a", "task-9")
    assert len(set(REJECTION_REASONS)) == 9
    assert all(reason.isidentifier() and reason.islower() for reason in REJECTION_REASONS)


def test_concurrent_verification_accepts_each_task_id_exactly_once() -> None:
    check = verifier()
    distinct = [sealed(f"task-{i}") for i in range(64)]
    with ThreadPoolExecutor(max_workers=16) as pool:
        list(pool.map(lambda envelope: check.verify(envelope, PAYLOAD), distinct))

    def attempt(envelope: Envelope, start: threading.Barrier) -> str:
        start.wait()
        try:
            check.verify(envelope, PAYLOAD)
        except EnvelopeRejected as exc:
            return exc.reason
        return "accepted"

    for i in range(20):
        contested = sealed(f"contested-{i}")
        start = threading.Barrier(2)
        with ThreadPoolExecutor(max_workers=2) as pool:
            outcomes = list(pool.map(attempt, [contested] * 2, [start] * 2))
        assert sorted(outcomes) == ["accepted", REPLAY]
