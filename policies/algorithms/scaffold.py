"""SCAFFOLD: FedAvg's round with control variates correcting the silos' drift."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field

from fedsilo.policies.algorithms.base import AlgorithmBase

if TYPE_CHECKING:
    from fedsilo.policies.schema import Policy


class ScaffoldConfig(AlgorithmBase):
    """SCAFFOLD (Karimireddy et al. 2020), as FLamby runs it: every local SGD step descends
    g - c_i + c, c_i the silo's control variate (kept at the silo), c the server's; each silo
    then sets c_i+ = c_i - c + (x - y_i)/(K lr) (option II) and sends y_i and c_i+ - c_i, both
    sample-weighted means at the coordinator (secure aggregation applies): x += `server_lr` *
    mean(y_i - x), c += (|S|/N) mean(c_i+ - c_i). `client_fraction`: the cohort |S| of the N
    silos (FLamby: every silo, every round)."""

    name: Literal["scaffold"]
    server_lr: float = Field(default=1.0, gt=0)
    client_fraction: float = Field(default=1.0, gt=0, le=1)

    def check(self, policy: Policy) -> None:
        training = policy.training
        if training.optimizer != "sgd" or training.momentum != 0:
            raise ValueError(
                "training.optimizer: scaffold's option II control variate (x - y_i)/(K lr) is "
                "the mean corrected gradient of K plain SGD steps at rate lr (FLamby allows "
                "only SGD); use optimizer sgd with momentum 0"
            )
