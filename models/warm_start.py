"""Warm starts (`model.init`): the model file a job starts from and the digest that pins it.

The coordinator (or `fedsilo simulate`) alone reads the file, a `final_model.safetensors` as
`fedsilo simulate --out` and `fedsilo job results` write it (its card's parameter spec names
the flat parameters, models/card.py), and sends its parameters as the job's initial model.

The digest is the model's, not the file's: BLAKE2b-256 over a canonical encoding of its named
tensors (`tensors_digest`), in name order, each as its name, dtype and shape (one JSON line)
and its bytes, every part length-prefixed. Two files holding the same tensors under other
metadata (a card written by another version, a header of another order) have one digest; a
changed value, name, shape or dtype gives another. A silo computes the same digest of the first
model it is sent, with its own network's names (`flat_digest`), and under model lineage refuses
it unless it is the policy's (silo/lineage.py).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

from fedsilo.models.architecture import describe_spec
from fedsilo.models.card import ModelCardError, read_final_model
from fedsilo.policies.model import ModelInit
from fedsilo.wire.tensors import ParameterSpec

DIGEST_FORMAT = b"fedsilo-model-digest/1\n"  # what the encoding is, hashed first
FILE_KEY = "model.init.file"
DIGEST_KEY = "model.init.digest"


class WarmStartError(ValueError):
    """A warm start that cannot be used; the message names the policy key (`model.init.file`
    or `model.init.digest`)."""


@dataclass(frozen=True)
class WarmStart:
    """A model file's parameters: the flat vector, its layout and the digest of its tensors."""

    model: torch.Tensor
    spec: ParameterSpec
    digest: str


def tensors_digest(named: Mapping[str, torch.Tensor]) -> str:
    """BLAKE2b-256 (hex) of the canonical encoding of `named` (the module docstring)."""
    digest = hashlib.blake2b(DIGEST_FORMAT, digest_size=32)
    for name in sorted(named):
        tensor = named[name].detach().to("cpu").contiguous()
        dtype = str(tensor.dtype).removeprefix("torch.")
        head = json.dumps([name, dtype, list(tensor.shape)]).encode()
        data = memoryview(tensor.reshape(-1).view(torch.uint8).numpy())
        for part in (head, data):
            digest.update(len(part).to_bytes(8, "little"))
            digest.update(part)
    return digest.hexdigest()


def flat_digest(flat: torch.Tensor, spec: ParameterSpec) -> str:
    """The digest of a flat parameter vector's tensors, named and shaped by `spec`."""
    return tensors_digest(spec.unflatten(flat))


def read_warm_start(path: Path, origin: str | None = None) -> WarmStart:
    """The model in the final-model file `path`, or a WarmStartError naming `origin` (by
    default `model.init.file` and the path)."""
    try:
        card, flat = read_final_model(path, origin or f"{FILE_KEY} {str(path)!r}")
    except ModelCardError as error:
        raise WarmStartError(str(error)) from None
    return WarmStart(flat, card.spec, flat_digest(flat, card.spec))


def load_pinned(init: ModelInit) -> WarmStart:
    """The model `init` names, its digest checked against the policy's: a WarmStartError
    when the file cannot be read, its `file` is relative (no policy file's folder to read it
    from) or its tensors' digest is not `init.digest`."""
    path = Path(init.file)
    if not path.is_absolute():
        raise WarmStartError(
            f"{FILE_KEY} {init.file!r} is relative and this policy came without its file's "
            "folder to read it from (a job submitted to `fedsilo coordinator serve`): name the "
            "file by its absolute path on the coordinator's host"
        )
    warm = read_warm_start(path)
    problem = digest_problem(init, warm.digest, "the file's tensors")
    if problem:
        raise WarmStartError(problem)
    return warm


def digest_problem(init: ModelInit, actual: str, what: str) -> str | None:
    """One message naming `model.init.digest` and both digests when `actual`, the digest of
    `what`, is not the one the policy pins; else None."""
    if actual == init.digest:
        return None
    return f"{DIGEST_KEY} is {init.digest}, but the digest of {what} is {actual}"


def fit_problem(warm: WarmStart, network: list[str], builder: str) -> str | None:
    """Where the warm start's tensors depart from the network `builder` names (its
    architecture lines, models/architecture.py): the first tensor whose name, shape or dtype
    differs, in one message naming `model.init.file`; None when they fit."""
    held, built = describe_spec(warm.spec), network
    for index, (ours, theirs) in enumerate(zip(held, built, strict=False)):
        if ours != theirs:
            return f"{FILE_KEY}: tensor {index}: the file holds {ours}, {builder} {theirs}"
    if len(held) != len(built):
        return (
            f"{FILE_KEY}: the file holds {len(held)} tensors, {builder} a network of {len(built)}"
        )
    return None


def init_block(path: Path, digest: str) -> str:
    """The `init:` block for the model file at `path`, indented to go under `model:`, after a
    comment saying so."""
    return "\n".join(
        [
            "# model.init: paste it under model: (a relative file is read from the policy "
            "file's folder)",
            "  init:",
            f"    file: {json.dumps(str(path))}",
            f"    digest: {digest}",
        ]
    )
