"""What an algorithm asks of a silo, its *silo contract*, read by both sides: the coordinator's
strategies build their tasks' configs with the builders here, and every silo checks each task
it receives against the contract of its own signed policy before anything runs
(silo/contract_gate.py): deny by default (docs/threat-model.md).

A contract is the algorithm's phases, each a `PhaseRule`: the rounds it may run in (0 is
setup), the task kind it sends, the tensors its weighted mean sums (such a phase runs inside
the policy's secure aggregation, if any), whether it hands models on, whether it only
reports scalars, and `expected(received, position, facts)`: the config an honest coordinator
sends at that position, derived from the silo's own policy and the task's public position
(round, phase, silo). The few fields an algorithm lets the coordinator choose (a FedDC silo's
`adopt`, AgnosticFedAvg's domain weights, R-FedTorch's update scale, a hand-off's recipient)
are copied from the received config once they pass their checks; any other difference is a
refusal naming the key. A rule's `tensors` fixes the names, shapes and dtypes of what a task
carries, from the silo's own model and data schema (`SiloFacts`).

Seeds, learning rates, epochs, steps, optimisers, proximal terms, mixup and the rest come
from the policy (`local_training`, `derived_train`), never from a task. Each algorithm's
config class declares its contract (`silo_contract`), beside its settings.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from fedsilo.policies.seeding import derive_seed
from fedsilo.wire.tasks import (
    DaisyReceive,
    EvaluateTask,
    FeatureMoments,
    Handoff,
    InitTask,
    LocalTraining,
    SchemaTask,
    Standardise,
    TaskConfig,
    TrainTask,
)
from fedsilo.wire.tasks.tensor_names import MODEL, SCALER_MEAN, SCALER_STD
from fedsilo.wire.tensors import ParameterSpec

if TYPE_CHECKING:
    from fedsilo.policies.schema import Policy


# The config keys that differ between the silos of one aggregation by design: each silo's own
# seeds (derived from its name) and a daisy chain's choice to adopt the aggregate. Everything
# else a secure sum's silos receive must be the same, which each one's signature binds.
PER_SILO_KEYS = frozenset({"seed", "model_seed", "local_seed", "adopt"})


class ContractError(ValueError):
    """A task outside the silo's own contract; the message names what differs."""


@dataclass(frozen=True)
class Position:
    """Where a task stands, as its header says: round (0: setup), phase, and the silo asked;
    `index`: the number in an indexed phase's name (`visit_3`: 3)."""

    round: int
    phase: str
    silo: str
    index: int | None = None


@dataclass(frozen=True)
class SiloFacts:
    """What a silo knows besides its policy: its name, the consortium's members as
    provisioned (itself included) with their hex X25519 sealing keys, its model's layout and
    its data's schema."""

    name: str
    members: tuple[str, ...]
    sealing_keys: Mapping[str, str]
    spec: ParameterSpec
    input_shape: tuple[int, ...]
    classes: int

    @property
    def consortium(self) -> int:
        return max(1, len(self.members))

    def model(self) -> TensorRule:
        """The flat model a task carries: the spec's length and dtype."""
        return TensorRule((self.spec.numel,), self.spec.dtype)


@dataclass(frozen=True)
class ChosenLength:
    """A dimension the coordinator chooses within `lengths`, the same length in every tensor
    of a task where a rule names it (`name`), e.g. a MultiBoost ensemble's size."""

    name: str
    lengths: range


# A dimension: its exact length, or one the coordinator chooses.
Dim = int | ChosenLength


@dataclass(frozen=True)
class TensorRule:
    """A tensor a task must carry: its shape and dtype (torch's name, "float32"); `value`:
    "zeros" or "model" for a reference a secure sum sends (all zeros, or the task's model)."""

    shape: tuple[Dim, ...]
    dtype: str
    value: str | None = None

    def fits(self, shape: tuple[int, ...], dtype: torch.dtype, chosen: dict[str, int]) -> bool:
        """Whether a tensor of `shape` and `dtype` is this one; a chosen length is recorded in
        `chosen` by its name the first time, and must be the same after."""
        if str(dtype).removeprefix("torch.") != self.dtype or len(shape) != len(self.shape):
            return False
        for n, d in zip(shape, self.shape, strict=True):
            if isinstance(d, ChosenLength):
                if n not in d.lengths or chosen.setdefault(d.name, n) != n:
                    return False
            elif n != d:
                return False
        return True

    def referring(self, value: str) -> TensorRule:
        """This tensor as a secure sum's reference: all zeros, or the task's model."""
        return replace(self, value=value)

    def describe(self) -> str:
        dims = ", ".join(
            f"{d.name} in {d.lengths.start}..{d.lengths.stop - 1}"
            if isinstance(d, ChosenLength)
            else str(d)
            for d in self.shape
        )
        return f"({dims}) {self.dtype}"


