"""The two references every experiment needs: `central` (one model trained on the pooled union
of the silos' training data, the gold standard) and `local` (each silo alone).

Both are simulation references. `central` needs a silo that holds the pooled data, which only
a simulation can build; `local` keeps every silo's model on the coordinator, which is fine for
a baseline run in one process and never what a deployment should do.
"""

from __future__ import annotations

from dataclasses import replace

from fedsilo.coordinator.phases import Phase
from fedsilo.coordinator.strategies.base import (
    EvaluationScript,
    RoundContext,
    RoundScript,
    ServerState,
    Strategy,
)
from fedsilo.policies.schema import Policy
from fedsilo.wire.tasks.tensor_names import MODEL

POOLED_SILO = "pooled"


class Central(Strategy):
    """Reference: one model trained on the pooled silos' training data."""

    name = "central"
    requires_pooled_silo = True

    def __init__(self, policy: Policy, pooled_silo: str = POOLED_SILO) -> None:
        super().__init__(policy)
        self.pooled_silo = pooled_silo

    def data_silos(self, ctx: RoundContext) -> tuple[str, ...]:
        return (*ctx.silos, self.pooled_silo)

    def round(self, state: ServerState, ctx: RoundContext) -> RoundScript:
        out = yield Phase(
            "train", (self.train_task(self.pooled_silo, state.model, state.spec, ctx),)
        )
        return replace(state, tensors={MODEL: out.tensors[self.pooled_silo][MODEL]})


class Local(Strategy):
    """Reference: each silo trains alone and is evaluated with its own model."""

    name = "local"

    def setup(self, ctx: RoundContext) -> RoundScript:
        state = yield from super().setup(ctx)
        return replace(state, tensors={self.key(s): state.model for s in ctx.silos})

    def round(self, state: ServerState, ctx: RoundContext) -> RoundScript:
        tasks = tuple(
            self.train_task(s, state.tensors[self.key(s)], state.spec, ctx) for s in ctx.silos
        )
        out = yield Phase("train", tasks)
        trained = {self.key(s): tensors[MODEL] for s, tensors in out.tensors.items()}
        return replace(state, tensors={**state.tensors, **trained})

    def evaluate(self, state: ServerState, ctx: RoundContext) -> EvaluationScript:
        tasks = tuple(
            self.evaluate_task(s, state.tensors[self.key(s)], state.spec) for s in ctx.silos
        )
        return (yield Phase("evaluate", tasks, quorum=1))

    @staticmethod
    def key(silo: str) -> str:
        return f"{MODEL}/{silo}"
