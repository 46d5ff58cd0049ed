"""Mixing schedules driven by the losses of the current model: AFL, AgnosticFedAvg, q-FedAvg,
TERM, PropFair and AAggFF (coordinator/mixing.py has the mathematics).

Every round: the sampled silos report the mean loss of the global model on their training
split (the `loss` task: clipped and noised by the silo's privacy layer, booked in its
ledger), the schedule turns the losses into mixing coefficients over the silos that reported,
and the same silos train; the new model is the mean of their models weighted by those
coefficients (a silo that drops out of training leaves the others renormalised). The loss
probe is a round trip of its own, not a scalar riding with the update as in the AAggFF
paper, because secure aggregation needs each silo's weight before its update is masked.

- q-FedAvg, TERM, PropFair: the stateless rows of AAggFF's unified table
  (docs/algorithms/aaggff.md): p_i proportional to (n_i/n) F_i^q, (n_i/n) exp(t F_i),
  (n_i/n) / (M - F_i).
- AFL (Mohri et al. 2019) as the AAggFF reference code's baseline runs it: lambda weights the
  round's mean, then moves by projected ascent on the losses (docs/algorithms/afl.md; local training
  instead of AFL's single gradient step, so it runs like every other averaging strategy).
- AgnosticFedAvg (Ro et al. 2021, docs/algorithms/agnostic_fedavg.md). With `domains: silo` each
  silo is one domain: the weight of silo k is beta_k = lambda_k n_k / N-bar_k (N-bar: its released
  counts averaged over the last `count_window` rounds), and lambda takes an exponentiated-gradient
  step on the mean losses. With `domains: data` lambda is over the values of the silos'
  `data.domain` column: the probe asks every silo for its domains' loss sums L^k and counts N^k at
  the received model, alpha = lambda / max(N-bar, 1) (N-bar: the consortium's domain totals over the
  window), beta_k = sum_i alpha_i N_i^k weights silo k's model, each silo trains on row losses
  weighted omega_i = alpha_i N / sum_j alpha_j N_j (alpha normalised by the consortium's totals, so
  equal alphas are the plain loss and the weights use no silo's own counts, which DP-SGD would not
  cover), and lambda takes the EG step on the domain mean losses L-bar_i = sum_k L_i^k / N_i
  (domains no silo reported keep their mass). The probe runs before training (the survey's silos
  send L and N with the update), so the window includes this round's counts.
- AAggFF (Hahn et al. 2024): AAggFF-S (online Newton step) when every silo takes part,
  AAggFF-D (FTRL with doubly-robust responses) when `client_fraction` < 1. With
  `server_optimizer` the mixed mean is not adopted but is the target of FedAdam's, FedYogi's
  or FedAdagrad's step (coordinator/strategies/fedopt.py `adaptive_step`), the thesis'
  plug-and-play pairing (docs/algorithms/aaggff.md, "With a server optimiser").

The coefficients of the last round are kept in the state (`mixing.weights`, by silo): the
engine exports them as `fedsilo_mixing_weight` and a restarted coordinator resumes them.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from fedsilo.coordinator.mixing import (
    AAggFFDState,
    AAggFFSState,
    aaggff_d_step,
    aaggff_s_step,
    exponentiated_gradient,
    loss_cap,
    projected_loss_ascent,
    propfair_weights,
    proportional_to_counts,
    qfedavg_weights,
    term_weights,
)
from fedsilo.coordinator.noised_reports import reported_losses
from fedsilo.coordinator.phases import Phase, SiloReport, Task, WeightedMean
from fedsilo.coordinator.strategies.base import (
    MIXING,
    RoundContext,
    RoundScript,
    ServerState,
    Strategy,
)
from fedsilo.coordinator.strategies.mixing_state import MixingState
from fedsilo.policies.algorithms.contract import Position
from fedsilo.policies.algorithms.loss_weighted import (
    AAggFFConfig,
    AflConfig,
    AgnosticFedAvgConfig,
    LambdaConfig,
    LossWeightedConfig,
    PropFairConfig,
    QFedAvgConfig,
    TermConfig,
)
from fedsilo.policies.algorithms.server_step import adaptive_step, with_moments
from fedsilo.wire.messages import DOMAIN_COUNT, DOMAIN_LOSS_SUM, domain_metric, domains_in
from fedsilo.wire.tasks.tensor_names import MODEL

log = logging.getLogger(__name__)

Reported = Mapping[str, tuple[float, float]]  # silo -> (loss, released sample count)
Decision = tuple[dict[str, float], MixingState]  # coefficients by silo, the new state


class LossWeighted(Strategy):
    """A round: probe the sampled silos' losses, decide the coefficients, train, mix."""

    @property
    def config(self) -> LossWeightedConfig:
        return self.policy.algorithm  # type: ignore[return-value]

    def round(self, state: ServerState, ctx: RoundContext) -> RoundScript:
        chosen = self.sample_silos(ctx)
        probe = yield Phase(
            "loss",
            tuple(
                Task(
                    s,
                    self.config.probe_config(self.policy, Position(ctx.round, "loss", s)),
                    {MODEL: state.model},
                    state.spec,
                )
                for s in chosen
            ),
        )
        mixing = MixingState.of(state.extra, MIXING, ctx.silos)
        weights, mixing = self.decide_from(probe.reports, mixing, ctx)
        options = self.train_options(mixing)
        tasks = tuple(
            self.train_task(s, state.model, state.spec, ctx, **options) for s in sorted(weights)
        )
        out = yield Phase("train", tasks, aggregate=WeightedMean((MODEL,), weights))
        used = {s: weights[s] for s in out.answered}
        total = sum(used.values())
        mixing = replace(
            mixing, weights={s: w / total for s, w in used.items()} if total > 0 else used
        )
        return replace(
            state,
            tensors=self.server_update(state, out.mean[MODEL]),
            extra={**state.extra, MIXING: mixing.to_json()},
        )

    def server_update(self, state: ServerState, mean: torch.Tensor) -> dict[str, torch.Tensor]:
        """The server optimiser: the mixed mean becomes the model (FedAvg's step 1)."""
        return {**state.tensors, MODEL: mean}

    def decide_from(
        self, reports: Mapping[str, SiloReport], mixing: MixingState, ctx: RoundContext
    ) -> Decision:
        """Coefficients from the probe's reports: each silo's mean loss (under DP clamped
        into its domain: coordinator/noised_reports.py) and released count (a silo whose loss
        is not finite did not report)."""
        losses = reported_losses(reports, self.policy.privacy, "loss")
        reported = {s: (loss, float(reports[s].num_samples)) for s, loss in losses.items()}
        return self.decide(reported, mixing, ctx)

    def decide(self, reported: Reported, mixing: MixingState, ctx: RoundContext) -> Decision:
        """Coefficients for the silos that reported, and the schedule's new state."""
        raise NotImplementedError

    def train_options(self, mixing: MixingState) -> dict[str, Any]:
        """The round's train tasks' optional `TrainTask` fields."""
        return {}


