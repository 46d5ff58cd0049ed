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

    # selects FedDRO: distributionally robust training on a federated Wasserstein barycenter of
    # point clouds the silos derive from their records (classification only)
    name: Literal["feddro"]
    releases_data: ClassVar[bool] = True
    # the share of the consortium's silos asked to train each round, drawn at random (at least
    # participants.min_silos); 1 (the default): every silo, every round
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    # the consortium's consent that silos send point clouds built from their own records (data, not
    # a model); feddro refuses to run unless it is true (false by default)
    release_point_clouds: bool = False
    # classwise (the default): one cloud per class on the features; datawise: one cloud on the
    # features with the one-hot label
    variant: Literal["classwise", "datawise"] = "classwise"
    # how many points each cloud (and the barycenter) holds (50 by default)
    support_points: int = Field(default=50, ge=1)
    # how many rounds at the start build the barycenter (stage A) before FedAvg-style training on it
    # begins (20 by default)
    barycenter_rounds: int = Field(default=20, ge=1)
    # the time t, between 0 and 1, at which a silo's cloud is interpolated between the barycenter
    # and its data each stage-A round (0.5 by default)
    interpolation: float = Field(default=0.5, gt=0, le=1)
    # the norm each record is clipped to before it shapes a cloud, for the Gaussian mechanism on the
    # clouds (set with point_cloud_noise); null (the default): no DP on the clouds
    point_cloud_clip: float | None = Field(default=None, gt=0)
    # the Gaussian noise on each cloud as a multiple of its sensitivity (set with point_cloud_clip);
    # null (the default): the clouds are sent without noise
    point_cloud_noise: float | None = Field(default=None, gt=0)
    # epochs the coordinator trains the policy's model on the barycenter points after stage A; 0
    # (the default): it trains none
    server_epochs: int = Field(default=0, ge=0)
    # the learning rate of the coordinator's training on the barycenter (0.001 by default)
    server_lr: float = Field(default=1e-3, gt=0, le=MAX_LR)
    # the batch size, in points, of the coordinator's training on the barycenter (64 by default)
    server_batch_size: int = Field(default=64, ge=1)
    # the penalty gamma of the WDRO adversary (Sinha et al.) that perturbs each training row in
    # stage B; smaller allows larger perturbations; null (the default): no adversary
    adversarial_penalty: float | None = Field(default=None, gt=0)
    # the gradient-ascent steps the adversary takes on each batch (10 by default)
    adversarial_steps: int = Field(default=10, ge=1)
    # the adversary's ascent step size, in input units (0.1 by default)
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
