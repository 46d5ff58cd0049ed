"""Federated MultiBoost (Cortes et al. 2021, federated as in the survey of Tyagi &
Chukkapalli): boosting over the silos' own base classifiers towards the worst silo's loss."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from fedsilo.policies.algorithms.base import SAMPLE_WEIGHTED, AlgorithmBase, task_kind
from fedsilo.policies.algorithms.contract import (
    ChosenLength,
    ContractError,
    PhaseRule,
    Position,
    SiloContract,
    SiloFacts,
    TensorRule,
    averaging_contract,
    carries_model,
    derived_train,
    evaluation_rounds,
    every_round,
    setup_round,
)
from fedsilo.policies.seeding import derive_seed
from fedsilo.wire.tasks import BoostProbe, TaskConfig
from fedsilo.wire.tasks.tensor_names import BOOST_ALPHA, BOOST_LEARNERS

if TYPE_CHECKING:
    from fedsilo.policies.schema import Policy


class MultiBoostConfig(AlgorithmBase):
    """Federated MultiBoost, each silo one domain (docs/algorithms/multiboost.md).

    - `base_learners`: N, the base classifiers each silo trains once at setup (the policy's
      model and `training:` section, each from its own seed).
    - `step`: eta_0; boosting round t adds eta_0 / sqrt(t) to the chosen classifier's alpha.
    """

    reports: ClassVar[frozenset[str]] = SAMPLE_WEIGHTED | {"losses"}
    averages: ClassVar[bool] = False  # each base classifier is one silo's model, sent as is
    # selects federated MultiBoost: boosting over base classifiers the silos train once, weighted
    # towards the worst silo's loss (binary classification only)
    name: Literal["multiboost"]
    # N, how many base classifiers each silo trains once at setup, each from its own seed with the
    # policy's model and training settings (1 by default, at most 16)
    base_learners: int = Field(default=1, ge=1, le=16)
    # eta_0, the boosting step: boosting round t adds eta_0 / sqrt(t) to the chosen classifier's
    # weight (1 by default)
    step: float = Field(default=1.0, gt=0)

    def task_problem(self, task: str, classes: int | None) -> str | None:
        if task == "classification" and classes == 2:
            return None
        kind = task_kind(task, classes)
        return f"algorithm: multiboost boosts binary classifiers; this data is a {kind}"

    def learner_seed(self, policy: Policy, learner: int) -> int:
        """The run seed base classifier `learner` is trained from, the same at every silo."""
        return derive_seed(policy.seed, "multiboost-learner", learner)

    def silo_contract(self, policy: Policy) -> SiloContract:
        """Setup trains `base_learners` classifiers per silo (`base-0`, ..., plain `train`
        tasks sent back as they are); each round probes the ensemble on the training split
        (`boost`: the loss sum and the edges of the classifiers the coordinator names as the
        silo's own), and evaluation on the test split."""

        def learners(config: TaskConfig, position: Position, facts: SiloFacts) -> dict:
            rows = ChosenLength("learners", range(1, self.base_learners * facts.consortium + 1))
            return {
                BOOST_LEARNERS: TensorRule((rows, facts.spec.numel), facts.spec.dtype),
                BOOST_ALPHA: TensorRule((rows,), "float64"),
            }

        def probe(received: TaskConfig, position: Position, facts: SiloFacts) -> TaskConfig:
            edges = received.edges if isinstance(received, BoostProbe) else ()
            return BoostProbe(edges=self._edges(edges, facts))

        base = PhaseRule(
            "base-{}",
            "train",
            setup_round,
            lambda received, position, facts: derived_train(
                policy, position, self.learner_seed(policy, position.index or 0)
            ),
            carries_model,
            indices=lambda facts: self.base_learners,
        )
        boost = PhaseRule(
            "boost",
            "boost_probe",
            every_round(policy),
            probe,
            learners,
            largest=lambda position, facts: BoostProbe(edges=tuple(range(self.base_learners))),
        )
        evaluate = PhaseRule(
            "evaluate",
            "boost_probe",
            evaluation_rounds(policy),
            lambda received, position, facts: BoostProbe(split="test", evaluate=True),
            learners,
        )
        return averaging_contract(policy, base, boost, evaluate)

    def _edges(self, edges: Any, facts: SiloFacts) -> tuple[int, ...]:
        """The classifiers whose edges a silo reports: distinct, at most its own number of
        base classifiers, each one of the ensemble's."""
        rows = self.base_learners * facts.consortium
        valid = all(isinstance(j, int) and 0 <= j < rows for j in edges)
        if not valid or len(set(edges)) != len(edges) or len(edges) > self.base_learners:
            raise ContractError(
                f"config key 'edges' is {list(edges)}; a silo reports the edges of at most its "
                f"{self.base_learners} base classifier(s), distinct, below {rows}"
            )
        return tuple(edges)