class TableRule(LossWeighted):
    """A stateless row of the unified table: p from this round's losses and counts alone."""

    def decide(self, reported: Reported, mixing: MixingState, ctx: RoundContext) -> Decision:
        silos = sorted(reported)
        losses = np.clip(np.array([reported[s][0] for s in silos]), 0.0, None)
        sizes = np.array([max(reported[s][1], 1.0) for s in silos])
        weights = self.weights(losses, sizes)
        return dict(zip(silos, weights.tolist(), strict=True)), mixing

    def weights(self, losses: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        raise NotImplementedError


class QFedAvg(TableRule):
    """Weights proportional to n_k F_k^q (Li et al. 2020)."""

    name = "qfedavg"

    @property
    def config(self) -> QFedAvgConfig:  # type: ignore[override]
        return self.policy.algorithm  # type: ignore[return-value]

    def weights(self, losses: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        return qfedavg_weights(losses, sizes, self.config.q)


class Term(TableRule):
    """Tilted weights n_k exp(t F_k) (Li et al. 2021)."""

    name = "term"

    @property
    def config(self) -> TermConfig:  # type: ignore[override]
        return self.policy.algorithm  # type: ignore[return-value]

    def weights(self, losses: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        return term_weights(losses, sizes, self.config.tilt)


class PropFair(TableRule):
    """Proportional fairness: weights n_k / (M - F_k) (Zhang et al. 2022)."""

    name = "propfair"

    @property
    def config(self) -> PropFairConfig:  # type: ignore[override]
        return self.policy.algorithm  # type: ignore[return-value]

    def weights(self, losses: np.ndarray, sizes: np.ndarray) -> np.ndarray:
        baseline = self.config.baseline
        if np.any(losses >= baseline):
            log.warning("propfair: losses %s reach the baseline M = %g; clipped", losses, baseline)
            losses = np.minimum(losses, baseline * (1 - 1e-6))
        return propfair_weights(losses, sizes, baseline)


class LambdaSchedule(LossWeighted):
    """A schedule with a lambda over the deployment's silos, kept in the state."""

    @property
    def config(self) -> LambdaConfig:  # type: ignore[override]
        return self.policy.algorithm  # type: ignore[return-value]

    def lam(self, mixing: MixingState, reported: Reported) -> np.ndarray:
        if mixing.lam is not None:
            return np.array(mixing.lam)
        silos = mixing.silos
        if self.config.init == "uniform":
            return np.full(len(silos), 1.0 / len(silos))
        return proportional_to_counts([reported.get(s, (0.0, 0.0))[1] for s in silos])

    def loss_vector(self, mixing: MixingState, reported: Reported) -> tuple[np.ndarray, float]:
        """Every silo's loss (NaN if it did not report), and the cap (fixed at first sight)."""
        losses = np.array([reported.get(s, (math.nan, 0.0))[0] for s in mixing.silos])
        cap = mixing.loss_cap
        return losses, loss_cap(self.config.loss_cap, losses) if cap is None else cap


class Afl(LambdaSchedule):
    """Agnostic FL: projected ascent on lambda over the silos (Mohri et al. 2019)."""

    name = "afl"

    @property
    def config(self) -> AflConfig:  # type: ignore[override]
        return self.policy.algorithm  # type: ignore[return-value]

    def decide(self, reported: Reported, mixing: MixingState, ctx: RoundContext) -> Decision:
        lam = self.lam(mixing, reported)
        losses, cap = self.loss_vector(mixing, reported)
        weights = {s: float(lam[i]) for i, s in enumerate(mixing.silos) if s in reported}
        settings = self.config
        lam = projected_loss_ascent(lam, losses, settings.step, cap, floor=settings.floor)
        return weights, replace(mixing, lam=tuple(lam.tolist()), loss_cap=cap)


class AgnosticFedAvg(LambdaSchedule):
    """EG ascent on lambda over silos or domains, FedAvg-style local epochs (Ro et al. 2021)."""

    name = "agnostic_fedavg"

    @property
    def config(self) -> AgnosticFedAvgConfig:  # type: ignore[override]
        return self.policy.algorithm  # type: ignore[return-value]

    @property
    def by_domain(self) -> bool:
        return self.config.domains == "data"

    def decide_from(
        self, reports: Mapping[str, SiloReport], mixing: MixingState, ctx: RoundContext
    ) -> Decision:
        if not self.by_domain:
            return super().decide_from(reports, mixing, ctx)
        if mixing.domains is None:  # the domains of the first probe, fixed for the run
            seen = set().union(*(domains_in(r.metrics) for r in reports.values()))
            mixing = replace(mixing, domains=tuple(sorted(seen)))
        assert mixing.domains is not None
        domains = list(mixing.domains)
        totals = {s: _domain_totals(r, domains) for s, r in reports.items()}
        totals = {s: t for s, t in totals.items() if t is not None}
        if not totals:
            return {}, mixing
        sums = np.array([totals[s][0] for s in sorted(totals)])
        counts = np.clip(np.array([totals[s][1] for s in sorted(totals)]), 0.0, None)
        consortium = counts.sum(axis=0)
        window = (*(mixing.counts or ()), tuple(consortium.tolist()))[-self.config.count_window :]
        if mixing.lam is not None:
            lam = np.array(mixing.lam)
        elif self.config.init == "uniform" or not consortium.any():
            lam = np.full(len(domains), 1.0 / len(domains))
        else:
            lam = np.maximum(consortium, 1.0) / np.maximum(consortium, 1.0).sum()
        alpha = lam / np.maximum(np.mean(window, axis=0), 1.0)
        betas = counts @ alpha
        total_weight = float(consortium @ alpha)
        scale = consortium.sum() / total_weight if total_weight > 0 else 1.0
        omega = dict(zip(domains, (alpha * scale).tolist(), strict=True))
        observed = consortium > 0
        means = np.where(observed, sums.sum(axis=0) / np.maximum(consortium, 1e-12), np.nan)
        cap = (
            mixing.loss_cap
            if mixing.loss_cap is not None
            else loss_cap(self.config.loss_cap, means)
        )
        if observed.any():
            clipped = np.clip(np.where(observed, means, 0.0), 0.0, cap)
            lam = exponentiated_gradient(lam, clipped, self.config.step, observed)
        mixing = replace(mixing, counts=window, omega=omega, loss_cap=cap, lam=tuple(lam.tolist()))
        return dict(zip(sorted(totals), betas.tolist(), strict=True)), mixing

    def train_options(self, mixing: MixingState) -> dict[str, Any]:
        return {"domain_weights": mixing.omega} if self.by_domain else {}

    def decide(self, reported: Reported, mixing: MixingState, ctx: RoundContext) -> Decision:
        silos = mixing.silos
        lam = self.lam(mixing, reported)
        losses, cap = self.loss_vector(mixing, reported)
        losses = np.clip(losses, 0.0, cap)
        counts = tuple(reported.get(s, (0.0, math.nan))[1] for s in silos)
        window = (*(mixing.counts or ()), counts)[-self.config.count_window :]
        history = np.array(window, dtype=float)
        seen = np.isfinite(history)
        mean_counts = np.where(seen, history, 0.0).sum(0) / np.maximum(seen.sum(0), 1)
        weights = {
            s: float(lam[i] * reported[s][1] / max(mean_counts[i], 1.0))
            for i, s in enumerate(silos)
            if s in reported
        }
        observed = np.isfinite(losses)
        if observed.any():
            lam = exponentiated_gradient(lam, losses, self.config.step, observed)
        return weights, replace(mixing, counts=window, loss_cap=cap, lam=tuple(lam.tolist()))


def _domain_totals(
    report: SiloReport, domains: list[str]
) -> tuple[list[float], list[float]] | None:
    """A silo's per-domain loss sums and counts, in `domains` order (a domain it did not report
    counts 0); None when a value is not finite (the whole reply is dropped)."""
    metrics = report.metrics
    sums = [float(metrics.get(domain_metric(DOMAIN_LOSS_SUM, d), 0.0)) for d in domains]
    counts = [float(metrics.get(domain_metric(DOMAIN_COUNT, d), 0.0)) for d in domains]
    if not all(math.isfinite(v) for v in (*sums, *counts)):
        return None
    return sums, counts


class AAggFF(LossWeighted):
    """Online-convex-optimisation mixing for fairness, -S or -D (Hahn et al. 2024)."""

    name = "aaggff"

    @property
    def config(self) -> AAggFFConfig:  # type: ignore[override]
        return self.policy.algorithm  # type: ignore[return-value]

    def setup(self, ctx: RoundContext) -> RoundScript:
        state = yield from super().setup(ctx)
        step = self.config.server_optimizer
        if step is None:
            return state
        return replace(state, tensors=with_moments(state.tensors, step.tau))

    def server_update(self, state: ServerState, mean: torch.Tensor) -> dict[str, torch.Tensor]:
        step = self.config.server_optimizer
        if step is None:
            return super().server_update(state, mean)
        return adaptive_step(step.name, step, state.tensors, mean)

    def decide(self, reported: Reported, mixing: MixingState, ctx: RoundContext) -> Decision:
        silos = mixing.silos
        losses = np.array([reported.get(s, (math.nan, 0.0))[0] for s in silos])
        transform = self.config.transform
        if self.config.client_fraction >= 1.0:
            state = (
                AAggFFSState.from_json(mixing.aaggff)
                if mixing.aaggff is not None
                else AAggFFSState.initial(len(silos))
            )
            state, weights = aaggff_s_step(state, losses, transform)
        else:
            fraction = self.policy.cohort_size(len(silos)) / len(silos)  # m/K, not q
            state = (
                AAggFFDState.from_json(mixing.aaggff)
                if mixing.aaggff is not None
                else AAggFFDState.initial(len(silos), fraction)
            )
            state, weights = aaggff_d_step(state, losses, transform)
        decided = {s: float(weights[i]) for i, s in enumerate(silos) if s in reported}
        return decided, replace(mixing, aaggff=state.to_json())
