"""SuPerFed: personalised FL by mixing a federated and a local model (Hahn et al. 2022)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

from pydantic import Field

from fedsilo.policies.algorithms.base import AlgorithmBase
from fedsilo.policies.algorithms.contract import (
    PhaseRule,
    Position,
    SiloContract,
    averaging_contract,
    evaluation_rounds,
    every_round,
    local_training,
    report_rule,
)
from fedsilo.policies.seeding import derive_seed
from fedsilo.wire.tasks import SuperFedEvaluate, SuperFedTrain
from fedsilo.wire.tasks.tensor_names import MODEL

if TYPE_CHECKING:
    from fedsilo.policies.schema import Policy


class SuperFedConfig(AlgorithmBase):
    """SuPerFed (Hahn et al. 2022): every silo keeps a local model that never leaves it and,
    from round floor(`start_fraction` T) + 1 on, trains the mixture (1 - lambda) w_federated +
    lambda w_local, lambda ~ U(0, 1) per minibatch (`mixing: model`) or per layer and minibatch
    (`layer`), with the proximity term `prox_mu` R_prox(w_federated, w_global) (`prox_form`: the
    reference's sum of per-layer L2 norms, `layer_l2`, or the squared norm) and the
    orthogonality term `ortho_nu` cos^2(w_federated, w_local). Only the federated model
    travels; the coordinator averages it by sample counts. Evaluation mixes the global model
    with each silo's local model over `lambda_grid` points of [0, 1] and reports the test
    metrics at the lambda chosen on the validation split (on the training split when the
    validation split has fewer than `min_validation` rows)."""

    # selects SuPerFed: personalised learning in which every silo mixes the federated model with a
    # local model that never leaves it
    name: Literal["superfed"]
    # how the two models are mixed during training: model (the default), one random weight per
    # minibatch, or layer, one per layer and minibatch
    mixing: Literal["model", "layer"] = "model"
    # the share of the run's rounds trained on the federated model alone before mixing starts (0.2
    # by default; 0: mix from the first round)
    start_fraction: float = Field(default=0.2, ge=0, le=1)
    # the weight of the proximity term that keeps the federated model near the global one (0.01 by
    # default; 0: none)
    prox_mu: float = Field(default=0.01, ge=0)
    # the proximity term's form: layer_l2 (the default), the sum of per-layer L2 distances, or
    # squared, the squared distance
    prox_form: Literal["layer_l2", "squared"] = "layer_l2"
    # the weight of the term cos^2(w_federated, w_local) that keeps the local model different from
    # the federated one (1 by default; 0: none)
    ortho_nu: float = Field(default=1.0, ge=0)
    # the share of the consortium's silos asked to train each round, drawn at random (at least
    # participants.min_silos); 1 (the default): every silo, every round
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    # how many evenly spaced mixing weights in [0, 1] evaluation tries, reporting test metrics at
    # the one best on validation (11 by default)
    lambda_grid: int = Field(default=11, ge=2)
    # the fewest validation rows a silo needs to choose its mixing weight on them; with fewer it
    # chooses on its training rows (20 by default)
    min_validation: int = Field(default=20, ge=1)

    def mixing_from(self, total_rounds: int) -> int:
        """The first round (1-based) that trains the mixture: floor(L T) + 1."""
        return math.floor(self.start_fraction * total_rounds + 1e-9) + 1

    def local_seed(self, policy: Policy, silo: str) -> int:
        """The seed of `silo`'s fresh local model: the same every round, and the silo's own."""
        return derive_seed(policy.seed, "superfed-local", silo)

    def train_config(self, policy: Policy, position: Position) -> SuperFedTrain:
        """A round's `superfed_train`: local training with the round's mixing settings."""
        return SuperFedTrain(
            local=local_training(policy, position),
            mixing=self.mixing,
            mixing_on=position.round >= self.mixing_from(policy.rounds),
            ortho_nu=self.ortho_nu,
            prox_form=self.prox_form,
            local_seed=self.local_seed(policy, position.silo),
        )

    def evaluate_config(self, policy: Policy, position: Position) -> SuperFedEvaluate:
        return SuperFedEvaluate(
            local_seed=self.local_seed(policy, position.silo),
            lambda_grid=self.lambda_grid,
            min_validation=self.min_validation,
        )

    def silo_contract(self, policy: Policy) -> SiloContract:
        """FedAvg's round of `superfed_train` tasks; evaluation mixes the global model with
        the silo's local model (`superfed_evaluate`)."""
        train = PhaseRule(
            "train",
            "superfed_train",
            every_round(policy),
            lambda received, position, facts: self.train_config(policy, position),
            sums=(MODEL,),
        )
        evaluate = report_rule(
            policy,
            "evaluate",
            "superfed_evaluate",
            lambda position: self.evaluate_config(policy, position),
            rounds=evaluation_rounds(policy),
        )
        return averaging_contract(policy, train, evaluate)
