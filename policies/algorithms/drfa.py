"""DRFA and DRFLM: min over the model, max over a mixture lambda of the silos' losses."""

from __future__ import annotations

from typing import TYPE_CHECKING, ClassVar, Literal

from pydantic import Field

from fedsilo.policies.algorithms.loss_weighted import LambdaConfig
from fedsilo.policies.model import LinearModel

if TYPE_CHECKING:
    from fedsilo.policies.schema import Policy


class DrfaConfig(LambdaConfig):
    """DRFA (Deng et al. 2020): silos drawn from lambda train tau = `training.steps` steps and
    send a checkpoint from a random step, so it needs fixed local steps.

    - `floor`: lambda's floor after each update, then renormalised.
    - `step_decay`: the step is multiplied by this every round; None: constant (0.9 under the
      `fedtorch` variant).
    - `variant`: as the paper (`paper`: silos drawn from lambda with replacement, a uniform mean
      with multiplicities) or as the R-FedTorch reference code (`fedtorch`: silos drawn
      uniformly without replacement, the update importance weighted by lambda_k K / |C|, the
      checkpoint before step k' ~ U{1..tau-1}).
    - `silos_per_round`: M, the draws from lambda (with replacement) and the size of the
      uniform loss probe; None: every silo.
    - `uniform_mix`: draws come from (1 - e) lambda + e/K, so a collapsed lambda still samples
      everyone now and then (0 is the paper).
    - `min_contributors`: never average fewer distinct silos (redraw, then skip the round): a
      "mean" of one silo is that silo's model.
    """

    needs_fixed_steps: ClassVar[bool] = True
    name: Literal["drfa"]
    step_decay: float | None = Field(default=None, gt=0, le=1)
    floor: float = Field(default=1e-3, ge=0, lt=1)
    silos_per_round: int | None = Field(default=None, ge=1)
    uniform_mix: float = Field(default=0.1, ge=0, le=1)
    min_contributors: int = Field(default=2, ge=1)
    variant: Literal["paper", "fedtorch"] = "paper"

    def check(self, policy: Policy) -> None:
        per_round, quorum = self.silos_per_round, policy.participants.min_silos
        if per_round is not None and per_round < quorum:
            raise ValueError(
                f"algorithm.silos_per_round: {per_round} silos a round cannot make a mean of "
                f"participants.min_silos {quorum} silos; raise it or lower min_silos"
            )
        if self.variant == "fedtorch" and (policy.training.steps or 0) < 2:
            raise ValueError(
                "training.steps: the fedtorch variant draws its checkpoint before step "
                "k' ~ U{1..tau-1}, so it needs tau >= 2 local steps"
            )
        silos = getattr(policy.data.partition, "silos", None)  # known for a simulation
        problem = None if silos is None else self.consortium_problem(policy, silos)
        if problem:
            raise ValueError(problem)

    def consortium_problem(self, policy: Policy, silos: int) -> str | None:
        """The paper's variant draws M silos from lambda with replacement and weighs each by
        its multiplicity. A quorum of M distinct silos out of M draws holds only for a draw of
        M different silos: each then counts once, so lambda never weighs the model, and once
        lambda leans towards one silo almost no draw qualifies (from lambda (0.93, 0.03, 0.03),
        3 distinct silos in 3 draws has probability 6 * 0.93 * 0.03^2, 0.5 %): rounds train
        no one and lambda, probed at the unchanged model, leans further. Refused."""
        draws = self.silos_per_round or silos
        quorum = policy.participants.min_silos
        if self.variant != "paper" or quorum < 2 or quorum < draws:
            return None
        return (
            f"participants.min_silos: {self.name} draws {draws} silo(s) a round from lambda "
            f"with replacement and weighs each by how often it is drawn; a quorum of {quorum} "
            f"distinct silos out of {draws} draws holds only when every draw is a different "
            "silo, so lambda would never weigh the model, and once lambda leans towards one "
            "silo almost no draw qualifies and training stops. Lower min_silos below "
            f"{draws} (the paper has no quorum; algorithm.min_contributors still keeps a mean "
            "from being one silo's model) or raise algorithm.silos_per_round above "
            f"{quorum}"
        )


class DrflmConfig(DrfaConfig):
    """DRFLM: DRFA whose silos train on Beta(`mixup_alpha`, `mixup_alpha`) mixup of their own
    rows.

    - `mixup_on`: mix the `inputs`, or the `embedding` g(x) that the model's last layer reads
      (the head sees the mixed embedding, gradients reach g through both rows).
    - `probe`: whether lambda's loss probe is on mixed (`mixup`) or `clean` rows.
    """

    dp_sgd_problem: ClassVar[str | None] = (
        "drflm's mixup puts one record into its own row and into every row that draws it as "
        "a partner, so per-row clipping does not bound a record's influence and the booked "
        "epsilon would be too low; use drfa under DP"
    )
    name: Literal["drflm"]  # type: ignore[assignment]
    mixup_alpha: float = Field(default=1.0, gt=0)
    probe: Literal["mixup", "clean"] = "mixup"
    mixup_on: Literal["inputs", "embedding"] = "inputs"

    def check(self, policy: Policy) -> None:
        super().check(policy)
        if self.mixup_on == "embedding" and isinstance(policy.model, LinearModel):
            raise ValueError(
                "algorithm.mixup_on: model 'linear' has no embedding (its one layer reads the "
                "inputs); use mixup_on 'inputs' or a model with hidden layers (mlp, cnn)"
            )
