"""The privacy planner: every release a job will book at one silo, known before anything is
spent, and whether the silo can afford it.

A silo's contract (policies/algorithms/contract.py) lists every position a job may ask of it;
`plan_job` walks them round by round (`SiloContract.planned_positions`: each with the config
of its largest release, one position of a phase a round where the silo takes one) and asks
each task kind what it would release (`TaskKind.releases`, the very function the agent books
with), on a copy of the silo's context that starts the job afresh: no count released yet, no
state kept. The plan is composed with the same accountant and delta the ledger uses, so a
silo that takes part in every round of an honest job books exactly its plan, and one that sits
out rounds (client sampling) books less; no coordinator can make it book more, since the
contract gate refuses every other position.

The plan is the silo's own: from its own copy of the signed policy, its own rows (DP-SGD's
sample rate is batch / n) and the consortium it knows (a client-DP share's noise depends on
the cohort). `refusal` compares it with the silo's caps and its ledger before the silo accepts
the job (silo/agent.py); the CLI (`fedsilo privacy plan`), `policy validate` and `simulate`
show the same numbers.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from functools import cached_property
from typing import Any

from fedsilo.policies.algorithms.contract import is_cross_site
from fedsilo.policies.privacy import MIN_NOISE_MULTIPLIER
from fedsilo.privacy.accounting import Mechanism, epsilon
from fedsilo.silo.errors import DpSgdError
from fedsilo.silo.memory import SiloMemory
from fedsilo.silo.state import LocalState
from fedsilo.silo.tasks import TASK_KINDS
from fedsilo.silo.tasks.base import SiloContext
from fedsilo.wire.messages import TaskMessage

TRAINING, EVALUATION, PROBES, POINT_CLOUDS, SETUP, CROSS_SITE_VALIDATION = (
    "training",
    "evaluation",
    "probes",
    "point clouds",
    "setup",
    "cross-site validation",
)
# What each kind of task is for, as the plan groups its releases
PURPOSES: Mapping[str, str] = {
    "train": TRAINING,
    "daisy_train": TRAINING,
    "scaffold_train": TRAINING,
    "superfed_train": TRAINING,
    "feddro_train": TRAINING,
    "energy_signals": TRAINING,
    "evaluate": EVALUATION,
    "daisy_evaluate": EVALUATION,
    "superfed_evaluate": EVALUATION,
    "loss": PROBES,
    "boost_probe": PROBES,
    "feddro_support": POINT_CLOUDS,
}


@dataclass(frozen=True)
class PlannedTask:
    """One position of the job at this silo, and what answering it releases."""

    round: int
    phase: str
    kind: str
    releases: tuple[Mechanism, ...]

    @property
    def purpose(self) -> str:
        """Its task kind's purpose; cross-site validation's evaluations on their own
        (`evaluation.cross_site`), so a privacy officer sees what they cost."""
        if is_cross_site(self.phase):
            return CROSS_SITE_VALIDATION
        return PURPOSES.get(self.kind, SETUP)


@dataclass(frozen=True)
class BudgetPlan:
    """What a job will book at one silo. `epsilon`: every release composed at `delta` (None
    where the policy asks for no DP, so nothing is accounted; inf where a release is
    un-noised)."""

    silo: str
    train_rows: int
    consortium: int
    delta: float | None
    accountant: str
    tasks: tuple[PlannedTask, ...]

    @property
    def releases(self) -> list[Mechanism]:
        return [m for task in self.tasks for m in task.releases]

    @cached_property
    def epsilon(self) -> float | None:
        """Composed once: a plan is asked for it by the refusal, the log and the tables."""
        return self._compose(self.releases)

    def by_purpose(self) -> dict[str, float | None]:
        """Each purpose's releases composed alone (training, evaluation, probes, ...), in the
        order they first appear. They do not add up to `epsilon`: composition is tighter than
        a sum."""
        return dict(self._by_purpose)

    @cached_property
    def _by_purpose(self) -> dict[str, float | None]:
        groups: dict[str, list[Mechanism]] = {}
        for task in self.tasks:
            if any(m.kind != "public" for m in task.releases):
                groups.setdefault(task.purpose, []).extend(task.releases)
        return {purpose: self._compose(releases) for purpose, releases in groups.items()}

    def to_json(self) -> dict[str, Any]:
        return {
            "silo": self.silo,
            "train_rows": self.train_rows,
            "consortium": self.consortium,
            "delta": self.delta,
            "accountant": self.accountant,
            "epsilon": json_epsilon(self.epsilon),
            "by_purpose": {k: json_epsilon(v) for k, v in self.by_purpose().items()},
            "tasks": len(self.tasks),
        }

    def _compose(self, releases: list[Mechanism]) -> float | None:
        if self.delta is None:
            return None
        return epsilon(releases, self.delta, self.accountant)  # type: ignore[arg-type]


@dataclass(frozen=True)
class _Planning(SiloContext):
    """A silo's context at the start of a job, for planning: its policy, data and keys, a
    fresh memory and state, DP-SGD's noise under `job_epsilon` as given; a split's count asked
    for is taken as released then (as its task's run would mark it)."""

    planned_noise: float | None = None

    def unreleased_counts(self, split: str) -> int:
        unreleased = super().unreleased_counts(split)
        self.released_count(split)
        return unreleased

    def job_noise(self) -> float | None:
        return self.planned_noise


def plan_job(ctx: SiloContext, job_noise: float | None = None) -> BudgetPlan:
    """Every release the job of `ctx.policy` books at the silo of `ctx` when it takes part in
    every round, composed as its ledger will compose it (under `job_epsilon`, with DP-SGD's
    noise at `job_noise`, by default the silo's calibrated one)."""
    fresh = {f.name: getattr(ctx, f.name) for f in fields(ctx) if f.name not in ("store", "state")}
    noise = job_noise if job_noise is not None else ctx.job_noise()
    planning = _Planning(**fresh, store=SiloMemory(), state=LocalState(), planned_noise=noise)
    planning.__dict__["facts"] = ctx.facts  # the model's layout, built once per silo
    tasks = []
    for rule, position, config in planning.contract.planned_positions(planning.facts):
        message = TaskMessage(
            f"plan/{position.round}/{position.phase}",
            position.round,
            position.phase,
            ctx.name,
            config,
        )
        kind = TASK_KINDS[rule.kind]
        tasks.append(
            PlannedTask(
                position.round,
                position.phase,
                rule.kind,
                tuple(kind.releases(message, planning)),
            )
        )
        kind.leaves(message, planning)
    privacy = ctx.privacy
    return BudgetPlan(
        silo=ctx.name,
        train_rows=len(ctx.data.y_train),
        consortium=ctx.consortium,
        delta=privacy.delta if privacy.differentially_private else None,
        accountant=privacy.accountant,
        tasks=tuple(tasks),
    )


# Where the calibration searches DP-SGD's noise multiplier under `job_epsilon`
NOISE_RANGE = (MIN_NOISE_MULTIPLIER, 1e4)
NOISE_TOLERANCE = 1e-6  # relative: far below what changes an epsilon's 4th digit


def calibrated_job_noise(ctx: SiloContext) -> float:
    """The least DP-SGD noise multiplier (to `NOISE_TOLERANCE`) at which everything the job
    books at this silo composes to at most the policy's `job_epsilon` (the other releases
    keep their own noise), or a `DpSgdError` with the plan when none does: the job's other
    releases alone spend the budget.

    Epsilon falls smoothly as the noise rises, so the search brackets the answer by doubling
    from 1 and closes in with regula falsi on log(noise) (the Illinois variant), about ten
    compositions of the plan where bisection takes forty."""
    target = ctx.privacy.job_epsilon
    assert target is not None
    draft = plan_job(ctx, job_noise=NOISE_RANGE[1])

    def excess(log_noise: float) -> float:
        noise = math.exp(log_noise)
        return (draft._compose([_with_noise(m, noise) for m in draft.releases]) or 0.0) - target

    low, high = (math.log(n) for n in NOISE_RANGE)
    if excess(high) > 0:
        others = [m for m in draft.releases if m.kind != "dp_sgd"]
        raise DpSgdError(
            f"privacy.job_epsilon {target:g} cannot be met at silo {ctx.name!r}: its "
            f"releases besides DP-SGD's training alone spend epsilon "
            f"{fmt(draft._compose(others))} ({describe(draft)}); raise job_epsilon, or "
            "evaluate less often (eval_every) or with more noise (privacy.reports)"
        )
    if excess(low) <= 0:
        return NOISE_RANGE[0]
    return math.exp(_least_within(excess, low, high))


def _least_within(excess: Callable[[float], float], low: float, high: float) -> float:
    """The least x in [low, high] (to `NOISE_TOLERANCE` in exp(x)) with excess(x) <= 0, for a
    decreasing `excess` with excess(low) > 0 >= excess(high): `high` narrowed from 0 (doubling
    the noise) and then by regula falsi, Illinois variant (a side kept twice has its value
    halved, so neither side sticks)."""
    guess = 0.0  # noise 1
    while low < guess < high:
        if excess(guess) <= 0:
            high = guess
            break
        low, guess = guess, guess + math.log(2)
    f_low, f_high = excess(low), excess(high)
    side = 0
    while high - low > NOISE_TOLERANCE:
        x = high - f_high * (high - low) / (f_high - f_low)
        x = min(max(x, low + NOISE_TOLERANCE / 2), high - NOISE_TOLERANCE / 2)
        f_x = excess(x)
        if f_x <= 0:
            high, f_high = x, f_x
            if side == -1:
                f_low /= 2
            side = -1
        else:
            low, f_low = x, f_x
            if side == 1:
                f_high /= 2
            side = 1
    return high


def _with_noise(mechanism: Mechanism, noise: float) -> Mechanism:
    return replace(mechanism, noise_multiplier=noise) if mechanism.kind == "dp_sgd" else mechanism


@dataclass(frozen=True)
class Caps:
    """A silo's budget for a job: its per-job cap (the stricter of the policy's and the
    site's, named by `job_key`), its cap over all jobs, and what its ledger holds of earlier
    jobs."""

    job: float | None = None
    job_key: str | None = None
    total: float | None = None
    spent_elsewhere: float = 0.0


def refusal(plan: BudgetPlan, caps: Caps) -> str | None:
    """Why the silo cannot afford `plan` under `caps`, with the numbers; None when it can."""
    planned = plan.epsilon
    if planned is None:
        return None
    if caps.job is not None and planned > caps.job:
        return (
            f"privacy budget: this job would spend epsilon {fmt(planned)} here "
            f"({describe(plan)}), above {caps.job_key} {caps.job:g}"
        )
    if caps.total is not None:
        reach = caps.spent_elsewhere + planned
        if reach > caps.total:
            return (
                f"privacy budget: this job would spend epsilon {fmt(planned)} here "
                f"({describe(plan)}); with the {fmt(caps.spent_elsewhere)} spent by earlier "
                f"jobs that is {fmt(reach)}, above rules.total_epsilon_cap {caps.total:g}"
            )
    return None


def describe(plan: BudgetPlan) -> str:
    """ "training 4, evaluation 6.9 at delta 1e-05, 92 training rows": the plan in a line."""
    parts = ", ".join(f"{purpose} {fmt(e)}" for purpose, e in plan.by_purpose().items())
    return f"{parts or 'nothing noised'} at delta {plan.delta:g}, {plan.train_rows} training rows"


def name(mechanism: Mechanism) -> str:
    """A release in a line: "dp_sgd (noise 1.1, sample rate 0.1317, 8 steps)"."""
    if mechanism.kind == "dp_sgd":
        return (
            f"dp_sgd (noise {mechanism.noise_multiplier:.4g}, sample rate "
            f"{mechanism.sample_rate:.4g}, {mechanism.steps} steps)"
        )
    if mechanism.kind == "gaussian":
        return (
            f"gaussian (sensitivity {mechanism.sensitivity:.4g}, noise std "
            f"{mechanism.noise_std:.4g}, sample rate {mechanism.sample_rate:.4g})"
        )
    return mechanism.kind


def fmt(value: float | None) -> str:
    """Epsilon in a message: 4 significant digits, "inf" without noise, "-" without DP."""
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.4g}"


def json_epsilon(value: float | None) -> float | str | None:
    """An epsilon as JSON holds it: "inf" for infinity (standard JSON has none)."""
    return "inf" if value is not None and math.isinf(value) else value
