"""FedDC's silo tasks: the silo keeps the model it currently hosts between rounds, trains it
one round's local steps at a time, and hands it on or sends it for aggregation when told.

- `daisy_train`: adopt the model the task carries when it says so (the start, and the
  aggregate after each aggregation), else train the hosted one; then keep the result, and
  send it to the coordinator (`send`, an aggregation round) or pack it for a hand-off
  (`handoff`: `seal_to` a recipient's X25519 key, which must be a roster member's, or `plain`).
  FedProx's anchor is the model of the last exchange. The hosted model stays until a
  replacement arrives: a hand-off that is never delivered costs nothing.
- `daisy_receive`: open a hand-off (bound to this deployment and round), check it, host it,
  and note who held it before (its sender, and the holders the sender's hand-off names).
- `daisy_evaluate`: the hosted model's metrics on a split, as `evaluate` reports them.
"""

from __future__ import annotations

from dataclasses import replace

import torch
from nacl.public import PrivateKey, PublicKey

from fedsilo.policies.algorithms.contract import return_window
from fedsilo.privacy.accounting import Mechanism
from fedsilo.privacy.handoff import Binding, HandoffError, open_sealed, pack, seal, unpack
from fedsilo.silo.memory import HostedModel
from fedsilo.silo.tasks.base import SiloContext, config_of, model_digest, protocol_answer
from fedsilo.silo.tasks.evaluate import evaluate, evaluate_releases
from fedsilo.silo.tasks.train import train, train_releases
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tasks import (
    DaisyEvaluate,
    DaisyReceive,
    DaisyTrain,
    EvaluateTask,
    Handoff,
    TaskConfig,
)
from fedsilo.wire.tasks.tensor_names import HANDOFF, MODEL, PROX_ANCHOR
from fedsilo.wire.tensors import bytes_tensor, tensor_bytes


def daisy_train(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    task = config_of(message, DaisyTrain)
    hosted = _hosted(ctx)
    if task.adopt:
        if MODEL not in message.tensors:
            raise HandoffError("daisy_train says adopt but carries no model")
        hosted.model = hosted.anchor = message.tensors[MODEL]
        hosted.delivered, hosted.root = None, model_digest(hosted.model)
        hosted.holders = ()
    if hosted.model is None or hosted.anchor is None:
        raise HandoffError(
            f"{ctx.name} hosts no daisy-chain model yet; the first task must carry one to adopt"
        )
    result = train(_as(message, task.train, {MODEL: hosted.model, PROX_ANCHOR: hosted.anchor}), ctx)
    hosted.model = trained = result.tensors[MODEL]
    hosted.delivered = None  # what it hosts now is its own training's
    tensors: dict[str, torch.Tensor] = {}
    if task.send:
        tensors[MODEL] = trained
    if task.handoff is not None:
        tensors[HANDOFF] = _packed(task.handoff, message, ctx, trained)
    return protocol_answer(message, ctx, tensors)


def daisy_receive(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    hosted = _hosted(ctx)
    if HANDOFF not in message.tensors:
        raise HandoffError("daisy_receive carries no hand-off")
    data = tensor_bytes(message.tensors[HANDOFF])
    sealed = config_of(message, DaisyReceive).sealed
    if sealed:
        data = open_sealed(data, _sealing_key(ctx))
    recipient = ctx.name if sealed else None
    bound = Binding(ctx.deployment, message.round, message.phase, recipient)
    handed = unpack(data, bound, ctx.roster)
    model = handed.model
    expected = hosted.model.numel() if hosted.model is not None else model.numel()
    if model.numel() != expected or model.dim() != 1:
        raise HandoffError(
            f"the handed-off model has {model.numel()} parameters, this silo's {expected}"
        )
    hosted.model = hosted.anchor = model.to(ctx.device)
    hosted.delivered, hosted.root = (message.round, message.phase), handed.root
    hosted.holders = (handed.sender, *handed.holders)[: return_window(ctx.policy)]
    return TaskResult(task_id=message.task_id, silo=ctx.name, kind=message.kind)


def daisy_evaluate(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    hosted = _hosted(ctx)
    if hosted.model is None:
        raise HandoffError(f"{ctx.name} hosts no daisy-chain model to evaluate")
    return evaluate(_as(message, _evaluation(message), {MODEL: hosted.model}), ctx)


def daisy_train_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    """Every local step is booked, sent or not: the hosted model leaves sooner or later."""
    return train_releases(_as(message, config_of(message, DaisyTrain).train, {}), ctx)


def daisy_evaluate_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    return evaluate_releases(_as(message, _evaluation(message), {}), ctx)


def _evaluation(message: TaskMessage) -> EvaluateTask:
    return EvaluateTask(split=config_of(message, DaisyEvaluate).split)


def _packed(
    handoff: Handoff, message: TaskMessage, ctx: SiloContext, model: torch.Tensor
) -> torch.Tensor:
    """The model packed for this phase's recipient, signed with this silo's identity, naming
    its earlier holders: sealed to the key `handoff` names, which must be another member's
    (the coordinator cannot slip in a key of its own), or plain. A sealed one's recipient
    joins the hosted model's holders: this silo keeps hosting the model until a replacement
    arrives, and the recipient holds a copy."""
    hosted, identity = _hosted(ctx), ctx.identity
    root, holders = hosted.root, hosted.holders
    if identity is None:
        raise HandoffError("hand-offs are signed by their sender; this silo has no identity")
    assert root is not None  # a hosted model was adopted, or handed on with its root
    if handoff.seal_to is None:
        bound = Binding(ctx.deployment, message.round, message.phase, None)
        return bytes_tensor(pack(model, bound, ctx.name, identity, root, holders))
    key = bytes.fromhex(handoff.seal_to)
    recipients = [n for n, k in ctx.sealing_roster.items() if n != ctx.name and bytes(k) == key]
    if not recipients:
        raise HandoffError("the hand-off key is no other member's; refusing to seal to it")
    bound = Binding(ctx.deployment, message.round, message.phase, recipients[0])
    sealed = seal(pack(model, bound, ctx.name, identity, root, holders), PublicKey(key))
    hosted.holders = (recipients[0], *holders)[: return_window(ctx.policy)]
    return bytes_tensor(sealed)


def _as(message: TaskMessage, config: TaskConfig, tensors: dict[str, torch.Tensor]) -> TaskMessage:
    """The task run on the hosted model: `config` (a `train` or `evaluate` task) with this
    task's ids."""
    return replace(message, config=config, tensors=tensors)


def _hosted(ctx: SiloContext) -> HostedModel:
    return ctx.store.hosted


def _sealing_key(ctx: SiloContext) -> PrivateKey:
    if ctx.sealing_key is None:
        raise HandoffError("sealed hand-offs need this silo's sealing key")
    return ctx.sealing_key
