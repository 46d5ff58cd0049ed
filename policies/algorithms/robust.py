"""`algorithm.robust`: the Byzantine-robust rules FedAvg's round may combine its models with in
the clear instead of the weighted mean (coordinate-wise median, trimmed mean, Krum,
Multi-Krum, norm-bounded averaging; docs/robust-aggregation.md), each with its own typed
settings and the preconditions it needs at the policy's quorum. The maths is the
coordinator's (coordinator/robust_aggregation.py); silos train exactly as under FedAvg."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, model_validator

from fedsilo.policies.base import PolicyModel


class RobustRuleBase(PolicyModel):
    """A robust rule's settings; `problem` says why it cannot run at a quorum."""

    name: str

    def problem(self, min_silos: int) -> str | None:
        """Why this rule cannot combine as few as `min_silos` updates (a round's fewest: its
        cohort is never smaller than `participants.min_silos`, whatever `client_fraction`), or
        None."""
        return None


class MedianRule(RobustRuleBase):
    """Coordinate-wise median (Yin et al. 2018)."""

    # selects the coordinate-wise median: every coordinate of the new model is the median of the
    # answering silos' values, one vote per silo whatever its number of rows
    name: Literal["median"]


class TrimmedMeanRule(RobustRuleBase):
    """Coordinate-wise trimmed mean (Yin et al. 2018): the k largest and k smallest values of
    every coordinate dropped, the rest averaged with equal weights."""

    # selects the coordinate-wise trimmed mean: for every coordinate the k largest and k smallest
    # of the silos' values are dropped and the others averaged, one vote per silo
    name: Literal["trimmed_mean"]
    # the share of the answering silos trimmed from each end, k = floor(beta n) of n answers (0.2 by
    # default); null when count is given instead
    beta: float | None = Field(default=0.2, ge=0, lt=0.5)
    # the number k of silos trimmed from each end, instead of a share (null by default: beta
    # decides); participants.min_silos must be above 2 count, so an update is left after trimming
    count: int | None = Field(default=None, ge=1)

    @model_validator(mode="before")
    @classmethod
    def _count_replaces_beta(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("count") is not None:
            if data.get("beta") is not None:
                raise ValueError(
                    "beta and count both say how many updates to trim from each end; give one"
                )
            data = {**data, "beta": None}
        return data

    @model_validator(mode="after")
    def _one_trim(self) -> TrimmedMeanRule:
        if self.beta is None and self.count is None:
            raise ValueError("give beta (a share of the silos) or count (a number of silos)")
        return self

    def trimmed(self, answers: int) -> int:
        """k, the updates dropped from each end of every coordinate among `answers`."""
        if self.count is not None:
            return self.count
        assert self.beta is not None  # one of the two is set (`_one_trim`)
        return int(self.beta * answers)

    def problem(self, min_silos: int) -> str | None:
        if min_silos - 2 * self.trimmed(min_silos) >= 1:
            return None
        return (
            f"algorithm.robust.count: trimming {self.count} updates from each end of as few as "
            f"participants.min_silos {min_silos} answers leaves none to average; min_silos must "
            f"be at least {2 * self.trimmed(min_silos) + 1} (raise it, or lower count)"
        )


class KrumSettings(RobustRuleBase):
    """What Krum and Multi-Krum share (Blanchard et al. 2017): the number of faulty silos f
    they are built to withstand, which needs n > 2f + 2 answers."""

    # the number f of faulty silos the rule withstands: each update is scored by the sum of its
    # squared distances to its n - f - 2 nearest other updates; participants.min_silos must be above
    # 2f + 2 (1 by default)
    f: int = Field(default=1, ge=0)

    def problem(self, min_silos: int) -> str | None:
        if min_silos > 2 * self.f + 2:
            return None
        return (
            f"algorithm.robust.f: {self.name} withstands f faulty silos only among n > 2f + 2 "
            f"= {2 * self.f + 2} answers, and a round may combine as few as "
            f"participants.min_silos {min_silos}; lower f or raise min_silos to "
            f"{2 * self.f + 3}"
        )


class KrumRule(KrumSettings):
    """Krum: the one update with the lowest score becomes the new model's update."""

    # selects Krum: the model whose update has the lowest score (the most central one) becomes the
    # new model
    name: Literal["krum"]


class MultiKrumRule(KrumSettings):
    """Multi-Krum: the m updates with the lowest scores, averaged with the phase's weights."""

    # selects Multi-Krum: the m updates with the lowest Krum scores are averaged, weighted by their
    # silos' sample counts
    name: Literal["multi_krum"]
    # the number m of lowest-scored updates averaged; null (the default): n - f of the n answering
    # silos. At most participants.min_silos - f
    m: int | None = Field(default=None, ge=1)

    def problem(self, min_silos: int) -> str | None:
        problem = super().problem(min_silos)
        if problem or self.m is None or self.m <= min_silos - self.f:
            return problem
        return (
            f"algorithm.robust.m: multi_krum averages m of the n - f honest-looking updates, and "
            f"a round may have as few as participants.min_silos {min_silos} answers with f "
            f"{self.f} faulty; lower m to {min_silos - self.f} or raise min_silos"
        )


class NormBoundedRule(RobustRuleBase):
    """Norm-bounded averaging (Sun et al. 2019, "Can you really backdoor federated learning?"):
    each update clipped to norm M around the round's model, then the weighted mean."""

    # selects norm-bounded averaging: each silo's update (its model minus the round's model) is
    # scaled down to Euclidean norm at most max_norm, then the updates are averaged weighted by
    # sample counts
    name: Literal["norm_bounded"]
    # the bound M: the largest Euclidean norm of one silo's update (over every parameter) that
    # counts in full; a longer update is scaled down to M. Required: choose it from the update norms
    # of a clean run
    max_norm: float = Field(gt=0)


# how each secure aggregation method hides a single update from the coordinator
HIDDEN = {"masking": "masked", "ckks": "encrypted"}

RobustRule = Annotated[
    MedianRule | TrimmedMeanRule | KrumRule | MultiKrumRule | NormBoundedRule,
    Field(discriminator="name"),
]


def robust_problem(
    rule: RobustRuleBase, secure: str, client_dp: bool, min_silos: int
) -> str | None:
    """Why `rule` cannot combine a policy's updates: under `secure` aggregation (its method,
    "none" for none), under client-level DP, or at a quorum of `min_silos`; None: it can."""
    if secure != "none":
        return (
            f"algorithm.robust: {rule.name} ranks, trims or clips each silo's own update, and "
            f"under secure_aggregation {secure} the coordinator sees only the sum of the "
            f"{HIDDEN[secure]} updates, never a single one; drop algorithm.robust "
            "or use secure_aggregation: none"
        )
    if client_dp:
        return (
            "algorithm.robust: under privacy.client_dp the released model is the noised mean "
            "of the clipped updates, with the noise and the epsilon calibrated to that mean; "
            f"{rule.name} combines the updates otherwise, which that guarantee does not cover; "
            "drop algorithm.robust (client_dp's clipping already bounds each silo's update, as "
            "norm_bounded would) or drop privacy.client_dp"
        )
    return rule.problem(min_silos)
