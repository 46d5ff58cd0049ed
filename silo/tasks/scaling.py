"""Federated standardisation: a silo reports per-feature moments of its training rows (sums,
sums of squares, counts of observed values) and receives the consortium's scaler, which it
applies to all of its splits. Columns the silo never observed are filled with the consortium
mean (0 after scaling).

The moments are exact: no DP covers them, so a silo in a DP deployment refuses to send them
(the policy is refused earlier still, when it is read); `standardise` releases nothing."""

from __future__ import annotations

import torch

from fedsilo.privacy.accounting import Mechanism
from fedsilo.silo.tasks.base import SiloContext
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tasks.tensor_names import (
    MOMENT_COUNT,
    MOMENT_SUM,
    MOMENT_SUMSQ,
    SCALER_MEAN,
    SCALER_STD,
)


def moments_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    if ctx.privacy.differentially_private:
        raise ValueError("exact feature moments are not released in a DP deployment")
    return [Mechanism.none()]


def feature_moments(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    x = ctx.data.x_train.reshape(len(ctx.data.x_train), -1).to(torch.float64)
    observed = ~torch.isnan(x)
    values = torch.where(observed, x, torch.zeros_like(x))
    moments = {
        MOMENT_COUNT: observed.sum(0).to(torch.float64),
        MOMENT_SUM: values.sum(0),
        MOMENT_SUMSQ: (values**2).sum(0),
    }
    return TaskResult(message.task_id, ctx.name, message.kind, num_samples=len(x), tensors=moments)


def standardise(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    mean, std = message.tensors[SCALER_MEAN], message.tensors[SCALER_STD]
    width = ctx.data.x_train[0].numel() if len(ctx.data.x_train) else mean.numel()
    if mean.shape != (width,) or std.shape != (width,) or bool((std <= 0).any()):
        raise ValueError(f"scaler does not fit this silo's {width} features")
    ctx.store.features = {
        split: _apply(ctx.raw_split(split), mean, std) for split in ("train", "val", "test")
    }
    return TaskResult(message.task_id, ctx.name, message.kind)


def _apply(x: torch.Tensor, mean: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    flat = (x.reshape(len(x), mean.numel()).to(torch.float64) - mean) / std  # 0 rows too
    return torch.nan_to_num(flat, nan=0.0).to(x.dtype).reshape(x.shape)
