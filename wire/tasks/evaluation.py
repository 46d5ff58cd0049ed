"""The tasks that only report: held-out metrics, a loss probe, SuPerFed's lambda curves."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedsilo.wire.tasks.codec import TaskConfig, optional
from fedsilo.wire.tasks.release import Release


@dataclass(frozen=True, kw_only=True)
class EvaluateTask(TaskConfig):
    """`evaluate`: the metrics of the model sent (MODEL) on `split`."""

    KIND: ClassVar[str] = "evaluate"
    SENDS: ClassVar[Release] = Release.NOTHING_PRIVATE
    split: str = "test"  # train | val | test


@dataclass(frozen=True, kw_only=True)
class LossProbe(TaskConfig):
    """`loss`: the mean loss of the model sent on `split`; with `mixup_alpha` (DRFLM) the mean
    mixed loss, partners and ratios drawn from `seed`, mixed on `mixup_on`; with `by_domain`
    (AgnosticFedAvg over the data's domains) each domain's loss sum and row count."""

    KIND: ClassVar[str] = "loss"
    SENDS: ClassVar[Release] = Release.NOTHING_PRIVATE
    split: str = "train"
    mixup_alpha: float | None = optional()
    seed: int | None = optional()
    mixup_on: str | None = optional()  # inputs (when absent) | embedding
    by_domain: bool = optional(False)  # sent only when true

    @property
    def mixup_site(self) -> str:
        return "inputs" if self.mixup_on is None else self.mixup_on


@dataclass(frozen=True, kw_only=True)
class SuperFedEvaluate(TaskConfig):
    """`superfed_evaluate`: the model sent mixed with the silo's local model (fresh from
    `local_seed` when it has none) at `lambda_grid` lambdas in [0, 1], lambda chosen on the
    validation split when it has at least `min_validation` rows, else on the training split."""

    KIND: ClassVar[str] = "superfed_evaluate"
    SENDS: ClassVar[Release] = Release.NOTHING_PRIVATE
    local_seed: int
    lambda_grid: int = 11
    min_validation: int = 20
