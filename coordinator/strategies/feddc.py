"""FedDC: federated daisy chaining (Kamp, Fischer and Vreeken, ICLR 2023; docs/algorithms/feddc.md).

Every round is one round of local training (`training.steps`; the paper's one minibatch step)
on the model each silo hosts. When round t (0-based) ends an aggregation period
((t+1) mod b = 0) the sampled silos send their models and the coordinator aggregates them,
with the unweighted mean (secure aggregation applies) or the iterated Radon point (individual
models, for convex models); the aggregate goes back to those silos with their next task. When
it ends a daisy period instead ((t+1) mod d = 0, aggregation taking priority), the sampled
silos' models move along a random permutation, sealed to their recipients when
`channel.sealed_handoffs` is on (coordinator/routing.py relays and delivers; a sealed
model whose recipient dropped stays with its sender). Silos that are not sampled keep training
what they host.
Daisy chaining alone (`aggregation_period: null`) and FedAvg with b local steps
(`daisy_period: null`) come out of the same round.

Silos host their models (silo/tasks/daisy.py); the coordinator's state holds the last
aggregate, which silos must adopt next (those asked to aggregate, and a silo that missed it
until it takes part again), and, for `no_return_window`, each hosted model's last holders: the
silos it was handed on from, and those its host sealed it to while keeping it (a sender keeps
its model until one arrives for it), as each silo counts them itself (silo/contract_gate.py
refuses a hand-off to one of them).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from fedsilo.coordinator.phases import (
    Phase,
    PhaseOutcome,
    QuorumNotMet,
    SiloReport,
    Task,
    WeightedMean,
)
from fedsilo.coordinator.radon import iterated_radon_point, radon_height, radon_number
from fedsilo.coordinator.strategies.base import (
    EvaluationScript,
    RoundContext,
    RoundScript,
    ServerState,
    Strategy,
)
from fedsilo.policies.algorithms import FedDcConfig
from fedsilo.wire.tasks import DaisyEvaluate, DaisyTrain, TrainTask
from fedsilo.wire.tasks.tensor_names import MODEL

log = logging.getLogger(__name__)

ADOPT = "adopt"  # state.extra: silos that must adopt the aggregate with their next task
LINEAGE = "lineage"  # state.extra: hosting silo -> the model's previous holders, latest first
PERMUTATION_TRIES = 1000


class FedDC(Strategy):
    """Daisy chaining with mean or Radon-point aggregation (Kamp et al. 2023)."""

    name = "feddc"

    @property
    def config(self) -> FedDcConfig:
        return self.policy.algorithm  # type: ignore[return-value]

    def round(self, state: ServerState, ctx: RoundContext) -> RoundScript:
        step = ctx.round - 1
        adopt = set(state.extra.get(ADOPT, ctx.silos))
        lineage: dict[str, list[str]] = {
            k: list(v) for k, v in state.extra.get(LINEAGE, {}).items()
        }
        if self.config.is_aggregation(step):
            sampled = self.sample_silos(ctx)
            rest = [s for s in ctx.silos if s not in sampled]
            if rest:
                out = yield Phase("local", tuple(self._task(s, state, ctx, adopt) for s in rest))
                lineage = _adopted(lineage, adopt, out)
                adopt -= set(out.answered)
            tasks = tuple(self._task(s, state, ctx, adopt, send=True) for s in sampled)
            if self.config.aggregator == "mean":
                weights = dict.fromkeys(sampled, 1.0)  # unweighted, as the paper
                # each hosted model is summed relative to the last aggregate
                mean = WeightedMean((MODEL,), weights, references={MODEL: state.model})
                out = yield Phase("aggregate", tasks, aggregate=mean)
                model = out.mean[MODEL]
            else:
                out = yield Phase("aggregate", tasks)
                model = self._radon(out, ctx)
            extra = {**state.extra, ADOPT: sorted((adopt - set(out.answered)) | set(sampled))}
            extra[LINEAGE] = _adopted(lineage, adopt, out)  # the sampled adopt with their next task
            return replace(state, tensors={**state.tensors, MODEL: model}, extra=extra)
        if self.config.is_daisy(step):
            sampled = self.sample_silos(ctx)
            # a silo told to adopt hands on the aggregate, which it adopts first
            route = self._permutation(sampled, _adopted(lineage, adopt), ctx)
            tasks = tuple(self._task(s, state, ctx, adopt) for s in ctx.silos)
            out = yield Phase("daisy", tasks, route=route)
            held = _adopted(lineage, adopt, out)
            # a sender keeps hosting what it sealed until a model arrives for it: its recipient
            # holds a copy, as the sender itself notes (silo/tasks/daisy.py)
            received = set(out.routes.values())
            kept = {s: [r, *held.get(s, [])] for s, r in route.items()
                    if s in out.reports and s not in received}  # fmt: skip
            moved = {r: [s, *held.get(s, [])] for s, r in out.routes.items()}
            window = self.config.no_return_window
            lineage = {s: h[:window] for s, h in (held | kept | moved).items() if window}
        else:
            out = yield Phase("local", tuple(self._task(s, state, ctx, adopt) for s in ctx.silos))
            lineage = _adopted(lineage, adopt, out)
        extra = {**state.extra, ADOPT: sorted(adopt - set(out.answered)), LINEAGE: lineage}
        return replace(state, extra=extra)

    def evaluate(self, state: ServerState, ctx: RoundContext) -> EvaluationScript:
        """The hosted (local) models on test and train splits, prefixed `local_`, and the
        last aggregate likewise (unprefixed; `train_` for the train split), so overfitting
        between aggregations shows. Without aggregation the local models are the result."""
        outcomes: list[tuple[str, PhaseOutcome]] = []
        aggregates = self.config.aggregation_period is not None
        for split in ("test", "train"):
            prefix = "" if split == "test" else "train_"
            tasks = tuple(Task(s, DaisyEvaluate(split=split), spec=state.spec) for s in ctx.silos)
            local = yield Phase(f"evaluate_local_{split}", tasks, quorum=1)
            outcomes.append((("local_" if aggregates else "") + prefix, local))
            if aggregates:
                tasks = tuple(
                    self.evaluate_task(s, state.model, state.spec, split) for s in ctx.silos
                )
                outcomes.append((prefix, (yield Phase(f"evaluate_{split}", tasks, quorum=1))))
        return _merged(outcomes)

    def _task(
        self,
        silo: str,
        state: ServerState,
        ctx: RoundContext,
        adopt: set[str],
        send: bool = False,
    ) -> Task:
        """One round of local training of what `silo` hosts (after adopting the aggregate
        when it must); `send`: the result goes to the coordinator."""
        base = self.train_task(silo, state.model, state.spec, ctx)
        assert isinstance(base.config, TrainTask)
        adopting = silo in adopt
        config = DaisyTrain(train=base.config, adopt=adopting, send=send)
        tensors = {MODEL: state.model} if adopting else {}
        return Task(silo, config, tensors, state.spec)

    def _permutation(
        self, sampled: tuple[str, ...], lineage: dict[str, list[str]], ctx: RoundContext
    ) -> dict[str, str]:
        """sender -> recipient over the sampled silos (fixed points keep their model), drawn
        until it is a derangement when asked and sends no model back to a recent holder."""
        rng = ctx.rng("daisy")
        silos = list(sampled)
        for _ in range(PERMUTATION_TRIES):
            image = [silos[i] for i in rng.permutation(len(silos))]
            route = dict(zip(silos, image, strict=True))
            if self._allowed(route, lineage):
                return {s: r for s, r in route.items() if s != r}
        raise RuntimeError(
            f"no permutation of {len(silos)} silos satisfies permutation="
            f"{self.config.permutation!r} and no_return_window={self.config.no_return_window} "
            f"in {PERMUTATION_TRIES} draws; lower the window or sample more silos"
        )

    def _allowed(self, route: dict[str, str], lineage: dict[str, list[str]]) -> bool:
        if self.config.permutation == "derangement" and any(s == r for s, r in route.items()):
            return False
        return not any(r in lineage.get(s, []) for s, r in route.items())

    def _radon(self, out: PhaseOutcome, ctx: RoundContext) -> torch.Tensor:
        """The iterated Radon point of r^h of the models, drawn at random."""
        models = {s: t[MODEL] for s, t in out.tensors.items()}
        dim = next(iter(models.values())).numel()
        r = radon_number(dim)
        if len(models) < r:  # too few answered: the round fails, as one below its quorum
            raise QuorumNotMet(
                f"algorithm.aggregator: the Radon point of models of {dim} parameters takes "
                f"r = d + 2 = {r} of them, and {len(models)} answered",
                out.phase,
                out.reports,
                out.dropped,
            )
        height = min(self.config.radon_iterations, radon_height(len(models), dim))
        order = sorted(models)
        chosen = [order[i] for i in ctx.rng("radon").permutation(len(order))]
        if height >= 1 and len(chosen) > r**height:
            log.info(
                "radon: %d of %d models left out: %s",
                len(chosen) - r**height,
                len(chosen),
                sorted(chosen[r**height :]),
            )
        stacked = np.stack([models[s].double().numpy() for s in chosen])
        point = iterated_radon_point(stacked, self.config.radon_iterations)
        reference = next(iter(models.values()))
        return torch.from_numpy(point).to(reference.dtype)


def _adopted(
    lineage: dict[str, list[str]], adopt: set[str], out: PhaseOutcome | None = None
) -> dict[str, list[str]]:
    """`lineage` less the silos told to adopt the aggregate (those of them that answered
    `out`, when given): the model each hosts then was held by no one before."""
    adopted = adopt if out is None else adopt & set(out.answered)
    return {s: held for s, held in lineage.items() if s not in adopted}


def _merged(outcomes: list[tuple[str, PhaseOutcome]]) -> PhaseOutcome:
    """One evaluation outcome: every silo's metrics from every phase, each under its prefix,
    the sample count of the first (the test split)."""
    first = outcomes[0][1]
    reports: dict[str, SiloReport] = {}
    for silo, report in first.reports.items():
        metrics: dict[str, Any] = {}
        for prefix, outcome in outcomes:
            if silo in outcome.reports:
                metrics |= {prefix + k: v for k, v in outcome.reports[silo].metrics.items()}
        reports[silo] = replace(report, metrics=metrics)
    dropped = {s: why for _, o in outcomes for s, why in o.dropped.items()}
    return PhaseOutcome(first.phase, reports, dropped)
