"""Frames on the wire: the hand-written chunk frames are exactly `fedsilo.v1.Frame` messages, and
what is read back is exactly what the protobuf parser reads, without a copy of the chunk."""

from __future__ import annotations

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
