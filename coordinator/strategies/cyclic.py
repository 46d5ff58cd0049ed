"""Cyclic weight transfer (Chang et al. 2018; FLamby's `Cyclic`; docs/algorithms/cyclic.md).

A round is one cycle: the model visits every active silo once, in a seeded order drawn from
(seed, round) (`deterministic_cycle`: the sorted silos), so a resumed run makes the same cycle.
Each visit is one phase of one `daisy_train` task: the first silo adopts the round's model,
the others train the model handed to them, and each hands it on to the next through the
engine's sealed hand-offs (`route`, coordinator/routing.py), which the coordinator relays
without reading them. The last silo sends its model to the coordinator: the round's model,
which starts the next round and which evaluation measures on every silo's test split, as
FedAvg's global model. A visit whose hand-off is not delivered abandons the round (the state
stays the round's start), so no silo trains a model other than the one the cycle brought.
"""

from __future__ import annotations

from dataclasses import replace

from fedsilo.coordinator.phases import Phase, QuorumNotMet, Task
from fedsilo.coordinator.strategies.base import (
    RoundContext,
    RoundScript,
    ServerState,
    Strategy,
)
from fedsilo.policies.algorithms import CyclicConfig
from fedsilo.wire.tasks import DaisyTrain, TrainTask
from fedsilo.wire.tasks.tensor_names import MODEL


class Cyclic(Strategy):
    """One model trained by every silo in turn, a seeded order per round (Chang et al. 2018)."""

    name = "cyclic"

    @property
    def config(self) -> CyclicConfig:
        return self.policy.algorithm  # type: ignore[return-value]

    def cycle(self, ctx: RoundContext) -> tuple[str, ...]:
        """The round's order of visits: a permutation of the active silos drawn from (seed,
        round), or their sorted order under `deterministic_cycle`."""
        silos = tuple(sorted(ctx.silos))
        if self.config.deterministic_cycle:
            return silos
        return tuple(silos[i] for i in ctx.rng("cycle").permutation(len(silos)))

    def round(self, state: ServerState, ctx: RoundContext) -> RoundScript:
        order = self.cycle(ctx)
        for step, silo in enumerate(order):
            first, last = step == 0, step == len(order) - 1
            base = self.train_task(silo, state.model, state.spec, ctx)
            assert isinstance(base.config, TrainTask)
            config = DaisyTrain(train=base.config, adopt=first, send=last)
            task = Task(silo, config, {MODEL: state.model} if first else {}, state.spec)
            if last:
                out = yield Phase(f"visit_{step}", (task,), quorum=1)
                if silo not in out.tensors:
                    raise QuorumNotMet(
                        f"cyclic: the last silo of the cycle, {silo!r}, sent no model",
                        out.phase,
                        out.reports,
                        out.dropped,
                    )
                return replace(state, tensors={**state.tensors, MODEL: out.tensors[silo][MODEL]})
            route = {silo: order[step + 1]}
            out = yield Phase(f"visit_{step}", (task,), route=route)
            if dict(out.routes) != route:
                raise QuorumNotMet(
                    f"cyclic: the model did not reach {order[step + 1]!r} from {silo!r}; the "
                    "round is abandoned",
                    out.phase,
                    out.reports,
                    out.dropped,
                )
        raise AssertionError("a cycle visits at least one silo")
