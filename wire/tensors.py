"""Models as flat parameter vectors with a spec, and the safetensors codec that carries them.

A model travels as one 1-D tensor plus a `ParameterSpec` (names, shapes, dtype of every
parameter, in order). Encoding is safetensors: raw little-endian bytes and a JSON header,
never pickle, so a round trip is bit-exact and decoding runs no code.

The format (8-byte header length, JSON header, tensors back to back) is read and written here
rather than by the safetensors package, whose Python API works on whole byte strings: `save`
returns a new copy of every tensor and `load` takes one. The coordinator instead sends a
tensor's own memory (`tensor_block`), and reads results slice by slice from wherever they
arrived (`index_tensors`), so a round never holds extra copies of a model. tests/test_wire.py
checks both directions against the safetensors package.
"""

from __future__ import annotations

import json
import math
import sys
import warnings
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedsilo.wire.payload import AnyPayload, Payload, as_payload


def bytes_tensor(data: bytes) -> torch.Tensor:
    """Opaque bytes (keys, shares, ciphertexts, sealed boxes) as a uint8 tensor, to travel
    among a message's tensors."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def tensor_bytes(tensor: torch.Tensor) -> bytes:
    """The bytes a `bytes_tensor` carries."""
    return tensor.to(torch.uint8).cpu().numpy().tobytes()


class WireError(ValueError):
    """A payload that does not decode, or does not match the spec it claims."""


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass(frozen=True)
class ParameterSpec:
    """The layout of a flat parameter vector: entries in order, all of one dtype."""

    entries: tuple[TensorSpec, ...]
    dtype: str = "float32"

    @classmethod
    def of(cls, named: Mapping[str, torch.Tensor]) -> ParameterSpec:
        dtypes = {str(t.dtype).removeprefix("torch.") for t in named.values()}
        if len(dtypes) > 1:
            raise WireError(f"parameters mix dtypes {sorted(dtypes)}; a flat vector needs one")
        dtype = dtypes.pop() if dtypes else "float32"
        return cls(tuple(TensorSpec(n, tuple(t.shape)) for n, t in named.items()), dtype)

    @property
    def numel(self) -> int:
        return sum(e.numel for e in self.entries)

    @property
    def torch_dtype(self) -> torch.dtype:
        return getattr(torch, self.dtype)

    def flatten(self, named: Mapping[str, torch.Tensor]) -> torch.Tensor:
        """Concatenate `named` in spec order into one detached CPU vector."""
        if list(named) != [e.name for e in self.entries]:
            raise WireError("parameter names or order differ from the spec")
        parts = []
        for entry in self.entries:
            tensor = named[entry.name]
            if tuple(tensor.shape) != entry.shape:
                raise WireError(f"{entry.name}: shape {tuple(tensor.shape)} != spec {entry.shape}")
            parts.append(tensor.detach().to("cpu", self.torch_dtype).reshape(-1))
        return torch.cat(parts) if parts else torch.zeros(0, dtype=self.torch_dtype)

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Split a flat vector back into named tensors (views of `flat`)."""
        self.check(flat)
        out, offset = {}, 0
        for entry in self.entries:
            out[entry.name] = flat[offset : offset + entry.numel].view(entry.shape)
            offset += entry.numel
        return out

    def check(self, flat: torch.Tensor) -> None:
        if flat.dim() != 1 or flat.numel() != self.numel or flat.dtype != self.torch_dtype:
            raise WireError(
                f"flat vector of shape {tuple(flat.shape)} and dtype {flat.dtype} does not match "
                f"the spec ({self.numel} x {self.dtype})"
            )

    def to_json(self) -> dict:
        return {"dtype": self.dtype, "entries": [[e.name, list(e.shape)] for e in self.entries]}

    @classmethod
    def from_json(cls, data: Mapping) -> ParameterSpec:
        try:
            entries = tuple(
                TensorSpec(str(n), tuple(_dimension(s) for s in shape))
                for n, shape in data["entries"]
            )
            return cls(entries, str(data["dtype"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"malformed parameter spec: {exc}") from exc


def _dimension(value: Any) -> int:
    """A spec's dimension: a non-negative JSON integer (not a bool, a string or a float)."""
    if type(value) is not int or value < 0:
        raise ValueError(f"a dimension must be a non-negative integer, not {value!r:.40}")
    return value


@dataclass(frozen=True)
class TensorBlock:
    """Tensors encoded once as a safetensors data section, with their header entries (dtype,
    shape, offsets into the section); every message carrying these tensors shares the block."""

    entries: Mapping[str, Any]
    data: tuple[memoryview, ...]


class TensorBlocks:
    """Encodes each distinct mapping of tensors once (tensors are told apart by identity, so
    keep them alive while the cache is in use)."""

    def __init__(self) -> None:
        self._blocks: dict[tuple[tuple[str, int], ...], TensorBlock] = {}

    def of(self, tensors: Mapping[str, torch.Tensor]) -> TensorBlock:
        key = tuple((name, id(t)) for name, t in tensors.items())
        if key not in self._blocks:
            self._blocks[key] = tensor_block(tensors)
        return self._blocks[key]


def tensor_block(tensors: Mapping[str, torch.Tensor]) -> TensorBlock:
    """The safetensors data section of `tensors` as views of their memory, not a copy: a
    contiguous little-endian CPU tensor's bytes are exactly its safetensors data (the layout
    safetensors itself writes: tensors back to back, offsets relative to the section).

    The views keep the tensors alive; a tensor changed while its block is being sent no longer
    matches the digest sealed over it, and the receiver refuses the message."""
    if sys.byteorder != "little":  # safetensors data is little-endian
        raise WireError("this host is big-endian; fedsilo's wire format needs little-endian")
    entries: dict[str, Any] = {}
    views: list[memoryview] = []
    offset = 0
    for name, tensor in tensors.items():
        data = tensor.detach().to("cpu").contiguous()
        raw = memoryview(data.reshape(-1).view(torch.uint8).numpy())
        if data.dtype not in _SAFETENSORS_DTYPES:
            raise WireError(f"tensor {name!r} has dtype {data.dtype}, which does not travel")
        entries[name] = {
            "dtype": _SAFETENSORS_DTYPES[data.dtype],
            "shape": list(data.shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        views.append(raw)
        offset += len(raw)
    return TensorBlock(entries, tuple(views))


def encode_payload(block: TensorBlock, header: Mapping) -> Payload:
    """A safetensors message: `header` (JSON, in the metadata block) ahead of the shared `block`.

    The safetensors layout is an 8-byte little-endian header length, the JSON header (padded
    with spaces to 8 bytes), then the data section, whose offsets are relative to its start;
    so one data section serves any number of headers."""
    document = {**block.entries, "__metadata__": {"fedsilo": json.dumps(header, sort_keys=True)}}
    text = json.dumps(document, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return Payload([len(text).to_bytes(8, "little") + text, *block.data])


def encode_tensors(tensors: Mapping[str, torch.Tensor], header: Mapping) -> bytes:
    """safetensors bytes holding `tensors` and a JSON `header` (in the metadata block)."""
    return encode_payload(tensor_block(tensors), header).to_bytes()


def decode_tensors(data: bytes | AnyPayload) -> tuple[dict[str, torch.Tensor], dict]:
    """The inverse of `encode_tensors`; raises WireError on anything malformed. Each tensor is
    copied once, straight from the payload (memory or spool file) into its own storage."""
    lazy, header = index_tensors(as_payload(data))
    return {name: tensor.load() for name, tensor in lazy.items()}, header


@dataclass(frozen=True)
class LazyTensor:
    """A tensor still in its payload, read slice by slice (see `index_tensors`)."""

    payload: AnyPayload
    offset: int  # of its first byte in the payload
    dtype: torch.dtype
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    def read(self, start: int, stop: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [start, stop) of the flattened tensor, copied once into a new tensor, or
        into the first `stop - start` elements of `into` (a buffer of this dtype, reused
        across slices: a fresh buffer per slice is fresh pages to fault in)."""
        out = torch.empty(stop - start, dtype=self.dtype) if into is None else into[: stop - start]
        if out.numel():
            view = memoryview(out.view(torch.uint8).numpy())
            self.payload.readinto(self.offset + start * self.dtype.itemsize, view)
        return out

    def peek(self, start: int, stop: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Elements [start, stop) to read, not to write: a view of the payload's own memory
        where it holds them in one aligned piece (a received message: no copy, and no fresh
        pages to fault in, which cost more than the copy), else a copy (`read`, into `into`
        when given)."""
        size = self.dtype.itemsize
        if isinstance(self.payload, Payload):
            view = self.payload.view(self.offset + start * size, (stop - start) * size)
            if view is not None and view.nbytes:
                with warnings.catch_warnings():  # read-only bytes: the view is never written
                    warnings.filterwarnings("ignore", "The given buffer is not writable")
                    raw = torch.frombuffer(view, dtype=torch.uint8)
                if raw.data_ptr() % size == 0:
                    return raw.view(self.dtype)
        return self.read(start, stop, into)

    def load(self) -> torch.Tensor:
        return self.read(0, self.numel).view(self.shape)

    def byte_chunks(self, chunk_bytes: int = 1 << 22) -> Iterator[bytes]:
        """The tensor's raw bytes, at most `chunk_bytes` at a time."""
        size = self.numel * self.dtype.itemsize
        for start in range(0, size, chunk_bytes):
            yield self.payload.read(self.offset + start, min(chunk_bytes, size - start))


class TensorsOnDemand(Mapping[str, torch.Tensor]):
    """A received message's tensors, each copied out of its payload the first time it is asked
    for (and kept), so a tensor nobody reads is never copied; `read_only` reads one in place."""

    def __init__(self, lazy: Mapping[str, LazyTensor]) -> None:
        self._lazy = dict(lazy)
        self._loaded: dict[str, torch.Tensor] = {}
        # each tensor's digest once a reader computed it (silo/tasks/base.py `tensor_digests`)
        self.digests: dict[str, bytes] = {}

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self._loaded:
            self._loaded[name] = self._lazy[name].load()
        return self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._lazy)

    def __len__(self) -> int:
        return len(self._lazy)

    def unread(self, name: str) -> LazyTensor | None:
        return None if name in self._loaded else self._lazy.get(name)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every value of `tensor` is finite: its min and max are (both propagate NaN, and
    an infinity is one of them). One pass and no buffer; `torch.isfinite(t).all()` writes a
    mask of the tensor's size first, 15x slower at 1e6 values, once per masked input."""
    if tensor.is_complex():  # no order to take a min by
        return bool(torch.isfinite(tensor).all())
    if not tensor.numel() or not tensor.is_floating_point():
        return True
    low, high = torch.aminmax(tensor)
    return math.isfinite(float(low)) and math.isfinite(float(high))


def read_only(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    """`tensors[name]`, to read and never to write: a view of the payload's memory where
    `tensors` still holds it unread there (a task's model at a silo: no 4 MB copy per million
    parameters, and no fresh pages to fault in), else `tensors[name]` itself."""
    lazy = tensors.unread(name) if isinstance(tensors, TensorsOnDemand) else None
    if lazy is None:
        return tensors[name]
    return lazy.peek(0, lazy.numel).view(lazy.shape)


def index_tensors(payload: AnyPayload) -> tuple[dict[str, LazyTensor], dict]:
    """The tensors of a safetensors message without reading their data, and its header.

    Written by hand because safetensors' own lazy reader memory-maps the file, which would
    count a spooled result's pages towards the coordinator's resident memory; the layout is
    the same one `decode_tensors` reads (checked: dtype, shape, offsets inside the payload)."""
    document = _document(payload)
    data_start = 8 + int.from_bytes(payload.read(0, 8), "little")
    tensors: dict[str, LazyTensor] = {}
    for name, entry in document.items():
        if name == "__metadata__":
            continue
        try:
            dtype = _DTYPES[entry["dtype"]]
            shape = tuple(int(s) for s in entry["shape"])
            begin, end = (int(o) for o in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"tensor {name!r} has a malformed entry: {exc}") from None
        if min(shape, default=0) < 0 or end - begin != math.prod(shape) * dtype.itemsize:
            raise WireError(f"tensor {name!r}: offsets do not match its shape and dtype")
        if begin < 0 or data_start + end > len(payload):
            raise WireError(f"tensor {name!r} lies outside the payload")
        tensors[name] = LazyTensor(payload, data_start + begin, dtype, shape)
    _check_back_to_back(tensors, data_start, len(payload))
    return tensors, _header_of(document)


def _check_back_to_back(tensors: Mapping[str, LazyTensor], start: int, end: int) -> None:
    """Tensors must tile the data section exactly, as safetensors requires: no overlap, no gap,
    nothing after the last one."""
    position = start
    for name, tensor in sorted(tensors.items(), key=lambda item: item[1].offset):
        if tensor.offset != position:
            raise WireError(f"tensor {name!r} overlaps another or leaves a gap before it")
        position += tensor.numel * tensor.dtype.itemsize
    if position != end:
        raise WireError(f"{end - position} bytes after the last tensor")


_DTYPES = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}
_SAFETENSORS_DTYPES = {dtype: name for name, dtype in _DTYPES.items()}
MAX_HEADER_BYTES = 100 << 20


def _document(payload: AnyPayload) -> dict:
    """The JSON header of a safetensors payload."""
    header_len = int.from_bytes(payload.read(0, 8), "little")
    if len(payload) < 8 or header_len > min(MAX_HEADER_BYTES, len(payload) - 8):
        raise WireError("payload is not a fedsilo safetensors message: bad header length")
    try:
        document = json.loads(payload.read(8, header_len))
    except ValueError as exc:
        raise WireError(f"payload is not a fedsilo safetensors message: {exc}") from None
    if not isinstance(document, dict):
        raise WireError("payload is not a fedsilo safetensors message: header is not an object")
    return document


def _header_of(document: Mapping) -> dict:
    try:
        header = json.loads(document["__metadata__"]["fedsilo"])
    except (KeyError, TypeError, ValueError) as exc:
        raise WireError(f"payload is not a fedsilo safetensors message: {exc!r}") from None
    if not isinstance(header, dict):
        raise WireError("message header is not a JSON object")
    return header
