"""SCAFFOLD: FedAvg's round with control variates correcting the silos' drift."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from fedsilo.policies.algorithms.base import AlgorithmBase
from fedsilo.policies.algorithms.contract import (
    PhaseRule,
    Position,
    SiloContract,
    averaging_contract,
    evaluation_rule,
    every_round,
    local_training,
)
from fedsilo.wire.tasks import ScaffoldTrain
from fedsilo.wire.tasks.tensor_names import CONTROL, CONTROL_DELTA, MODEL

if TYPE_CHECKING:
    from fedsilo.policies.schema import Policy


class ScaffoldConfig(AlgorithmBase):
    """SCAFFOLD (Karimireddy et al. 2020), as FLamby runs it: every local SGD step descends
    g - c_i + c, c_i the silo's control variate (kept at the silo), c the server's; each silo
    then sets c_i+ = c_i - c + (x - y_i)/(K lr) (option II) and sends y_i and c_i+ - c_i, both
    sample-weighted means at the coordinator (secure aggregation applies): x += `server_lr` *
    mean(y_i - x), c += (|S|/N) mean(c_i+ - c_i). `client_fraction`: the cohort |S| of the N
    silos (FLamby: every silo, every round)."""

    lineage_gap: ClassVar[str | None] = None  # its server step is server_step.py's
    # selects SCAFFOLD: FedAvg's round with control variates that correct each silo's drift from the
    # global model
    name: Literal["scaffold"]
    # the server's step size towards the mean of the silos' models: x += server_lr (mean - x); 1
    # (the default) takes the mean itself
    server_lr: float = Field(default=1.0, gt=0)
    # the share of the consortium's silos asked to train each round, drawn at random (at least
    # participants.min_silos); 1 (the default): every silo, every round
    client_fraction: float = Field(default=1.0, gt=0, le=1)

    def train_config(self, policy: Policy, position: Position) -> ScaffoldTrain:
        return ScaffoldTrain(local=local_training(policy, position))

    def silo_contract(self, policy: Policy) -> SiloContract:
        """FedAvg's round of `scaffold_train` tasks, which carry the server's control variate
        beside the model; the model and the change of the silo's control variate are averaged
        (the change summed relative to zeros)."""

        train = PhaseRule(
            "train",
            "scaffold_train",
            every_round(policy),
            lambda received, position, facts: self.train_config(policy, position),
            lambda config, position, facts: {MODEL: facts.model(), CONTROL: facts.model()},
            sums=(MODEL, CONTROL_DELTA),
            references=lambda facts: {CONTROL_DELTA: facts.model().referring("zeros")},
        )
        return averaging_contract(policy, train, evaluation_rule(policy))

    def check(self, policy: Policy) -> None:
        training = policy.training
        if training.optimizer != "sgd" or training.momentum != 0:
            raise ValueError(
                "training.optimizer: scaffold's option II control variate (x - y_i)/(K lr) is "
                "the mean corrected gradient of K plain SGD steps at rate lr (FLamby allows "
                "only SGD); use optimizer sgd with momentum 0"
            )
