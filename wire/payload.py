"""A message's bytes without needless copies, so the coordinator's memory stays bounded by what a
round needs rather than by how many silos take part.

- `Payload` holds consecutive parts in memory: a task is a small per-silo header ahead of a
  tensor block that every silo of a phase shares, so broadcasting a model to K silos keeps one
  copy of it, not K.
- `SpooledPayload` is a large payload received from the network, written to an anonymous
  temporary file as its chunks arrive (unlinked at once: nothing is left behind, even after a
  crash). Reading it goes through `os.pread`, not a memory map, so the pages never count
  towards the process's resident size; the engine reads such results slice by slice.

Both expose the same reading interface (`len`, `read`, `readinto`, `chunks`, `to_bytes`,
`digest`);
`as_payload` lifts plain bytes.

A payload's digest, the one its signed envelope carries, is BLAKE3-256 (the `blake3` package,
the BLAKE3 authors' bindings): every message is hashed by its sender and its receiver, and on 2
cores BLAKE2b took 11 ms per 4 MB where BLAKE3 takes 1 ms, a large share of a round with a
model of 1e6 parameters or more (bench/transport.py).
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from typing import BinaryIO

from blake3 import blake3

DIGEST_BYTES = 32
Chunk = tuple[bytes | memoryview, ...]  # consecutive pieces of a payload, sent as one frame
READ_BYTES = 1 << 22  # how much `SpooledPayload` reads at once when it walks the whole payload


def payload_hash() -> blake3:
    """A fresh hash of the kind payload digests use (update it, then `digest()`)."""
    return blake3()


def digest_of(parts: Iterable[bytes | memoryview]) -> bytes:
    """The payload digest (BLAKE3-256) of the concatenation of `parts`."""
    digest = payload_hash()
    for part in parts:
        digest.update(part)
    return digest.digest(length=DIGEST_BYTES)


class _Sized:
    """What both payloads share: their size, and `read` on top of their own `readinto`."""

    _size: int

    def __len__(self) -> int:
        return self._size

    def read(self, offset: int, length: int) -> bytes:
        """`length` bytes from `offset` (fewer at the end of the payload)."""
        out = bytearray(max(0, min(length, self._size - offset)))
        self.readinto(offset, memoryview(out))
        return bytes(out)

    def readinto(self, offset: int, buffer: memoryview) -> None:
        raise NotImplementedError


class Payload(_Sized):
    """Bytes held in memory as consecutive parts (not joined unless someone asks for bytes)."""

    def __init__(self, parts: Iterable[bytes | memoryview], digest: bytes | None = None) -> None:
        self.parts = tuple(memoryview(p).cast("B") for p in parts)
        self._size = sum(len(p) for p in self.parts)
        self._digest = digest

    def readinto(self, offset: int, buffer: memoryview) -> None:
        """Fill `buffer` with the payload's bytes from `offset` (copied once, straight in)."""
        filled = 0
        for part in self.parts:
            if filled == len(buffer):
                return
            if offset >= len(part):
                offset -= len(part)
                continue
            piece = part[offset : offset + len(buffer) - filled]
            buffer[filled : filled + len(piece)] = piece
            filled += len(piece)
            offset = 0
        if filled == len(buffer):
            return
        raise ValueError(f"payload ends {len(buffer) - filled} bytes short")

    def view(self, offset: int, length: int) -> memoryview | None:
        """Bytes [offset, offset + length) without a copy where one part holds them all, else
        None."""
        for part in self.parts:
            if offset < len(part):
                return part[offset : offset + length] if offset + length <= len(part) else None
            offset -= len(part)
        return None

    def chunks(self, chunk_bytes: int) -> Iterator[Chunk]:
        """Consecutive chunks of at most `chunk_bytes`, each the views of the parts it spans (no
        copy: the frame that carries a chunk joins its pieces, wire/framing.py). An empty payload
        yields one empty chunk, so a receiver always sees a frame."""
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        if self._size == 0:
            yield (b"",)
            return
        pieces: list[memoryview] = []
        room = chunk_bytes
        for part in self.parts:
            start = 0
            while start < len(part):
                piece = part[start : start + room]
                pieces.append(piece)
                start += len(piece)
                room -= len(piece)
                if room == 0:
                    yield tuple(pieces)
                    pieces, room = [], chunk_bytes
        if pieces:
            yield tuple(pieces)

    def to_bytes(self) -> bytes:
        return b"".join(self.parts)

    def digest(self) -> bytes:
        """The payload digest, BLAKE3-256 (computed once)."""
        if self._digest is None:
            self._digest = digest_of(self.parts)
        return self._digest


class SpooledPayload(_Sized):
    """A payload in an anonymous temporary file; see the module docstring."""

    def __init__(self, directory: str | None = None) -> None:
        self._file: BinaryIO = tempfile.TemporaryFile(dir=directory)  # noqa: SIM115 (owned)
        self._size = 0
        self._digest: bytes | None = None

    def append(self, data: bytes | memoryview) -> None:
        self._file.write(data)
        self._size += len(data)

    def seal(self, digest: bytes) -> SpooledPayload:
        """Finish writing; `digest` is the payload digest the writer computed while appending."""
        self._file.flush()
        self._digest = digest
        return self

    def readinto(self, offset: int, buffer: memoryview) -> None:
        filled = 0
        while filled < len(buffer):
            got = os.preadv(self._file.fileno(), [buffer[filled:]], offset + filled)
            if got <= 0:
                raise OSError(f"spool file ends {len(buffer) - filled} bytes short")
            filled += got

    def chunks(self, chunk_bytes: int) -> Iterator[Chunk]:
        """Consecutive chunks of at most `chunk_bytes`, each read from the file as one piece."""
        if chunk_bytes < 1:
            raise ValueError(f"chunk_bytes must be positive, got {chunk_bytes}")
        if self._size == 0:
            yield (b"",)
        for start in range(0, self._size, chunk_bytes):
            yield (self.read(start, chunk_bytes),)

    def to_bytes(self) -> bytes:
        return self.read(0, self._size)

    def digest(self) -> bytes:
        if self._digest is None:
            self._digest = digest_of(
                self.read(start, READ_BYTES) for start in range(0, self._size, READ_BYTES)
            )
        return self._digest

    def close(self) -> None:
        self._file.close()


AnyPayload = Payload | SpooledPayload


def as_payload(data: bytes | memoryview | AnyPayload) -> AnyPayload:
    return data if isinstance(data, Payload | SpooledPayload) else Payload([data])
