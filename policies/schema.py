"""The deployment policy: one versioned document that selects algorithm, model, training,
participation rules, compute placement and (for simulations) the data."""

from __future__ import annotations

import math
from typing import Any

from pydantic import Field, TypeAdapter, model_validator

from fedsilo.policies.algorithms import AlgorithmConfig, FedAvgConfig
from fedsilo.policies.base import PolicyModel
from fedsilo.policies.channel import ChannelConfig
from fedsilo.policies.compute import ComputeConfig
from fedsilo.policies.data import DataConfig
from fedsilo.policies.mixing import READERS, MixingConfig
from fedsilo.policies.model import LinearModel, ModelConfig
from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.policies.secure_aggregation import SecureAggregationConfig
from fedsilo.policies.training import TrainingConfig

SUPPORTED_VERSIONS = (1,)
MAX_SEED = 2**32 - 1  # every generator a silo seeds (NumPy, torch) takes it
MAX_PHASE_TIMEOUT_S = 7 * 24 * 3600.0
MAX_ROUNDS = 1_000_000


class ParticipantsConfig(PolicyModel):
    """Quorum and deadlines: a phase needs `min_silos` answers within `phase_timeout_s`."""

    min_silos: int = Field(default=1, ge=1)
    phase_timeout_s: float = Field(default=600.0, gt=0, le=MAX_PHASE_TIMEOUT_S)
    max_consecutive_failed_rounds: int = Field(default=3, ge=1)


