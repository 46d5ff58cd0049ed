"""A silo's reply as the coordinator checks it: `accept` decodes it and turns anything wrong
(malformed, for another task, failed, budget exhausted, non-finite, missing or misshapen
tensors) into a `Dropout` with its reason; an `Accepted` reply keeps an aggregated phase's
tensors unread in the payload, to be read slice by slice (a quantized model, `compression:`,
read decoded: the model the task sent + q * scale, wire/quantized.py, never a full-size copy
of it). Either keeps the silo's signed receipt of the booking (a receipt for another task or
silo, or malformed, drops the reply), for the engine to store: it is what a privacy officer
audits the silo's ledger against."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace

import torch

from fedsilo.coordinator.phases import Identical, SiloReport, WeightedMean
from fedsilo.coordinator.state import StateStore
from fedsilo.privacy.receipts import Receipt, ReceiptError
from fedsilo.wire.messages import STATUS_BUDGET_EXHAUSTED, TaskMessage, TaskResult
from fedsilo.wire.payload import AnyPayload
from fedsilo.wire.quantized import Dequantized, dequantized
from fedsilo.wire.tasks import Quantization, TrainTask
from fedsilo.wire.tasks.tensor_names import MODEL, SCALES
from fedsilo.wire.tensors import LazyTensor, WireError, all_finite

SLICE_ELEMENTS = 1 << 20  # elements read at once (a multiple of every SIMD width)
# a tensor of an answer still to read: in its payload, or a quantized one read decoded
Unread = LazyTensor | Dequantized


class SliceReader:
    """Reads slices of unread tensors, copying those a payload cannot lend (a spooled reply)
    into one buffer per dtype, kept from slice to slice: a fresh buffer per slice is fresh pages
    for the kernel to fault in, once its allocator has given its free memory back
    (ops/memory.py). A slice it returns is valid until the next `peek` of the same dtype."""

    def __init__(self) -> None:
        self._buffers: dict[torch.dtype, torch.Tensor] = {}

    def peek(self, tensor: Unread, start: int, stop: int) -> torch.Tensor:
        buffer = self._buffers.get(tensor.dtype)
        if buffer is None or buffer.numel() < stop - start:
            buffer = self._buffers[tensor.dtype] = torch.empty(stop - start, dtype=tensor.dtype)
        return tensor.peek(start, stop, buffer)


def raw_weights(
    weights: Mapping[str, float] | None, counted: Mapping[str, Accepted]
) -> dict[str, float]:
    """Each silo's weight: the strategy's, or the sample count it released."""
    if weights is not None:
        return {s: float(weights.get(s, 0.0)) for s in counted}
    return {s: float(reply.result.num_samples) for s, reply in counted.items()}


def released_reports(
    inputs: Mapping[str, Accepted], counted: Mapping[str, Accepted]
) -> dict[str, SiloReport]:
    """The reports of a secure sum's contributors: each one's training count as the step that
    released it for the sum's weights released it (`counted`: advertise, keys folded into an
    unmask answer, a CKKS join), and the timing and ledger receipt of its input; nothing of the
    masked or encrypted input itself, which holds tensors only."""
    return {
        s: SiloReport(
            counted[s].result.num_samples,
            {},
            a.result.compute_seconds,
            a.result.epsilon,
            a.result.ledger_head,
        )
        for s, a in sorted(inputs.items())
    }


def reports_of(results: Mapping[str, Accepted]) -> dict[str, SiloReport]:
    return {
        s: SiloReport(
            a.result.num_samples,
            dict(a.result.metrics),
            a.result.compute_seconds,
            a.result.epsilon,
            a.result.ledger_head,
        )
        for s, a in sorted(results.items())
    }


@dataclass(frozen=True)
class Accepted:
    """A checked reply: the result, and (for an aggregated phase) its tensors still unread."""

    result: TaskResult
    lazy: Mapping[str, Unread] = field(default_factory=dict)
    receipt: Receipt | None = None


@dataclass(frozen=True)
class Dropout:
    """Why a reply is not used; `retire`: the silo's privacy budget is spent for good."""

    reason: str
    retire: bool = False
    receipt: Receipt | None = None


def keep_receipts(
    store: StateStore | None, deployment: str, checked: Mapping[str, Accepted | Dropout]
) -> None:
    """Store the replies' receipts (those that have one, in silo order), if there is a store."""
    if store is not None:
        store.save_receipts(
            deployment,
            [(s, c.receipt.to_json()) for s, c in checked.items() if c.receipt is not None],
        )


