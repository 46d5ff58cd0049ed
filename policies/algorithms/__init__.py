"""The `algorithm:` section: which strategy runs, with its own parameters."""

from __future__ import annotations

import math
from typing import Annotated, ClassVar, Literal

from pydantic import Field

from fedsilo.policies.base import PolicyModel
from fedsilo.policies.training import MAX_LR

# Every algorithm evaluates on the silos' held-out data, and weights silos by sample counts.
SAMPLE_WEIGHTED: frozenset[str] = frozenset({"counts", "metrics"})


class FedAvgConfig(PolicyModel):
    """FedAvg (McMahan et al.): sample-weighted mean of the sampled silos' models."""

    reports: ClassVar[frozenset[str]] = SAMPLE_WEIGHTED  # report kinds it cannot run without
    averages: ClassVar[bool] = True  # one aggregate of models: secure aggregation applies
    clips_updates: ClassVar[bool] = True  # equal-weight mean of clipped updates: client DP
    name: Literal["fedavg"]
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    prox_mu: float = Field(default=0.0, ge=0)


class FedProxConfig(PolicyModel):
    """FedProx (Li et al.): FedAvg with the proximal term (mu/2)||w - w_global||^2 locally."""

    reports: ClassVar[frozenset[str]] = SAMPLE_WEIGHTED
    averages: ClassVar[bool] = True
    clips_updates: ClassVar[bool] = True
    name: Literal["fedprox"]
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    prox_mu: float = Field(default=0.1, gt=0)


class FedOptConfig(PolicyModel):
    """FedAdam / FedYogi / FedAdagrad (Reddi et al.): an adaptive step on the mean update."""

    reports: ClassVar[frozenset[str]] = SAMPLE_WEIGHTED
    averages: ClassVar[bool] = True
    clips_updates: ClassVar[bool] = True
    name: Literal["fedadam", "fedyogi", "fedadagrad"]
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    prox_mu: float = Field(default=0.0, ge=0)
    server_lr: float = Field(default=0.1, gt=0, le=MAX_LR)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.99, ge=0, lt=1)
    tau: float = Field(default=1e-3, gt=0)


class CentralConfig(PolicyModel):
    """Reference: one model trained on the pooled union of the silos' training data."""

    reports: ClassVar[frozenset[str]] = SAMPLE_WEIGHTED
    averages: ClassVar[bool] = False
    name: Literal["central"]


class LocalConfig(PolicyModel):
    """Reference: each silo trains alone and is evaluated with its own model."""

    reports: ClassVar[frozenset[str]] = SAMPLE_WEIGHTED
    averages: ClassVar[bool] = False
    name: Literal["local"]


class MixingAlgorithmConfig(PolicyModel):
    """The loss-driven mixing schedules (their parameters in the policy's `mixing:` section):
    DRFA and DRFLM (Deng et al. 2021; DRFA with local mixup), AFL (Mohri et al. 2019, as
    projected ascent on lambda), AgnosticFedAvg (Ro et al. 2021; a domain is a silo, or a value
    of the silos' `data.domain` column with `mixing.domains: data`), q-FedAvg,
    TERM, PropFair (as the unified table of the AAggFF thesis), AAggFF (Hahn et al. 2024:
    AAggFF-S with every silo, AAggFF-D when `client_fraction` < 1)."""

    reports: ClassVar[frozenset[str]] = SAMPLE_WEIGHTED | {"losses"}
    averages: ClassVar[bool] = True
    name: Literal[
        "drfa", "drflm", "afl", "agnostic_fedavg", "qfedavg", "term", "propfair", "aaggff"
    ]
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    prox_mu: float = Field(default=0.0, ge=0)


class ApproxFedAvgConfig(PolicyModel):
    """ApproxFedAvg (the survey's proposal, spec robust-and-daisy-chain.md §7): FedAvg whose silos
    train each minibatch on the log-sum-exp (1/mu) log sum_i exp(mu F_i) of their domains'
    losses F_i, a soft maximum over the domains of the silo's `data.domain` column (`mixing:
    temperature` mu, `domain_reduction`). With one domain per silo it is FedAvg."""

    reports: ClassVar[frozenset[str]] = SAMPLE_WEIGHTED
    averages: ClassVar[bool] = True
    name: Literal["approx_fedavg"]
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    prox_mu: float = Field(default=0.0, ge=0)


class SuperFedConfig(PolicyModel):
    """SuPerFed (Hahn et al. 2022; spec thesis-methods.md §1): every silo keeps a local model
    that never leaves it and, from round floor(`start_fraction` T) + 1 on, trains the mixture
    (1 - lambda) w_federated + lambda w_local, lambda ~ U(0, 1) per minibatch (`mixing: model`)
    or per layer and minibatch (`layer`), with the proximity term `prox_mu` R_prox(w_federated,
    w_global) (`prox_form`: the reference's sum of per-layer L2 norms, `layer_l2`, or the
    squared norm) and the orthogonality term `ortho_nu` cos^2(w_federated, w_local). Only the
    federated model travels; the coordinator averages it by sample counts. Evaluation mixes the
    global model with each silo's local model over `lambda_grid` points of [0, 1] and reports
    the test metrics at the lambda chosen on the validation split (on the training split when
    the validation split has fewer than `min_validation` rows)."""

    reports: ClassVar[frozenset[str]] = SAMPLE_WEIGHTED
    averages: ClassVar[bool] = True
    name: Literal["superfed"]
    mixing: Literal["model", "layer"] = "model"
    start_fraction: float = Field(default=0.2, ge=0, le=1)
    prox_mu: float = Field(default=0.01, ge=0)
    prox_form: Literal["layer_l2", "squared"] = "layer_l2"
    ortho_nu: float = Field(default=1.0, ge=0)
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    lambda_grid: int = Field(default=11, ge=2)
    min_validation: int = Field(default=20, ge=1)

    def mixing_from(self, total_rounds: int) -> int:
        """The first round (1-based) that trains the mixture: floor(L T) + 1."""
        return math.floor(self.start_fraction * total_rounds + 1e-9) + 1


