"""`energy_signals`: FedEvg's task at a silo (the round in silo/energy.py).

The task carries the synthetic points and their labels (`SYNTHETIC`, `SYNTHETIC_LABELS`), the
local training settings (`epochs` or `steps`, `batch_size`, `optimizer`, `lr`, `weight_decay`,
`seed`), the energy settings (`energy`, `sgld_steps`, `sgld_step`, `sgld_noise`,
`gradient_clip`, `synthetic_ce_weight`), `model_seed` (the fresh model of this round),
`spectral_norm` and `persist_local_model` (start from the silo's model of its last round, kept
in its state folder, instead of a fresh one). It answers with `WEIGHTED_GRADIENT` (s * g per
point) and `WEIGHT` (s per point) and the training count, and no model parameters: the model
never leaves the silo.

Releases: what a `train` task releases (the energy signals are post-processing of the trained
model: exact without DP, DP-SGD's run under DP, booked as such), refused under client-level DP.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from fedsilo.privacy.accounting import Mechanism
from fedsilo.silo.energy import EnergySettings, EnergyTraining, with_spectral_norm
from fedsilo.silo.local_loop import local_steps, optimizer_for, released_training
from fedsilo.silo.schedule import LocalSchedule
from fedsilo.silo.tasks.base import SiloContext, config_of, task_result
from fedsilo.silo.tasks.train import train_releases
from fedsilo.wire.messages import (
    TaskMessage,
    TaskResult,
)
from fedsilo.wire.tasks import EnergySignals
from fedsilo.wire.tasks.tensor_names import (
    SYNTHETIC,
    SYNTHETIC_LABELS,
    WEIGHT,
    WEIGHTED_GRADIENT,
)

if TYPE_CHECKING:  # Opacus loads only on the DP path
    from fedsilo.silo.dp_training import DpSgdPlan

LOCAL_MODEL = "fedevg-local"  # the persisted energy model's name in the silo's LocalState


def energy_signals_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    if ctx.privacy.client_dp is not None:
        raise ValueError("fedevg sends no model update for client-level DP to clip")
    return train_releases(message, ctx)


def energy_signals(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    task = config_of(message, EnergySignals)
    settings = EnergySettings.of(task)
    synthetic = _synthetic_set(message, ctx)
    x, y = ctx.split("train")
    schedule = LocalSchedule.of(task.local, len(y))
    seed = task.local.seed
    model = _energy_model(task, message.round, ctx)
    training = EnergyTraining(model, (x, y), synthetic, settings, seed)
    optimizer = optimizer_for(model.parameters(), task.local)
    model.train()

    def private(plan: DpSgdPlan, private_seed: int) -> list[float | None]:
        from fedsilo.silo.dp_training import ClippedSums, check_model, noisy_steps

        check_model(model)
        params = list(model.parameters())
        with ClippedSums(model, params, plan.max_grad_norm) as sums:
            gradients, add_synthetic = training.private_gradients(sums, sums.unwatched)
            return noisy_steps(
                plan, seed, private_seed, params, optimizer, gradients, after_noise=add_synthetic
            )

    losses, metrics = local_steps(
        message, ctx, schedule, lambda batches: training.train(optimizer, batches), private
    )
    if task.persist_local_model:
        ctx.state.save(LOCAL_MODEL, message.round, model.state_dict())
    weighted, weights = training.signals()
    count = released_training(ctx, message, schedule, losses, metrics)
    tensors = {WEIGHTED_GRADIENT: weighted.cpu(), WEIGHT: weights.cpu()}
    return task_result(message, ctx, tensors, count, metrics)


def _synthetic_set(message: TaskMessage, ctx: SiloContext) -> tuple[torch.Tensor, torch.Tensor]:
    """The synthetic points (float32, on the silo's device) and labels, checked against the
    silo's data: the same input shape, labels among its classes."""
    if SYNTHETIC not in message.tensors or SYNTHETIC_LABELS not in message.tensors:
        raise ValueError("an energy_signals task carries the synthetic points and their labels")
    x = message.tensors[SYNTHETIC].to(ctx.device, torch.float32)
    labels = message.tensors[SYNTHETIC_LABELS].to(ctx.device, torch.long)
    data = ctx.data
    if tuple(x.shape[1:]) != tuple(data.input_shape) or x.shape[0] != labels.shape[0]:
        raise ValueError(
            f"synthetic points of shape {tuple(x.shape)} with {labels.shape[0]} labels do not "
            f"fit this silo's inputs {tuple(data.input_shape)}"
        )
    classes = data.num_classes or 0
    if labels.numel() and not (int(labels.min()) >= 0 and int(labels.max()) < classes):
        raise ValueError(f"synthetic labels must lie in 0..{classes - 1}")
    return x, labels


def _energy_model(task: EnergySignals, round_no: int, ctx: SiloContext) -> nn.Module:
    """This round's energy model: fresh from `model_seed` (spectrally normalised last layer when
    asked), or, with `persist_local_model`, the silo's model of its last round."""
    model = ctx.new_model(seed=task.model_seed)
    if task.spectral_norm:
        model = with_spectral_norm(model, task.model_seed)
    if task.persist_local_model:
        kept = ctx.state.latest(LOCAL_MODEL, round_no)
        if kept is not None:
            model.load_state_dict({k: v.to(ctx.device) for k, v in kept.items()})
    return model
