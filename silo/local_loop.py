"""The local loop every training task runs (`train`, `daisy_train`, `superfed_train`,
`energy_signals`): its optimiser, its one choice between plain steps and the silo's DP-SGD, the
plain gradient steps on an objective, and what the run reports besides its model.

The choice is the silo's, never the task's: with `privacy.dp_sgd` in the silo's own policy the
run goes through silo/dp_training.py with that policy's parameters, and its metrics also carry
the plan's public parameters (`dp_noise_multiplier`, `dp_sample_rate`, `dp_steps`). Plain steps
visit the task seed's shuffled batches (silo/schedule.py), the very order DP-SGD uses without
Poisson sampling.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any

import torch

from fedsilo.models.global_rng import seeded_global_rng
from fedsilo.policies.model import PluginModel
from fedsilo.silo.reports import LOSSES
from fedsilo.silo.schedule import LocalSchedule, shuffled_batches
from fedsilo.wire.messages import TaskMessage
from fedsilo.wire.tasks import (
    EnergySignals,
    FedDroTrain,
    LocalTraining,
    SuperFedTrain,
    TaskConfig,
    TrainTask,
)
from fedsilo.wire.tensors import WireError

if TYPE_CHECKING:  # Opacus loads only on the DP path; the task context imports every handler
    from fedsilo.silo.dp_training import DpSgdPlan
    from fedsilo.silo.tasks.base import SiloContext


def local_training(config: TaskConfig) -> LocalTraining:
    """The local-training settings a training task's config carries."""
    if isinstance(config, TrainTask | SuperFedTrain | EnergySignals | FedDroTrain):
        return config.local
    raise WireError(f"a {config.KIND} task carries no local-training settings")


def optimizer_for(params: Any, local: LocalTraining) -> torch.optim.Optimizer:
    """The task's `optimizer` (sgd with `momentum`, or adam) at `lr` and `weight_decay`."""
    lr, decay = float(local.lr), float(local.weight_decay)
    if local.optimizer == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=decay)
    if local.optimizer == "sgd":
        return torch.optim.SGD(params, lr=lr, momentum=float(local.momentum), weight_decay=decay)
    raise ValueError(f"unknown optimizer {local.optimizer!r}; use sgd or adam")


def local_steps(
    message: TaskMessage,
    ctx: SiloContext,
    schedule: LocalSchedule,
    plain: Callable[[Iterator[torch.Tensor]], list[float]],
    private: Callable[[DpSgdPlan, int], list[float | None]],
) -> tuple[list[float | None], dict[str, float]]:
    """A training task's steps: `plain(batches)` over the task seed's shuffled batches, or under
    the silo's DP-SGD `private(plan, private_seed)`; each step's loss, and the metrics (the
    steps, and the DP plan's public parameters). A plug-in network's own randomness (dropout)
    comes from torch's global generator, seeded from the task alone (`network_randomness`)."""
    metrics = {"steps": float(schedule.steps)}
    local = local_training(message.config)
    if ctx.privacy.dp_sgd is None:
        generator = torch.Generator().manual_seed(local.seed)
        with network_randomness(ctx, local.seed):
            return list(plain(shuffled_batches(schedule, generator))), metrics
    from fedsilo.silo.dp_training import dp_sgd_plan  # Opacus loads only on the DP path

    plan = dp_sgd_plan(ctx.privacy, local, schedule.n, ctx.rounds, ctx.job_noise())
    with network_randomness(ctx, ctx.private_seed(message.task_id, "network")):
        losses = private(plan, ctx.private_seed(message.task_id, "dp-sgd"))
    return losses, metrics | plan.public_metrics()


def network_randomness(ctx: SiloContext, seed: int) -> AbstractContextManager[None]:
    """Where a training task's network draws its own randomness: a plug-in network (which may
    use dropout) from torch's global generator seeded with `seed` (the task's; under DP-SGD
    from the silo's secret, like the rest of the task's randomness) and held while it trains
    (models/global_rng.py); a zoo network draws none."""
    if isinstance(ctx.policy.model, PluginModel):
        return seeded_global_rng(seed)
    return nullcontext()


def gradient_steps(
    optimizer: torch.optim.Optimizer,
    batch_loss: Callable[[torch.Tensor], torch.Tensor],
    batches: Iterator[torch.Tensor],
    device: torch.device,
    regulariser: Callable[[], torch.Tensor] | None = None,
    after_step: Callable[[int], None] | None = None,
) -> list[float]:
    """Plain steps: each batch's `batch_loss` (plus `regulariser()`, a data-independent term
    such as FedProx's) descended by `optimizer`; `after_step` runs after each step with its
    number (1-based). The batch losses, without the regulariser."""
    losses = []
    for step, index in enumerate(batches, start=1):
        optimizer.zero_grad(set_to_none=True)
        loss = batch_loss(index.to(device))
        (loss + regulariser() if regulariser is not None else loss).backward()
        optimizer.step()
        losses.append(float(loss.detach()))
        if after_step is not None:
            after_step(step)
    return losses


def released_training(
    ctx: SiloContext,
    message: TaskMessage,
    schedule: LocalSchedule,
    losses: list[float | None],
    metrics: dict[str, float],
) -> int:
    """What a training task reports besides the model: the mean loss of its last window into
    `metrics` (when losses may leave exactly), and the training count as it is released."""
    reports = ctx.reports(message.task_id, "train")
    if reports.allows(LOSSES) and not reports.noised:
        recent = [loss for loss in losses[-schedule.window :] if loss is not None]
        metrics["train_loss"] = sum(recent) / len(recent) if recent else float("nan")
    ctx.released_count("train")
    return reports.count(schedule.n)
