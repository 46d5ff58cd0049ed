"""The training tasks: plain local training (FedAvg and every strategy built on it), SuPerFed's
mixture training and FedEvg's energy signals, all over the same local-training settings."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from fedsilo.wire.tasks.codec import JsonFields, TaskConfig, flattened, optional
from fedsilo.wire.tasks.release import Release
from fedsilo.wire.tensors import WireError


@dataclass(frozen=True, kw_only=True)
class LocalTraining(JsonFields):
    """What every training task carries from the policy's `training:` section (the keys that
    `Strategy.train_task` always sends, `epochs` and `steps` included, one of them null): the
    schedule (`steps` when set, else `epochs`), the optimiser, FedProx's `prox_mu` (0: none)
    and the seed of the minibatch draws."""

    batch_size: int
    optimizer: str  # sgd | adam
    lr: float
    seed: int
    epochs: int | None = None  # None when the policy trains by steps
    steps: int | None = None
    momentum: float = 0.0
    weight_decay: float = 0.0
    prox_mu: float = 0.0

    @classmethod
    def decode(cls, data: Any, kind: str) -> Self:
        settings = super().decode(data, kind)
        if settings.epochs is None and not settings.steps:
            raise WireError(f"{kind} task: config key 'epochs' is missing (and no steps are set)")
        return settings


QUANTIZED_BITS = (8, 16)


@dataclass(frozen=True, kw_only=True)
class Quantization(JsonFields):
    """The policy's `compression:` as a `train` task carries it: the answer sends the update
    quantized to `bits` a value, one float32 scale per `block_size` consecutive values of a
    parameter tensor (absent: one per parameter tensor); wire/quantized.py."""

    bits: int
    block_size: int | None = optional()

    def __post_init__(self) -> None:
        if self.bits not in QUANTIZED_BITS:
            raise WireError(f"a quantized update has 8 or 16 bits a value, not {self.bits}")
        if self.block_size is not None and self.block_size < 1:
            raise WireError(f"a block holds at least one value, not {self.block_size}")

    @property
    def levels(self) -> int:
        """L = 2^(bits-1) - 1, the largest |q|."""
        return 2 ** (self.bits - 1) - 1


@dataclass(frozen=True, kw_only=True)
class TrainTask(TaskConfig):
    """`train`: local training from the model sent (MODEL). The optional keys, absent unless
    the strategy sends them, compose the local loop (silo/tasks/train.py)."""

    KIND: ClassVar[str] = "train"
    SENDS: ClassVar[Release] = Release.IN_THE_CLEAR
    local: LocalTraining = flattened()
    # DRFLM: every step on Beta(a, a) mixup of the batch's rows, mixed on `mixup_on`
    mixup_alpha: float | None = optional()
    mixup_on: str | None = optional()  # inputs (when absent) | embedding
    # AgnosticFedAvg over the data's domains: each row's loss weighted by its domain's weight
    domain_weights: Mapping[str, float] | None = optional()
    # ApproxFedAvg: a soft maximum over the batch's domains' losses
    domain_temperature: float | None = optional()
    domain_reduction: str | None = optional()  # sum (when absent) | mean
    # DRFA: the parameters after this step return as CHECKPOINT; R-FedTorch's update scale
    checkpoint_step: int | None = optional()
    update_scale: float | None = optional()  # 1 when absent
    # client-level DP with distributed noise: the silos sharing the round's noise (1: absent)
    cohort: int | None = optional()
    # `compression:`: the trained model's update travels quantized (absent: the model as is)
    compression: Quantization | None = optional()

    @property
    def mixup_site(self) -> str:
        return "inputs" if self.mixup_on is None else self.mixup_on

    @property
    def reduction(self) -> str:
        return "sum" if self.domain_reduction is None else self.domain_reduction

    @property
    def scale(self) -> float:
        return 1.0 if self.update_scale is None else self.update_scale

    @property
    def cohort_size(self) -> int:
        return 1 if self.cohort is None else self.cohort


@dataclass(frozen=True, kw_only=True)
class SuperFedTrain(TaskConfig):
    """`superfed_train`: the mixture (1 - lambda) w_federated + lambda w_local trained from
    round `mixing_on` on, lambda per minibatch (`mixing: model`) or per layer too (`layer`);
    `prox_mu` (in `local`) weighs the proximity term of form `prox_form`, `ortho_nu` the
    orthogonality term; a fresh local model starts from `local_seed`."""

    KIND: ClassVar[str] = "superfed_train"
    SENDS: ClassVar[Release] = Release.IN_THE_CLEAR
    local: LocalTraining = flattened()
    mixing: str  # model | layer
    mixing_on: bool
    local_seed: int
    ortho_nu: float = 0.0
    prox_form: str = "layer_l2"  # layer_l2 | squared


@dataclass(frozen=True, kw_only=True)
class EnergySignals(TaskConfig):
    """`energy_signals` (FedEvg): train a fresh energy model (from `model_seed`, or the silo's
    kept one with `persist_local_model`) on the local rows and the synthetic set sent
    (SYNTHETIC, SYNTHETIC_LABELS); return WEIGHTED_GRADIENT and WEIGHT per synthetic point.
    `local.prox_mu` is sent and not read."""

    KIND: ClassVar[str] = "energy_signals"
    SENDS: ClassVar[Release] = Release.IN_THE_CLEAR
    local: LocalTraining = flattened()
    sgld_steps: int
    sgld_step: float
    sgld_noise: float
    gradient_clip: float
    synthetic_ce_weight: float
    model_seed: int
    energy: str = "joint"  # joint | marginal
    spectral_norm: bool = False
    persist_local_model: bool = False
