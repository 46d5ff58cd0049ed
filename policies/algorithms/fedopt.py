"""FedAdam, FedYogi and FedAdagrad: FedAvg with an adaptive server step; the step's settings
(`ServerStepSettings`) are shared with schedules that plug a server optimiser in (AAggFF's
`server_optimizer`)."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from fedsilo.policies.algorithms.fedavg import AveragingConfig
from fedsilo.policies.base import PolicyModel
from fedsilo.policies.training import MAX_LR

ServerOptimizerName = Literal["fedadam", "fedyogi", "fedadagrad"]


class ServerStepSettings(PolicyModel):
    """An adaptive server step's settings (Reddi et al. 2021): step size, moment decays and
    the adaptivity floor tau."""

    server_lr: float = Field(default=0.1, gt=0, le=MAX_LR)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.99, ge=0, lt=1)
    tau: float = Field(default=1e-3, gt=0)


class ServerOptimizerConfig(ServerStepSettings):
    """A server optimiser plugged into another algorithm's mean (`name`: which step)."""

    name: ServerOptimizerName


class FedOptConfig(AveragingConfig, ServerStepSettings):
    """FedAdam / FedYogi / FedAdagrad (Reddi et al.): an adaptive step on the mean update."""

    clips_updates: ClassVar[bool] = True
    name: ServerOptimizerName
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    prox_mu: float = Field(default=0.0, ge=0)
