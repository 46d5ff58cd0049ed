"""Frames on the wire: the hand-written chunk frames are exactly `fedsilo.v1.Frame` messages, and
what is read back is exactly what the protobuf parser reads, without a copy of the chunk; a
message sent whole (`ExchangeOne`) is exactly a `fedsilo.v1.Frames` of the same frames, and reads
back as they do."""

from __future__ import annotations

import tracemalloc
from uuid import uuid4

import pytest
from hypothesis import given
from hypothesis import strategies as st
from nacl.signing import SigningKey

from fedsilo.wire import fedsilo_pb2 as pb
from fedsilo.wire.envelope import EnvelopeVerifier, seal
from fedsilo.wire.framing import (
    MALFORMED,
    MessageRejected,
    chunk_frame,
    frame_body,
    frames_of,
    one_message,
    read_message,
    to_frames,
)
from fedsilo.wire.payload import Payload

KEY = SigningKey(bytes([3]) * 32)
VERIFIER = EnvelopeVerifier("d", {"silo-a": KEY.verify_key})
pieces = st.lists(st.binary(max_size=300), min_size=1, max_size=4)


@given(pieces)
def test_a_chunk_frame_is_the_protobuf_encoding_of_its_joined_pieces(chunk: list[bytes]) -> None:
    assert chunk_frame(tuple(chunk)) == pb.Frame(chunk=b"".join(chunk)).SerializeToString()


@given(st.binary(max_size=70_000))
def test_a_chunk_frame_reads_back_as_a_view_of_the_frame_not_a_copy(chunk: bytes) -> None:
    raw = chunk_frame((chunk,))
    body = frame_body(raw)
    assert isinstance(body, memoryview) and body.obj is raw
    assert bytes(body) == chunk


@given(st.binary(max_size=64), st.binary(max_size=64))
def test_a_chunk_frame_laid_out_otherwise_reads_as_the_protobuf_parser_reads_it(
    first: bytes, last: bytes
) -> None:
    """A chunk field twice (the last one counts) is still a valid Frame, read the slow way."""
    raw = chunk_frame((first,)) + chunk_frame((last,))
    assert bytes(frame_body(raw)) == pb.Frame.FromString(raw).chunk == last


def test_an_envelope_frame_reads_as_its_envelope() -> None:
    raw = next(
        to_frames(
            seal(b"x", signing_key=KEY, sender="silo-a", deployment="d", round=0, task_id="t"), b"x"
        )
    )
    body = frame_body(raw)
    assert isinstance(body, pb.Envelope) and body.sender == "silo-a"


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"\xff\xfenot a Frame", "not a fedsilo.v1.Frame"),
        (b"\x12\x05abc", "not a fedsilo.v1.Frame"),  # announces 5 bytes, carries 3
        (b"\x12" + b"\xff" * 11, "not a fedsilo.v1.Frame"),  # a length that never ends
        (b"", "neither an envelope nor a chunk"),
    ],
)
def test_bytes_that_are_not_a_frame_with_a_body_are_malformed(raw: bytes, says: str) -> None:
    with pytest.raises(MessageRejected, match=says) as info:
        frame_body(raw)
    assert info.value.reason == MALFORMED


@given(st.binary(max_size=5000), st.integers(min_value=1, max_value=2048))
def test_a_message_in_any_chunk_size_reads_back_verified(payload: bytes, chunk_bytes: int) -> None:
    header, body = payload[:7], payload[7:]  # a payload in two parts, as a task is
    envelope = seal(
        payload, signing_key=KEY, sender="silo-a", deployment="d", round=0, task_id=uuid4().hex
    )
    frames = list(to_frames(envelope, Payload([header, body]), chunk_bytes))
    received, read = read_message(frames, VERIFIER, max_bytes=1 << 20)
    assert received == envelope and read.to_bytes() == payload
    assert all(len(pb.Frame.FromString(raw).chunk) <= chunk_bytes for raw in frames[1:])


@given(st.binary(max_size=5000), st.integers(min_value=1, max_value=2048))
def test_a_message_sent_whole_is_the_protobuf_encoding_of_its_frames(
    payload: bytes, chunk_bytes: int
) -> None:
    envelope = seal(
        payload, signing_key=KEY, sender="silo-a", deployment="d", round=0, task_id=uuid4().hex
    )
    parts = Payload([payload[:7], payload[7:]])
    frames = list(to_frames(envelope, parts, chunk_bytes))
    whole = one_message(envelope, parts, chunk_bytes)
    assert whole == pb.Frames(frames=[pb.Frame.FromString(f) for f in frames]).SerializeToString()
    assert [bytes(f) for f in frames_of(whole)] == frames
    received, read = read_message(frames_of(whole), VERIFIER, max_bytes=1 << 20)
    assert received == envelope and read.to_bytes() == payload


@given(st.binary(max_size=300))
def test_a_message_sent_whole_reads_its_chunk_as_a_view_not_a_copy(payload: bytes) -> None:
    envelope = seal(payload, signing_key=KEY, sender="silo-a", deployment="d", round=0, task_id="t")
    whole = one_message(envelope, payload)
    _, chunk = list(frames_of(whole))
    body = frame_body(chunk)
    assert isinstance(body, memoryview) and body.obj is whole and bytes(body) == payload


@pytest.mark.parametrize(
    "whole",
    [
        b"\x0a\x05abc",  # announces 5 bytes, carries 3
        b"\x0a" + b"\xff" * 11,  # a length that never ends
        b"\xff\xfenot Frames",
        pb.Frames(frames=[pb.Frame(chunk=b"x")]).SerializeToString() + b"\x10\x01",  # field 2
    ],
)
def test_bytes_that_are_not_frames_alone_are_malformed(whole: bytes) -> None:
    with pytest.raises(MessageRejected, match="not a fedsilo.v1.Frames of frames alone") as info:
        list(frames_of(whole))
    assert info.value.reason == MALFORMED


def test_frames_are_read_one_at_a_time_so_a_bad_first_one_is_refused_before_the_rest() -> None:
    """A request of a million empty frames (2 MB) costs the reader one frame's memory, not a
    view of each made ahead (about 180 MB)."""
    whole = b"\x0a\x00" * 1_000_000
    tracemalloc.start()
    try:
        with pytest.raises(MessageRejected, match="neither an envelope nor a chunk"):
            read_message(frames_of(whole), VERIFIER, max_bytes=1 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20


def test_an_empty_message_sent_whole_has_no_frame_to_read() -> None:
    with pytest.raises(MessageRejected, match="no frame arrived"):
        read_message(frames_of(b""), VERIFIER, max_bytes=1 << 20)
