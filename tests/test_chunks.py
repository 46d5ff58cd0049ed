"""Chunked payloads: any size round-trips; a corrupted, short or overlong stream is refused."""

from __future__ import annotations

import random
import tracemalloc
from collections.abc import Iterable

import pytest
from blake3 import blake3
from nacl.signing import SigningKey

from fedsilo.wire.chunks import (
    CORRUPTED,
    DEFAULT_CHUNK_BYTES,
    OVERSIZED,
    TRUNCATED,
    ChunkAssembler,
    ChunkError,
)
from fedsilo.wire.envelope import EnvelopeVerifier, seal
from fedsilo.wire.payload import AnyPayload, Payload, SpooledPayload

MIB = 1 << 20
SMALL_CHUNK = 1024
LIMIT = 1 << 30


def payload_of(size: int) -> bytes:
    return random.Random(size).randbytes(size)


def digest(payload: bytes) -> bytes:
    return blake3(payload).digest()


def assemble(
    chunks: Iterable[bytes | memoryview], expected_size: int, expected_digest: bytes, max_bytes: int
) -> AnyPayload:
    """A whole chunk stream through one `ChunkAssembler`, as a receiver runs it."""
    assembler = ChunkAssembler(expected_size, expected_digest, max_bytes)
    for chunk in chunks:
        assembler.add(chunk)
    return assembler.finish()


def iter_chunks(payload: bytes | bytearray, chunk_bytes: int = DEFAULT_CHUNK_BYTES) -> list:
    """The chunks of a payload in one part: each is a single piece, a view of the payload."""
    chunks = list(Payload([payload]).chunks(chunk_bytes))
    assert all(len(chunk) == 1 for chunk in chunks)
    return [piece for (piece,) in chunks]


def test_default_chunks_fit_under_grpcs_4_mib_message_limit() -> None:
    assert DEFAULT_CHUNK_BYTES == MIB < 4 * MIB


