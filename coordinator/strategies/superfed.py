"""SuPerFed (Hahn et al. 2022; docs/algorithms/superfed.md): personalised federated learning
through a connected low-loss subspace.

The coordinator runs FedAvg's round, every federated tensor sample-weighted (biases
too, which the reference code leaves out), so secure aggregation and DP-SGD apply unchanged;
only the task differs: `superfed_train` with the round's mixing settings, mixing on from round
floor(L T) + 1. Each silo keeps its local model itself (silo/tasks/superfed.py); the
coordinator never sees it. Evaluation asks every silo for `superfed_evaluate`: the global
model mixed with its local model over the lambda grid, reported at the lambda the silo's
validation split chooses.
"""

from __future__ import annotations

from typing import Any

from fedsilo.coordinator.phases import Phase, Task
from fedsilo.coordinator.strategies.base import EvaluationScript, RoundContext, ServerState
from fedsilo.coordinator.strategies.fedavg import FedAvg
from fedsilo.policies.algorithms import SuperFedConfig
from fedsilo.policies.algorithms.contract import Position
from fedsilo.wire.tasks import TaskConfig
from fedsilo.wire.tasks.tensor_names import MODEL


class SuperFed(FedAvg):
    """Personalised FL: a private local model mixed with the federated one (Hahn et al. 2022)."""

    name = "superfed"

    @property
    def config(self) -> SuperFedConfig:  # type: ignore[override]
        return self.policy.algorithm  # type: ignore[return-value]

    def train_config(self, position: Position, **chosen: Any) -> TaskConfig:
        return self.config.train_config(self.policy, position)

    def evaluate(self, state: ServerState, ctx: RoundContext) -> EvaluationScript:
        tasks = tuple(
            Task(
                s,
                self.config.evaluate_config(self.policy, Position(ctx.round, "evaluate", s)),
                {MODEL: state.model},
                state.spec,
            )
            for s in ctx.silos
        )
        return (yield Phase("evaluate", tasks, quorum=1))