def accept(
    payload: AnyPayload, sent: TaskMessage, aggregate: WeightedMean | Identical | None
) -> Accepted | Dropout:
    """Decode and check one reply; a bad reply is that silo's dropout, with the reason.

    For a phase that aggregates, tensors stay in the payload (possibly a spool file) and are
    checked slice by slice; `_weighted_mean` and `_digest` read them the same way."""
    try:
        if aggregate is None:
            accepted = Accepted(TaskResult.decode(payload))
            tensors: Mapping[str, torch.Tensor | LazyTensor] = accepted.result.tensors
        else:
            result, lazy = TaskResult.decode_lazily(payload)
            accepted, tensors = Accepted(result, lazy), lazy
    except WireError as exc:
        return Dropout(f"malformed reply: {exc}")
    result = accepted.result
    if result.task_id != sent.task_id or result.silo != sent.silo:
        return Dropout(
            f"reply is for task {result.task_id!r} of silo {result.silo!r}, not this task"
        )
    try:
        receipt = None if result.receipt is None else Receipt.from_json(result.receipt)
    except ReceiptError as exc:
        return Dropout(f"malformed receipt: {exc}")
    if receipt is not None and (receipt.task_id, receipt.silo) != (sent.task_id, sent.silo):
        return Dropout(f"the receipt is for task {receipt.task_id!r} of silo {receipt.silo!r}")
    return replace(_checked(accepted, tensors, sent, aggregate), receipt=receipt)


def _checked(
    accepted: Accepted,
    tensors: Mapping[str, torch.Tensor | Unread],
    sent: TaskMessage,
    aggregate: WeightedMean | Identical | None,
) -> Accepted | Dropout:
    result = accepted.result
    if result.status == STATUS_BUDGET_EXHAUSTED:
        return Dropout(f"{STATUS_BUDGET_EXHAUSTED}: {result.error}", retire=True)
    if not result.ok:
        return Dropout(f"task failed at the silo ({result.status}): {result.error}")
    quantization = quantization_of(sent)
    if isinstance(aggregate, WeightedMean) and quantization is not None:
        try:
            tensors = dequantized_model(accepted.lazy, sent, quantization)
        except WireError as exc:
            return Dropout(f"malformed reply: {exc}")
        accepted = replace(accepted, lazy=tensors)
    for name, tensor in tensors.items():
        if tensor.dtype.is_floating_point and not _all_finite(tensor):
            return Dropout(
                f"non-finite values in {name!r} (training that diverged: a smaller training.lr "
                "or optimizer settings may help)"
            )
    if aggregate is not None:
        missing = [t for t in aggregate.tensors if t not in tensors]
        if missing:
            return Dropout(f"reply lacks {missing}")
        if sent.spec is not None and any(
            tuple(tensors[t].shape) != (sent.spec.numel,) for t in aggregate.tensors
        ):
            return Dropout("reply's tensors do not match the model's shape")
        for name, shape in (getattr(aggregate, "shapes", None) or {}).items():
            if tuple(tensors[name].shape) != tuple(shape):
                return Dropout(
                    f"reply's {name!r} has shape {tuple(tensors[name].shape)}, not {tuple(shape)}"
                )
        weighted_by_samples = isinstance(aggregate, WeightedMean) and aggregate.weights is None
        # a secure sum's input holds tensors only: its weight is the count released before it
        counts_itself = not sent.config.SENDS.tensors_only
        if weighted_by_samples and counts_itself and result.num_samples <= 0:
            return Dropout("reply reports no samples")
    return accepted


def quantization_of(sent: TaskMessage) -> Quantization | None:
    """How the answer to `sent` carries its model: quantized (`compression:`), or None."""
    return sent.config.compression if isinstance(sent.config, TrainTask) else None


def dequantized_model(
    lazy: Mapping[str, Unread], sent: TaskMessage, quantization: Quantization
) -> dict[str, Unread]:
    """An answer's unread tensors with its quantized MODEL read as the model it stands for,
    from the model `sent` carried and its parameter spec (wire/quantized.py); a WireError
    when it is not the quantized update of that model."""
    if sent.spec is None:
        raise WireError("a quantized model is read against the task's parameter spec; none")
    sizes = [entry.numel for entry in sent.spec.entries]
    return dequantized(lazy, MODEL, SCALES + MODEL, sent.tensors[MODEL], quantization, sizes)


def _all_finite(tensor: torch.Tensor | Unread) -> bool:
    return all(all_finite(part) for part in _slices(tensor))


def _slices(tensor: torch.Tensor | Unread) -> Iterator[torch.Tensor]:
    if isinstance(tensor, torch.Tensor):
        yield tensor
        return
    reader = SliceReader()
    for start in range(0, tensor.numel, SLICE_ELEMENTS):
        yield reader.peek(tensor, start, min(start + SLICE_ELEMENTS, tensor.numel))
