"""DRFA's two additions to a silo's local run: the checkpoint after a random number of steps,
and R-FedTorch's update scale.

* `checkpoint_step` t (a whole number in 0..the run's local steps; absent: none): the result
  also carries `CHECKPOINT`, the flat parameters after exactly t optimiser steps (0: the model
  received). Without DP it is exact like the model; with DP-SGD it is an intermediate iterate of
  the same run, which DP-SGD's accounting already covers (the analysis releases every iterate),
  so it is post-processing and booked once with the model. Refused with `privacy.client_dp`,
  whose clipping and noise share cover one update per task.
* `update_scale` s (a finite float; absent: 1): the model leaves as received + s (trained -
  received), the importance weight lambda_k K of DRFA's R-FedTorch variant (its weights need not
  sum to one: a uniform mean of the scaled models is then its update). Post-processing of the
  trained model; refused with client-level DP, whose clip bounds the unscaled update.
"""

from __future__ import annotations

import math

import torch

from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.wire.tasks.tensor_names import CHECKPOINT
from fedsilo.wire.tensors import ParameterSpec


def checkpoint_step(step: int | None, steps: int, privacy: PrivacyConfig) -> int | None:
    """The task's `checkpoint_step` (a whole number: the task's decoding sees to it), checked
    before any training: in 0..steps, and never with client-level DP."""
    if step is None:
        return None
    if privacy.client_dp is not None:
        raise ValueError(
            "checkpoint_step cannot be combined with privacy.client_dp: its clipping and noise "
            "share cover one update per task"
        )
    if not 0 <= step <= steps:
        raise ValueError(f"checkpoint_step {step} is outside the run's 0..{steps} local steps")
    return step


class Checkpoint:
    """The flat parameters after optimiser step `step` (None: no checkpoint; 0: the model
    received, taken at once), taken by `after_step`, which the training calls after every
    step."""

    def __init__(self, step: int | None, model: torch.nn.Module, spec: ParameterSpec) -> None:
        self.step = step
        self.model = model
        self.spec = spec
        self.taken: dict[str, torch.Tensor] = {}
        self.after_step(0)

    def after_step(self, step: int) -> None:
        if step == self.step:
            self.taken[CHECKPOINT] = self.spec.flatten(dict(self.model.named_parameters()))

    def tensors(self) -> dict[str, torch.Tensor]:
        """{CHECKPOINT: parameters} once taken, else nothing."""
        return self.taken


def update_scale(scale: float, privacy: PrivacyConfig) -> float:
    """The task's `update_scale` (1 when absent): finite, and never with client-level DP."""
    scale = float(scale)
    if not math.isfinite(scale):
        raise ValueError(f"update_scale must be a finite number, not {scale}")
    if scale != 1.0 and privacy.client_dp is not None:
        raise ValueError(
            "update_scale cannot be combined with privacy.client_dp: its clip bounds the "
            "unscaled update"
        )
    return scale


def scaled(received: torch.Tensor, trained: torch.Tensor, scale: float) -> torch.Tensor:
    """received + scale (trained - received); the trained model itself at scale 1."""
    if scale == 1.0:
        return trained
    received = received.to(trained)
    return received + scale * (trained - received)
