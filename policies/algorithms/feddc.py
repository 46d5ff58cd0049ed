"""FedDC, federated daisy chaining: local steps, hand-offs between silos, periodic aggregation."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from fedsilo.policies.algorithms.base import AlgorithmBase
from fedsilo.policies.algorithms.contract import (
    Expected,
    PhaseRule,
    Position,
    SiloContract,
    SiloFacts,
    averaging_contract,
    carries_nothing,
    checked_handoff,
    daisy_tensors,
    derived_train,
    evaluation_rounds,
    evaluation_rule,
    every_round,
)
from fedsilo.wire.tasks import DaisyEvaluate, DaisyTrain, TaskConfig
from fedsilo.wire.tasks.tensor_names import MODEL

# FedDC's local step, aggregation and hand-off: one of them a round for each silo
LOCAL_STEP = "local-step"

if TYPE_CHECKING:
    from fedsilo.policies.schema import Policy


class FedDcConfig(AlgorithmBase):
    """FedDC (Kamp et al. 2023): every round is one local step; every `daisy_period` rounds the
    sampled silos' models move to a random permutation of them, every `aggregation_period`
    rounds they are aggregated (`mean`, or the iterated Radon point of height
    `radon_iterations`) and sent back. None: never (daisy chaining only, or FedAvg with
    `aggregation_period` local steps). `permutation`: `uniform` (fixed points allowed, as the
    paper) or `derangement`; `no_return_window` L: a model never returns to a silo that held
    it in its last L hops (a return would hand the silo its recipient's exact update)."""

    hands_off: ClassVar[bool] = True
    # selects FedDC (federated daisy chaining): silos train locally, hand their models on to other
    # silos and aggregate them periodically
    name: Literal["feddc"]
    # every how many rounds the sampled silos' models are handed on to a random permutation of those
    # silos (1 by default: every round); null: never (no daisy chaining)
    daisy_period: int | None = Field(default=1, ge=1)
    # every how many rounds the models are aggregated and sent back to every silo (10 by default);
    # null: never
    aggregation_period: int | None = Field(default=10, ge=1)
    # how models are aggregated: mean (the default; secure aggregation applies) or radon, their
    # iterated Radon point (needs every model, and at least parameters + 2 of them a round)
    aggregator: Literal["mean", "radon"] = "mean"
    # the height of the iterated Radon point when aggregator is radon: each level takes the Radon
    # points of groups of the level below (1 by default)
    radon_iterations: int = Field(default=1, ge=1)
    # the share of the consortium's silos asked to train each round, drawn at random (at least
    # participants.min_silos); 1 (the default): every silo, every round
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    # weight mu of a proximal term (mu/2)||w - w_global||^2 added to each silo's local loss; 0 (the
    # default): none
    prox_mu: float = Field(default=0.0, ge=0)
    # how hand-offs are drawn: uniform (the default, as the paper: a silo may keep its own model) or
    # derangement (every model moves to another silo)
    permutation: Literal["uniform", "derangement"] = "uniform"
    # L, the hops during which a model never returns to a silo that held it, since a return would
    # show that silo the next one's exact update; 0 (the default): no restriction
    no_return_window: int = Field(default=0, ge=0)

    @property
    def averages(self) -> bool:  # type: ignore[override]
        """Aggregation rounds take a mean (secure aggregation applies); Radon needs every model."""
        return self.aggregator == "mean"

    @property
    def title(self) -> str:
        return f"{self.name} with the Radon aggregator" if self.aggregator == "radon" else self.name

    def check(self, policy: Policy) -> None:
        if policy.secure_aggregation.enabled and self.client_fraction < 1:
            raise ValueError(
                "algorithm.client_fraction: under secure aggregation every feddc silo sends into "
                "a sum only a hosted model that descends from the sum's reference (the last "
                "aggregate), and a silo left out of an aggregation keeps an older one; use "
                "client_fraction 1 or secure_aggregation none"
            )

    def model_problem(self, policy: Policy, silos: int, parameters: int) -> str | None:
        """The Radon point of models of d parameters takes r = d + 2 of them each round."""
        cohort = policy.cohort_size(silos)
        if self.aggregator != "radon" or cohort >= parameters + 2:
            return None
        return (
            f"algorithm.aggregator: the Radon point of models of {parameters} parameters takes "
            f"r = d + 2 = {parameters + 2} of them a round, and a round asks {cohort} of the "
            f"{silos} silos; use aggregator mean, a smaller model or more silos"
        )

    def is_aggregation(self, step: int) -> bool:
        """Local step `step` (0-based) ends with an aggregation."""
        return self.aggregation_period is not None and (step + 1) % self.aggregation_period == 0

    def is_daisy(self, step: int) -> bool:
        """Local step `step` ends with a hand-off (never when it also aggregates)."""
        return (
            self.daisy_period is not None
            and (step + 1) % self.daisy_period == 0
            and not self.is_aggregation(step)
        )

    def silo_contract(self, policy: Policy) -> SiloContract:
        """Every round each silo trains what it hosts (`local`), adopting the last aggregate
        when told; aggregation rounds' sampled silos send it instead (`aggregate`, a mean
        summed relative to the last aggregate, or each model for Radon's point); daisy rounds
        hand the sampled silos' models on (`daisy`). Evaluation: the hosted models and, with
        aggregation, the last aggregate, on the test and training splits."""
        every = every_round(policy)
        rules = [
            PhaseRule("local", "daisy_train", every, self._daisy(policy, False, False),
                      daisy_tensors, round_slot=LOCAL_STEP),
            PhaseRule(
                "aggregate",
                "daisy_train",
                lambda r: every(r) and self.is_aggregation(r - 1),
                self._daisy(policy, True, False),
                daisy_tensors,
                sums=(MODEL,) if self.aggregator == "mean" else (),
                references=lambda facts: {MODEL: facts.model()},
                from_reference=True,
                round_slot=LOCAL_STEP,
            ),
            PhaseRule(
                "daisy",
                "daisy_train",
                lambda r: every(r) and self.is_daisy(r - 1),
                self._daisy(policy, False, True),
                daisy_tensors,
                routed=True,
                round_slot=LOCAL_STEP,
            ),
        ]  # fmt: skip
        evaluated = evaluation_rounds(policy)
        for split in ("test", "train"):
            rules.append(
                PhaseRule(
                    f"evaluate_local_{split}",
                    "daisy_evaluate",
                    evaluated,
                    lambda received, position, facts, split=split: DaisyEvaluate(split=split),
                    carries_nothing,
                )
            )
            if self.aggregation_period is not None:
                rules.append(evaluation_rule(policy, split, f"evaluate_{split}"))
        return averaging_contract(policy, *rules)

    def _daisy(self, policy: Policy, send: bool, hands_off: bool) -> Expected:
        """A `daisy_train` phase's expected task: the coordinator chooses whether the silo adopts
        the aggregate and, in a daisy round, the hand-off's recipient."""

        def expected(received: TaskConfig, position: Position, facts: SiloFacts) -> TaskConfig:
            asked = received if isinstance(received, DaisyTrain) else None
            handoff = asked.handoff if asked is not None and hands_off else None
            return DaisyTrain(
                train=derived_train(policy, position),
                adopt=asked.adopt if asked is not None else False,
                send=send,
                handoff=checked_handoff(handoff, policy, facts),
            )

        return expected
