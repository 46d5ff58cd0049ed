"""The strategy contract: a round is a generator that yields phases and returns the next state.

A strategy decides; it never talks to silos. `setup` builds the initial state, `round` reads
like the paper's pseudocode, `evaluate` asks silos for held-out metrics of the current model.
State is an immutable `ServerState` (tensors + JSON-able extras), so a round that fails
midway leaves the previous state untouched.
"""

from __future__ import annotations

import hashlib
from collections.abc import Generator, Mapping
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

import numpy as np
import torch

from fedsilo.coordinator.phases import Identical, Phase, PhaseOutcome, Task, WeightedMean
from fedsilo.coordinator.strategies.mixing_state import MixingState
from fedsilo.models.architecture import describe_spec, spec_difference
from fedsilo.models.warm_start import WarmStartError, fit_problem, load_pinned
from fedsilo.policies.algorithms.contract import (
    CROSS_SITE,
    Position,
    derived_train,
    init_config,
)
from fedsilo.policies.schema import Policy
from fedsilo.policies.seeding import derive_rng, derive_seed
from fedsilo.wire.messages import schema_of
from fedsilo.wire.tasks import (
    EvaluateTask,
    FeatureMoments,
    SchemaTask,
    Standardise,
    TaskConfig,
)
from fedsilo.wire.tasks.tensor_names import (
    MODEL,
    MOMENT_COUNT,
    MOMENT_SUM,
    MOMENT_SUMSQ,
    SCALER_MEAN,
    SCALER_STD,
)
from fedsilo.wire.tensors import ParameterSpec

MIXING = "mixing"  # state.extra of a mixing schedule: its `MixingState` as JSON


@dataclass(frozen=True)
class ServerState:
    tensors: Mapping[str, torch.Tensor]
    spec: ParameterSpec
    extra: Mapping[str, Any] = field(default_factory=dict)

    @property
    def model(self) -> torch.Tensor:
        return self.tensors[MODEL]


@dataclass(frozen=True)
class RoundContext:
    """What a round may know: its number (1-based; 0 is setup), the silos still active, the
    seed, and the coordinator's secret.

    `rng` and `seed_for` derive from the policy's seed, which every silo knows; draws no silo
    may predict (noise the coordinator adds) come from `private_generator`, keyed with
    `secret` as well.
    """

    round: int
    total_rounds: int
    silos: tuple[str, ...]
    seed: int
    min_silos: int
    secret: bytes = field(default=b"", repr=False)

    def rng(self, *purpose: int | str) -> np.random.Generator:
        return derive_rng(self.seed, "round", self.round, *purpose)

    def seed_for(self, *purpose: int | str) -> int:
        return derive_seed(self.seed, "round", self.round, *purpose)

    def private_generator(self, *purpose: int | str) -> torch.Generator:
        """A generator for this round's `purpose` that only the coordinator can predict."""
        label = "/".join(str(p) for p in (self.seed, "round", self.round, *purpose)).encode()
        digest = hashlib.blake2b(label, key=self.secret[:64], digest_size=8).digest()
        return torch.Generator().manual_seed(int.from_bytes(digest, "little") >> 1)


def mixing_weights(extra: Mapping[str, Any]) -> dict[str, float] | None:
    """Each silo's mixing coefficient after a round of a mixing schedule (else None)."""
    weights = MixingState.from_json(extra[MIXING]).weights if MIXING in extra else None
    return dict(weights) if weights else None


RoundScript = Generator[Phase, PhaseOutcome, ServerState]
EvaluationScript = Generator[Phase, PhaseOutcome, PhaseOutcome]
CrossSiteScript = Generator[Phase, PhaseOutcome, dict[str, PhaseOutcome]]


class SetupError(RuntimeError):
    """The silos cannot agree on an initial model (their data schemas or policies differ)."""


