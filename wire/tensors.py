"""Models as flat parameter vectors with a spec, and the safetensors codec that carries them.

A model travels as one 1-D tensor plus a `ParameterSpec` (names, shapes, dtype of every
parameter, in order). Encoding is safetensors: raw little-endian bytes and a JSON header,
never pickle, so a round trip is bit-exact and decoding runs no code.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from safetensors.torch import load as st_load
from safetensors.torch import save as st_save


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
                TensorSpec(str(n), tuple(int(s) for s in shape)) for n, shape in data["entries"]
            )
            return cls(entries, str(data["dtype"]))
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"malformed parameter spec: {exc}") from exc


def encode_tensors(tensors: Mapping[str, torch.Tensor], header: Mapping) -> bytes:
    """safetensors bytes holding `tensors` and a JSON `header` (in the metadata block)."""
    contiguous = {name: t.detach().to("cpu").contiguous() for name, t in tensors.items()}
    return st_save(contiguous, metadata={"fedsilo": json.dumps(header, sort_keys=True)})


def decode_tensors(data: bytes) -> tuple[dict[str, torch.Tensor], dict]:
    """The inverse of `encode_tensors`; raises WireError on anything malformed."""
    try:
        tensors = st_load(bytes(data))
        header_len = int.from_bytes(data[:8], "little")
        metadata = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
        header = json.loads(metadata["fedsilo"])
    except Exception as exc:  # safetensors raises several error types for bad input
        raise WireError(f"payload is not a fedsilo safetensors message: {exc}") from exc
    if not isinstance(header, dict):
        raise WireError("message header is not a JSON object")
    return tensors, header
