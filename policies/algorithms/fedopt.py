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

    # the server's step size: how far each round's adaptive step moves the global model (0.1 by
    # default)
    server_lr: float = Field(default=0.1, gt=0, le=MAX_LR)
    # decay of the first moment (the running mean of the round-to-round updates); 0.9 by default, 0
    # uses only the latest update
    beta1: float = Field(default=0.9, ge=0, lt=1)
    # decay of the second moment (the running mean of squared updates) of fedadam and fedyogi;
    # fedadagrad sums them instead (0.99 by default)
    beta2: float = Field(default=0.99, ge=0, lt=1)
    # the adaptivity floor added to the square root of the second moment, so a coordinate that
    # barely moves takes no huge step; also sets the initial second moment tau^2 (0.001 by default)
    tau: float = Field(default=1e-3, gt=0)


class ServerOptimizerConfig(ServerStepSettings):
    """A server optimiser plugged into another algorithm's mean (`name`: which step)."""

    # which adaptive server step to apply: fedadam, fedyogi or fedadagrad
    name: ServerOptimizerName


class FedOptConfig(AveragingConfig, ServerStepSettings):
    """FedAdam / FedYogi / FedAdagrad (Reddi et al.): an adaptive step on the mean update."""

    clips_updates: ClassVar[bool] = True
    # selects FedAvg with an adaptive server step: fedadam, fedyogi or fedadagrad (Reddi et al.),
    # each treating the round's mean update as a gradient
    name: ServerOptimizerName
    # the share of the consortium's silos asked to train each round, drawn at random (at least
    # participants.min_silos); 1 (the default): every silo, every round
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    # weight mu of a proximal term (mu/2)||w - w_global||^2 added to each silo's local loss; 0 (the
    # default): none
    prox_mu: float = Field(default=0.0, ge=0)