# What `expected` is given where nothing was received: no chosen field, the derived config.
_UNCHOSEN: Any = object()
Expected = Callable[[TaskConfig, Position, SiloFacts], TaskConfig]
Largest = Callable[[Position, SiloFacts], TaskConfig | None]
Tensors = Callable[[TaskConfig, Position, SiloFacts], dict[str, TensorRule]]
Rounds = Callable[[int], bool]


def carries_model(config: TaskConfig, position: Position, facts: SiloFacts) -> dict:
    return {MODEL: facts.model()}


def carries_nothing(config: TaskConfig, position: Position, facts: SiloFacts) -> dict:
    return {}


@dataclass(frozen=True)
class PhaseRule:
    """One phase of an algorithm, as a silo holds the coordinator to it.

    `name`: the phase's name; with `indices` a pattern such as "visit_{}", whose number runs
    below `indices(facts)`. `kind`: the task kind sent (the one a secure sum wraps). `rounds`:
    the rounds it may run in. `sums`: the tensors its weighted mean sums (none: its answers
    reach the coordinator one by one); `references`: for each summed tensor the task does not
    carry, what a secure sum sends as its reference ("zeros" or "model") and its shape.
    `routed`: its models are handed on (daisy chains). `handed_from`: the phase of the same
    round whose hand-off a position's task must train (None: any model the silo hosts).
    `once_a_round`: a silo takes at most one of an indexed phase's positions a round (a cyclic
    visit), recorded durably; `round_slot`: rules that share one are alternatives, a silo
    answers at most one of their positions a round (FedDC's local step, aggregation or
    hand-off), recorded the same way. `largest`: the config a coordinator sends when it makes
    every choice the rule leaves it at its largest release (a MultiBoost silo's every edge, a
    client-DP round's whole cohort), for the privacy planner (silo/budget_plan.py); None: the
    derived config. `from_reference`: in a secure sum, a silo sends only a model it
    trained from the sum's reference (FedDC's hosted models: adopted from it, or handed on from
    a silo that did). `evaluates`: the split on which an evaluation of the model sent reports
    (`evaluation_rule`), which cross-site validation reads (`cross_site_rows`). A
    phase that only reports scalars (a loss probe, an evaluation) is answered, like every
    position, once: the allowance that bounds an oracle (docs/threat-model.md)."""

    name: str
    kind: str
    rounds: Rounds
    expected: Expected
    tensors: Tensors = carries_model
    sums: tuple[str, ...] = ()
    references: Callable[[SiloFacts], dict[str, TensorRule]] = lambda facts: {}
    routed: bool = False
    indices: Callable[[SiloFacts], int] | None = None
    handed_from: Callable[[Position], str | None] = lambda position: None
    once_a_round: bool = False
    from_reference: bool = False
    round_slot: str | None = None
    largest: Largest = lambda position, facts: None
    evaluates: str | None = None

    @property
    def slot(self) -> str | None:
        """The name a silo records its one position a round under (None: not limited)."""
        return self.round_slot or (self.name if self.once_a_round else None)

    def planned_config(self, position: Position, facts: SiloFacts) -> TaskConfig:
        """The config of this rule's largest release at `position` (`largest`, checked as
        any received config is)."""
        largest = self.largest(position, facts)
        return self.expected(largest if largest is not None else _UNCHOSEN, position, facts)

    def match(self, phase: str, facts: SiloFacts) -> int | None | bool:
        """False when `phase` is not this rule's; else its index (None for a plain name)."""
        if self.indices is None:
            return None if phase == self.name else False
        found = re.fullmatch(re.escape(self.name).replace(r"\{\}", r"(0|[1-9][0-9]*)"), phase)
        if found is None or int(found[1]) >= self.indices(facts):
            return False
        return int(found[1])


