"""The loss-driven schedules that weigh each silo by the losses the silos report: AFL,
AgnosticFedAvg, q-FedAvg, TERM, PropFair and AAggFF (DRFA and DRFLM, in `drfa.py`, share the
lambda settings)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from fedsilo.policies.algorithms.base import SAMPLE_WEIGHTED, AlgorithmBase
from fedsilo.policies.algorithms.contract import (
    Position,
    SiloContract,
    SiloFacts,
    averaging_contract,
    evaluation_rule,
    non_negative_weights,
    report_rule,
    train_rule,
)
from fedsilo.policies.algorithms.fedopt import ServerOptimizerConfig
from fedsilo.wire.tasks import LossProbe

if TYPE_CHECKING:
    from fedsilo.policies.schema import Policy

RESPONSE_TRANSFORMS = ("weibull", "exponential", "frechet", "normal", "gumbel", "logistic")


class LossWeightedConfig(AlgorithmBase):
    """A schedule that turns the losses its silos report into how much each silo counts."""

    reports: ClassVar[frozenset[str]] = SAMPLE_WEIGHTED | {"losses"}
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    prox_mu: float = Field(default=0.0, ge=0)

    def probe_config(self, policy: Policy, position: Position) -> LossProbe:
        """The round's loss probe at the global model (on the training split)."""
        return LossProbe()

    def silo_contract(self, policy: Policy) -> SiloContract:
        """Each round a loss probe (`loss`), then FedAvg's `train` phase, mixed by the schedule's
        coefficients (the coordinator's weights, which a secure sum checks)."""
        probe = report_rule(policy, "loss", "loss", lambda p: self.probe_config(policy, p))
        return averaging_contract(policy, probe, train_rule(policy), evaluation_rule(policy))


class LambdaConfig(LossWeightedConfig):
    """A schedule that keeps a mixture lambda over the silos (or domains) and moves it by the
    losses.

    - `step`: lambda's ascent step (DRFA's and AFL's gamma, AgnosticFedAvg's EG step).
    - `init`: lambda's start, `counts` (proportional to the released sample counts) or `uniform`.
    - `loss_cap`: losses are clipped to [0, loss_cap] before they move lambda; None: 10 times
      the median loss of the first round.
    """

    step: float = Field(default=0.1, gt=0)
    init: Literal["counts", "uniform"] = "counts"
    loss_cap: float | None = Field(default=None, gt=0)


class AflConfig(LambdaConfig):
    """AFL (Mohri et al. 2019), as projected ascent on lambda over the silos; `floor`: lambda's
    floor after each update, then renormalised."""

    name: Literal["afl"]
    floor: float = Field(default=1e-3, ge=0, lt=1)


class AgnosticFedAvgConfig(LambdaConfig):
    """AgnosticFedAvg (Ro et al. 2021): exponentiated-gradient ascent on lambda.

    - `domains`: each `silo` is a domain, or the values of the silos' `data.domain` column are
      (`data`: lambda over those, every silo reports per-domain losses).
    - `count_window`: r, the rounds of released counts averaged into N-bar.
    """

    name: Literal["agnostic_fedavg"]
    count_window: int = Field(default=5, ge=1)
    domains: Literal["silo", "data"] = "silo"

    @property
    def needs_domains(self) -> bool:
        return self.domains == "data"

    def probe_config(self, policy: Policy, position: Position) -> LossProbe:
        return LossProbe(by_domain=self.domains == "data")

    def chosen_train_options(self, policy: Policy) -> dict[str, Callable[[Any, SiloFacts], Any]]:
        """Over the data's domains, the coordinator's weight of each domain's rows (omega);
        never inside a secure sum (`check`)."""
        if self.domains != "data" or policy.secure_aggregation.enabled:
            return {}
        return {"domain_weights": non_negative_weights}

    def check(self, policy: Policy) -> None:
        if self.domains == "data" and policy.secure_aggregation.enabled:
            raise ValueError(
                "secure_aggregation: agnostic_fedavg over the data's domains weighs each row's "
                "loss by the coordinator's domain weights, which inside a secure sum could give "
                "every other silo's domains weight 0 and leave one silo's update alone (no silo "
                "sees the others' domains to check it); use domains 'silo' (its weights are the "
                "sum's, which each silo checks) or secure_aggregation none"
            )


class QFedAvgConfig(LossWeightedConfig):
    """q-FedAvg (Li et al. 2020), as the unified table of the AAggFF thesis: weights
    proportional to n_k F_k^q."""

    name: Literal["qfedavg"]
    q: float = Field(default=1.0, ge=0)


class TermConfig(LossWeightedConfig):
    """TERM (Li et al. 2021), as the unified table: weights n_k exp(t F_k), t = `tilt`."""

    name: Literal["term"]
    tilt: float = Field(default=1.0)


class PropFairConfig(LossWeightedConfig):
    """PropFair (Zhang et al. 2022), as the unified table: weights n_k / (M - F_k), M =
    `baseline`."""

    name: Literal["propfair"]
    baseline: float = Field(default=3.0, gt=0)


class AAggFFConfig(LossWeightedConfig):
    """AAggFF (Hahn et al. 2024): AAggFF-S with every silo, AAggFF-D when `client_fraction`
    < 1; `transform`: the response CDF; `server_optimizer`: an adaptive server step (FedAdam,
    FedYogi, FedAdagrad, with their settings) taken towards the AAggFF-mixed mean instead of
    adopting it (the thesis' plug-and-play)."""

    name: Literal["aaggff"]
    transform: Literal[RESPONSE_TRANSFORMS] = "normal"  # type: ignore[valid-type]
    server_optimizer: ServerOptimizerConfig | None = None
