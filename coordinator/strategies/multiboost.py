"""Federated MultiBoost (Cortes et al. 2021, "Boosting with multiple sources", NeurIPS; federated
as in §IV of Tyagi & Chukkapalli's survey; docs/algorithms/multiboost.md), each silo one domain
with the uniform domain posterior Q(k | x) = 1/p (absorbed into alpha).

Setup: after the initial model, `base_learners` phases of plain `train` tasks, without
aggregation: every silo trains N base classifiers h_{k,j} (the policy's model, each from its
own seed) and sends them in the clear; they are fixed from then on.

Round t: every silo gets the ensemble (all base classifiers and alpha) in a `boost_probe` task
and answers its exponential loss sum A_k = sum_i exp(-y_i f(x_i)), its count m_k and, for each
of its own base classifiers r, the edge sum E_{k,r} = sum_i exp(-y_i f(x_i)) y_i h_{k,r}(x_i)
(noised through the silo's reports under DP). With the exponential surrogate Phi' = Phi, so
Z_k = A_k and the weighted edge is 1 - 2 eps_{k,r} = E_{k,r} / Z_k. The coordinator
(`boost_step`) takes the worst domains K_t = argmax_k A_k / m_k, the coordinate
(k, r) = argmax over k in K_t, r of k's classifiers of (Z_k / m_k)(1 - 2 eps_{k,r}) = E_{k,r} / m_k,
and adds eta_t = eta_0 / sqrt(t) to alpha_{k,r} (the survey's federated step; no step when
that edge is not positive). Evaluation: `boost_probe` with `evaluate` on the test split.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import numpy as np
import torch

from fedsilo.coordinator.phases import Phase, SiloReport, Task
from fedsilo.coordinator.strategies.base import (
    EvaluationScript,
    RoundContext,
    RoundScript,
    ServerState,
    Strategy,
)
from fedsilo.policies.algorithms.contract import Position, derived_train
from fedsilo.policies.algorithms.multiboost import MultiBoostConfig
from fedsilo.wire.tasks import BoostProbe
from fedsilo.wire.tasks.multiboost import LOSS_SUM, edges_in
from fedsilo.wire.tasks.tensor_names import BOOST_ALPHA, BOOST_LEARNERS, MODEL

MULTIBOOST = "multiboost"  # state.extra: {"owners": silo of each base classifier, "chosen": ...}
TIE = 1e-9  # relative: domains whose mean loss is this close to the largest are all worst


@dataclass(frozen=True)
class DomainReport:
    """One domain's sums at the current ensemble: A_k, m_k and E_{k,r} by classifier index."""

    loss_sum: float
    count: float
    edges: Mapping[int, float]


@dataclass(frozen=True)
class BoostStep:
    alpha: np.ndarray
    worst: tuple[str, ...]  # K_t
    chosen: int | None  # the classifier whose alpha moved (None: no positive edge)
    eta: float


def boost_step(
    reports: Mapping[str, DomainReport],
    owners: Sequence[str],
    alpha: np.ndarray,
    t: int,
    step: float,
) -> BoostStep:
    """One boosting round from the domains' reports: K_t, the coordinate with the largest
    E_{k,r} / m_k among the worst domains' own classifiers (the lowest index on a tie), and
    alpha with eta_0 / sqrt(t) added there."""
    means = {k: r.loss_sum / max(r.count, 1.0) for k, r in reports.items()}
    if not means:
        return BoostStep(alpha.copy(), (), None, 0.0)
    top = max(means.values())
    worst = tuple(sorted(k for k, v in means.items() if v >= top - TIE * abs(top)))
    best, chosen = 0.0, None
    for j, owner in enumerate(owners):
        if owner in worst and j in reports[owner].edges:
            score = reports[owner].edges[j] / max(reports[owner].count, 1.0)
            if score > best:
                best, chosen = score, j
    eta = step / math.sqrt(t)
    alpha = alpha.copy()
    if chosen is not None:
        alpha[chosen] += eta
    return BoostStep(alpha, worst, chosen, eta if chosen is not None else 0.0)


class MultiBoost(Strategy):
    """Boosting over the silos' own base classifiers, worst silo first (Cortes et al. 2021)."""

    name = "multiboost"

    @property
    def config(self) -> MultiBoostConfig:
        return self.policy.algorithm  # type: ignore[return-value]

    def setup(self, ctx: RoundContext) -> RoundScript:
        state = yield from super().setup(ctx)
        rows, owners = [], []
        for j in range(self.config.base_learners):
            seed = self.config.learner_seed(self.policy, j)
            phase = f"base-{j}"
            out = yield Phase(
                phase,
                tuple(
                    Task(
                        s,
                        derived_train(self.policy, Position(ctx.round, phase, s, j), seed),
                        {MODEL: state.model},
                        state.spec,
                    )
                    for s in ctx.silos
                ),
            )
            for silo in sorted(out.tensors):
                rows.append(out.tensors[silo][MODEL])
                owners.append(silo)
        tensors = {
            **state.tensors,
            BOOST_LEARNERS: torch.stack(rows),
            BOOST_ALPHA: torch.zeros(len(rows), dtype=torch.float64),
        }
        return replace(
            state, tensors=tensors, extra={**state.extra, MULTIBOOST: {"owners": owners}}
        )

    def round(self, state: ServerState, ctx: RoundContext) -> RoundScript:
        owners = list(state.extra[MULTIBOOST]["owners"])
        tasks = tuple(
            Task(
                s,
                BoostProbe(edges=tuple(j for j, o in enumerate(owners) if o == s)),
                self.ensemble(state),
                state.spec,
            )
            for s in ctx.silos
        )
        out = yield Phase("boost", tasks)
        reports = {s: r for s, r in ((s, domain_report(r)) for s, r in out.reports.items()) if r}
        alpha = state.tensors[BOOST_ALPHA].numpy()
        moved = boost_step(reports, owners, alpha, ctx.round, self.config.step)
        record: dict[str, Any] = {
            "round": ctx.round,
            "worst": list(moved.worst),
            "chosen": moved.chosen,
            "eta": moved.eta,
        }
        extra = dict(state.extra[MULTIBOOST])
        extra["chosen"] = [*extra.get("chosen", []), record]
        return replace(
            state,
            tensors={**state.tensors, BOOST_ALPHA: torch.from_numpy(moved.alpha)},
            extra={**state.extra, MULTIBOOST: extra},
        )

    def evaluate(self, state: ServerState, ctx: RoundContext) -> EvaluationScript:
        probe = BoostProbe(split="test", evaluate=True)
        tasks = tuple(Task(s, probe, self.ensemble(state), state.spec) for s in ctx.silos)
        return (yield Phase("evaluate", tasks, quorum=1))

    @staticmethod
    def ensemble(state: ServerState) -> dict[str, torch.Tensor]:
        return {
            BOOST_LEARNERS: state.tensors[BOOST_LEARNERS],
            BOOST_ALPHA: state.tensors[BOOST_ALPHA],
        }


def domain_report(report: SiloReport) -> DomainReport | None:
    """A silo's sums from its metrics; None when one is missing or not finite."""
    metrics = report.metrics
    loss = metrics.get(LOSS_SUM, math.nan)
    edges = edges_in(dict(metrics))
    values = (loss, float(report.num_samples), *edges.values())
    if not all(math.isfinite(v) for v in values):
        return None
    return DomainReport(float(loss), float(report.num_samples), edges)
