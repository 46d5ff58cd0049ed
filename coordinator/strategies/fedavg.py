"""FedAvg (McMahan et al. 2017) and FedProx (Li et al. 2020).

Each round a seeded fraction C of the silos trains from the global model; the new global
model is the sample-weighted mean of their models. FedProx adds (mu/2)||w - w_global||^2 to
each silo's local objective and is otherwise the same round.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fedsilo.coordinator.phases import Phase, WeightedMean
from fedsilo.coordinator.strategies.base import (
    MODEL,
    RoundContext,
    RoundScript,
    ServerState,
    Strategy,
)
from fedsilo.policies.algorithms import FedAvgConfig, FedProxConfig


class FedAvg(Strategy):
    name = "fedavg"

    @property
    def config(self) -> FedAvgConfig | FedProxConfig:
        return self.policy.algorithm  # type: ignore[return-value]

    def round(self, state: ServerState, ctx: RoundContext) -> RoundScript:
        chosen = self.sample_silos(ctx, self.config.client_fraction)
        tasks = tuple(
            self.train_task(s, state.model, state.spec, ctx, prox_mu=self.config.prox_mu)
            for s in chosen
        )
        out = yield Phase("train", tasks, aggregate=WeightedMean((MODEL,)))
        return replace(state, tensors=self.server_update(state, out.mean[MODEL]))

    def server_update(self, state: ServerState, mean: torch.Tensor) -> dict[str, torch.Tensor]:
        """The server optimiser: for FedAvg, SGD with step 1 on mean - x, i.e. x = mean."""
        return {**state.tensors, MODEL: mean}


class FedProx(FedAvg):
    name = "fedprox"
