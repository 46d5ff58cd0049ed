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
    compresses_updates: ClassVar[bool] = True  # its round's mean is FedAvg's train phase, mixed
    # the share of the consortium's silos asked to train each round, drawn at random (at least
    # participants.min_silos); 1 (the default): every silo, every round
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    # weight mu of a proximal term (mu/2)||w - w_global||^2 added to each silo's local loss; 0 (the
    # default): none
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

    # the ascent step size of the mixture lambda each round (DRFA's and AFL's gamma,
    # AgnosticFedAvg's exponentiated-gradient step); 0.1 by default
    step: float = Field(default=0.1, gt=0)
    # lambda's starting weights: counts (the default, proportional to the silos' released sample
    # counts) or uniform
    init: Literal["counts", "uniform"] = "counts"
    # losses are clipped to [0, loss_cap] before they move lambda, so one diverging silo cannot take
    # all the weight; null (the default): 10 times the first round's median loss
    loss_cap: float | None = Field(default=None, gt=0)


class AflConfig(LambdaConfig):
    """AFL (Mohri et al. 2019), as projected ascent on lambda over the silos; `floor`: lambda's
    floor after each update, then renormalised."""

    # selects AFL (agnostic federated learning): projected ascent on a mixture lambda over the
    # silos, which weights the silos with the highest loss more
    name: Literal["afl"]
    # the smallest weight lambda keeps for any silo after each update, before it is renormalised
    # (0.001 by default; 0: a silo's weight may reach 0)
    floor: float = Field(default=1e-3, ge=0, lt=1)


class AgnosticFedAvgConfig(LambdaConfig):
    """AgnosticFedAvg (Ro et al. 2021): exponentiated-gradient ascent on lambda.

    - `domains`: each `silo` is a domain, or the values of the silos' `data.domain` column are
      (`data`: lambda over those, every silo reports per-domain losses).
    - `count_window`: r, the rounds of released counts averaged into N-bar.
    """

    # selects AgnosticFedAvg: exponentiated-gradient ascent on a mixture lambda over the silos or
    # the data's domains
    name: Literal["agnostic_fedavg"]
    # r, how many rounds of released sample counts are averaged into the count each silo is weighted
    # by (5 by default)
    count_window: int = Field(default=5, ge=1)
    # silo (the default): each silo is a domain; data: the values of data.domain are, and every silo
    # reports a loss per domain (not under secure aggregation)
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

    # selects q-FedAvg: each silo's update weighted by n_k F_k^q, its sample count times its loss to
    # the power q
    name: Literal["qfedavg"]
    # the fairness exponent: 0 is FedAvg's weighting, larger values weight high-loss silos more (1
    # by default)
    q: float = Field(default=1.0, ge=0)


class TermConfig(LossWeightedConfig):
    """TERM (Li et al. 2021), as the unified table: weights n_k exp(t F_k), t = `tilt`."""

    # selects TERM (tilted empirical risk): each silo's update weighted by n_k exp(tilt F_k)
    name: Literal["term"]
    # t of the weights n_k exp(t F_k): positive weights high-loss silos more, negative weights them
    # less, 0 is FedAvg's weighting (1 by default)
    tilt: float = Field(default=1.0)


class PropFairConfig(LossWeightedConfig):
    """PropFair (Zhang et al. 2022), as the unified table: weights n_k / (M - F_k), M =
    `baseline`."""

    # selects PropFair (proportional fairness): each silo's update weighted by n_k / (M - F_k), M
    # the baseline
    name: Literal["propfair"]
    # M of the weights n_k / (M - F_k), in the units of the loss: a silo whose loss nears M gets a
    # large weight (3 by default; losses are kept below it)
    baseline: float = Field(default=3.0, gt=0)


class AAggFFConfig(LossWeightedConfig):
    """AAggFF (Hahn et al. 2024): AAggFF-S with every silo, AAggFF-D when `client_fraction`
    < 1; `transform`: the response CDF; `server_optimizer`: an adaptive server step (FedAdam,
    FedYogi, FedAdagrad, with their settings) taken towards the AAggFF-mixed mean instead of
    adopting it (the thesis' plug-and-play)."""

    # selects AAggFF: an online-learning mixture of the silos that favours those the model serves
    # worst (AAggFF-S with every silo, AAggFF-D when client_fraction is below 1)
    name: Literal["aaggff"]
    # the response CDF that turns a silo's loss into its response (normal by default)
    transform: Literal[RESPONSE_TRANSFORMS] = "normal"  # type: ignore[valid-type]
    # an adaptive server step (name: fedadam, fedyogi or fedadagrad, with its settings) taken
    # towards the mixed mean instead of adopting it; null (the default): the mixed mean is the next
    # model
    server_optimizer: ServerOptimizerConfig | None = None
