"""Cyclic weight transfer: one model trained by every silo in turn, handed on sealed."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from fedsilo.policies.algorithms.base import AlgorithmBase

if TYPE_CHECKING:
    from fedsilo.policies.schema import Policy


class CyclicConfig(AlgorithmBase):
    """Cyclic weight transfer (Chang et al. 2018), as FLamby's `Cyclic`: each round the model
    visits every silo once, each training its local steps on the model it receives and handing
    it on sealed to the next; the order is a seeded permutation drawn anew each round
    (`deterministic_cycle: true`: the silos' sorted order every round). The last silo sends
    the round's model to the coordinator, which evaluates it like FedAvg's global model."""

    hands_off: ClassVar[bool] = True
    averages: ClassVar[bool] = False  # the round's model is one silo's, in no sum
    name: Literal["cyclic"]
    deterministic_cycle: bool = False

    def check(self, policy: Policy) -> None:
        if not policy.channel.sealed_handoffs:
            raise ValueError(
                "channel.sealed_handoffs: cyclic hands the model from silo to silo, and the "
                "coordinator relays every hand-off; unsealed, two consecutive hand-offs give "
                "it one silo's exact update; set channel.sealed_handoffs: true"
            )
        if policy.participants.min_silos != 1:
            raise ValueError(
                "participants.min_silos: each step of a cyclic round is one silo training and "
                "handing the model on, so no step has more than one answer; set min_silos: 1"
            )
