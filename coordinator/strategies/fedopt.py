"""Adaptive federated optimisation (Reddi et al. 2021): FedAdagrad, FedAdam, FedYogi.

The silos run the FedAvg round (FedOpt extends FedAvg); the server treats
Delta = mean(models) - x as a pseudo-gradient and takes a per-coordinate adaptive step
(docs/algorithms/fedadam.md):

    m  = beta1 m + (1 - beta1) Delta
    v  = v + Delta^2                                   (Adagrad)
    v  = beta2 v + (1 - beta2) Delta^2                 (Adam)
    v  = v - (1 - beta2) Delta^2 sign(v - Delta^2)     (Yogi)
    x  = x + server_lr * m / (sqrt(v) + tau),          m_0 = 0, v_0 = tau^2
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fedsilo.coordinator.strategies.base import RoundContext, RoundScript, ServerState
from fedsilo.coordinator.strategies.fedavg import FedAvg
from fedsilo.policies.algorithms import FedOptConfig
from fedsilo.wire.tasks.tensor_names import MODEL


class FedOpt(FedAvg):
    @property
    def config(self) -> FedOptConfig:
        return self.policy.algorithm  # type: ignore[return-value]

    def setup(self, ctx: RoundContext) -> RoundScript:
        state = yield from super().setup(ctx)
        zeros = torch.zeros_like(state.model)
        return replace(
            state,
            tensors={
                MODEL: state.model,
                "m": zeros,
                "v": torch.full_like(zeros, self.config.tau**2),
            },
        )

    def server_update(self, state: ServerState, mean: torch.Tensor) -> dict[str, torch.Tensor]:
        c = self.config
        x, m, v = state.model, state.tensors["m"], state.tensors["v"]
        delta = mean - x
        m = c.beta1 * m + (1 - c.beta1) * delta
        v = self.second_moment(v, delta * delta)
        x = x + c.server_lr * m / (v.sqrt() + c.tau)
        return {MODEL: x, "m": m, "v": v}

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class FedAdagrad(FedOpt):
    """Adagrad server step on the mean update (Reddi et al. 2021)."""

    name = "fedadagrad"

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        return v + delta_sq


class FedAdam(FedOpt):
    """Adam server step on the mean update (Reddi et al. 2021)."""

    name = "fedadam"

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        return self.config.beta2 * v + (1 - self.config.beta2) * delta_sq


class FedYogi(FedOpt):
    """Yogi server step on the mean update (Reddi et al. 2021)."""

    name = "fedyogi"

    def second_moment(self, v: torch.Tensor, delta_sq: torch.Tensor) -> torch.Tensor:
        return v - (1 - self.config.beta2) * delta_sq * torch.sign(v - delta_sq)
