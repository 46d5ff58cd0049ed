"""DRFA (Deng et al. 2020) and DRFLM (DRFA with local mixup), the "paper" variant
(docs/algorithms/drfa.md, drflm.md): min over w, max over lambda in the simplex of
sum_k lambda_k f_k(w).

A round: draw M silos from lambda with replacement (mixed with `uniform_mix` of the uniform
distribution; redrawn until at least `min_contributors` distinct silos, else nobody trains this
round and only lambda's probe runs), and a checkpoint step t' uniform in 1..tau, drawn from the
run's public seed and the round alone (`DrfaConfig.checkpoint_step`), so that every silo
derives it from its own policy. Each distinct
silo trains tau local steps from w-bar and sends its model and its checkpoint after t' steps;
both are averaged with the draws' multiplicities as weights (secure aggregation applies to
both). Then M silos drawn uniformly report their loss at the averaged checkpoint w-tilde, and
lambda takes a projected ascent step gamma_s tau v, v the losses clipped to the cap and scaled
by K/|U'| (unbiased), then the floor. DRFLM trains every local step on Beta(alpha, alpha)
mixup of the silo's data and, with `probe: mixup`, reports the loss on mixed data too.

With `variant: fedtorch` the round is the R-FedTorch reference code's (drfa.md, "The fedtorch
variant"): M silos drawn uniformly without replacement, the new model w-bar + sum_k (lambda_k K /
M)(w_k - w-bar) (importance weights that need not sum to one: each silo scales its own update by
lambda_k K, the `update_scale` of its task, and the mean of the scaled models is that sum), the
checkpoint taken before local step k' ~ U{1..tau-1} (after k' - 1 steps) and averaged uniformly, and
the step decayed by `step_decay` (0.9 unless set). A trained silo learns its own lambda_k K there.

lambda starts uniform and, with `init: counts`, is set proportional to the sample counts the
silos released after the first round's probe. The losses are noisy reports of the silo's
privacy layer; lambda ranks silos by them, so it is kept in the coordinator's state (and in
`fedsilo_mixing_weight`), never sent to silos.
"""

from __future__ import annotations

import logging
import math
from dataclasses import replace

import numpy as np

from fedsilo.coordinator.mixing import (
    loss_cap,
    meets_contributor_minimum,
    mix_with_uniform,
    projected_loss_ascent,
    proportional_to_counts,
)
from fedsilo.coordinator.noised_reports import reported_losses
from fedsilo.coordinator.phases import Phase, Task, WeightedMean
from fedsilo.coordinator.strategies.base import (
    MIXING,
    RoundContext,
    RoundScript,
    ServerState,
    Strategy,
)
from fedsilo.coordinator.strategies.mixing_state import MixingState
from fedsilo.policies.algorithms.contract import Position
from fedsilo.policies.algorithms.drfa import DrfaConfig, DrflmConfig
from fedsilo.wire.tasks.tensor_names import CHECKPOINT, MODEL

log = logging.getLogger(__name__)

DRAW_TRIES = 100
FEDTORCH_STEP_DECAY = 0.9  # R-FedTorch multiplies drfa_gamma by 0.9 every round


