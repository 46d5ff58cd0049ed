"""DRFA and DRFLM: min over the model, max over a mixture lambda of the silos' losses."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from fedsilo.policies.algorithms.contract import (
    PhaseRule,
    Position,
    SiloContract,
    SiloFacts,
    averaging_contract,
    evaluation_rule,
    every_round,
    expected_train,
    finite_within,
    report_rule,
)
from fedsilo.policies.algorithms.loss_weighted import LambdaConfig
from fedsilo.policies.model import LinearModel
from fedsilo.policies.seeding import derive_rng, derive_seed
from fedsilo.wire.tasks import LossProbe
from fedsilo.wire.tasks.tensor_names import CHECKPOINT, MODEL

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
    compresses_updates: ClassVar[bool] = False  # its models travel with a checkpoint
    # selects DRFA: distributionally robust training that keeps a mixture lambda over the silos,
    # draws the silos that train from it and moves it towards the silos with the highest loss
    name: Literal["drfa"]
    # a factor the lambda step is multiplied by every round (between 0 and 1); null (the default): a
    # constant step, or 0.9 under the fedtorch variant
    step_decay: float | None = Field(default=None, gt=0, le=1)
    # the smallest weight lambda keeps for any silo after each update, before it is renormalised
    # (0.001 by default; 0: a silo's weight may reach 0)
    floor: float = Field(default=1e-3, ge=0, lt=1)
    # M, how many silos are drawn from lambda each round (with replacement) and how many take the
    # uniform loss probe; null (the default): every silo
    silos_per_round: int | None = Field(default=None, ge=1)
    # the share e of uniform sampling mixed into the draws, (1 - e) lambda + e/K, so a silo whose
    # weight collapsed is still drawn now and then (0.1 by default; 0 is the paper)
    uniform_mix: float = Field(default=0.1, ge=0, le=1)
    # the fewest distinct silos a round's mean may hold: a draw with fewer is redrawn, then the
    # round skipped, since a mean of one silo is that silo's model (2 by default)
    min_contributors: int = Field(default=2, ge=1)
    # paper (the default): silos drawn from lambda with replacement, a mean with multiplicities;
    # fedtorch: as the R-FedTorch code, silos drawn uniformly and updates weighted by lambda
    variant: Literal["paper", "fedtorch"] = "paper"

    def checkpoint_step(self, policy: Policy, round_no: int) -> int:
        """Round `round_no`'s checkpoint step t' from the run's public seed, the same for every
        silo (the paper: uniform in 1..tau; fedtorch: the step before k' ~ U{1..tau-1})."""
        tau = policy.training.steps
        assert tau is not None  # the policy requires training.steps for DRFA
        rng = derive_rng(policy.seed, "round", round_no, "drfa-checkpoint")
        if self.variant == "fedtorch":
            return int(rng.integers(1, tau)) - 1
        return int(rng.integers(1, tau + 1))

    def train_options(self, policy: Policy, position: Position) -> dict[str, Any]:
        return {"checkpoint_step": self.checkpoint_step(policy, position.round)}

    def chosen_train_options(self, policy: Policy) -> dict[str, Callable[[Any, SiloFacts], Any]]:
        """R-FedTorch's update scale lambda_k K, in [0, K] (lambda is in the simplex)."""
        if self.variant != "fedtorch":
            return {}
        return {
            "update_scale": lambda value, facts: finite_within(
                value, "update_scale", 0.0, float(facts.consortium)
            )
        }

    def silo_contract(self, policy: Policy) -> SiloContract:
        """Each round: the drawn silos train (the model and the checkpoint, both averaged with
        the draws' multiplicities, the checkpoint summed relative to the model sent), then
        lambda's loss probe (`probe`) at the averaged checkpoint."""
        train = PhaseRule(
            "train",
            "train",
            every_round(policy),
            expected_train(policy),
            sums=(MODEL, CHECKPOINT),
            references=lambda facts: {CHECKPOINT: facts.model().referring("model")},
        )
        probe = report_rule(policy, "probe", "loss", lambda p: self.probe_config(policy, p))
        return averaging_contract(policy, train, probe, evaluation_rule(policy))

    def check(self, policy: Policy) -> None:
        if self.variant == "fedtorch" and policy.secure_aggregation.enabled:
            raise ValueError(
                "secure_aggregation: the fedtorch variant scales each silo's update by a "
                "coordinator-chosen lambda_k K, which no silo can check inside a secure sum "
                "(a scale of 0 for every other silo would leave one silo's update alone); "
                "use variant 'paper' or secure_aggregation none"
            )
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
    # selects DRFLM: DRFA whose silos train on mixup of their own rows
    name: Literal["drflm"]  # type: ignore[assignment]
    # alpha of the Beta(alpha, alpha) draw that sets how much two rows are mixed: small values mix
    # little, 1 (the default) draws the share uniformly
    mixup_alpha: float = Field(default=1.0, gt=0)
    # whether lambda's loss probe runs on mixed rows (mixup, the default) or on the clean rows
    probe: Literal["mixup", "clean"] = "mixup"
    # what is mixed: the inputs (the default) or the embedding that the model's last layer reads
    # (not for the linear model)
    mixup_on: Literal["inputs", "embedding"] = "inputs"

    def train_options(self, policy: Policy, position: Position) -> dict[str, Any]:
        return super().train_options(policy, position) | {
            "mixup_alpha": self.mixup_alpha,
            "mixup_on": self.mixup_on,
        }

    def probe_config(self, policy: Policy, position: Position) -> LossProbe:
        if self.probe != "mixup":
            return LossProbe(split="train")
        seed = derive_seed(policy.seed, "round", position.round, "probe", position.silo)
        return LossProbe(split="train", mixup_alpha=self.mixup_alpha, seed=seed)

    def check(self, policy: Policy) -> None:
        super().check(policy)
        if self.mixup_on == "embedding" and isinstance(policy.model, LinearModel):
            raise ValueError(
                "algorithm.mixup_on: model 'linear' has no embedding (its one layer reads the "
                "inputs); use mixup_on 'inputs' or a model with hidden layers (mlp, cnn)"
            )