class Policy(PolicyModel):
    version: int
    name: str = Field(default="fedsilo-run", min_length=1)
    seed: int = Field(default=0, ge=0, le=MAX_SEED)
    rounds: int = Field(default=20, ge=1, le=MAX_ROUNDS)
    eval_every: int = Field(default=1, ge=1)
    algorithm: AlgorithmConfig = FedAvgConfig(name="fedavg")
    model: ModelConfig = LinearModel(name="linear")
    training: TrainingConfig = TrainingConfig()
    participants: ParticipantsConfig = ParticipantsConfig()
    compute: ComputeConfig = ComputeConfig()
    data: DataConfig = DataConfig()
    privacy: PrivacyConfig = PrivacyConfig()
    secure_aggregation: SecureAggregationConfig = SecureAggregationConfig()
    channel: ChannelConfig = ChannelConfig()
    mixing: MixingConfig = MixingConfig()

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
        hands_off = self.algorithm.name == "feddc"
        if self.privacy.client_dp is not None and hands_off:
            raise ValueError(
                "privacy.client_dp: feddc hands single silos' models to other silos, which "
                "noise added to an aggregate does not protect; use privacy.dp_sgd (noise on "
                "every local step, so on every hop)"
            )
        if self.channel.sealed_handoffs and not hands_off:
            raise ValueError(
                f"channel.sealed_handoffs: {self.algorithm.name} hands no models between "
                "silos; only feddc does (drop the setting or choose feddc)"
            )
        if self.privacy.client_dp is not None and not getattr(
            self.algorithm, "clips_updates", False
        ):
            raise ValueError(
                f"privacy.client_dp: {self.algorithm.name} does not average clipped model "
                "updates, so client-level DP does not apply; use a FedAvg-family algorithm "
                "(fedavg, fedprox, fedadam, fedyogi, fedadagrad) or drop client_dp"
            )
        self._check_dp_noise()
        self._check_federated_scaling()
        self._check_secure_aggregation()
        self._check_mixing()
        self._check_fedevg()
        return self

    def _check_dp_noise(self) -> None:
        dp_sgd = self.privacy.dp_sgd
        if dp_sgd is not None and dp_sgd.noise_multiplier == 0:
            raise ValueError(
                "privacy.dp_sgd.noise_multiplier: 0 adds no noise, so the models would leave "
                "the silos without any DP guarantee; set a positive noise_multiplier or a "
                "target_epsilon (or drop privacy.dp_sgd for a deployment without DP)"
            )

    def _check_federated_scaling(self) -> None:
        if self.data.scaling == "federated" and self.data.split.val == 0:
            raise ValueError(
                "data.split.val: scaling 'federated' standardises every split of every silo "
                "with the consortium's scaler, which needs a validation split; set split.val "
                "above 0 or use scaling 'local'"
            )

    def _check_fedevg(self) -> None:
        algorithm = self.algorithm
        if algorithm.name != "fedevg":
            return
        if self.data.scaling != "none":
            raise ValueError(
                "data.scaling: fedevg's synthetic points live in [0, 1], so the silos' features "
                "must too: use scaling 'none' on data in [0, 1] (e.g. sklearn:digits' pixels)"
            )
        if self.data.task == "regression" or self.data.source == "sklearn:diabetes":
            raise ValueError("algorithm: fedevg's energies come from a classifier's logits")
        if self.privacy.dp_sgd is not None and algorithm.spectral_norm:  # type: ignore[union-attr]
            raise ValueError(
                "algorithm.spectral_norm: DP-SGD clips per-sample gradients of plain layers, and "
                "a spectrally normalised layer is not one; set spectral_norm: false under DP"
            )

    def _check_mixing(self) -> None:
        name = self.algorithm.name
        defaults = MixingConfig()
        for field in sorted(self.mixing.model_fields_set):
            changed = getattr(self.mixing, field) != getattr(defaults, field)
            if changed and name not in READERS[field]:
                readers = ", ".join(sorted(READERS[field]))
                raise ValueError(
                    f"mixing.{field}: {name} does not read it (read by {readers}); drop it "
                    "or choose one of those algorithms"
                )
        if name == "drflm" and self.privacy.differentially_private:
            raise ValueError(
                "privacy: drflm's mixup puts one record into its own row and into every row "
                "that draws it as a partner, so per-row clipping does not bound a record's "
                "influence and the booked epsilon would be too low; use drfa under DP"
            )
        if name in ("drfa", "drflm") and self.training.steps is None:
            raise ValueError(
                f"training.steps: {name} needs a fixed number of local steps tau per round "
                "(its checkpoint is drawn from 1..tau); set steps instead of epochs"
            )
        per_round = self.mixing.silos_per_round
        quorum = self.participants.min_silos
        if name in ("drfa", "drflm") and per_round is not None and per_round < quorum:
            raise ValueError(
                f"mixing.silos_per_round: {per_round} silos a round cannot make a mean of "
                f"participants.min_silos {quorum} silos; raise it or lower min_silos"
            )
        if self.mixing.variant == "fedtorch" and (self.training.steps or 0) < 2:
            raise ValueError(
                "training.steps: the fedtorch variant draws its checkpoint before step "
                "k' ~ U{1..tau-1}, so it needs tau >= 2 local steps"
            )
        if self.mixing.mixup_on == "embedding" and isinstance(self.model, LinearModel):
            raise ValueError(
                "mixing.mixup_on: model 'linear' has no embedding (its one layer reads the "
                "inputs); use mixup_on 'inputs' or a model with hidden layers (mlp, cnn)"
            )
        if name == "approx_fedavg" and self.privacy.dp_sgd is not None:
            raise ValueError(
                "privacy.dp_sgd: approx_fedavg weights each row's gradient by a softmax over its "
                "batch's domain losses, which the other rows set, so per-row clipping does not "
                "bound a record's influence; use agnostic_fedavg (mixing.domains: data) under DP"
            )

    def _check_secure_aggregation(self) -> None:
        secure = self.secure_aggregation
        if not secure.enabled:
            return
        if not self.algorithm.averages:
            raise ValueError(
                f"secure_aggregation: {self.algorithm.name}"
                + (" with the Radon aggregator" if self.algorithm.name == "feddc" else "")
                + " needs each silo's own model, which secure aggregation hides; use an "
                "averaging algorithm (aggregator: mean) or secure_aggregation: none"
            )
        if self.data.scaling == "federated":
            raise ValueError(
                "secure_aggregation: data.scaling 'federated' sums raw feature moments, which "
                "have no bound to clip them to; use scaling 'local' (or 'none')"
            )
        if self.algorithm.name == "feddc" and not self.channel.sealed_handoffs:
            raise ValueError(
                f"channel.sealed_handoffs: feddc under secure_aggregation {secure.method} hands "
                "single silos' models on between aggregations, which silos refuse to send in "
                "the clear; set channel.sealed_handoffs: true"
            )
        partition = self.data.partition
        if partition is not None:
            problem = self.secure_aggregation_problem(partition.silos)
            if problem:
                raise ValueError(problem)

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
        without sealed hand-offs unless it is feddc, and without secure aggregation unless it
        averages, and with only the mixing settings it reads (the rest mean nothing to it)."""
        document = {**self.model_dump(), "algorithm": {"name": name}}
        document["mixing"] = {
            k: v for k, v in self.mixing.model_dump().items() if name in READERS[k]
        }
        algorithm = TypeAdapter(AlgorithmConfig).validate_python({"name": name})
        if name != "feddc":
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