class Drfa(Strategy):
    """Min over the model, max over lambda: silos drawn from lambda (Deng et al. 2020)."""

    name = "drfa"

    @property
    def config(self) -> DrfaConfig | DrflmConfig:
        return self.policy.algorithm  # type: ignore[return-value]

    def round(self, state: ServerState, ctx: RoundContext) -> RoundScript:
        settings = self.config
        mixing = MixingState.of(state.extra, MIXING, ctx.silos)
        silos = list(mixing.silos)
        active = [s in ctx.silos for s in silos]
        lam = (
            np.array(mixing.lam) if mixing.lam is not None else np.full(len(silos), 1 / len(silos))
        )
        tau = self.policy.training.steps
        assert tau is not None  # the policy requires training.steps for DRFA
        draws = settings.silos_per_round or len(silos)
        rng = ctx.rng("drfa")
        fedtorch = settings.variant == "fedtorch"
        if fedtorch:
            chosen, scales = self._draw_uniformly(lam, silos, active, draws, rng)
        else:
            chosen, scales = self._draw_from_lambda(lam, silos, active, draws, rng), {}
        model = averaged = state.model
        if chosen is None:  # nobody trains; lambda is still probed, so it can move back
            log.info("drfa: round %d trains no one, too few distinct silos drawn", ctx.round)
        else:
            out = yield Phase(
                "train",
                self._train_tasks(state, ctx, sorted(chosen), scales),
                # the checkpoint, like the model, is summed relative to the model sent
                aggregate=WeightedMean(
                    (MODEL, CHECKPOINT), chosen, references={CHECKPOINT: state.model}
                ),
            )
            model, averaged = out.mean[MODEL], out.mean[CHECKPOINT]
        reachable = [s for s, on in zip(silos, active, strict=True) if on]
        probed = rng.choice(len(reachable), size=min(draws, len(reachable)), replace=False)
        probe = yield Phase(
            "probe",
            tuple(
                Task(
                    s,
                    settings.probe_config(self.policy, Position(ctx.round, "probe", s)),
                    {MODEL: averaged},
                    state.spec,
                )
                for s in sorted(reachable[i] for i in probed)
            ),
        )
        reported = reported_losses(probe.reports, self.policy.privacy, "probe")
        losses = np.array([reported.get(s, math.nan) for s in silos])
        if mixing.lam is None and settings.init == "counts":
            lam = proportional_to_counts(
                [probe.reports[s].num_samples if s in reported else 0 for s in silos]
            )
        cap = (
            mixing.loss_cap if mixing.loss_cap is not None else loss_cap(settings.loss_cap, losses)
        )
        decay = settings.step_decay or (FEDTORCH_STEP_DECAY if fedtorch else None)
        step = settings.step * (decay**ctx.round if decay else 1.0)
        lam = projected_loss_ascent(lam, losses, step * tau, cap, settings.floor)
        mixing = replace(
            mixing,
            lam=tuple(lam.tolist()),
            loss_cap=cap,
            weights=dict(zip(silos, lam.tolist(), strict=True)),
        )
        return replace(
            state,
            tensors={**state.tensors, MODEL: model},
            extra={**state.extra, MIXING: mixing.to_json()},
        )

    def _train_tasks(
        self, state: ServerState, ctx: RoundContext, silos: list[str], scales: dict[str, float]
    ) -> tuple[Task, ...]:
        """The drawn silos' train tasks: the checkpoint step and DRFLM's mixup derived from the
        policy (`DrfaConfig.train_options`), R-FedTorch's scale chosen here (an explicit 1.0 is
        sent as such: the silo is told its scale)."""
        return tuple(
            self.train_task(silo, state.model, state.spec, ctx, update_scale=scales.get(silo))
            for silo in silos
        )

    def _draw_from_lambda(
        self,
        lam: np.ndarray,
        silos: list[str],
        active: list[bool],
        draws: int,
        rng: np.random.Generator,
    ) -> dict[str, float] | None:
        """The paper: M draws from lambda (among the active silos) with replacement, as each
        drawn silo's multiplicity (its weight in the mean); None when no draw reaches the
        minimum of distinct contributors."""
        settings = self.config
        on = np.array(active)
        weights = np.where(on, lam, 0.0)
        weights = mix_with_uniform(weights / weights.sum(), settings.uniform_mix)
        weights = np.where(on, weights, 0.0)
        weights /= weights.sum()
        # a mean of fewer than the quorum is never applied (the engine refuses it)
        wanted = max(settings.min_contributors, self.policy.participants.min_silos)
        needed = min(wanted, int(on.sum()))
        for _ in range(DRAW_TRIES):
            counts = np.bincount(rng.choice(len(lam), size=draws, p=weights), minlength=len(lam))
            if needed < 2 or meets_contributor_minimum(counts, needed):
                return {silos[i]: float(c) for i, c in enumerate(counts) if c > 0}
        return None

    @staticmethod
    def _draw_uniformly(
        lam: np.ndarray,
        silos: list[str],
        active: list[bool],
        draws: int,
        rng: np.random.Generator,
    ) -> tuple[dict[str, float], dict[str, float]]:
        """R-FedTorch: M active silos uniformly without replacement, equal weights in the mean,
        and each silo's update scale lambda_k K."""
        reachable = [i for i, on in enumerate(active) if on]
        picked = rng.choice(len(reachable), size=min(draws, len(reachable)), replace=False)
        chosen = sorted(reachable[i] for i in picked)
        scales = {silos[i]: float(lam[i] * len(silos)) for i in chosen}
        return dict.fromkeys(scales, 1.0), scales


class Drflm(Drfa):
    """DRFA whose silos train and report losses on local mixup."""

    name = "drflm"
