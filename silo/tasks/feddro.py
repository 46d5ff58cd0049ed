"""`feddro_support` and `feddro_train`: FedDRO's tasks at a silo (the maths in silo/feddro.py;
docs/algorithms/feddro.md).

Both read the algorithm's settings from the silo's own copy of the signed policy and refuse to
run under any policy but a FedDRO one that says `release_point_clouds: true`, whatever the
coordinator sends.

`feddro_support` carries the silo's last cloud (SUPPORT) and the barycenter (BARYCENTER),
(groups, points, dim) each, and answers the new cloud and PRESENT (1 per group the silo holds,
else 0; a group it lacks keeps its cloud). The cloud is built from the silo's training records:
a data-like release, booked as `none` (no DP guarantee, epsilon infinite), or, with the
policy's `point_cloud_clip` and `point_cloud_noise`, as a Gaussian mechanism (records clipped to
that norm, eta_P noised before it meets the barycenter; a record is in one group, so one
mechanism per task). PRESENT is exact either way.

`feddro_train` carries MODEL and BARYCENTER: the silo maps its training rows onto the
barycenter (exact OT, barycentric projection) and trains on them as `train` does, with the
WDRO adversary when the policy sets `adversarial_penalty`. It releases what `train` releases.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from fedsilo.policies.algorithms.feddro import FedDroConfig
from fedsilo.privacy.accounting import Mechanism
from fedsilo.silo.feddro import (
    WassersteinAdversary,
    clip_rows,
    groups_of,
    mapped_records,
    point_cloud_sensitivity,
    support_step,
)
from fedsilo.silo.local_loop import gradient_steps, local_steps, optimizer_for, released_training
from fedsilo.silo.objectives import Objective, RowLoss
from fedsilo.silo.schedule import LocalSchedule
from fedsilo.silo.tasks.base import SiloContext, config_of, flat_parameters, task_result
from fedsilo.silo.tasks.train import train_releases
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tasks import FedDroTrain
from fedsilo.wire.tasks.tensor_names import BARYCENTER, MODEL, PRESENT, SUPPORT

if TYPE_CHECKING:  # Opacus loads only on the DP path
    from fedsilo.silo.dp_training import DpSgdPlan


def settings(ctx: SiloContext) -> FedDroConfig:
    """The silo's own FedDRO settings; refuses under any other policy."""
    algorithm = ctx.algorithm
    if not isinstance(algorithm, FedDroConfig) or not algorithm.release_point_clouds:
        raise ValueError(
            "feddro tasks release point clouds of this silo's records; its policy is not a "
            "feddro policy with release_point_clouds: true"
        )
    return algorithm


def feddro_support_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    config = settings(ctx)
    if config.point_cloud_clip is None or config.point_cloud_noise is None:
        return [Mechanism.none()]
    sensitivity = point_cloud_sensitivity(
        config.support_points, config.interpolation, config.point_cloud_clip
    )
    return [
        Mechanism.gaussian(
            sensitivity=sensitivity, noise_std=config.point_cloud_noise * sensitivity
        )
    ]


def feddro_support(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    config = settings(ctx)
    support, barycenter = _clouds(message, ctx, config)
    x, y = _records(ctx)
    clip, noise = config.point_cloud_clip, config.point_cloud_noise
    generator = np.random.default_rng(ctx.private_seed(message.task_id, "feddro-support"))
    groups = groups_of(x, y, config.variant, _classes(ctx))
    updated, present = support.copy(), np.zeros(len(groups))
    for g, records in enumerate(groups):
        if records is None:
            continue
        step_noise = None
        if clip is not None and noise is not None:
            records = clip_rows(records, clip)
            std = noise * point_cloud_sensitivity(support.shape[1], config.interpolation, clip)
            step_noise = (std, generator)
        updated[g] = support_step(
            support[g], records, barycenter[g], config.interpolation, step_noise
        )
        present[g] = 1.0
    return TaskResult(
        task_id=message.task_id,
        silo=ctx.name,
        kind=message.kind,
        num_samples=0,
        metrics={},
        tensors={SUPPORT: torch.from_numpy(updated), PRESENT: torch.from_numpy(present)},
    )


def feddro_train_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    settings(ctx)
    return train_releases(message, ctx)


def feddro_train(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    config = settings(ctx)
    local = config_of(message, FedDroTrain).local
    model, spec = ctx.load_model(message)
    _, barycenter = _clouds(message, ctx, config, support=False)
    x, y = _records(ctx)
    mapped, labels = mapped_records(x, y, barycenter, config.variant)
    shape = (len(y), *ctx.data.input_shape)
    mx = torch.from_numpy(mapped).to(ctx.device, torch.float32).reshape(shape)
    my = torch.from_numpy(labels).to(ctx.device, torch.long)
    schedule = LocalSchedule.of(local, len(y))
    optimizer = optimizer_for(model.parameters(), local)
    objective: Objective = RowLoss(ctx.data.task, model, mx, my)
    if config.adversarial_penalty is not None:
        objective = WassersteinAdversary(
            ctx.data.task,
            model,
            mx,
            my,
            config.adversarial_penalty,
            config.adversarial_steps,
            config.adversarial_step,
        )

    def private(plan: DpSgdPlan, private_seed: int) -> list[float | None]:
        from fedsilo.silo.dp_training import train_private

        return train_private(
            model, optimizer, plan, local.seed, private_seed, objective.per_sample_loss
        )

    model.train()
    losses, metrics = local_steps(
        message,
        ctx,
        schedule,
        lambda batches: gradient_steps(optimizer, objective.batch_loss, batches, mx.device),
        private,
    )
    count = released_training(ctx, message, schedule, losses, metrics)
    return task_result(message, ctx, {MODEL: flat_parameters(model, spec)}, count, metrics, spec)


def _classes(ctx: SiloContext) -> int:
    classes = ctx.data.num_classes or 0
    if classes < 2:
        raise ValueError("feddro needs a classification task")
    return classes


def _records(ctx: SiloContext) -> tuple[np.ndarray, np.ndarray]:
    """The training rows flattened to (n, dim), float64, and their labels."""
    x, y = ctx.split("train")
    if len(y) == 0:
        raise ValueError(f"silo {ctx.name!r} has no training samples")
    return x.reshape(len(y), -1).double().cpu().numpy(), y.long().cpu().numpy()


def _clouds(
    message: TaskMessage, ctx: SiloContext, config: FedDroConfig, support: bool = True
) -> tuple[np.ndarray, np.ndarray]:
    """The clouds the task carries, float64 (the silo's own only for a support step), checked
    against the silo's data: as many groups as the variant makes, points of its width."""
    names = (SUPPORT, BARYCENTER) if support else (BARYCENTER,)
    for name in names:
        if name not in message.tensors:
            raise ValueError(f"a {message.kind} task carries {name}")
    classes = _classes(ctx)
    width = int(np.prod(ctx.data.input_shape))
    groups, dim = (classes, width) if config.variant == "classwise" else (1, width + classes)
    clouds = [message.tensors[name].double().cpu().numpy() for name in names]
    for cloud in clouds:
        if cloud.ndim != 3 or cloud.shape[0] != groups or cloud.shape[2] != dim:
            raise ValueError(
                f"clouds of shape {cloud.shape} do not fit this silo's {groups} groups of "
                f"{dim}-dimensional points"
            )
    barycenter = clouds[-1]
    return (clouds[0] if support else barycenter), barycenter
