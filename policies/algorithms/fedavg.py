"""FedAvg and the algorithms that are FedAvg with another local objective: FedProx and
ApproxFedAvg; and what every algorithm of FedAvg's round shares, its optional robust rule
(`algorithm.robust`, policies/algorithms/robust.py)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar, Literal

from pydantic import Field

from fedsilo.policies.algorithms.base import AlgorithmBase
from fedsilo.policies.algorithms.contract import Position, SiloContract, averaging_contract
from fedsilo.policies.algorithms.robust import RobustRule, robust_problem

if TYPE_CHECKING:
    from fedsilo.policies.schema import Policy


class AveragingConfig(AlgorithmBase):
    """An algorithm whose round is FedAvg's (a `train` phase whose models are averaged),
    whatever its local objective or server step: under masking its silos derive each round's
    model themselves (`secure_aggregation.lineage`). Its coordinator combines the models with
    their weighted mean, or with a robust rule in the clear (`robust`)."""

    lineage_gap: ClassVar[str | None] = None
    compresses_updates: ClassVar[bool] = True
    # how the coordinator combines the silos' models: null (the default) takes their sample-weighted
    # mean; a robust rule withstands silos whose data or update is broken or poisoned
    # (docs/robust-aggregation.md), in the clear only: not with secure_aggregation or
    # privacy.client_dp
    robust: RobustRule | None = None

    def check(self, policy: Policy) -> None:
        if self.robust is None:
            return
        problem = robust_problem(
            self.robust,
            policy.secure_aggregation.method,
            policy.privacy.client_dp is not None,
            policy.participants.min_silos,
        )
        if problem:
            raise ValueError(problem)

    def silo_contract(self, policy: Policy) -> SiloContract:
        return averaging_contract(policy)


class FedAvgConfig(AveragingConfig):
    """FedAvg (McMahan et al.): sample-weighted mean of the sampled silos' models."""

    clips_updates: ClassVar[bool] = True
    # selects FedAvg: each round the sampled silos train locally and the coordinator takes the
    # sample-weighted mean of their models
    name: Literal["fedavg"]
    # the share of the consortium's silos asked to train each round, drawn at random (at least
    # participants.min_silos); 1 (the default): every silo, every round
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    # weight mu of a proximal term (mu/2)||w - w_global||^2 added to each silo's local loss, pulling
    # local training towards the round's model; 0 (the default): plain FedAvg
    prox_mu: float = Field(default=0.0, ge=0)


class FedProxConfig(AveragingConfig):
    """FedProx (Li et al.): FedAvg with the proximal term (mu/2)||w - w_global||^2 locally."""

    clips_updates: ClassVar[bool] = True
    # selects FedProx: FedAvg whose silos add the proximal term (prox_mu/2)||w - w_global||^2 to
    # their local loss
    name: Literal["fedprox"]
    # the share of the consortium's silos asked to train each round, drawn at random (at least
    # participants.min_silos); 1 (the default): every silo, every round
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    # weight mu of the proximal term that keeps each silo's local model near the round's model;
    # larger holds silos closer together (0.1 by default; must be above 0, else use fedavg)
    prox_mu: float = Field(default=0.1, gt=0)


class ApproxFedAvgConfig(AveragingConfig):
    """ApproxFedAvg (the survey's proposal): FedAvg whose silos train each minibatch on the
    log-sum-exp (1/mu) log sum_i exp(mu F_i) of their domains' losses F_i, a soft maximum over
    the domains of the silo's `data.domain` column. With one domain per silo it is FedAvg.

    - `temperature`: mu.
    - `domain_reduction`: whether a batch's domain loss is the `sum` of its rows' losses (the
      survey's form; divided by the batch size) or their `mean`.
    """

    dp_sgd_problem: ClassVar[str | None] = (
        "approx_fedavg weights each row's gradient by a softmax over its batch's domain "
        "losses, which the other rows set, so per-row clipping does not bound a record's "
        "influence; use agnostic_fedavg (algorithm.domains: data) under DP"
    )
    # selects ApproxFedAvg: FedAvg whose silos train on a soft maximum of their domains' losses (the
    # domains of data.domain)
    name: Literal["approx_fedavg"]
    # the share of the consortium's silos asked to train each round, drawn at random (at least
    # participants.min_silos); 1 (the default): every silo, every round
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    # weight mu of a proximal term (mu/2)||w - w_global||^2 added to each silo's local loss; 0 (the
    # default): none
    prox_mu: float = Field(default=0.0, ge=0)
    # mu of the soft maximum (1/mu) log sum exp(mu F_i) over a silo's domain losses: larger weights
    # the worst domain more, towards 0 it is their mean (1 by default)
    temperature: float = Field(default=1.0, gt=0)
    # how a batch's loss on one domain is formed from its rows' losses: sum (the default, divided by
    # the batch size) or mean
    domain_reduction: Literal["sum", "mean"] = "sum"

    @property
    def needs_domains(self) -> bool:
        return True

    def train_options(self, policy: Policy, position: Position) -> dict[str, Any]:
        return {"domain_temperature": self.temperature, "domain_reduction": self.domain_reduction}
