"""FedDC's silo tasks: the silo keeps the model it currently hosts between rounds, trains it
one round's local steps at a time, and hands it on or sends it for aggregation when told.

- `daisy_train`: adopt the model the task carries when it says so (the start, and the
  aggregate after each aggregation), else train the hosted one; then keep the result, and
  send it to the coordinator (`send`, an aggregation round) or pack it for a hand-off
  (`handoff`: `seal_to` a recipient's X25519 key, which must be a roster member's, or `plain`).
  FedProx's anchor is the model of the last exchange. The hosted model stays until a
  replacement arrives: a hand-off that is never delivered costs nothing.
- `daisy_reseal`: the hosted model (the one just handed off) packed again for another
  recipient, when the first dropped out before delivery.
- `daisy_receive`: open a hand-off (bound to this deployment and round), check it, host it.
- `daisy_evaluate`: the hosted model's metrics on a split, as `evaluate` reports them.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from nacl.public import PrivateKey, PublicKey

from fedsilo.privacy.accounting import Mechanism
from fedsilo.privacy.handoff import (
    HANDOFF,
    HandoffError,
    binding,
    open_sealed,
    pack,
    seal,
    unpack,
)
from fedsilo.silo.proximal import PROX_ANCHOR
from fedsilo.silo.tasks.base import (
    MODEL,
    SiloContext,
    with_tensors,
)
from fedsilo.silo.tasks.evaluate import evaluate, evaluate_releases
from fedsilo.silo.tasks.train import train, train_releases
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tensors import bytes_tensor, tensor_bytes


def daisy_train(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    hosted = _hosted(ctx)
    if message.config.get("adopt"):
        if MODEL not in message.tensors:
            raise HandoffError("daisy_train says adopt but carries no model")
        hosted["model"] = hosted["anchor"] = message.tensors[MODEL]
    if "model" not in hosted:
        raise HandoffError(
            f"{ctx.name} hosts no daisy-chain model yet; the first task must carry one to adopt"
        )
    result = train(
        _as(message, "train", {MODEL: hosted["model"], PROX_ANCHOR: hosted["anchor"]}), ctx
    )
    hosted["model"] = trained = result.tensors[MODEL]
    tensors: dict[str, torch.Tensor] = {}
    if message.config.get("send"):
        tensors[MODEL] = trained
    if "handoff" in message.config:
        tensors[HANDOFF] = _packed(message, ctx, trained)
    return with_tensors(message, ctx, result, tensors)


def daisy_reseal(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    hosted = _hosted(ctx)
    if "model" not in hosted:
        raise HandoffError(f"{ctx.name} hosts no daisy-chain model to hand off")
    return TaskResult(
        task_id=message.task_id,
        silo=ctx.name,
        kind=message.kind,
        tensors={HANDOFF: _packed(message, ctx, hosted["model"])},
    )


def daisy_receive(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    hosted = _hosted(ctx)
    if HANDOFF not in message.tensors:
        raise HandoffError("daisy_receive carries no hand-off")
    data = tensor_bytes(message.tensors[HANDOFF])
    if message.config.get("sealed"):
        data = open_sealed(data, _sealing_key(ctx))
    model = unpack(data, binding(ctx.deployment, message.round))
    expected = hosted["model"].numel() if "model" in hosted else model.numel()
    if model.numel() != expected or model.dim() != 1:
        raise HandoffError(
            f"the handed-off model has {model.numel()} parameters, this silo's {expected}"
        )
    hosted["model"] = hosted["anchor"] = model.to(ctx.device)
    return TaskResult(task_id=message.task_id, silo=ctx.name, kind=message.kind)


def daisy_evaluate(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    hosted = _hosted(ctx)
    if "model" not in hosted:
        raise HandoffError(f"{ctx.name} hosts no daisy-chain model to evaluate")
    return evaluate(_as(message, "evaluate", {MODEL: hosted["model"]}), ctx)


def daisy_train_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    """Every local step is booked, sent or not: the hosted model leaves sooner or later."""
    return train_releases(_as(message, "train", {}), ctx)


def daisy_evaluate_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    return evaluate_releases(_as(message, "evaluate", {}), ctx)


def _packed(message: TaskMessage, ctx: SiloContext, model: torch.Tensor) -> torch.Tensor:
    """The model packed for this round's recipient: sealed to the key the task names, which
    must be a roster member's (the coordinator cannot slip in a key of its own)."""
    handoff: dict[str, Any] = message.config["handoff"]
    packed = pack(model, binding(ctx.deployment, message.round))
    if "seal_to" not in handoff:
        return bytes_tensor(packed)
    key = bytes.fromhex(str(handoff["seal_to"]))
    members = {bytes(public) for name, public in ctx.sealing_roster.items() if name != ctx.name}
    if key not in members:
        raise HandoffError("the hand-off key is no other member's; refusing to seal to it")
    return bytes_tensor(seal(packed, PublicKey(key)))


def _as(message: TaskMessage, kind: str, tensors: dict[str, torch.Tensor]) -> TaskMessage:
    """The task run on the hosted model: `kind` with this task's config and ids."""
    return replace(message, kind=kind, tensors=tensors)


def _hosted(ctx: SiloContext) -> dict[str, torch.Tensor]:
    return ctx.store.setdefault("daisy", {})


def _sealing_key(ctx: SiloContext) -> PrivateKey:
    if ctx.sealing_key is None:
        raise HandoffError("sealed hand-offs need this silo's sealing key")
    return ctx.sealing_key