def initial_model_mismatch(out: PhaseOutcome) -> str:
    """Which silos built an initial model other than the majority's, with the input width and
    number of classes each silo built for (its `init` answer's schema metrics)."""
    groups: dict[str, list[str]] = {}
    for silo, digest in sorted(out.digests.items()):
        groups.setdefault(digest, []).append(silo)
    ranked = sorted(groups.values(), key=len, reverse=True)
    built = {silo: _built_for(out.reports[silo].metrics) for silo in out.digests}
    why = "their feature schemas or model settings disagree"

    def each(silos: list[str]) -> str:
        return ", ".join(f"{silo!r} {built[silo]}" for silo in sorted(silos))

    if len(ranked[0]) == len(ranked[1]):
        every = each(list(out.digests))
        return f"the silos built different initial models and no majority agrees ({every}): {why}"
    majority, odd = ranked[0], [silo for group in ranked[1:] for silo in group]
    schemas = {built[silo] for silo in majority}
    them = (
        ", ".join(map(repr, majority)) + f" {schemas.pop()}"
        if len(schemas) == 1
        else each(majority)
    )
    said = "silo" if len(odd) == 1 else "silos"
    return f"{said} {each(odd)} built a different initial model than the majority ({them}): {why}"


def _built_for(metrics: Mapping[str, float]) -> str:
    """`(input width 13, 2 classes)` from an init answer's schema metrics."""
    if "classes" not in metrics:
        return "(input width and classes not reported)"
    shape, classes = schema_of(metrics)
    inputs = (
        f"input width {shape[0]}" if len(shape) == 1 else "input shape " + "x".join(map(str, shape))
    )
    return f"({inputs}, {f'{classes} classes' if classes else 'no classes (regression)'})"


