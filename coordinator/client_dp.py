"""Client-level DP at the coordinator (DP-FedAvg, McMahan et al. 2018): how the engine runs a
round's weighted means under `privacy.client_dp`, the noise each still needs, and the epsilon
of the models the consortium publishes. No strategy knows of it.

The silos clip their updates to norm S (and, with `noise: distributed`, each of the m silos
a round asks adds N(0, (z S)^2 / m) to its own; the task tells it m, silo/client_dp.py).
The engine averages them with equal weights, whatever weights the strategy would have used,
so the mean over the m' silos that answered is
x + (sum of clipped updates + E) / m', E the noise already in the sum. This module adds
what E lacks of N(0, (z S)^2): all of it with central noise; with distributed noise the
shares of the m - m' silos that did not answer. The top-up is drawn from the coordinator's
secret, so no silo can subtract it. FedOpt's server step then takes the noised mean.

Accounting: each completed round is one sampled Gaussian mechanism with noise multiplier z
at sample rate q = (silos asked) / (silos active), composed over rounds with the policy's
accountant. Opacus' accountants assume Poisson sampling; a round draws a fixed number of
silos without replacement, as McMahan et al. (2018) also account it, so for q < 1 the
epsilon is that approximation (q = 1, every silo every round, is exact).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import torch

from fedsilo.coordinator.phases import Phase, PhaseOutcome, Task, WeightedMean
from fedsilo.coordinator.strategies.base import RoundContext, ServerState
from fedsilo.policies.privacy import ClientDpConfig
from fedsilo.policies.schema import Policy
from fedsilo.privacy.accounting import Mechanism, epsilon
from fedsilo.wire.tasks import TrainTask

STATE_KEY = "client_dp"


class ClientDp:
    """The client-level DP of one deployment's policy (`privacy.client_dp`)."""

    def __init__(self, policy: Policy) -> None:
        if policy.privacy.client_dp is None:
            raise ValueError("the policy's privacy section has no client_dp")
        self.policy = policy
        self.config: ClientDpConfig = policy.privacy.client_dp

    @property
    def sum_std(self) -> float:
        """The noise std the sum of a round's clipped updates carries: z S."""
        return self.config.noise_multiplier * self.config.clip

    def missing_variance(self, answered: int, asked: int) -> float:
        """The variance the sum of `answered` silos' updates still lacks of (z S)^2, when
        `asked` silos were asked (and each sized its share for them)."""
        if self.config.noise == "central":
            return self.sum_std**2
        return self.sum_std**2 * (1.0 - answered / asked)

    def noised_mean(
        self, mean: torch.Tensor, answered: int, asked: int, generator: torch.Generator
    ) -> torch.Tensor:
        """The equal-weight mean of `answered` silos' models, with its noise made whole
        (drawn from `generator`, which only the coordinator may know)."""
        variance = self.missing_variance(answered, asked)
        if variance == 0.0:
            return mean
        noise = torch.normal(
            0.0,
            math.sqrt(variance),
            mean.shape,
            generator=generator,
            dtype=torch.float64,
        )
        return mean + (noise / answered).to(mean.dtype)

    def booked(self, extra: Mapping[str, Any], asked: int, active: int) -> dict[str, Any]:
        """The state's accounting after one more completed round that asked `asked` of
        `active` silos: {"rounds": [[sample rate, rounds], ...], "epsilon": ...}."""
        rounds = [list(entry) for entry in extra.get(STATE_KEY, {}).get("rounds", [])]
        rate = asked / active
        for entry in rounds:
            if entry[0] == rate:
                entry[1] += 1
                break
        else:
            rounds.append([rate, 1])
        return {"rounds": rounds, "epsilon": self.epsilon(rounds)}

    def epsilon(self, rounds: Sequence[Sequence[float]]) -> float:
        """The client-level epsilon of `rounds` ([sample rate, count] pairs) at the policy's
        delta, by its accountant."""
        mechanism = {
            "sensitivity": self.config.clip,
            "noise_std": self.sum_std,
        }
        releases = [
            Mechanism.gaussian(**mechanism, sample_rate=rate)
            for rate, count in rounds
            for _ in range(int(count))
        ]
        privacy = self.policy.privacy
        return epsilon(releases, privacy.delta, privacy.accountant)


class ClientDpRound:
    """One round's DP-FedAvg means: each made whole with noise from the round's private
    generator, and booked in the state once the round completes (an abandoned round publishes
    no model and books nothing)."""

    def __init__(self, dp: ClientDp, ctx: RoundContext) -> None:
        self.dp = dp
        self.active = len(ctx.silos)
        self.generator = ctx.private_generator("client-dp")
        self.asked: list[int] = []  # silos asked by each mean taken so far

    @classmethod
    def of(cls, policy: Policy, ctx: RoundContext) -> ClientDpRound | None:
        """The round's client-level DP, None when the policy has none."""
        return None if policy.privacy.client_dp is None else cls(ClientDp(policy), ctx)

    def phase(self, phase: Phase) -> Phase:
        """`phase` (a weighted mean of trained models: the policy admits client-level DP only
        for algorithms whose means are) as DP-FedAvg runs it: equal weights, so one silo moves
        the sum by at most S whatever its sample count, and with distributed noise every task
        tells its silo how many silos share the round's noise."""
        aggregate = phase.aggregate
        assert isinstance(aggregate, WeightedMean)
        if aggregate.weights is not None:
            raise ValueError(
                f"phase {phase.name!r} weighs its silos, and client-level DP weighs them equally"
            )
        chosen = [task.silo for task in phase.tasks]
        tasks = phase.tasks
        if self.dp.config.noise == "distributed":
            tasks = tuple(replace(t, config=_with_cohort(t, len(chosen))) for t in tasks)
        return replace(
            phase, tasks=tasks, aggregate=replace(aggregate, weights=dict.fromkeys(chosen, 1.0))
        )

    def noised(self, phase: Phase, outcome: PhaseOutcome) -> PhaseOutcome:
        """`outcome` of `phase` (as `phase` made it) with every mean's noise made whole."""
        asked, answered = len(phase.tasks), len(outcome.answered)
        mean = {
            name: self.dp.noised_mean(tensor, answered, asked, self.generator)
            for name, tensor in outcome.mean.items()
        }
        self.asked.append(asked)
        return replace(outcome, mean=mean)

    def booked(self, state: ServerState) -> ServerState:
        """`state` with the round's means booked in its accounting."""
        extra = state.extra
        for asked in self.asked:
            extra = {**extra, STATE_KEY: self.dp.booked(extra, asked, self.active)}
        return replace(state, extra=extra)


def _with_cohort(task: Task, cohort: int) -> TrainTask:
    """`task`'s train config telling its silo how many silos share the round's noise."""
    if not isinstance(task.config, TrainTask):
        raise ValueError(f"client-level DP noises train tasks, not {task.kind}")
    return replace(task.config, cohort=cohort)


def published_epsilon(extra: Mapping[str, Any]) -> float | None:
    """The client-level epsilon booked in a strategy state's extras (None: no client DP)."""
    booked = extra.get(STATE_KEY)
    return None if booked is None else float(booked["epsilon"])
