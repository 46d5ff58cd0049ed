"""What a silo's local run minimises over a minibatch of row indices: the batch's loss, which
plain training descends, and each row's loss, which DP-SGD clips row by row.

`RowLoss` is the plain objective (the task's mean loss, or its per-row losses); `MeanOfRows` is
the mean of any per-row losses (DRFLM's mixed rows, silo/mixup.py); silo/domains.py's
`DomainObjective` weights the rows of either by their domain.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from torch import Tensor, nn

from fedsilo.silo.evaluation import loss_function, per_sample_loss_function

# The losses of one minibatch, one per row (shape (len(rows),)), given the rows it holds.
PerSampleLoss = Callable[[Tensor], Tensor]


class Objective(Protocol):
    def batch_loss(self, index: Tensor) -> Tensor:
        """The scalar loss plain training descends on the rows `index`."""
        ...

    def per_sample_loss(self, index: Tensor) -> Tensor:
        """Each row's loss, what DP-SGD clips as a sample's."""
        ...


class RowLoss:
    """The task's loss of `model` on rows of (x, y); the per-row loss is looked up when first
    asked for (a task plug-in may define none)."""

    def __init__(self, task: str, model: nn.Module, x: Tensor, y: Tensor) -> None:
        self.task = task
        self.mean_loss = loss_function(task)
        self.model, self.x, self.y = model, x, y

    def batch_loss(self, index: Tensor) -> Tensor:
        return self.mean_loss(self.model(self.x[index]), self.y[index])

    def per_sample_loss(self, index: Tensor) -> Tensor:
        return per_sample_loss_function(self.task)(self.model(self.x[index]), self.y[index])


class MeanOfRows:
    """The mean of `per_sample_loss` over the batch's rows."""

    def __init__(self, per_sample_loss: PerSampleLoss) -> None:
        self.per_sample_loss = per_sample_loss

    def batch_loss(self, index: Tensor) -> Tensor:
        return self.per_sample_loss(index).mean()
