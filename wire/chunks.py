"""Chunked payloads: cutting a payload into frames, and reassembling it within bounded memory.

A payload of any size travels as a stream of chunks of at most `DEFAULT_CHUNK_BYTES`, below
gRPC's 4 MiB default message limit (`Payload.chunks` cuts them). The receiver learns the
payload's size and digest (BLAKE3-256, wire/payload.py) from its signed envelope;
`ChunkAssembler` writes the chunks into a buffer of exactly that size (a temporary file above
`SPOOL_ABOVE_BYTES`, so a round's results never have to fit in memory at once), hashes them as
they arrive, and refuses the stream the moment it runs past the announced size, so a sender
cannot make the receiver hold more than it announced.
"""

from __future__ import annotations

import numpy

from fedsilo.wire.payload import DIGEST_BYTES, AnyPayload, Payload, SpooledPayload, payload_hash

DEFAULT_CHUNK_BYTES = 1 << 20
SPOOL_ABOVE_BYTES = 1 << 23  # larger payloads are reassembled in a temporary file

OVERSIZED = "oversized"
TRUNCATED = "truncated"
CORRUPTED = "corrupted"


class ChunkError(Exception):
    """A chunk stream that does not reassemble; `reason` is OVERSIZED, TRUNCATED or CORRUPTED."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


class ChunkAssembler:
    """Reassembles one payload of announced size and digest from its chunks.

    Memory is one buffer of `expected_size` bytes, allocated up front and written once, or a
    spool file when the size is above `spool_above`; an announced size above `max_bytes` is
    refused before anything is allocated. Create one per incoming stream, after the envelope
    that announces the size has been verified; it is not thread-safe.
    """

    def __init__(
        self,
        expected_size: int,
        expected_digest: bytes,
        max_bytes: int,
        spool_above: int = SPOOL_ABOVE_BYTES,
    ) -> None:
        if expected_size < 0:
            raise ValueError(f"expected_size must be non-negative, got {expected_size}")
        if len(expected_digest) != DIGEST_BYTES:
            raise ValueError(f"expected_digest must be {DIGEST_BYTES} bytes (BLAKE3-256)")
        if expected_size > max_bytes:
            raise ChunkError(
                OVERSIZED, f"announced {expected_size} bytes, the limit is {max_bytes}"
            )
        self._expected_size = expected_size
        self._expected_digest = expected_digest
        self._spool = SpooledPayload() if expected_size > spool_above else None
        # Not zeroed: every byte is written before the payload is returned (`finish`), and
        # zeroing first would touch each fresh page once more.
        self._buffer = memoryview(
            numpy.empty(0 if self._spool is not None else expected_size, dtype=numpy.uint8)
        )
        self._received = 0
        self._hash = payload_hash()

    def add(self, chunk: bytes | memoryview) -> None:
        """Append one chunk; raise OVERSIZED, without buffering it, if it runs past the size."""
        view = memoryview(chunk).cast("B")
        end = self._received + len(view)
        if end > self._expected_size:
            self._received = end
            raise self._overrun()
        if self._spool is not None:
            self._spool.append(view)
        else:
            self._buffer[self._received : end] = view
        self._hash.update(view)
        self._received = end

    def finish(self) -> AnyPayload:
        """The payload, once every announced byte arrived and the digest matches."""
        if self._received > self._expected_size:
            raise self._overrun()
        if self._received < self._expected_size:
            raise ChunkError(
                TRUNCATED,
                f"stream ended after {self._received} of {self._expected_size} bytes",
            )
        if self._hash.digest(length=DIGEST_BYTES) != self._expected_digest:
            raise ChunkError(CORRUPTED, "payload digest differs from the announced one")
        if self._spool is not None:
            return self._spool.seal(self._expected_digest)
        return Payload([self._buffer], self._expected_digest)

    def _overrun(self) -> ChunkError:
        return ChunkError(
            OVERSIZED,
            f"stream reached {self._received} bytes, {self._expected_size} were announced",
        )
