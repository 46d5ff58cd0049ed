"""Adaptive federated optimisation (Reddi et al. 2021): FedAdagrad, FedAdam, FedYogi.

The silos run the FedAvg round (FedOpt extends FedAvg); the server treats
Delta = mean(models) - x as a pseudo-gradient and takes a per-coordinate adaptive step
(docs/algorithms/fedadam.md):

    m  = beta1 m + (1 - beta1) Delta
    v  = v + Delta^2                                   (Adagrad)
    v  = beta2 v + (1 - beta2) Delta^2                 (Adam)
    v  = v - (1 - beta2) Delta^2 sign(v - Delta^2)     (Yogi)
    x  = x + server_lr * m / (sqrt(v) + tau),          m_0 = 0, v_0 = tau^2

The step itself (`with_moments`, `adaptive_step`) is shared: AAggFF's `server_optimizer`
applies it to its own mixed mean (docs/algorithms/aaggff.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace

import torch

from fedsilo.coordinator.strategies.base import RoundContext, RoundScript, ServerState
from fedsilo.coordinator.strategies.fedavg import FedAvg
from fedsilo.policies.algorithms import FedOptConfig
from fedsilo.policies.algorithms.fedopt import ServerStepSettings
from fedsilo.wire.tasks.tensor_names import MODEL

FIRST_MOMENT, SECOND_MOMENT = "m", "v"  # the server optimiser's state in ServerState.tensors

SecondMoment = Callable[[ServerStepSettings, torch.Tensor, torch.Tensor], torch.Tensor]
SECOND_MOMENTS: dict[str, SecondMoment] = {
    "fedadagrad": lambda c, v, delta_sq: v + delta_sq,
    "fedadam": lambda c, v, delta_sq: c.beta2 * v + (1 - c.beta2) * delta_sq,
    "fedyogi": lambda c, v, delta_sq: v - (1 - c.beta2) * delta_sq * torch.sign(v - delta_sq),
}


def with_moments(tensors: Mapping[str, torch.Tensor], tau: float) -> dict[str, torch.Tensor]:
    """`tensors` with the optimiser's initial moments beside MODEL: m_0 = 0, v_0 = tau^2."""
    zeros = torch.zeros_like(tensors[MODEL])
    return {
        **tensors,
        FIRST_MOMENT: zeros,
        SECOND_MOMENT: torch.full_like(zeros, tau**2),
    }


def adaptive_step(
    name: str,
    settings: ServerStepSettings,
    tensors: Mapping[str, torch.Tensor],
    mean: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """One `name` step (fedadam, fedyogi, fedadagrad) from MODEL and its moments in `tensors`
    towards `mean`: the new MODEL, m and v (other tensors kept)."""
    c = settings
    x, m, v = tensors[MODEL], tensors[FIRST_MOMENT], tensors[SECOND_MOMENT]
    delta = mean - x
    m = c.beta1 * m + (1 - c.beta1) * delta
    v = SECOND_MOMENTS[name](c, v, delta * delta)
    x = x + c.server_lr * m / (v.sqrt() + c.tau)
    return {**tensors, MODEL: x, FIRST_MOMENT: m, SECOND_MOMENT: v}


class FedOpt(FedAvg):
    @property
    def config(self) -> FedOptConfig:
        return self.policy.algorithm  # type: ignore[return-value]

    def setup(self, ctx: RoundContext) -> RoundScript:
        state = yield from super().setup(ctx)
        return replace(state, tensors=with_moments({MODEL: state.model}, self.config.tau))

    def server_update(self, state: ServerState, mean: torch.Tensor) -> dict[str, torch.Tensor]:
        return adaptive_step(self.name, self.config, state.tensors, mean)


class FedAdagrad(FedOpt):
    """Adagrad server step on the mean update (Reddi et al. 2021)."""

    name = "fedadagrad"


class FedAdam(FedOpt):
    """Adam server step on the mean update (Reddi et al. 2021)."""

    name = "fedadam"


class FedYogi(FedOpt):
    """Yogi server step on the mean update (Reddi et al. 2021)."""

    name = "fedyogi"
