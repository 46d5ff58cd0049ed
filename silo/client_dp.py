"""Client-level DP (DP-FedAvg, `privacy.client_dp`) at a silo: the update that leaves is clipped
to L2 norm S and, with distributed noise, carries this silo's share N(0, (z S)^2 / m) of the
round's noise, m the silos the task says the round asked (at most the consortium the silo knows:
a coordinator that claims more cannot shrink the share below (z S)^2 / K).

Without DP-SGD the share is what the silo books: a Gaussian release of sensitivity S and std
z S / sqrt(m) (the coordinator sees each update; only their sum carries the full noise). With
DP-SGD the model is booked as DP-SGD's run, and clipping and the share are post-processing of it.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

import torch

from fedsilo.privacy.accounting import Mechanism
from fedsilo.wire.messages import TaskMessage
from fedsilo.wire.tasks import TrainTask

if TYPE_CHECKING:  # the task context imports every handler, which import this module
    from fedsilo.silo.tasks.base import SiloContext


def share_mechanism(message: TaskMessage, ctx: SiloContext) -> Mechanism:
    """The release of one clipped, noised update without DP-SGD."""
    return Mechanism.gaussian(
        sensitivity=ctx.privacy.client_dp.clip, noise_std=share_std(message, ctx)
    )


def share_std(message: TaskMessage, ctx: SiloContext) -> float:
    """This silo's share of a round's client-level noise: z S / sqrt(m), m the silos the
    round asked (as the task says, at most the consortium this silo knows, at least 1)."""
    client_dp = ctx.privacy.client_dp
    task = message.config
    asked = task.cohort_size if isinstance(task, TrainTask) else 1
    cohort = max(1, min(asked, ctx.consortium))
    return client_dp.noise_multiplier * client_dp.clip / math.sqrt(cohort)


@torch.no_grad()
def clipped_update(
    message: TaskMessage, ctx: SiloContext, received: torch.Tensor, trained: torch.Tensor
) -> torch.Tensor:
    """received + the update clipped to norm S, plus the silo's noise share (distributed)."""
    update = (trained - received).double()
    clip = ctx.privacy.client_dp.clip
    update *= min(1.0, clip / max(float(update.norm()), 1e-300))
    if ctx.privacy.client_dp.noise == "distributed":
        generator = ctx.noise_generator(message.task_id, "client-dp")
        update += torch.normal(
            0.0, share_std(message, ctx), update.shape, generator=generator, dtype=torch.float64
        ).to(update.device)
    return received + update.to(received.dtype)