class Strategy:
    name: ClassVar[str]

    def __init__(self, policy: Policy) -> None:
        self.policy = policy

    def setup(self, ctx: RoundContext) -> RoundScript:
        """Every silo builds the model from the run's seed; all answers must be identical. A
        warm start (`model.init`) replaces the model with the file's, read here, once its
        digest is the policy's and its tensors fit the network the silos built."""
        init = self.policy.model.init
        try:
            warm = None if init is None else load_pinned(init)
        except WarmStartError as error:
            raise SetupError(str(error)) from None
        if self.policy.data.scaling == "federated":
            yield from self.federated_scaling(ctx)
        tasks = tuple(Task(s, init_config(self.policy)) for s in ctx.silos)
        out = yield Phase("init", tasks, aggregate=Identical((MODEL,)), quorum=1)
        ((_, tensors),) = out.tensors.items()
        if len(set(out.digests.values())) > 1:
            raise SetupError(initial_model_mismatch(out))
        assert out.spec is not None
        difference = spec_difference(self.policy.model, out.spec)
        if difference is not None:
            raise SetupError(f"the initial model is not the one the policy pins: {difference}")
        if warm is None:
            return ServerState({MODEL: tensors[MODEL]}, out.spec)
        problem = fit_problem(warm, describe_spec(out.spec), "the silos built")
        if problem is not None:
            raise SetupError(problem)
        return ServerState({MODEL: warm.model}, out.spec)

    def classification_schema(
        self, ctx: RoundContext
    ) -> Generator[Phase, PhaseOutcome, tuple[tuple[int, ...], int]]:
        """The silos' common input shape and number of classes (a `schema` phase); refused
        when two silos disagree or the task is not a classification."""
        out = yield Phase("schema", tuple(Task(s, SchemaTask()) for s in ctx.silos), quorum=1)
        schemas = {s: schema_of(r.metrics) for s, r in out.reports.items()}
        first = min(schemas)
        for silo, schema in sorted(schemas.items()):
            if schema != schemas[first]:
                raise SetupError(
                    f"silo {silo!r} has inputs {schema}, {first!r} has {schemas[first]}"
                )
        shape, classes = schemas[first]
        if classes < 2:
            raise SetupError(
                f"{self.name} needs a classification task (the silos report no classes)"
            )
        return shape, classes

    def federated_scaling(self, ctx: RoundContext) -> Generator[Phase, PhaseOutcome, None]:
        """Consortium-wide feature mean and std from the silos' summed moments, then broadcast.

        The strategy sees only the sums (averaged with equal weights, so every ratio below is
        the pooled one), never one silo's moments.
        """
        names = (MOMENT_COUNT, MOMENT_SUM, MOMENT_SUMSQ)
        out = yield Phase(
            "moments",
            tuple(Task(s, FeatureMoments()) for s in ctx.silos),
            aggregate=WeightedMean(names, weights=dict.fromkeys(ctx.silos, 1.0)),
        )
        count = out.mean[MOMENT_COUNT].clamp(min=1e-12)
        mean = out.mean[MOMENT_SUM] / count
        std = (out.mean[MOMENT_SUMSQ] / count - mean**2).clamp(min=0).sqrt()
        std = torch.where(std > 1e-12, std, torch.ones_like(std))
        scaler = {SCALER_MEAN: mean, SCALER_STD: std}
        yield Phase(
            "standardise",
            tuple(Task(s, Standardise(), tensors=scaler) for s in self.data_silos(ctx)),
        )

    def data_silos(self, ctx: RoundContext) -> tuple[str, ...]:
        """Every endpoint holding data this strategy trains or evaluates on."""
        return ctx.silos

    def round(self, state: ServerState, ctx: RoundContext) -> RoundScript:
        raise NotImplementedError

    def evaluate(self, state: ServerState, ctx: RoundContext) -> EvaluationScript:
        """The current global model on every silo's test split."""
        tasks = tuple(self.evaluate_task(s, state.model, state.spec) for s in ctx.silos)
        return (yield Phase("evaluate", tasks, quorum=1))

    def global_model(self, state: ServerState) -> torch.Tensor | None:
        """The final global model, the cross-site matrix's first row; None for a strategy that
        keeps none (`local`: a model per silo)."""
        return state.tensors.get(MODEL)

    def cross_site(
        self, models: Mapping[str, torch.Tensor], state: ServerState, ctx: RoundContext
    ) -> CrossSiteScript:
        """Cross-site validation (coordinator/cross_site.py): each of `models` (by row, in
        order) on every silo's test split with the plain `evaluate` task, row k in phase
        `cross_site_<k>`; each row's outcome."""
        outcomes = {}
        for index, (row, model) in enumerate(models.items()):
            tasks = tuple(self.evaluate_task(s, model, state.spec) for s in ctx.silos)
            outcomes[row] = yield Phase(CROSS_SITE.format(index), tasks, quorum=0)
        return outcomes

    # -- building blocks shared by strategies -------------------------------------------------

    def sample_silos(self, ctx: RoundContext) -> tuple[str, ...]:
        """The policy's cohort of the active silos (`Policy.cohort_size`), drawn without
        replacement, seeded by round."""
        k = self.policy.cohort_size(len(ctx.silos))
        if k == len(ctx.silos):
            return ctx.silos
        chosen = ctx.rng("sample").choice(len(ctx.silos), size=k, replace=False)
        return tuple(ctx.silos[i] for i in sorted(chosen))

    def train_task(
        self,
        silo: str,
        model: torch.Tensor,
        spec: ParameterSpec,
        ctx: RoundContext,
        **chosen: Any,
    ) -> Task:
        """The round's training task for `silo` from `model`: the config the algorithm's silo
        contract derives from the policy (policies/algorithms/contract.py), which every silo
        checks, with the options the strategy chooses (`chosen`: AgnosticFedAvg's domain
        weights, R-FedTorch's update scale)."""
        config = self.train_config(Position(ctx.round, "train", silo), **chosen)
        return Task(silo, config, {MODEL: model}, spec)

    def train_config(self, position: Position, **chosen: Any) -> TaskConfig:
        """The config of the strategy's training task: `train` here (SuPerFed, FedEvg, SCAFFOLD
        and FedDRO send their own kinds)."""
        derived = derived_train(self.policy, position)
        return replace(derived, **chosen) if chosen else derived

    @staticmethod
    def evaluate_task(
        silo: str, model: torch.Tensor, spec: ParameterSpec, split: str = "test"
    ) -> Task:
        return Task(silo, EvaluateTask(split=split), {MODEL: model}, spec)
