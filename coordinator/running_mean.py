"""The weighted mean of a phase's replies in the clear: sum_k a_k x_k / sum_k a_k in float64,
in sorted silo order, so the mean is bit-identical whatever order the replies arrive in.

The sum runs while replies arrive: a reply is added as soon as every silo before it in sorted
order has answered or dropped out, so with silos that answer in turn (in-process, one at a
time) the coordinator sums one while the next trains, and the mean is one division once the
last reply is in. That needs a float64 running sum of the model's size; above
`RUNNING_SUM_BYTES` the replies are summed once all are in instead, slice by slice over their
unread tensors, so memory stays the output plus a slice's buffers (its float64 sum, and a
spooled reply's slice, read into a buffer kept from slice to slice) whatever the model's size.
Either way every element goes through the same operations (slices of `SLICE_ELEMENTS`, the
same silos in the same order), so both give the same bits. A quantized answer
(`compression:`) is read the same way, each slice decoded into the reader's buffer
(`Dequantized` in wire/quantized.py).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from fedsilo.coordinator.phases import WeightedMean
from fedsilo.coordinator.replies import SLICE_ELEMENTS, Accepted, SliceReader, raw_weights

RUNNING_SUM_BYTES = 256 << 20


class RunningMean:
    """Feed it each silo's fate (`accepted` or `dropped`, any order); `mean` once all are in."""

    def __init__(self, aggregate: WeightedMean, silos: Sequence[str]) -> None:
        self.aggregate = aggregate
        self._order = sorted(silos)
        self._next = 0  # silos before it in `_order` are summed or skipped
        self._fates: dict[str, Accepted | None] = {}
        self._sums: dict[str, torch.Tensor] | None = None  # name -> float64 running sum
        self._summed: list[str] = []
        self._widened = torch.empty(0, dtype=torch.float64)  # a slice widened to float64
        self._reader = SliceReader()

    def accepted(self, silo: str, accepted: Accepted) -> None:
        self._fates[silo] = accepted
        self._advance()

    def dropped(self, silo: str) -> None:
        self._fates[silo] = None
        self._advance()

    def _advance(self) -> None:
        while self._next < len(self._order) and self._order[self._next] in self._fates:
            silo = self._order[self._next]
            accepted = self._fates[silo]
            if accepted is not None:
                weight = raw_weights(self.aggregate.weights, {silo: accepted})[silo]
                if weight != 0.0:
                    self._add(silo, accepted, weight)
            self._next += 1

    def _add(self, silo: str, accepted: Accepted, weight: float) -> None:
        if self._sums is None:
            numel = sum(accepted.lazy[name].numel for name in self.aggregate.tensors)
            if 8 * numel > RUNNING_SUM_BYTES:
                self._next = len(self._order)  # too large to keep: summed at the end
                return
            self._sums = {
                name: torch.zeros(accepted.lazy[name].numel, dtype=torch.float64)
                for name in self.aggregate.tensors
            }
        if any(accepted.lazy[n].numel != s.numel() for n, s in self._sums.items()):
            self._sums, self._summed = None, []  # sizes differ: left to the sum at the end
            self._next = len(self._order)
            return
        for name, running in self._sums.items():
            tensor = accepted.lazy[name]
            for start in range(0, tensor.numel, SLICE_ELEMENTS):
                stop = min(start + SLICE_ELEMENTS, tensor.numel)
                part = self._reader.peek(tensor, start, stop)
                _add_scaled(running[start:stop], part, weight, self._widened)
        self._summed.append(silo)

    def mean(self, results: Mapping[str, Accepted]) -> tuple[dict[str, torch.Tensor], float]:
        """The mean of `results` (the accepted replies) and their total weight; an empty mean
        when the total is not positive. It divides the running sum in place, so a second call
        sums the replies again, slice by slice."""
        weights = raw_weights(self.aggregate.weights, results)
        total = math.fsum(weights.values())
        if total <= 0:
            return {}, total
        terms = [(s, weights[s]) for s in sorted(results) if weights[s] != 0.0]
        summed = self._sums if self._summed == [s for s, _ in terms] else None
        self._sums, self._summed = None, []  # divided in place below: a second mean re-sums
        return {
            name: self._divided(
                results, name, terms, total, None if summed is None else summed[name]
            )
            for name in self.aggregate.tensors
        }, total

    def _divided(
        self,
        results: Mapping[str, Accepted],
        name: str,
        terms: list[tuple[str, float]],
        total: float,
        summed: torch.Tensor | None,
    ) -> torch.Tensor:
        """Tensor `name` of the mean: `summed` (the running sum) over `total`, or, without one,
        `terms` (silo, weight) summed slice by slice over their unread tensors, through the
        same kept buffers as the running sum."""
        first = results[min(results)].lazy[name]
        mean = torch.empty(first.shape, dtype=first.dtype)
        flat = mean.view(-1)
        sums = torch.empty(
            0 if summed is not None else min(SLICE_ELEMENTS, first.numel), dtype=torch.float64
        )
        for start in range(0, first.numel, SLICE_ELEMENTS):
            stop = min(start + SLICE_ELEMENTS, first.numel)
            if summed is not None:
                acc = summed[start:stop]
            else:
                acc = sums[: stop - start].zero_()
                for silo, weight in terms:
                    part = self._reader.peek(results[silo].lazy[name], start, stop)
                    _add_scaled(acc, part, weight, self._widened)
            if flat.is_floating_point():
                # divided in place, then narrowed: a float64 division written into a float32
                # `out` goes through a temporary of the slice's size, fresh pages for every
                # slice once the allocator has given its free memory back (ops/memory.py);
                # the same bits
                flat[start:stop].copy_(acc.div_(total))
            else:
                flat[start:stop] = acc / total
        return mean


def _add_scaled(
    acc: torch.Tensor, part: torch.Tensor, weight: float, widened: torch.Tensor
) -> None:
    """acc += weight * part, in float64: `part` widened into the reused buffer `widened` first
    (exactly), since torch's add with a scale across dtypes is more than twice as slow as the
    cast and the same-dtype add; the bits are the same."""
    if part.dtype == acc.dtype:
        acc.add_(part, alpha=weight)
        return
    widened.resize_(part.numel())
    widened.copy_(part.view(-1))
    acc.add_(widened, alpha=weight)