@pytest.mark.parametrize("size", [0, 1, MIB, MIB + 1, 5 * MIB + MIB // 2])
def test_payloads_round_trip_through_default_chunks(size: int) -> None:
    payload = payload_of(size)
    chunks = list(iter_chunks(payload))
    assert len(chunks) == max(1, -(-size // MIB))
    assert all(len(chunk) <= MIB for chunk in chunks)
    assert assemble(chunks, size, digest(payload), LIMIT).to_bytes() == payload


@pytest.mark.parametrize(
    "size", [0, 1, SMALL_CHUNK - 1, SMALL_CHUNK, SMALL_CHUNK + 1, 5 * SMALL_CHUNK + 512]
)
def test_payloads_round_trip_through_small_chunks(size: int) -> None:
    payload = payload_of(size)
    chunks = list(iter_chunks(payload, SMALL_CHUNK))
    assert [len(chunk) for chunk in chunks[:-1]] == [SMALL_CHUNK] * (len(chunks) - 1)
    assert assemble(chunks, size, digest(payload), LIMIT).to_bytes() == payload


def test_an_empty_payload_is_sent_as_one_empty_chunk() -> None:
    assert [bytes(chunk) for chunk in iter_chunks(b"")] == [b""]


def test_chunks_are_views_of_the_payload_not_copies() -> None:
    payload = bytearray(payload_of(3 * SMALL_CHUNK))
    chunks = list(iter_chunks(payload, SMALL_CHUNK))
    payload[SMALL_CHUNK] ^= 0xFF
    assert chunks[1][0] == payload[SMALL_CHUNK]


def test_chunk_size_must_be_positive() -> None:
    with pytest.raises(ValueError, match="positive"):
        next(Payload([b"abc"]).chunks(0))


def test_a_flipped_byte_in_a_chunk_is_corrupted() -> None:
    payload = payload_of(4 * SMALL_CHUNK)
    chunks = [bytearray(chunk) for chunk in iter_chunks(payload, SMALL_CHUNK)]
    chunks[2][17] ^= 0x01
    with pytest.raises(ChunkError) as info:
        assemble(chunks, len(payload), digest(payload), LIMIT)
    assert info.value.reason == CORRUPTED


def test_a_missing_chunk_is_truncated() -> None:
    payload = payload_of(4 * SMALL_CHUNK)
    chunks = list(iter_chunks(payload, SMALL_CHUNK))
    del chunks[1]
    with pytest.raises(ChunkError) as info:
        assemble(chunks, len(payload), digest(payload), LIMIT)
    assert info.value.reason == TRUNCATED


def test_an_extra_chunk_is_refused_at_the_add_that_crosses_the_size() -> None:
    payload = payload_of(2 * SMALL_CHUNK)
    assembler = ChunkAssembler(len(payload), digest(payload), LIMIT)
    for chunk in iter_chunks(payload, SMALL_CHUNK):
        assembler.add(chunk)
    with pytest.raises(ChunkError) as info:
        assembler.add(b"x")
    assert info.value.reason == OVERSIZED
    with pytest.raises(ChunkError, match=OVERSIZED):
        assembler.finish()


def test_a_chunk_running_past_the_size_is_refused_before_it_is_buffered() -> None:
    assembler = ChunkAssembler(10, digest(b"0123456789"), LIMIT)
    assembler.add(b"01234")
    with pytest.raises(ChunkError) as info:
        assembler.add(b"56789!")
    assert info.value.reason == OVERSIZED
    with pytest.raises(ChunkError, match=OVERSIZED):
        assembler.add(b"5")


def test_an_announced_size_above_the_limit_is_refused_before_allocating() -> None:
    with pytest.raises(ChunkError) as info:
        ChunkAssembler(1 << 62, bytes(32), max_bytes=MIB)
    assert info.value.reason == OVERSIZED


def test_a_digest_of_the_wrong_length_is_a_programming_error() -> None:
    with pytest.raises(ValueError, match="32 bytes"):
        ChunkAssembler(1, bytes(16), LIMIT)


def test_a_sealed_payload_streams_in_chunks_and_verifies() -> None:
    key = SigningKey(bytes([7]) * 32)
    payload = payload_of(3 * SMALL_CHUNK + 5)
    envelope = seal(payload, signing_key=key, sender="silo-a", deployment="d", round=1, task_id="t")
    received = assemble(
        iter_chunks(payload, SMALL_CHUNK), envelope.payload_size, envelope.payload_digest, LIMIT
    )
    EnvelopeVerifier("d", {"silo-a": key.verify_key}).verify(envelope, received)


def test_a_large_payload_is_reassembled_in_a_spool_file_not_in_memory() -> None:
    payload = payload_of(8 * MIB + 3)
    chunks = iter_chunks(payload, SMALL_CHUNK)
    tracemalloc.start()
    assembler = ChunkAssembler(len(payload), digest(payload), LIMIT, spool_above=SMALL_CHUNK)
    for chunk in chunks:
        assembler.add(chunk)
    received = assembler.finish()
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < MIB  # an empty spool is falsy (it has a length): no buffer of the full size
    assert isinstance(received, SpooledPayload)
    assert len(received) == len(payload)
    assert received.to_bytes() == payload
    assert received.read(SMALL_CHUNK - 2, 7) == payload[SMALL_CHUNK - 2 : SMALL_CHUNK + 5]
    assert b"".join(piece for (piece,) in received.chunks(SMALL_CHUNK)) == payload
    assert received.digest() == digest(payload)


def test_a_spooled_payload_that_is_corrupted_is_refused_like_one_in_memory() -> None:
    payload = payload_of(4 * SMALL_CHUNK)
    chunks = [bytearray(chunk) for chunk in iter_chunks(payload, SMALL_CHUNK)]
    chunks[3][0] ^= 0x80
    assembler = ChunkAssembler(len(payload), digest(payload), LIMIT, spool_above=SMALL_CHUNK)
    for chunk in chunks:
        assembler.add(chunk)
    with pytest.raises(ChunkError, match=CORRUPTED):
        assembler.finish()


@pytest.mark.parametrize("sizes", [(0,), (3, 0, 5), (SMALL_CHUNK, 1), (7, SMALL_CHUNK * 2 + 1, 9)])
def test_chunks_of_a_payload_in_parts_are_those_of_its_concatenation(sizes: tuple) -> None:
    """A chunk that spans parts is the views of each, joined only when its frame is written."""
    parts = [payload_of(n + i) for i, n in enumerate(sizes)]
    whole = b"".join(parts)
    chunks = list(Payload(parts).chunks(SMALL_CHUNK))
    assert all(isinstance(piece, memoryview) for chunk in chunks for piece in chunk if piece)
    assert [b"".join(c) for c in chunks] == [
        b"".join(c) for c in Payload([whole]).chunks(SMALL_CHUNK)
    ]
    assert Payload(parts).digest() == digest(whole)
    assert Payload(parts).read(2, SMALL_CHUNK + 5) == whole[2 : SMALL_CHUNK + 7]
