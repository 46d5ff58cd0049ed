"""The `algorithm:` section: which strategy runs, with its own parameters."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field

from fedsilo.policies.base import PolicyModel

# Every algorithm evaluates on the silos' held-out data, and weights silos by sample counts.
SAMPLE_WEIGHTED: frozenset[str] = frozenset({"counts", "metrics"})


class FedAvgConfig(PolicyModel):
    """FedAvg (McMahan et al.): sample-weighted mean of the sampled silos' models."""

    reports: ClassVar[frozenset[str]] = SAMPLE_WEIGHTED  # report kinds it cannot run without
    averages: ClassVar[bool] = True  # one aggregate of models: client DP, secure aggregation
    name: Literal["fedavg"]
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    prox_mu: float = Field(default=0.0, ge=0)


class FedProxConfig(PolicyModel):
    """FedProx (Li et al.): FedAvg with the proximal term (mu/2)||w - w_global||^2 locally."""

    reports: ClassVar[frozenset[str]] = SAMPLE_WEIGHTED
    averages: ClassVar[bool] = True
    name: Literal["fedprox"]
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    prox_mu: float = Field(default=0.1, gt=0)


class FedOptConfig(PolicyModel):
    """FedAdam / FedYogi / FedAdagrad (Reddi et al.): an adaptive step on the mean update."""

    reports: ClassVar[frozenset[str]] = SAMPLE_WEIGHTED
    averages: ClassVar[bool] = True
    name: Literal["fedadam", "fedyogi", "fedadagrad"]
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    prox_mu: float = Field(default=0.0, ge=0)
    server_lr: float = Field(default=0.1, gt=0)
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


AlgorithmConfig = Annotated[
    FedAvgConfig | FedProxConfig | FedOptConfig | CentralConfig | LocalConfig,
    Field(discriminator="name"),
]