class FedEvgConfig(PolicyModel):
    """FedEvg (thesis ch. IV; spec thesis-methods.md §3): silos send energy signals, not models.
    The coordinator keeps `samples_per_class` synthetic points per class (noise at first) and
    moves them every round by one Langevin step down the mixture of the silos' energies, step
    eta_t from `server_step_max` to `server_step_min` (the cosine-beta curve), noise
    `server_noise` (or `server_noise_scale` * eta_t); each silo trains a fresh energy model
    (JEM-style: cross-entropy, a contrastive term with `client_sgld_steps` Langevin steps of size
    `client_sgld_step` and noise `client_sgld_noise` from the synthetic points, and
    `synthetic_ce_weight` times the cross-entropy on them) and sends, per synthetic point, the
    input gradient of its energy clipped to `gradient_clip` and exp(-sign of the energy). The
    classifier the silos evaluate is the policy's model trained on the synthetic set alone
    (`classifier_epochs` of Adam at `classifier_lr`)."""

    reports: ClassVar[frozenset[str]] = SAMPLE_WEIGHTED
    averages: ClassVar[bool] = True  # the two sums of the mixture gradient
    name: Literal["fedevg"]
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    samples_per_class: int = Field(default=10, ge=1)
    energy: Literal["joint", "marginal"] = "joint"
    server_step_max: float = Field(default=10.0, gt=0)
    server_step_min: float = Field(default=1.0, gt=0)
    server_noise: float = Field(default=1e-4, ge=0)
    server_noise_scale: float | None = Field(default=None, ge=0)
    client_sgld_steps: int = Field(default=1, ge=0)
    client_sgld_step: float = Field(default=1.0, ge=0)
    client_sgld_noise: float = Field(default=0.01, ge=0)
    gradient_clip: float = Field(default=3.0, gt=0)
    synthetic_ce_weight: float = Field(default=0.1, ge=0)
    spectral_norm: bool = True
    persist_local_model: bool = False
    classifier_epochs: int = Field(default=100, ge=1)
    classifier_lr: float = Field(default=1e-3, gt=0, le=MAX_LR)
    classifier_batch_size: int = Field(default=64, ge=1)
    image_every: int = Field(default=10, ge=1)


class FedDcConfig(PolicyModel):
    """FedDC (Kamp et al. 2023): every round is one local step; every `daisy_period` rounds the
    sampled silos' models move to a random permutation of them, every `aggregation_period`
    rounds they are aggregated (`mean`, or the iterated Radon point of height
    `radon_iterations`) and sent back. None: never (daisy chaining only, or FedAvg with
    `aggregation_period` local steps). `permutation`: `uniform` (fixed points allowed, as the
    paper) or `derangement`; `no_return_window` L: a model never returns to a silo that held
    it in its last L hops (a return would hand the silo its recipient's exact update)."""

    reports: ClassVar[frozenset[str]] = SAMPLE_WEIGHTED
    name: Literal["feddc"]
    daisy_period: int | None = Field(default=1, ge=1)
    aggregation_period: int | None = Field(default=10, ge=1)
    aggregator: Literal["mean", "radon"] = "mean"
    radon_iterations: int = Field(default=1, ge=1)
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    prox_mu: float = Field(default=0.0, ge=0)
    permutation: Literal["uniform", "derangement"] = "uniform"
    no_return_window: int = Field(default=0, ge=0)

    @property
    def averages(self) -> bool:  # type: ignore[override]
        """Aggregation rounds take a mean (secure aggregation applies); Radon needs every model."""
        return self.aggregator == "mean"

    def is_aggregation(self, step: int) -> bool:
        """Local step `step` (0-based) ends with an aggregation."""
        return self.aggregation_period is not None and (step + 1) % self.aggregation_period == 0

    def is_daisy(self, step: int) -> bool:
        """Local step `step` ends with a hand-off (never when it also aggregates)."""
        return (
            self.daisy_period is not None
            and (step + 1) % self.daisy_period == 0
            and not self.is_aggregation(step)
        )


AlgorithmConfig = Annotated[
    FedAvgConfig
    | FedProxConfig
    | FedOptConfig
    | CentralConfig
    | LocalConfig
    | FedDcConfig
    | MixingAlgorithmConfig
    | ApproxFedAvgConfig
    | SuperFedConfig
    | FedEvgConfig,
    Field(discriminator="name"),
]