@dataclass(frozen=True)
class SiloContract:
    """An algorithm's phases: what a silo under its policy answers, and nothing else."""

    algorithm: str
    rules: tuple[PhaseRule, ...]
    rounds: int

    def position(
        self, round_no: int, phase: str, silo: str, facts: SiloFacts
    ) -> tuple[PhaseRule, Position]:
        """The rule of `phase` in round `round_no`, or a ContractError saying why there is none."""
        if not 0 <= round_no <= self.rounds:
            raise ContractError(
                f"round {round_no} is outside this silo's policy (rounds 0..{self.rounds})"
            )
        for rule in self.rules:
            index = rule.match(phase, facts)
            if index is not False and rule.rounds(round_no):
                return rule, Position(round_no, phase, silo, index)
        known = sorted({r.name for r in self.rules})
        raise ContractError(
            f"phase {phase!r} is not one of {self.algorithm}'s phases in round {round_no} "
            f"(its phases: {', '.join(known)})"
        )

    def planned_positions(
        self, facts: SiloFacts
    ) -> Iterator[tuple[PhaseRule, Position, TaskConfig]]:
        """Every position this contract lets a coordinator ask of the silo `facts` describes,
        round by round in phase order, with its largest config: the most a job can ask of it
        (one position of an indexed or slotted phase a round where the silo takes one; every
        index of another indexed phase). What the privacy planner books in advance."""
        for round_no in range(self.rounds + 1):
            slots: set[str] = set()
            for rule in self.rules:
                if not rule.rounds(round_no) or rule.slot in slots:
                    continue
                if rule.slot is not None:
                    slots.add(rule.slot)
                count = 1 if rule.indices is None else rule.indices(facts)
                indices = [None] if rule.indices is None else list(range(count))
                for index in indices[:1] if rule.slot is not None else indices:
                    phase = rule.name if index is None else rule.name.replace("{}", str(index))
                    position = Position(round_no, phase, facts.name, index)
                    yield rule, position, rule.planned_config(position, facts)

    def next_aggregation(self, round_no: int, phase: str) -> int | None:
        """The first round after `round_no` in which `phase` is one of the contract's weighted
        means (None: none up to the last round): the aggregation keys are folded for."""
        sums = [r for r in self.rules if r.name == phase and r.indices is None and r.sums]
        for later in range(round_no + 1, self.rounds + 1):
            if any(rule.rounds(later) for rule in sums):
                return later
        return None

    def aggregates(self, round_no: int, phase: str, facts: SiloFacts) -> bool:
        """Whether `phase` of round `round_no` is one of the contract's weighted means."""
        try:
            rule, _ = self.position(round_no, phase, facts.name, facts)
        except ContractError:
            return False
        return bool(rule.sums)


# -- rounds ---------------------------------------------------------------------------------------


def setup_round(round_no: int) -> bool:
    return round_no == 0


def every_round(policy: Policy) -> Rounds:
    return lambda round_no: 1 <= round_no <= policy.rounds


def evaluation_rounds(policy: Policy) -> Rounds:
    """The rounds the engine evaluates after: every `eval_every`-th and the last."""
    return lambda r: 1 <= r <= policy.rounds and (r % policy.eval_every == 0 or r == policy.rounds)


# -- what every task derives from the policy ----------------------------------------------------


def local_training(policy: Policy, position: Position, seed: int | None = None) -> LocalTraining:
    """A training task's local settings at `position`: the policy's `training:` section, the
    learning rate of its schedule at that round, the algorithm's proximal weight, and the
    minibatch seed drawn from (seed, round, silo) (`seed`: another run seed, e.g. a MultiBoost
    base learner's; the round then counts as 1 for the schedule)."""
    training = policy.training
    round_no = position.round if seed is None else 1
    return LocalTraining(
        epochs=training.epochs,
        steps=training.steps,
        batch_size=training.batch_size,
        optimizer=training.optimizer,
        lr=training.lr_at(round_no - 1, policy.rounds),
        momentum=training.momentum,
        weight_decay=training.weight_decay,
        prox_mu=float(getattr(policy.algorithm, "prox_mu", 0.0)),
        seed=derive_seed(policy.seed if seed is None else seed, "round", round_no, "train",
                         position.silo),
    )  # fmt: skip


