"""The two references every comparison wants: pooled (central) and isolated (local) training."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from fedsilo.policies.algorithms.base import AlgorithmBase
from fedsilo.policies.algorithms.contract import (
    SiloContract,
    averaging_contract,
    evaluation_rule,
    train_rule,
)

if TYPE_CHECKING:
    from fedsilo.policies.schema import Policy


class ReferenceConfig(AlgorithmBase):
    """A reference run: `train` tasks whose models come back one by one, no mean."""

    averages: ClassVar[bool] = False

    def silo_contract(self, policy: Policy) -> SiloContract:
        return averaging_contract(policy, train_rule(policy, sums=()), evaluation_rule(policy))


class CentralConfig(ReferenceConfig):
    """Reference: one model trained on the pooled union of the silos' training data."""

    # selects the central reference: one model trained on all silos' training data pooled, the upper
    # bound a federation aims for (a simulation only)
    name: Literal["central"]


class LocalConfig(ReferenceConfig):
    """Reference: each silo trains alone and is evaluated with its own model."""

    # selects the local reference: each silo trains alone on its own data and is evaluated with its
    # own model, the baseline a federation should beat
    name: Literal["local"]
