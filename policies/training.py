"""The `training:` section: how each silo trains locally, and the learning-rate schedule."""

from __future__ import annotations

import math
from typing import Annotated, Literal

from pydantic import Field, JsonValue, model_validator

from fedsilo.policies.base import PolicyModel
from fedsilo.policies.model import FACTORY_PATTERN
from fedsilo.policies.package_pin import PackagePin

# The largest learning rate a policy may set: far beyond any useful one (models diverge long
# before), but small enough that a typo such as 1e300 is refused instead of failing every round.
MAX_LR = 10.0


class ConstantLr(PolicyModel):
    # constant (the default): the learning rate stays lr every round
    kind: Literal["constant"] = "constant"


class ExponentialLr(PolicyModel):
    """lr * gamma^round, as the seeds' "lr 0.01, gamma = .995" settings."""

    # exponential: the learning rate of round r is lr * gamma^r
    kind: Literal["exponential"]
    # the factor the learning rate is multiplied by every round (above 0, at most 1; e.g. 0.995)
    gamma: float = Field(gt=0, le=1)


class StepLr(PolicyModel):
    """lr * gamma^(round // every)."""

    # step: the learning rate is multiplied by gamma every `every` rounds
    kind: Literal["step"]
    # every how many rounds the learning rate drops
    every: int = Field(ge=1)
    # the factor the learning rate is multiplied by at each drop (above 0, at most 1)
    gamma: float = Field(gt=0, le=1)


class CosineLr(PolicyModel):
    """Cosine decay from lr to min_lr over the run's rounds."""

    # cosine: the learning rate decays from lr to min_lr along a cosine over the run's rounds
    kind: Literal["cosine"]
    # the learning rate of the last round (0 by default)
    min_lr: float = Field(default=0.0, ge=0, le=MAX_LR)


LrSchedule = Annotated[ConstantLr | ExponentialLr | StepLr | CosineLr, Field(discriminator="kind")]


class StepPlugin(PolicyModel):
    """A site's own training step (a `fedsilo.TrainingStep` from an installed package, entry
    point group `fedsilo.steps`): augmentation, gradient accumulation, early stopping on the
    site's validation split, mixed precision on CUDA. Every silo loads it from its own copy of
    the policy and refuses the job unless the installed package is the pinned one."""

    # the entry point's value, `module:attr`: a fedsilo.TrainingStep subclass, built as
    # cls(**args) for each training task
    plugin: str = Field(pattern=FACTORY_PATTERN)
    # the package every silo must have installed: its version and code digest, printed by
    # `fedsilo plugin pin module:attr` (required)
    package: PackagePin
    # keyword arguments the step is built with (none by default)
    args: dict[str, JsonValue] = Field(default_factory=dict)


class TrainingConfig(PolicyModel):
    """Local training at each silo; exactly one of `epochs` and `steps` per round."""

    # passes over its training rows each silo makes per round (1 by default); null when steps is
    # set, as exactly one of epochs and steps is
    epochs: int | None = Field(default=1, ge=1)
    # optimiser steps (batches) each silo takes per round, instead of epochs; null (the default):
    # epochs decide
    steps: int | None = Field(default=None, ge=1)
    # rows per training batch (32 by default)
    batch_size: int = Field(default=32, ge=1)
    # the local optimiser: sgd (the default) or adam
    optimizer: Literal["sgd", "adam"] = "sgd"
    # the local learning rate, the start of lr_schedule (0.05 by default, at most 10)
    lr: float = Field(default=0.05, gt=0, le=MAX_LR)
    # SGD's momentum, from 0 up to (not including) 1 (0 by default: none)
    momentum: float = Field(default=0.0, ge=0, lt=1)
    # L2 weight decay added by the optimiser (0 by default: none)
    weight_decay: float = Field(default=0.0, ge=0)
    # how the learning rate changes from round to round (kind: constant by default)
    lr_schedule: LrSchedule = ConstantLr()
    # a site's own training step from an installed package, pinned by version and digest (none
    # by default: fedsilo's own step); only `train` tasks take one
    step: StepPlugin | None = None

    @model_validator(mode="before")
    @classmethod
    def _steps_replace_epochs(cls, data: object) -> object:
        if isinstance(data, dict) and data.get("steps") is not None and "epochs" not in data:
            return {**data, "epochs": None}
        return data

    @model_validator(mode="after")
    def _one_budget(self) -> TrainingConfig:
        if (self.epochs is None) == (self.steps is None):
            raise ValueError("set exactly one of 'epochs' and 'steps' (local work per round)")
        return self

    def lr_at(self, round_index: int, total_rounds: int) -> float:
        """The local learning rate of round `round_index` (0-based)."""
        schedule = self.lr_schedule
        if isinstance(schedule, ExponentialLr):
            return self.lr * schedule.gamma**round_index
        if isinstance(schedule, StepLr):
            return self.lr * schedule.gamma ** (round_index // schedule.every)
        if isinstance(schedule, CosineLr):
            progress = round_index / max(1, total_rounds - 1)
            return schedule.min_lr + 0.5 * (self.lr - schedule.min_lr) * (
                1 + math.cos(math.pi * progress)
            )
        return self.lr
