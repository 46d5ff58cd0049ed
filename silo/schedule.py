"""A train task's local work: its batch size and number of steps, read from the task's
local-training settings, and the seeded order of its shuffled minibatches.

Private and non-private training both read their schedule here, so the steps a DP-SGD plan
accounts for are exactly the steps the training takes.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from fedsilo.wire.tasks import LocalTraining


@dataclass(frozen=True)
class LocalSchedule:
    """`steps` minibatches of `batch` rows out of `n`; `window`: the last steps whose mean
    loss the task reports (the last epoch, or every step when training by steps)."""

    n: int
    batch: int
    steps: int
    window: int

    @classmethod
    def of(cls, local: LocalTraining, n: int) -> LocalSchedule:
        if n < 1:
            raise ValueError("no training samples")
        batch = min(local.batch_size, n)
        if local.steps:
            return cls(n, batch, local.steps, local.steps)
        assert local.epochs is not None  # decoding refuses a config with neither
        steps_per_epoch = math.ceil(n / batch)
        return cls(n, batch, local.epochs * steps_per_epoch, steps_per_epoch)


def shuffled_batches(schedule: LocalSchedule, generator: torch.Generator) -> Iterator[torch.Tensor]:
    """The schedule's minibatches of row indices; a fresh permutation each pass through the
    data, so the last batch of a pass may be smaller."""
    produced = 0
    while produced < schedule.steps:
        order = torch.randperm(schedule.n, generator=generator)
        for start in range(0, schedule.n, schedule.batch):
            if produced == schedule.steps:
                return
            yield order[start : start + schedule.batch]
            produced += 1
