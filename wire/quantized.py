"""A silo's update as it travels under the policy's `compression:` section: quantized to 8 or
16 bits a value, with float32 scales, and read back by the coordinator as the model it stands
for, a slice at a time.

A `train` task whose config carries a `Quantization` is answered with the update
u = trained - received of its flat model, not the trained model: per group of values (a
parameter tensor of the model's spec, or a block of `block_size` consecutive values of one,
the tensor's last block possibly shorter) one scale s = absmax(u) / L, L = 2^(bits-1) - 1,
and per value q = stochastic_round(u / s) in [-L, L], so E[q s] = u and |q s - u| < s. The
answer's MODEL tensor holds q (int8 or int16), SCALES + MODEL the scales (float32); an
all-zero group has scale 0 and q = 0.

The coordinator decodes x = received + q s in the model's dtype (`Dequantized`): the same
float operations whichever slice it reads, so a mean over silos keeps its bits whatever order
the answers arrive in, and no full-size copy of an answer is made to read it slice by slice.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from fedsilo.wire.tasks import Quantization
from fedsilo.wire.tensors import LazyTensor, WireError

_DTYPES = {8: torch.int8, 16: torch.int16}
CHUNK_ELEMENTS = 1 << 20  # values a silo quantizes at once (its float64 buffers' length)


def value_dtype(quantization: Quantization) -> torch.dtype:
    """The integer dtype q travels in: int8 or int16."""
    return _DTYPES[quantization.bits]


@dataclass(frozen=True)
class ScaleLayout:
    """Which values of a flat vector share a scale: each parameter tensor (`sizes`, in order)
    split into groups of `group[i]` values from its start, its last group possibly shorter."""

    starts: tuple[int, ...]  # each tensor's first value in the flat vector
    sizes: tuple[int, ...]
    group: tuple[int, ...]
    first_scale: tuple[int, ...]  # each tensor's first scale
    count: int  # scales in all

    @classmethod
    def of(cls, sizes: Sequence[int], block_size: int | None) -> ScaleLayout:
        starts, groups, firsts = [], [], []
        value = scale = 0
        for size in sizes:
            group = max(size, 1) if block_size is None else block_size
            starts.append(value)
            groups.append(group)
            firsts.append(scale)
            value += size
            scale += -(-size // group)
        return cls(tuple(starts), tuple(sizes), tuple(groups), tuple(firsts), scale)

    @property
    def numel(self) -> int:
        return (self.starts[-1] + self.sizes[-1]) if self.sizes else 0

    def pieces(self, start: int, stop: int) -> list[tuple[int, int, int]]:
        """The tensors values [start, stop) of the flat vector fall in: (tensor, first value
        within it, last value + 1 within it)."""
        found = []
        at = max(bisect.bisect_right(self.starts, start) - 1, 0)
        while at < len(self.sizes) and self.starts[at] < stop:
            low = max(start, self.starts[at]) - self.starts[at]
            high = min(stop - self.starts[at], self.sizes[at])
            if high > low:
                found.append((at, low, high))
            at += 1
        return found

    def scale_in_place(self, values: torch.Tensor, scales: torch.Tensor, start: int) -> None:
        """Multiply `values`, the flat vector's values from `start` on, each by its group's
        scale (one multiplication per value, the same whatever slice `values` is)."""
        for tensor, low, high in self.pieces(start, start + len(values)):
            offset = self.starts[tensor] + low - start
            part = values[offset : offset + high - low]
            group, first = self.group[tensor], self.first_scale[tensor]
            _scale_groups(part, scales[first : first + -(-self.sizes[tensor] // group)], low, group)


def _scale_groups(values: torch.Tensor, scales: torch.Tensor, low: int, group: int) -> None:
    """`values`, the values from `low` on of a tensor whose groups of `group` values share
    `scales`, multiplied by their group's scale: the first group's rest, the whole groups at
    once, then the start of the last one."""
    index, done = low // group, 0
    lead = min(len(values), (index + 1) * group - low)
    values[:lead].mul_(scales[index])
    done, index = lead, index + 1
    whole = (len(values) - done) // group
    if whole:
        values[done : done + whole * group].view(whole, group).mul_(
            scales[index : index + whole].unsqueeze(1)
        )
        done, index = done + whole * group, index + whole
    if done < len(values):
        values[done:].mul_(scales[index])


def quantize(
    received: torch.Tensor,
    trained: torch.Tensor,
    quantization: Quantization,
    sizes: Sequence[int],
    generator: torch.Generator,
    norm_bound: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(q, scales) of the update trained - received (flat vectors of one float dtype, made of
    parameter tensors of `sizes`), rounded stochastically with uniforms drawn from
    `generator` in order, a chunk at a time. `norm_bound`: the scales shrunk so that the
    decoded update's L2 norm is at most it (client-level DP's clip, which the rounding may
    otherwise exceed). A ValueError for a non-finite update, which no scale represents."""
    layout = ScaleLayout.of(sizes, quantization.block_size)
    if layout.numel != received.numel() or received.numel() != trained.numel():
        raise ValueError(
            f"the update has {trained.numel()} values against a model of {received.numel()}, "
            f"and its tensors hold {layout.numel}"
        )
    q = torch.empty(layout.numel, dtype=value_dtype(quantization))
    scales = torch.zeros(layout.count, dtype=torch.float32)
    squares = math.fsum(
        _quantize_tensor(received, trained, quantization, layout, tensor, generator, q, scales)
        for tensor in range(len(layout.sizes))
    )
    if not math.isfinite(squares):
        raise ValueError("the trained model is not finite, so its update has no scale")
    if norm_bound is not None and math.sqrt(squares) > norm_bound:
        scales.mul_(norm_bound / math.sqrt(squares))
    return q, scales