def derived_train(policy: Policy, position: Position, seed: int | None = None) -> TrainTask:
    """The `train` config at `position`: local training, the options the algorithm derives
    from the policy (`train_options`), none of those the coordinator chooses, and the
    policy's `compression` (so a silo whose own policy does not ask refuses a task that
    would have it quantize, and one whose policy asks refuses a task that would not)."""
    options = policy.algorithm.train_options(policy, position)
    compression = None if policy.compression is None else policy.compression.on_the_wire()
    return TrainTask(
        local=local_training(policy, position, seed), compression=compression, **options
    )


def chosen_train_options(policy: Policy) -> dict[str, Callable[[Any, SiloFacts], Any]]:
    """The `train` options a coordinator chooses under `policy`, each with its check: the
    algorithm's (`chosen_train_options`) and, under client-level DP with distributed noise,
    the cohort that shares the round's noise (between min_silos and the round's cohort size)."""
    chosen = dict(policy.algorithm.chosen_train_options(policy))
    client_dp = policy.privacy.client_dp
    if client_dp is not None and client_dp.noise == "distributed":
        chosen["cohort"] = lambda value, facts: whole_number_within(
            value,
            "cohort",
            policy.participants.min_silos,
            policy.cohort_size(facts.consortium),
        )
    return chosen


def expected_train(policy: Policy) -> Expected:
    """`expected` of a `train` phase: the derived config, with the chosen options copied."""

    def expected(received: TaskConfig, position: Position, facts: SiloFacts) -> TaskConfig:
        derived = derived_train(policy, position)
        return with_chosen(derived, received, chosen_train_options(policy), facts)

    return expected


def with_chosen(
    derived: TaskConfig,
    received: TaskConfig,
    chosen: Mapping[str, Callable[[Any, SiloFacts], Any]],
    facts: SiloFacts,
) -> TaskConfig:
    """`derived` with each of the `chosen` fields `received` sets, once its check passes."""
    if type(received) is not type(derived):
        return derived
    values = {}
    for name, check in chosen.items():
        value = getattr(received, name)
        if value is not None:
            values[name] = check(value, facts)
    return replace(derived, **values) if values else derived


# -- checks of what a coordinator chooses ------------------------------------------------------


def finite_within(value: Any, name: str, low: float, high: float) -> float:
    value = float(value)
    if not (math.isfinite(value) and low <= value <= high):
        raise ContractError(f"config key {name!r} is {value!r}; this silo takes {low:g}..{high:g}")
    return value


