"""Taking the masks out of a masked sum: the secrets rebuilt from the shares the silos revealed,
and the weighted mean of the survivors' inputs, computed alike by the coordinator, which
aggregates (coordinator/secure_sum.py), and by a silo checking a model's lineage
(silo/lineage.py): one function, so both get the same bits.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Protocol

import numpy as np
import torch
from nacl.public import PrivateKey

from fedsilo.privacy.masking import (
    STREAM_CHUNK_ELEMENTS,
    Advertisement,
    FixedPoint,
    KeyStreams,
    MaskingError,
    combine_shares,
    silo_indices,
    tensor_context,
    unmask_terms,
)
from fedsilo.wire.tasks.tensor_names import REVEALED_KEY, REVEALED_SEED

SLICE_ELEMENTS = 1 << 20  # how much of each input is read at a time


class Slices(Protocol):
    """A masked input read a slice at a time (a `LazyTensor`, or a tensor held whole)."""

    def peek(self, start: int, stop: int) -> torch.Tensor: ...


class Held:
    """A tensor held whole, read as `Slices`."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.flat = tensor.reshape(-1)

    def peek(self, start: int, stop: int) -> torch.Tensor:
        return self.flat[start:stop]


def rebuild(
    revealed: Mapping[str, Mapping[str, bytes]],
    indices: Mapping[str, int],
    name: str,
    threshold: int,
) -> bytes:
    """The secret whose shares the revealers (`revealed`: revealer -> share name -> bytes)
    revealed under `name` (REVEALED_SEED or REVEALED_KEY + silo), from `threshold` of them."""
    shares = {
        indices[holder]: pieces[name] for holder, pieces in revealed.items() if name in pieces
    }
    return combine_shares(shares, threshold)


def unmasked_means(
    label: bytes,
    adverts: Mapping[str, Advertisement],
    inputs: Mapping[str, Mapping[str, Slices]],
    dropped: Mapping[str, Collection[str]],
    revealed: Mapping[str, Mapping[str, bytes]],
    weights: Mapping[str, float],
    references: Mapping[str, torch.Tensor],
    bound: float,
    threshold: int,
) -> dict[str, torch.Tensor]:
    """reference + decode(sum of the summed silos' `inputs` - masks) / their total weight, per
    tensor of `references`: the self-masks of the summed silos and the masking keys of the
    `dropped` silos (each with the summed silos that masked with it) rebuilt from `threshold`
    of the `revealed` shares. MaskingError when the shares do not rebuild a key."""
    summed = sorted(inputs)
    indices = silo_indices(list(adverts))
    seeds = [rebuild(revealed, indices, REVEALED_SEED + silo, threshold) for silo in summed]
    keys = {}
    for silo in sorted(dropped):
        key = PrivateKey(rebuild(revealed, indices, REVEALED_KEY + silo, threshold))
        if bytes(key.public_key) != bytes(adverts[silo].masking_key):
            raise MaskingError(f"the shares of {silo}'s masking key do not rebuild it")
        keys[silo] = key
    total_weight = sum(weights[s] for s in summed)
    if total_weight <= 0:
        raise MaskingError("the summed silos carry zero total weight")
    encoding = FixedPoint.for_silos(bound, len(adverts))
    terms = unmask_terms(
        seeds,
        keys,
        {s: adverts[s].masking_key for s in summed},
        {d: set(p) for d, p in dropped.items()},
    )
    mean = {}
    for name, reference in references.items():
        before = reference.reshape(-1).numpy()
        streams = KeyStreams(terms, tensor_context(label, name), len(before))
        update = _unmasked_mean(
            [inputs[s][name] for s in summed], streams, encoding, total_weight, before
        )
        mean[name] = torch.from_numpy(update).reshape(reference.shape)
    return mean


def _unmasked_mean(
    inputs: Sequence[Slices],
    streams: KeyStreams,
    encoding: FixedPoint,
    total_weight: float,
    before: np.ndarray,
) -> np.ndarray:
    """before + decode(sum of `inputs` - masks) / total_weight, in `before`'s dtype, a chunk at
    a time while it is in cache: each input read in place a slice at a time (no copy of one),
    summed (mod 2^32), unmasked by the next elements of `streams`, decoded and averaged in
    float64 (`before` widened exactly)."""
    update = np.empty(len(before), dtype=before.dtype)
    total = np.empty(min(len(before), STREAM_CHUNK_ELEMENTS), dtype=np.uint32)
    work = np.empty(len(total), dtype=np.float64)
    for start in range(0, len(before), SLICE_ELEMENTS):
        stop = min(start + SLICE_ELEMENTS, len(before))
        pieces = [i.peek(start, stop).numpy().view(np.uint32) for i in inputs]
        for at in range(start, stop, len(total)):
            upto = min(at + len(total), stop)
            part, out = total[: upto - at], work[: upto - at]
            np.copyto(part, pieces[0][at - start : upto - start])
            for piece in pieces[1:]:
                np.add(part, piece[at - start : upto - start], out=part)
            streams.add_to(part)
            encoding.decode(part, out=out)
            out /= total_weight
            out += before[at:upto]
            update[at:upto] = out
    return update
