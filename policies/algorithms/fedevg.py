"""FedEvg (thesis ch. IV): silos send energy signals for a synthetic set, not models."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

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
    every_round,
    local_training,
    schema_rule,
)
from fedsilo.policies.model import PluginModel
from fedsilo.policies.seeding import derive_seed
from fedsilo.policies.training import MAX_LR
from fedsilo.wire.tasks import EnergySignals
from fedsilo.wire.tasks.tensor_names import SYNTHETIC, SYNTHETIC_LABELS, WEIGHT, WEIGHTED_GRADIENT

if TYPE_CHECKING:
    from fedsilo.policies.schema import Policy


class FedEvgConfig(AlgorithmBase):
    """FedEvg: the coordinator keeps `samples_per_class` synthetic points per class (noise at
    first) and moves them every round by one Langevin step down the mixture of the silos'
    energies, step eta_t from `server_step_max` to `server_step_min` (the cosine-beta curve),
    noise `server_noise` (or `server_noise_scale` * eta_t); each silo trains a fresh energy model
    (JEM-style: cross-entropy, a contrastive term with `client_sgld_steps` Langevin steps of size
    `client_sgld_step` and noise `client_sgld_noise` from the synthetic points, and
    `synthetic_ce_weight` times the cross-entropy on them) and sends, per synthetic point, the
    input gradient of its energy clipped to `gradient_clip` and exp(-sign of the energy). The
    classifier the silos evaluate is the policy's model trained on the synthetic set alone
    (`classifier_epochs` of Adam at `classifier_lr`). Its aggregates are the two sums of the
    mixture gradient, so secure aggregation applies."""

    # selects FedEvg: silos send energy signals that move a synthetic data set at the coordinator,
    # never their models (classification only)
    name: Literal["fedevg"]
    # the share of the consortium's silos asked to train each round, drawn at random (at least
    # participants.min_silos); 1 (the default): every silo, every round
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    # how many synthetic points the coordinator keeps per class (10 by default)
    samples_per_class: int = Field(default=10, ge=1)
    # the energy each silo's model defines: joint (the default), -f(x)[y] for the point's label, or
    # marginal, -log sum_y exp f(x)[y]
    energy: Literal["joint", "marginal"] = "joint"
    # the largest Langevin step size the coordinator moves the synthetic points by, at the start of
    # the run (10 by default)
    server_step_max: float = Field(default=10.0, gt=0)
    # the smallest Langevin step size, reached at the end of the run along a cosine curve (1 by
    # default)
    server_step_min: float = Field(default=1.0, gt=0)
    # the standard deviation of the noise added to the synthetic points at each server step (0.0001
    # by default; 0: none)
    server_noise: float = Field(default=1e-4, ge=0)
    # when set, the server step's noise is this multiple of the step size instead of server_noise;
    # null (the default): server_noise
    server_noise_scale: float | None = Field(default=None, ge=0)
    # the Langevin steps each silo runs from the synthetic points to draw the contrastive samples of
    # its energy model (1 by default; 0: none)
    client_sgld_steps: int = Field(default=1, ge=0)
    # the step size of those silo-side Langevin steps (1 by default)
    client_sgld_step: float = Field(default=1.0, ge=0)
    # the standard deviation of the noise of those silo-side Langevin steps (0.01 by default)
    client_sgld_noise: float = Field(default=0.01, ge=0)
    # the norm each silo clips its energy's input gradient to, per synthetic point, before it is
    # summed (3 by default)
    gradient_clip: float = Field(default=3.0, gt=0)
    # the weight of the cross-entropy on the synthetic points in each silo's local loss (0.1 by
    # default; 0: none)
    synthetic_ce_weight: float = Field(default=0.1, ge=0)
    # true (the default): the silos' energy models use spectrally normalised layers; set false under
    # DP-SGD, which cannot clip them
    spectral_norm: bool = True
    # true: each silo starts its energy model from its own model of its last round, kept in its
    # state folder; false (the default): from a fresh model every round
    persist_local_model: bool = False
    # the epochs of Adam that train the policy's model on the synthetic set alone, the classifier
    # the silos evaluate (100 by default)
    classifier_epochs: int = Field(default=100, ge=1)
    # the learning rate of that classifier's training (0.001 by default)
    classifier_lr: float = Field(default=1e-3, gt=0, le=MAX_LR)
    # the batch size, in synthetic points, of that classifier's training (64 by default)
    classifier_batch_size: int = Field(default=64, ge=1)
    # every how many rounds a simulation saves the synthetic set, to view as images (10 by default)
    image_every: int = Field(default=10, ge=1)

    def energy_config(self, policy: Policy, position: Position) -> EnergySignals:
        """A round's `energy_signals`: local training of a fresh energy model (its seed from
        the round and the silo) and the policy's Langevin and clipping settings."""
        return EnergySignals(
            local=local_training(policy, position),
            energy=self.energy,
            sgld_steps=self.client_sgld_steps,
            sgld_step=self.client_sgld_step,
            sgld_noise=self.client_sgld_noise,
            gradient_clip=self.gradient_clip,
            synthetic_ce_weight=self.synthetic_ce_weight,
            spectral_norm=self.spectral_norm,
            persist_local_model=self.persist_local_model,
            model_seed=derive_seed(
                policy.seed, "round", position.round, "energy-model", position.silo
            ),
        )

    def silo_contract(self, policy: Policy) -> SiloContract:
        """Setup learns the data schema; each round the sampled silos get the synthetic set
        (`samples_per_class` points per class, in the schema's shape) and answer energy
        signals, two sums relative to zeros."""

        def points(facts: SiloFacts, value: str | None = None) -> dict[str, TensorRule]:
            n = self.samples_per_class * facts.classes
            return {
                "points": TensorRule((n, *facts.input_shape), "float32", value),
                "per_point": TensorRule((n,), "float32", value),
            }

        energy = PhaseRule(
            "energy",
            "energy_signals",
            every_round(policy),
            lambda received, position, facts: self.energy_config(policy, position),
            lambda config, position, facts: {
                SYNTHETIC: points(facts)["points"],
                SYNTHETIC_LABELS: TensorRule((self.samples_per_class * facts.classes,), "int64"),
            },
            sums=(WEIGHTED_GRADIENT, WEIGHT),
            references=lambda facts: {
                WEIGHTED_GRADIENT: points(facts, "zeros")["points"],
                WEIGHT: points(facts, "zeros")["per_point"],
            },
        )
        return averaging_contract(policy, schema_rule(), energy, evaluation_rule(policy))

    def task_problem(self, task: str, classes: int | None) -> str | None:
        return classification_problem(self.name, task, classes)

    def check(self, policy: Policy) -> None:
        if policy.data.scaling != "none":
            raise ValueError(
                "data.scaling: fedevg's synthetic points live in [0, 1], so the silos' features "
                "must too: use scaling 'none' on data in [0, 1] (e.g. sklearn:digits' pixels)"
            )
        if isinstance(policy.model, PluginModel):
            raise ValueError(
                "model: fedevg trains its classifier at the coordinator, which runs no model "
                "plug-in; use a zoo model (linear, mlp or cnn)"
            )
        data = policy.data
        if data.task not in (None, "classification") or data.source == "sklearn:diabetes":
            raise ValueError("algorithm: fedevg's energies come from a classifier's logits")
        if policy.privacy.dp_sgd is not None and self.spectral_norm:
            raise ValueError(
                "algorithm.spectral_norm: DP-SGD clips per-sample gradients of plain layers, and "
                "a spectrally normalised layer is not one; set spectral_norm: false under DP"
            )