def whole_number_within(value: Any, name: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ContractError(f"config key {name!r} is {value!r}; this silo takes {low}..{high}")
    return value


def non_negative_weights(value: Any, facts: SiloFacts) -> Mapping[str, float]:
    """Domain weights: finite and non-negative, at least one positive."""
    weights = {str(k): float(v) for k, v in dict(value).items()}
    if not weights or any(not (math.isfinite(w) and w >= 0) for w in weights.values()):
        raise ContractError(
            f"config key 'domain_weights' must be finite and non-negative, not {weights}"
        )
    if not any(w > 0 for w in weights.values()):
        raise ContractError("config key 'domain_weights' gives every domain weight 0")
    return weights


# -- the phases most algorithms share ------------------------------------------------------------


def setup_rules(policy: Policy) -> tuple[PhaseRule, ...]:
    """Setup (round 0): federated scaling's moments and scaler when the policy asks for it,
    and the initial model from the run's seed."""
    rules = [
        PhaseRule(
            "init",
            "init",
            setup_round,
            lambda r, p, f: init_config(policy),
            carries_nothing,
        )
    ]
    if policy.data.scaling == "federated":
        rules += [
            PhaseRule(
                "moments",
                "feature_moments",
                setup_round,
                lambda r, p, f: FeatureMoments(),
                carries_nothing,
                sums=("count", "sum", "sumsq"),
            ),
            PhaseRule(
                "standardise",
                "standardise",
                setup_round,
                lambda r, p, f: Standardise(),
                scaler_tensors,
            ),
        ]
    return tuple(rules)


def schema_rule() -> PhaseRule:
    """Setup's data schema (one input row's shape and the classes), for algorithms that build
    something of their own from it."""
    return PhaseRule("schema", "schema", setup_round, lambda r, p, f: SchemaTask(), carries_nothing)


def init_config(policy: Policy) -> InitTask:
    return InitTask(seed=derive_seed(policy.seed, "model-init"))


def scaler_tensors(config: TaskConfig, position: Position, facts: SiloFacts) -> dict:
    width = math.prod(facts.input_shape)
    return {
        SCALER_MEAN: TensorRule((width,), "float64"),
        SCALER_STD: TensorRule((width,), "float64"),
    }


def evaluation_rule(policy: Policy, split: str = "test", name: str = "evaluate") -> PhaseRule:
    """The global model's metrics on `split`, after each evaluation round."""
    return PhaseRule(
        name,
        "evaluate",
        evaluation_rounds(policy),
        lambda r, p, f: EvaluateTask(split=split),
        evaluates=split,
    )


# -- cross-site validation (`evaluation.cross_site`) ----------------------------------------------

# Its phases, one per row of the matrix: row k's model on each silo's test split, in the last
# round, after the final evaluation (coordinator/cross_site.py).
CROSS_SITE = "cross_site_{}"


def is_cross_site(phase: str) -> bool:
    """Whether `phase` is one of cross-site validation's (`cross_site_<k>`)."""
    return (
        re.fullmatch(re.escape(CROSS_SITE).replace(r"\{\}", "(0|[1-9][0-9]*)"), phase) is not None
    )


@dataclass(frozen=True)
class CrossSiteRows:
    """The models cross-site validation may evaluate under a policy, read from its algorithm's
    phases in the last round. `global_model`: the algorithm evaluates a global model on the
    test split, or averages the silos' models into one; `site_models`: each silo's model of the
    last `train` phase reaches the coordinator in the clear (averaged in the clear, or returned
    one by one), else `why_not_sites` says why in a line."""

    global_model: bool
    site_models: bool
    why_not_sites: str | None = None

    def count(self, facts: SiloFacts) -> int:
        """The most cross-site positions a silo answers: a row for the global model and one
        for each member's model."""
        return int(self.global_model) + (facts.consortium if self.site_models else 0)


def cross_site_rows(policy: Policy, rules: tuple[PhaseRule, ...]) -> CrossSiteRows:
    """What cross-site validation can evaluate under `policy`, whose algorithm has `rules`."""
    last = policy.rounds
    trains = [rule for rule in rules if rule.name == "train" and rule.rounds(last)]
    averaged = any(MODEL in rule.sums for rule in trains)
    returned = any(
        not rule.sums and not rule.routed and rule.kind == TrainTask.KIND for rule in trains
    )
    evaluated = any(rule.evaluates == "test" and rule.rounds(last) for rule in rules)
    secure = policy.secure_aggregation
    why = None
    if not (averaged or returned):
        why = f"{policy.algorithm.name} sends the coordinator no site's own model in its last round"
    elif secure.enabled:
        why = (
            f"under secure_aggregation {secure.method} the coordinator holds only the sum of "
            "the sites' models, never one site's"
        )
    elif policy.privacy.client_dp is not None:
        why = (
            "under privacy.client_dp the coordinator takes each site's model only clipped, into "
            "a noised mean"
        )
    return CrossSiteRows(evaluated or averaged, why is None, why)


def cross_site_rules(policy: Policy, rules: tuple[PhaseRule, ...]) -> tuple[PhaseRule, ...]:
    """The cross-site phase, when `policy` asks for it and its algorithm (`rules`) has a model
    to evaluate: each row's plain `evaluate` of the test split, in the last round, at most
    `CrossSiteRows.count` rows."""
    if not policy.evaluation.cross_site:
        return ()
    rows = cross_site_rows(policy, rules)
    if not (rows.global_model or rows.site_models):
        return ()
    return (
        PhaseRule(
            CROSS_SITE,
            EvaluateTask.KIND,
            lambda r: r == policy.rounds,
            lambda r, p, f: EvaluateTask(split="test"),
            indices=rows.count,
        ),
    )


def cross_site_problem(policy: Policy) -> str | None:
    """Why `policy`'s `evaluation.cross_site` cannot run (its algorithm's contract has no
    cross-site phase: no model the coordinator holds is evaluated with `evaluate`), or None."""
    if not policy.evaluation.cross_site:
        return None
    contract = policy.algorithm.silo_contract(policy)
    if any(rule.name == CROSS_SITE for rule in contract.rules):
        return None
    return (
        f"evaluation.cross_site: {policy.algorithm.name} evaluates no model the coordinator "
        "holds with the evaluate task (neither a global model nor each site's own model "
        "reaches it in the clear); set cross_site to false or choose another algorithm"
    )


def train_rule(policy: Policy, sums: tuple[str, ...] = (MODEL,)) -> PhaseRule:
    """Each round's `train` phase, its models summed as `sums` says (none: one by one)."""
    return PhaseRule(
        "train",
        "train",
        every_round(policy),
        expected_train(policy),
        sums=sums,
        largest=largest_train(policy),
    )


def largest_train(policy: Policy) -> Largest:
    """A `train` task with the coordinator's choices at their largest release: under
    client-level DP with distributed noise, the round's whole cohort (each silo's share of the
    noise is smallest then)."""

    def largest(position: Position, facts: SiloFacts) -> TaskConfig | None:
        client_dp = policy.privacy.client_dp
        if client_dp is None or client_dp.noise != "distributed":
            return None
        return replace(derived_train(policy, position), cohort=policy.cohort_size(facts.consortium))

    return largest


def averaging_contract(policy: Policy, *rules: PhaseRule) -> SiloContract:
    """Setup, then `rules` (FedAvg's round when none are given: the `train` phase, a weighted
    mean of models, and the evaluation of the global model on each silo's test split), then
    cross-site validation where the policy asks for it (`cross_site_rules`)."""
    rules = rules or (train_rule(policy), evaluation_rule(policy))
    cross_site = cross_site_rules(policy, rules)
    return SiloContract(
        policy.algorithm.name, (*setup_rules(policy), *rules, *cross_site), policy.rounds
    )


def report_rule(
    policy: Policy,
    name: str,
    kind: str,
    config: Callable[[Position], TaskConfig],
    rounds: Rounds | None = None,
) -> PhaseRule:
    """A phase whose answers are scalar reports of the model sent (a loss probe), each round
    unless `rounds` says otherwise; its config derived from the position alone."""

    def expected(received: TaskConfig, position: Position, facts: SiloFacts) -> TaskConfig:
        return config(position)

    return PhaseRule(name, kind, rounds or every_round(policy), expected)


# -- daisy chains ---------------------------------------------------------------------------------


def checked_handoff(handoff: Handoff | None, policy: Policy, facts: SiloFacts) -> Handoff | None:
    """A hand-off's recipient as a coordinator chooses it: sealed to another member's key
    under `channel.sealed_handoffs`, else in the clear (None: the model is kept)."""
    if handoff is None:
        return None
    if not policy.channel.sealed_handoffs:
        if handoff.seal_to is not None:
            raise ContractError("config key 'handoff': this silo's policy hands models on plain")
        return handoff
    others = {key for name, key in facts.sealing_keys.items() if name != facts.name}
    if handoff.seal_to not in others:
        raise ContractError(
            "config key 'handoff' seals to no other member's key (channel.sealed_handoffs)"
        )
    return handoff


def return_window(policy: Policy) -> int:
    """How many of a hosted model's last holders a hand-off never goes to (FedDC's
    `no_return_window`; 0 for an algorithm without one)."""
    return int(getattr(policy.algorithm, "no_return_window", 0))


def daisy_tensors(config: TaskConfig, position: Position, facts: SiloFacts) -> dict:
    """A `daisy_train` task carries a model only when it says to adopt one."""
    return {MODEL: facts.model()} if getattr(config, "adopt", False) else {}


def routed_receive(policy: Policy) -> DaisyReceive:
    """The `daisy_receive` step of a routed phase: sealed as the policy says."""
    return DaisyReceive(sealed=policy.channel.sealed_handoffs)
