"""FedAvg (McMahan et al. 2017), FedProx (Li et al. 2020) and ApproxFedAvg (the survey's
proposal): docs/algorithms/fedavg.md, fedprox.md and approx_fedavg.md.

Each round a seeded fraction C of the silos trains from the global model; the new global
model is the sample-weighted mean of their models. FedProx adds (mu/2)||w - w_global||^2 to
each silo's local objective and is otherwise the same round. ApproxFedAvg is FedAvg's round
whose silos minimise, on every minibatch, the log-sum-exp of their domains' losses at the
policy's temperature (silo/domains.py); the coordinator mixes with the sample counts (beta_k =
n_k) and keeps no lambda.

Under client-level DP the engine runs this round's mean as DP-FedAvg (McMahan et al. 2018),
so the strategy sees only the noised mean, as FedOpt's server step does. With
`algorithm.robust` the engine combines the models in the clear by that rule instead of their
mean (docs/robust-aggregation.md), and the server step takes the combination as the mean.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fedsilo.coordinator.phases import Phase, WeightedMean
from fedsilo.coordinator.strategies.base import (
    RoundContext,
    RoundScript,
    ServerState,
    Strategy,
)
from fedsilo.policies.algorithms import ApproxFedAvgConfig, FedAvgConfig, FedProxConfig
from fedsilo.policies.algorithms.fedavg import AveragingConfig
from fedsilo.policies.algorithms.robust import RobustRuleBase
from fedsilo.policies.algorithms.server_step import initial_state, server_step
from fedsilo.wire.tasks.tensor_names import MODEL


class FedAvg(Strategy):
    """Sample-weighted mean of the sampled silos' models (McMahan et al. 2017)."""

    name = "fedavg"

    @property
    def config(self) -> FedAvgConfig | FedProxConfig | ApproxFedAvgConfig:
        return self.policy.algorithm  # type: ignore[return-value]

    def round(self, state: ServerState, ctx: RoundContext) -> RoundScript:
        chosen = self.sample_silos(ctx)
        tasks = tuple(self.train_task(s, state.model, state.spec, ctx) for s in chosen)
        combined = WeightedMean((MODEL,), robust=self.robust)
        out = yield Phase("train", tasks, aggregate=combined)
        return replace(state, tensors=self.server_update(state, out.mean[MODEL]))

    @property
    def robust(self) -> RobustRuleBase | None:
        """The robust rule the round combines the models with (`algorithm.robust` of an
        algorithm of FedAvg's round), or None: their weighted mean."""
        algorithm = self.policy.algorithm
        return algorithm.robust if isinstance(algorithm, AveragingConfig) else None

    def setup(self, ctx: RoundContext) -> RoundScript:
        state = yield from super().setup(ctx)
        return replace(state, tensors=initial_state(self.policy.algorithm, state.model))

    def server_update(self, state: ServerState, mean: torch.Tensor) -> dict[str, torch.Tensor]:
        """The server optimiser (policies/algorithms/server_step.py): for FedAvg, SGD with step
        1 on mean - x, i.e. x = mean; FedOpt's adaptive step; the same one its silos repeat
        under model lineage."""
        return server_step(self.policy.algorithm, state.tensors, {MODEL: mean})


class FedProx(FedAvg):
    """FedAvg with the proximal term (mu/2)||w - w_global||^2 locally (Li et al. 2020)."""

    name = "fedprox"


class ApproxFedAvg(FedAvg):
    """FedAvg whose silos train on a soft maximum over their domains' losses (survey §V); the
    temperature and reduction travel in its train tasks (`ApproxFedAvgConfig.train_options`)."""

    name = "approx_fedavg"
