"""Cyclic weight transfer: one model trained by every silo in turn, handed on sealed."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from fedsilo.policies.algorithms.base import AlgorithmBase
from fedsilo.policies.algorithms.contract import (
    ContractError,
    PhaseRule,
    Position,
    SiloContract,
    SiloFacts,
    averaging_contract,
    checked_handoff,
    daisy_tensors,
    derived_train,
    evaluation_rule,
    every_round,
)
from fedsilo.wire.tasks import DaisyTrain, TaskConfig

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
    # selects cyclic weight transfer: each round one model visits every silo in turn, each training
    # it and handing it on sealed to the next
    name: Literal["cyclic"]
    # true: the silos visit in their sorted order every round; false (the default): a seeded random
    # order drawn anew each round
    deterministic_cycle: bool = False

    def silo_contract(self, policy: Policy) -> SiloContract:
        """Each round, visits `visit_0`, `visit_1`, ... (a silo takes one a round): the first
        adopts the round's model, each later one trains the model the visit before handed it
        this round (signed by a member, privacy/handoff.py), and each hands its model on sealed
        to the next, or, after the first visit, sends it to the coordinator instead (the
        cycle's last: a model at least two silos trained this round, never one silo's update
        alone)."""

        def expected(received: TaskConfig, position: Position, facts: SiloFacts) -> TaskConfig:
            first = position.index == 0
            asked = received if isinstance(received, DaisyTrain) else DaisyTrain(
                train=derived_train(policy, position)
            )  # fmt: skip
            if asked.send and (first or asked.handoff is not None):
                raise ContractError(
                    "config key 'send': a cyclic visit sends the model to the coordinator only "
                    "after the first visit, and then hands it to no one"
                )
            return DaisyTrain(
                train=derived_train(policy, position),
                adopt=first,
                send=asked.send,
                handoff=checked_handoff(asked.handoff, policy, facts),
            )

        visit = PhaseRule(
            "visit_{}",
            "daisy_train",
            every_round(policy),
            expected,
            daisy_tensors,
            routed=True,
            indices=lambda facts: facts.consortium,
            handed_from=lambda position: f"visit_{position.index - 1}" if position.index else None,
            once_a_round=True,
        )
        return averaging_contract(policy, visit, evaluation_rule(policy))

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