def _quantize_tensor(
    received: torch.Tensor,
    trained: torch.Tensor,
    quantization: Quantization,
    layout: ScaleLayout,
    tensor: int,
    generator: torch.Generator,
    q: torch.Tensor,
    scales: torch.Tensor,
) -> float:
    """Parameter tensor `tensor`'s update quantized into `q` and `scales`, a chunk of whole
    groups at a time in float64; the squared L2 norm of its decoded update."""
    start, size, group = layout.starts[tensor], layout.sizes[tensor], layout.group[tensor]
    first, levels, blocks = layout.first_scale[tensor], quantization.levels, quantization.block_size

    def update(low: int, high: int) -> torch.Tensor:
        return trained[start + low : start + high].double() - received[start + low : start + high]

    chunk = CHUNK_ELEMENTS if blocks is None else max(CHUNK_ELEMENTS // group, 1) * group
    if size == 0:  # no values, no scale
        return 0.0
    if blocks is None:  # one scale: the tensor's largest |u| first (NaN propagates)
        absmax = torch.zeros((), dtype=torch.float64)
        for low in range(0, size, chunk):
            absmax = torch.maximum(absmax, update(low, min(low + chunk, size)).abs().max())
        scales[first] = float(absmax) / levels
    squares = 0.0
    for low in range(0, size, chunk):
        high = min(low + chunk, size)
        u = update(low, high)
        if blocks is None:
            per_value = scales[first : first + 1].double()
        else:
            own = scales[first + low // group : first + -(-high // group)]
            own.copy_(_block_absmax(u, group).div_(levels))
            per_value = own.double().repeat_interleave(group)[: high - low]
        rounded = u.div_(torch.where(per_value == 0, 1.0, per_value))
        rounded.add_(torch.rand(high - low, dtype=torch.float64, generator=generator))
        rounded.floor_().clamp_(-levels, levels)
        q[start + low : start + high] = rounded
        squares += float(rounded.mul_(per_value).square_().sum())
    return squares


def _block_absmax(values: torch.Tensor, group: int) -> torch.Tensor:
    """The largest |value| of each group of `group` values (the last one possibly shorter)."""
    whole = len(values) // group
    heads = values[: whole * group].view(whole, group).abs().amax(dim=1)
    if whole * group == len(values):
        return heads
    return torch.cat([heads, values[whole * group :].abs().amax().reshape(1)])


def dequantize(
    q: torch.Tensor, scales: torch.Tensor, reference: torch.Tensor, layout: ScaleLayout
) -> torch.Tensor:
    """reference + q * scale, whole: what `Dequantized` reads slice by slice."""
    out = q.to(reference.dtype)
    layout.scale_in_place(out, scales, 0)
    return out.add_(reference.reshape(-1))


class Dequantized:
    """A quantized answer's MODEL read as the model it stands for, reference + q * scale in the
    reference's dtype, a slice at a time: what the coordinator sums, in place of the answer's
    unread tensor (`LazyTensor`'s `numel`, `shape`, `dtype`, `peek` and `load`)."""

    def __init__(
        self, q: LazyTensor, scales: torch.Tensor, reference: torch.Tensor, layout: ScaleLayout
    ) -> None:
        self._q, self._scales, self._layout = q, scales, layout
        self._reference = reference.reshape(-1)
        self._buffer = torch.empty(0, dtype=q.dtype)  # q's slice, where the payload lends none
        self.dtype: torch.dtype = reference.dtype
        self.shape: tuple[int, ...] = (q.numel,)

    @property
    def numel(self) -> int:
        return self._q.numel

    def peek(self, start: int, stop: int, into: torch.Tensor | None = None) -> torch.Tensor:
        """Values [start, stop) decoded into `into` (a buffer of this dtype, reused across
        slices) or a new tensor."""
        out = torch.empty(stop - start, dtype=self.dtype) if into is None else into[: stop - start]
        if self._buffer.numel() < stop - start:
            self._buffer = torch.empty(stop - start, dtype=self._q.dtype)
        out.copy_(self._q.peek(start, stop, self._buffer))
        self._layout.scale_in_place(out, self._scales, start)
        return out.add_(self._reference[start:stop])

    def load(self) -> torch.Tensor:
        out = torch.empty(self.numel, dtype=self.dtype)
        for start in range(0, self.numel, CHUNK_ELEMENTS):
            stop = min(start + CHUNK_ELEMENTS, self.numel)
            self.peek(start, stop, out[start:stop])
        return out


def dequantized(
    tensors: Mapping[str, LazyTensor],
    name: str,
    scales_name: str,
    reference: torch.Tensor,
    quantization: Quantization,
    sizes: Sequence[int],
) -> dict[str, LazyTensor | Dequantized]:
    """An answer's unread `tensors` with `name` read as `Dequantized` (its scales under
    `scales_name`, which leave the mapping); a WireError when they are not the quantized
    update of a model of parameter tensors of `sizes` that `quantization` says."""
    layout = ScaleLayout.of(sizes, quantization.block_size)
    q, scales = tensors.get(name), tensors.get(scales_name)
    if q is None or scales is None:
        raise WireError(f"a quantized answer carries {name!r} and {scales_name!r}")
    want = str(value_dtype(quantization)).removeprefix("torch.")
    if q.dtype != value_dtype(quantization) or q.shape != (layout.numel,):
        raise WireError(
            f"{name!r} is {q.shape} {str(q.dtype).removeprefix('torch.')}; a {quantization.bits}"
            f"-bit update of this model is ({layout.numel},) {want}"
        )
    if scales.dtype != torch.float32 or scales.shape != (layout.count,):
        raise WireError(
            f"{scales_name!r} is {scales.shape} {str(scales.dtype).removeprefix('torch.')}; "
            f"this model's update has ({layout.count},) float32 scales"
        )
    loaded = scales.load()
    if not bool(torch.isfinite(loaded).all()) or bool((loaded < 0).any()):
        raise WireError(f"{scales_name!r} holds a scale that is negative or not finite")
    rest = {k: v for k, v in tensors.items() if k not in (name, scales_name)}
    return rest | {name: Dequantized(q, loaded, reference, layout)}
