"""The deployment policy: one versioned document that selects algorithm, model, training,
participation rules, compute placement and (for simulations) the data."""

from __future__ import annotations

import math
import typing
from collections.abc import Callable
from typing import Any

from pydantic import (
    Field,
    SerializeAsAny,
    TypeAdapter,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from fedsilo.policies.algorithms import AlgorithmConfig
from fedsilo.policies.algorithms.base import AlgorithmBase, algorithm_classes, names_of
from fedsilo.policies.algorithms.contract import cross_site_problem
from fedsilo.policies.algorithms.fedavg import FedAvgConfig
from fedsilo.policies.algorithms.former_mixing import SCHEDULE_SETTINGS, moved_message
from fedsilo.policies.algorithms.plugins import validate_plugin_algorithm
from fedsilo.policies.base import PolicyModel
from fedsilo.policies.channel import ChannelConfig
from fedsilo.policies.compression import CompressionConfig
from fedsilo.policies.compute import ComputeConfig
from fedsilo.policies.data import DataConfig
from fedsilo.policies.evaluation import EvaluationConfig
from fedsilo.policies.model import LinearModel, ModelConfig
from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.policies.secure_aggregation import SecureAggregationConfig
from fedsilo.policies.training import TrainingConfig

SUPPORTED_VERSIONS = (1,)
MAX_SEED = 2**32 - 1  # every generator a silo seeds (NumPy, torch) takes it
MAX_PHASE_TIMEOUT_S = 7 * 24 * 3600.0
MAX_ROUNDS = 1_000_000


class ParticipantsConfig(PolicyModel):
    """Quorum and deadlines: a phase needs `min_silos` answers within `phase_timeout_s`; a job
    short of its quorum waits `quorum_grace_s` for silos to come back before it fails."""

    # the quorum: the fewest silos whose answers a phase that aggregates or hands models on
    # needs; a round with fewer fails, and a consortium smaller than this is refused (1 by default)
    min_silos: int = Field(default=1, ge=1)
    # seconds each phase waits for the silos' answers; answers that come later are dropped, and a
    # phase left short of its quorum fails its round (600 by default, at most a week)
    phase_timeout_s: float = Field(default=600.0, gt=0, le=MAX_PHASE_TIMEOUT_S)
    # the run stops after this many failed rounds in a row (a failed round leaves the model as it
    # was; 3 by default)
    max_consecutive_failed_rounds: int = Field(default=3, ge=1)
    # seconds a deployment short of its quorum waits for silos to come back (an agent restarted
    # by its service manager rejoins) before its next round; 0 fails the round at once
    quorum_grace_s: float = Field(default=60.0, ge=0, le=MAX_PHASE_TIMEOUT_S)


class Policy(PolicyModel):
    # the policy format's version; 1, the only one (required)
    version: int
    # the run's name, shown in logs, metrics and reports (fedsilo-run by default)
    name: str = Field(default="fedsilo-run", min_length=1)
    # the seed every random draw of the run derives from (partitions, sampling, model
    # initialisation), so a run can be repeated (0 by default)
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    # how many federated rounds the job runs (20 by default)
    rounds: int = Field(default=20, ge=1, le=MAX_ROUNDS)
    # every how many rounds the model is evaluated on the silos' held-out data (1 by default: every
    # round)
    eval_every: int = Field(default=1, ge=1)
    # which federated algorithm runs, chosen by name, with its own settings (fedavg by default); a
    # name no built-in algorithm has selects an installed strategy plug-in (entry point group
    # fedsilo.algorithms)
    algorithm: SerializeAsAny[AlgorithmConfig] = FedAvgConfig(name="fedavg")
    # which network each silo trains, chosen by name (linear by default)
    model: ModelConfig = LinearModel(name="linear")
    # how each silo trains locally each round: epochs or steps, batch size, optimiser, learning rate
    training: TrainingConfig = TrainingConfig()
    # the quorum and deadlines every phase of a round is held to
    participants: ParticipantsConfig = ParticipantsConfig()
    # where each silo trains (device), and what a simulated silo reserves on a Ray cluster
    compute: ComputeConfig = ComputeConfig()
    # where the rows come from, how they become silos and how each silo splits them
    data: DataConfig = DataConfig()
    # how each silo's data is protected (DP-SGD, client-level DP, noisy reports) and accounted
    privacy: PrivacyConfig = PrivacyConfig()
    # how the coordinator sums models without seeing any one silo's (none by default)
    secure_aggregation: SecureAggregationConfig = SecureAggregationConfig()
    # how models that move between silos travel
    channel: ChannelConfig = ChannelConfig()
    # how each silo's update travels to the coordinator: quantized to 8 or 16 bits a value
    # (docs/compression.md); null (the default): the trained model as it is, 32 bits a value
    compression: CompressionConfig | None = None
    # what the job evaluates besides each evaluation round's metrics: cross_site, the matrix of
    # every model on every site's test split after the final evaluation (off by default)
    evaluation: EvaluationConfig = EvaluationConfig()

    @model_validator(mode="before")
    @classmethod
    def _known_version(cls, data: Any) -> Any:
        if isinstance(data, dict):
            version = data.get("version")
            if version is None:
                raise ValueError(
                    "'version' is required; this fedsilo reads policy version(s) "
                    f"{SUPPORTED_VERSIONS}"
                )
            if version not in SUPPORTED_VERSIONS:
                raise ValueError(
                    f"unsupported policy version {version!r}; "
                    f"this fedsilo reads {SUPPORTED_VERSIONS}"
                )
        return data

    @field_validator("algorithm", mode="wrap")
    @classmethod
    def _plugin_algorithm(cls, value: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        builtin = [name for config in algorithm_classes() for name in names_of(config)]
        try:
            plugin = validate_plugin_algorithm(value, builtin)
        except ValidationError as exc:  # the plug-in's own fields, named under algorithm.
            raise ValueError(
                "; ".join(
                    f"{'.'.join(str(part) for part in error['loc']) or 'algorithm'}: "
                    f"{error['msg'].removeprefix('Value error, ')}"
                    for error in exc.errors()
                )
            ) from None
        return plugin if plugin is not None else handler(value)

    @model_validator(mode="before")
    @classmethod
    def _no_mixing_section(cls, data: Any) -> Any:
        if isinstance(data, dict) and "mixing" in data:
            raise ValueError(moved_message(data["mixing"], data.get("algorithm")))
        return data

    @model_validator(mode="after")
    def _privacy_fits_the_algorithm_and_data(self) -> Policy:
        needed = sorted(set(self.privacy.reports.forbidden) & self.algorithm.reports)
        if needed:
            raise ValueError(
                f"privacy.reports.forbidden: {self.algorithm.name} cannot run without "
                f"{needed} reports (it weights silos by sample counts and evaluates held-out "
                "metrics); allow them or choose another algorithm"
            )
        dp = self.privacy.differentially_private or self.privacy.client_dp is not None
        if dp and self.data.scaling == "federated":
            raise ValueError(
                "data.scaling: 'federated' sends each silo's exact feature sums, which DP "
                "does not cover; with privacy.dp_sgd or privacy.client_dp use scaling 'local'"
            )
        hands_off = self.algorithm.hands_off
        if self.privacy.client_dp is not None and hands_off:
            raise ValueError(
                f"privacy.client_dp: {self.algorithm.name} hands single silos' models to other "
                "silos, which noise added to an aggregate does not protect; use privacy.dp_sgd "
                "(noise on every local step, so on every hop)"
            )
        if self.channel.sealed_handoffs and not hands_off:
            handing_off = " or ".join(_names_where(lambda cls: cls.hands_off))
            raise ValueError(
                f"channel.sealed_handoffs: {self.algorithm.name} hands no models between "
                f"silos; only {handing_off} does (drop the setting or choose {handing_off})"
            )
        if self.privacy.client_dp is not None and not self.algorithm.clips_updates:
            clipping = ", ".join(_names_where(lambda cls: cls.clips_updates))
            raise ValueError(
                f"privacy.client_dp: {self.algorithm.name} does not average clipped model "
                "updates, so client-level DP does not apply; use a FedAvg-family algorithm "
                f"({clipping}) or drop client_dp"
            )
        self._check_dp_noise()
        self._check_federated_scaling()
        self._check_secure_aggregation()
        self._check_compression()
        self._check_local_work()
        self._check_step_plugin()
        self.algorithm.check(self)
        cross_site = cross_site_problem(self)
        if cross_site:
            raise ValueError(cross_site)
        silos = self.data.known_silos()
        problem = None if silos is None else self.consortium_problem(silos)
        if problem:
            raise ValueError(problem)
        return self

    def _check_step_plugin(self) -> None:
        """A training step plug-in runs in plain `train` tasks only: an algorithm that trains
        with a task of its own kind (SuPerFed's mixtures, FedDC's daisy chain...) or on mixed or
        domain-weighted rows (DRFLM, AgnosticFedAvg, ApproxFedAvg) cannot take one."""
        if self.training.step is None:
            return
        from fedsilo.policies.algorithms.contract import Position, derived_train
        from fedsilo.wire.tasks import TASK_CONFIGS

        training_kinds = {  # the kinds that carry local training, or a train task inside
            kind
            for kind, config in TASK_CONFIGS.items()
            if {"local", "train"} & set(config.__dataclass_fields__)
        }
        kinds = {rule.kind for rule in self.algorithm.silo_contract(self).rules}
        other = sorted((kinds & training_kinds) - {"train"})
        if other:
            raise ValueError(
                f"training.step: {self.algorithm.name} trains with its own task kind "
                f"({', '.join(other)}), which takes no step plug-in; a step plug-in runs in "
                "`train` tasks (the FedAvg family, the loss-weighted schedules, strategy "
                "plug-ins that send `train`)"
            )
        derived = derived_train(self, Position(1, "train", ""))
        if self.algorithm.needs_domains or derived.mixup_alpha is not None:
            raise ValueError(
                f"training.step: {self.algorithm.name} trains on mixed or domain-weighted rows, "
                "which a step plug-in does not compose with"
            )

    def _check_dp_noise(self) -> None:
        dp_sgd = self.privacy.dp_sgd
        if dp_sgd is not None and dp_sgd.noise_multiplier == 0:
            raise ValueError(
                "privacy.dp_sgd.noise_multiplier: 0 adds no noise, so the models would leave "
                "the silos without any DP guarantee; set a positive noise_multiplier or a "
                "training_epsilon (or drop privacy.dp_sgd for a deployment without DP)"
            )

    def _check_federated_scaling(self) -> None:
        if self.data.scaling == "federated" and self.data.split.val == 0:
            raise ValueError(
                "data.split.val: scaling 'federated' standardises every split of every silo "
                "with the consortium's scaler, which needs a validation split; set split.val "
                "above 0 or use scaling 'local'"
            )

    def _check_local_work(self) -> None:
        algorithm = self.algorithm
        problem = algorithm.dp_sgd_problem
        if self.privacy.dp_sgd is not None and problem:
            raise ValueError(f"privacy.dp_sgd: {problem}")
        if algorithm.needs_fixed_steps and self.training.steps is None:
            raise ValueError(
                f"training.steps: {algorithm.name} needs a fixed number of local steps tau per "
                "round (it draws a checkpoint from them); set steps instead of epochs"
            )

    def _check_compression(self) -> None:
        if self.compression is None:
            return
        problem = self.compression.problem(self, _names_where(lambda cls: cls.compresses_updates))
        if problem:
            raise ValueError(problem)

    def _check_secure_aggregation(self) -> None:
        secure = self.secure_aggregation
        if secure.lineage and self.lineage_gap is not None:
            raise ValueError(
                f"secure_aggregation.lineage: silos cannot derive the models they are sent "
                f"here: {self.lineage_gap}; drop lineage or set it to false"
            )
        if not secure.enabled:
            return
        if not self.algorithm.averages:
            raise ValueError(
                f"secure_aggregation: {self.algorithm.title} needs each silo's own model, which "
                "secure aggregation hides; use an averaging algorithm (aggregator: mean) or "
                "secure_aggregation: none"
            )
        if self.data.scaling == "federated":
            raise ValueError(
                "secure_aggregation: data.scaling 'federated' sums raw feature moments, which "
                "have no bound to clip them to; use scaling 'local' (or 'none')"
            )
        if self.algorithm.hands_off and not self.channel.sealed_handoffs:
            raise ValueError(
                f"channel.sealed_handoffs: {self.algorithm.name} under secure_aggregation "
                f"{secure.method} hands single silos' models on between aggregations, which "
                "silos refuse to send in the clear; set channel.sealed_handoffs: true"
            )
        fraction = getattr(self.algorithm, "client_fraction", 1.0)
        if secure.neighbours is not None and fraction < 1.0:
            raise ValueError(
                "secure_aggregation.neighbours: the sparse graph is over the whole roster, so "
                f"every silo must take part in every round (algorithm.client_fraction "
                f"{fraction:g}); use client_fraction 1 or leave neighbours out"
            )

    @property
    def lineage_gap(self) -> str | None:
        """Why this policy's silos cannot derive each model they are sent themselves (model
        lineage, privacy/lineage.py), or None when they can."""
        secure = self.secure_aggregation
        if secure.method != "masking":
            return f"it verifies masked sums, and secure_aggregation is {secure.method!r}"
        if self.algorithm.lineage_gap is not None:
            return f"{self.algorithm.name}: {self.algorithm.lineage_gap}"
        if self.privacy.client_dp is not None:
            return (
                "privacy.client_dp: the coordinator adds noise to the mean, which no silo can check"
            )
        return None

    @property
    def uses_lineage(self) -> bool:
        """Whether every silo derives the models it is sent (`secure_aggregation.lineage`: on
        by default wherever it applies)."""
        return self.secure_aggregation.lineage is not False and self.lineage_gap is None

    def consortium_problem(self, silos: int) -> str | None:
        """Why this policy cannot run over a consortium of `silos` silos, or None: a
        simulation's (known from its partition, or for a natural partition once its data is
        read) or a deployment's members at the start of a job. Its quorum, its algorithm's own
        rule, and its secure aggregation's group."""
        quorum = self.participants.min_silos
        if silos < quorum:
            return (
                f"participants.min_silos: every phase needs {quorum} silos' answers and the "
                f"consortium has {silos}; lower min_silos or add silos"
            )
        return self.algorithm.consortium_problem(self, silos) or self.secure_aggregation_problem(
            silos
        )

    def secure_aggregation_problem(self, consortium: int) -> str | None:
        """Why this policy's secure aggregation cannot run in a consortium of `consortium`
        silos (a simulation's partition, or a deployment's roster at coordinator start-up)."""
        return self.silo_secure_aggregation.group_problem(self.cohort_size(consortium))

    @property
    def silo_secure_aggregation(self) -> SecureAggregationConfig:
        """The section as every silo enforces it: no secure sum over fewer silos than the
        policy's quorum (`participants.min_silos`) or its `min_group`, whichever is larger."""
        secure = self.secure_aggregation
        group = max(secure.min_group, self.participants.min_silos)
        return (
            secure if group == secure.min_group else secure.model_copy(update={"min_group": group})
        )

    def cohort_size(self, consortium: int) -> int:
        """How many of `consortium` silos a round asks to train: max(min_silos,
        ceil(client_fraction * consortium)), at most the consortium."""
        fraction = getattr(self.algorithm, "client_fraction", 1.0)
        wanted = max(self.participants.min_silos, math.ceil(fraction * consortium - 1e-9))
        return min(consortium, wanted)

    def with_algorithm(self, name: str) -> Policy:
        """This policy with another algorithm (its defaults), for side-by-side comparisons;
        keeping the loss-driven schedule settings of this one that it reads (`step`, `floor`,
        ...), without sealed hand-offs unless it hands models off, and without secure
        aggregation unless it averages."""
        algorithm = TypeAdapter(AlgorithmConfig).validate_python({"name": name})
        settings = {
            key: value
            for key, value in self.algorithm.model_dump().items()
            if key in SCHEDULE_SETTINGS and key in type(algorithm).model_fields
        }
        document = {**self.model_dump(), "algorithm": {"name": name, **settings}}
        if not algorithm.hands_off:
            document["channel"] = ChannelConfig().model_dump()
        if not algorithm.averages:
            document["secure_aggregation"] = SecureAggregationConfig().model_dump()
        return Policy.model_validate(document)

    def with_overrides(self, *, seed: int | None = None, silos: int | None = None) -> Policy:
        """This policy with another seed or number of silos, validated as a whole (a ValueError
        for a natural partition, which has no number of silos)."""
        document = self.model_dump()
        if seed is not None:
            document["seed"] = seed
        if silos is not None:
            document["data"] = self.data.with_silos(silos).model_dump()
        return Policy.model_validate(document)


def _names_where(capable: Callable[[type[AlgorithmBase]], bool]) -> list[str]:
    """The algorithms whose config class has a capability, in the order the union lists them."""
    (union, _) = typing.get_args(AlgorithmConfig)
    return [name for cls in typing.get_args(union) if capable(cls) for name in names_of(cls)]
