"""FedDRO (Wasserstein-barycenter DRO; docs/algorithms/feddro.md): stage A builds a
federated Wasserstein barycenter from point clouds the silos derive from their own records,
stage B trains FedAvg-style on the silos' records mapped onto it, optionally adversarially."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from fedsilo.policies.algorithms.base import AlgorithmBase, classification_problem
from fedsilo.policies.algorithms.contract import (
    PhaseRule,
    Position,
    SiloContract,
    SiloFacts,
    TensorRule,
    averaging_contract,
    evaluation_rule,
    local_training,
    schema_rule,
)
from fedsilo.policies.model import PluginModel
from fedsilo.policies.training import MAX_LR
from fedsilo.wire.tasks import FedDroSupport, FedDroTrain
from fedsilo.wire.tasks.tensor_names import BARYCENTER, MODEL, SUPPORT

if TYPE_CHECKING:
    from fedsilo.policies.schema import Policy


class FedDroConfig(AlgorithmBase):
    """FedDRO: the first `barycenter_rounds` rounds (stage A) each silo moves its cloud of
    `support_points` points (per class with `variant: classwise`, on (x, one-hot y) with
    `datawise`) towards its data and the coordinator's barycenter by interpolating measures at
    time `interpolation` (exact OT), and the coordinator takes the free-support Wasserstein
    barycenter of the clouds. With `server_epochs` > 0 the coordinator then trains the policy's
    model on the barycenter points (the paper's toy "Ours"). The remaining rounds (stage B) are
    FedAvg on each silo's records mapped onto the barycenter (barycentric projection), with the
    penalty-form WDRO adversary of Sinha et al. when `adversarial_penalty` is set. The clouds
    are data-like: the policy must say `release_point_clouds: true`; `point_cloud_clip` and
    `point_cloud_noise` add the Gaussian mechanism to them. A run of no more rounds than
    `barycenter_rounds` and `server_epochs` 0 builds the barycenter and trains no model."""

    name: Literal["feddro"]
    releases_data: ClassVar[bool] = True
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    release_point_clouds: bool = False
    variant: Literal["classwise", "datawise"] = "classwise"
    support_points: int = Field(default=50, ge=1)
    barycenter_rounds: int = Field(default=20, ge=1)
    interpolation: float = Field(default=0.5, gt=0, le=1)
    point_cloud_clip: float | None = Field(default=None, gt=0)
    point_cloud_noise: float | None = Field(default=None, gt=0)
    server_epochs: int = Field(default=0, ge=0)
    server_lr: float = Field(default=1e-3, gt=0, le=MAX_LR)
    server_batch_size: int = Field(default=64, ge=1)
    adversarial_penalty: float | None = Field(default=None, gt=0)
    adversarial_steps: int = Field(default=10, ge=1)
    adversarial_step: float = Field(default=0.1, gt=0)

    def cloud_shape(self, facts: SiloFacts) -> tuple[int, int, int]:
        """(groups, points, dim) of a silo's cloud and of the barycenter: a cloud per class on
        the features (classwise), or one on (features, one-hot label) (datawise)."""
        width = math.prod(facts.input_shape)
        if self.variant == "classwise":
            return facts.classes, self.support_points, width
        return 1, self.support_points, width + facts.classes

    def train_config(self, policy: Policy, position: Position) -> FedDroTrain:
        return FedDroTrain(local=local_training(policy, position))

    def silo_contract(self, policy: Policy) -> SiloContract:
        """Setup learns the data schema; stage A's rounds each ask every silo for its next
        cloud (`support`, from its last and the barycenter), stage B's are FedAvg's round of
        `feddro_train` tasks, which carry the barycenter beside the model."""
        stage_a = min(self.barycenter_rounds, policy.rounds)

        def cloud(facts: SiloFacts) -> TensorRule:
            return TensorRule(self.cloud_shape(facts), "float64")

        support = PhaseRule(
            "support",
            "feddro_support",
            lambda r: 1 <= r <= stage_a,
            lambda received, position, facts: FedDroSupport(),
            lambda config, position, facts: {SUPPORT: cloud(facts), BARYCENTER: cloud(facts)},
        )
        train = PhaseRule(
            "train",
            "feddro_train",
            lambda r: stage_a < r <= policy.rounds,
            lambda received, position, facts: self.train_config(policy, position),
            lambda config, position, facts: {MODEL: facts.model(), BARYCENTER: cloud(facts)},
            sums=(MODEL,),
        )
        return averaging_contract(policy, schema_rule(), support, train, evaluation_rule(policy))

    def task_problem(self, task: str, classes: int | None) -> str | None:
        return classification_problem(self.name, task, classes)

    def check(self, policy: Policy) -> None:
        if not self.release_point_clouds:
            raise ValueError(
                "algorithm.release_point_clouds: feddro's stage A sends each silo's point "
                "clouds, built from its own records (data, not a model); set it to true to "
                "say the consortium accepts that"
            )
        if (self.point_cloud_clip is None) != (self.point_cloud_noise is None):
            raise ValueError(
                "algorithm.point_cloud_clip and point_cloud_noise: set both (the Gaussian "
                "mechanism on the point clouds) or neither"
            )
        data = policy.data
        if data.task not in (None, "classification") or data.source == "sklearn:diabetes":
            raise ValueError("algorithm: feddro's clouds are per class (classification only)")
        if isinstance(policy.model, PluginModel) and self.server_epochs:
            raise ValueError(
                "algorithm.server_epochs: the coordinator runs no model plug-in; use a zoo model"
            )
        if policy.privacy.dp_sgd is not None and self.adversarial_penalty is not None:
            raise ValueError(
                "algorithm.adversarial_penalty: the adversary's inner ascent reads other "
                "gradients than a DP-SGD row's; drop it under privacy.dp_sgd"
            )
