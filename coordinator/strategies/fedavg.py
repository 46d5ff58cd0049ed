"""FedAvg (McMahan et al. 2017), FedProx (Li et al. 2020) and ApproxFedAvg (the survey's
proposal, spec robust-and-daisy-chain.md §7).

Each round a seeded fraction C of the silos trains from the global model; the new global
model is the sample-weighted mean of their models. FedProx adds (mu/2)||w - w_global||^2 to
each silo's local objective and is otherwise the same round. ApproxFedAvg is FedAvg's round
whose silos minimise, on every minibatch, the log-sum-exp of their domains' losses at the
policy's temperature (silo/domains.py); the coordinator mixes with the sample counts (beta_k =
n_k) and keeps no lambda.

With `privacy.client_dp` the round is DP-FedAvg (McMahan et al. 2018): silos clip their
updates, the mean weighs them equally, and coordinator/client_dp.py makes the aggregate's noise
whole and books the round's epsilon in the state. FedOpt inherits it: its server step then
takes the noised mean.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch

from fedsilo.coordinator.client_dp import STATE_KEY, ClientDp
from fedsilo.coordinator.phases import Phase, WeightedMean
from fedsilo.coordinator.strategies.base import (
    MODEL,
    RoundContext,
    RoundScript,
    ServerState,
    Strategy,
)
from fedsilo.policies.algorithms import ApproxFedAvgConfig, FedAvgConfig, FedProxConfig


class FedAvg(Strategy):
    """Sample-weighted mean of the sampled silos' models (McMahan et al. 2017)."""

    name = "fedavg"

    @property
    def config(self) -> FedAvgConfig | FedProxConfig | ApproxFedAvgConfig:
        return self.policy.algorithm  # type: ignore[return-value]

    def round(self, state: ServerState, ctx: RoundContext) -> RoundScript:
        chosen = self.sample_silos(ctx)
        mu = self.config.prox_mu
        if self.policy.privacy.client_dp is None:
            tasks = tuple(self.train_task(s, state.model, state.spec, ctx, mu) for s in chosen)
            out = yield Phase("train", tasks, aggregate=WeightedMean((MODEL,)))
            return replace(state, tensors=self.server_update(state, out.mean[MODEL]))
        dp = ClientDp(self.policy)
        tasks = tuple(
            self.train_task(s, state.model, state.spec, ctx, mu, dp.task_config(chosen))
            for s in chosen
        )
        out = yield Phase("train", tasks, aggregate=WeightedMean((MODEL,), dp.weights(chosen)))
        mean = dp.noised_mean(
            out.mean[MODEL], len(out.answered), len(chosen), ctx.private_generator("client-dp")
        )
        booked = dp.booked(state.extra, asked=len(chosen), active=len(ctx.silos))
        return replace(
            state,
            tensors=self.server_update(state, mean),
            extra={**state.extra, STATE_KEY: booked},
        )

    def server_update(self, state: ServerState, mean: torch.Tensor) -> dict[str, torch.Tensor]:
        """The server optimiser: for FedAvg, SGD with step 1 on mean - x, i.e. x = mean."""
        return {**state.tensors, MODEL: mean}


class FedProx(FedAvg):
    """FedAvg with the proximal term (mu/2)||w - w_global||^2 locally (Li et al. 2020)."""

    name = "fedprox"


class ApproxFedAvg(FedAvg):
    """FedAvg whose silos train on a soft maximum over their domains' losses (survey §V)."""

    name = "approx_fedavg"

    def train_settings(self, silo: str, ctx: RoundContext) -> Mapping[str, Any]:
        mixing = self.policy.mixing
        return {
            "domain_temperature": mixing.temperature,
            "domain_reduction": mixing.domain_reduction,
        }
