"""Domains inside a silo (`data.domain`, e.g. sex or the scanner): which rows belong to which
domain, and the two training objectives that weight domains (the per-domain loss totals that
AgnosticFedAvg's probe reports leave through silo/reports.py).

- AgnosticFedAvg (docs/algorithms/agnostic_fedavg.md): row j's loss counts omega of its domain,
  the weights the coordinator sends (`domain_weights`); the objective is a mean over the batch of
  weighted per-row losses, so DP-SGD clips each weighted row as a sample.
- ApproxFedAvg (docs/algorithms/approx_fedavg.md): the batch loss is (1/mu) log sum_i exp(mu F_i)
  over the domains i present in the batch (`domain_temperature` mu), F_i the sum of the domain's row
  losses divided by the batch size (`sum`: the survey's sums, at the scale of a mean loss, so one
  domain is the plain mean loss and mu keeps its meaning across batch sizes; a domain with more rows
  in the batch has the larger F_i) or their mean (`mean`). Autograd of the log-sum-exp is sum_i
  softmax(mu F)_i grad F_i, the survey's update: a softmax-weighted average of the domains' terms
  where the plain mean loss's gradient is their sum (with `sum`), so at small mu and p domains in
  the batch the step is 1/p of FedAvg's at the same learning rate.

Domain names are the categories the consortium declared for the column; a domain a silo does not
hold simply has no rows there.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from fedsilo.policies.schema import Policy
from fedsilo.silo.data import SiloDataset
from fedsilo.wire.tasks import TrainTask

if TYPE_CHECKING:  # the task context imports every handler, and the handlers import this module
    from fedsilo.silo.tasks.base import SiloContext

DOMAIN_REDUCTIONS = ("sum", "mean")


def needs_domains(policy: Policy) -> bool:
    """Whether the policy's algorithm trains or probes per domain of `data.domain`."""
    return policy.algorithm.needs_domains


def check_domains(policy: Policy, data: SiloDataset) -> None:
    """Refuse, before any work, a policy that needs domains this silo's data does not declare."""
    if needs_domains(policy) and not data.domains:
        raise ValueError(
            f"{policy.algorithm.name} weights the domains inside each silo, but silo "
            f"{data.name!r} declares no domain column: set data.domain to a categorical column"
        )


def split_domains(ctx: SiloContext, split: str) -> tuple[tuple[str, ...], Tensor]:
    """The domain names and the domain code of every row of `split` (on the silo's device);
    refused when the silo's data declares no domain column."""
    data = ctx.data
    if not data.domains:
        raise ValueError(
            f"silo {ctx.name!r} holds no domains: its data section declares no domain column "
            "(data.domain), which this algorithm needs"
        )
    return data.domains, data.domain_codes[split].to(ctx.device)


class DomainObjective:
    """A training objective over a batch of row indices that weights the rows' domains."""

    def __init__(
        self,
        row_loss: Callable[[Tensor], Tensor],
        codes: Tensor,
        domains: int,
        weights: Tensor | None = None,
        temperature: float | None = None,
        reduction: str = "sum",
    ) -> None:
        self.row_loss = row_loss
        self.codes = codes
        self.domains = domains
        self.weights = weights
        self.temperature = temperature
        self.reduction = reduction

    def per_sample_loss(self, index: Tensor) -> Tensor:
        """Each row's weighted loss (AgnosticFedAvg): what DP-SGD clips row by row."""
        if self.weights is None:
            raise ValueError(
                "approx_fedavg's log-sum-exp couples the rows of a batch: it has no per-row "
                "loss for DP-SGD to clip"
            )
        return self.row_loss(index) * self.weights[self.codes[index]].to(self.weights.device)

    def batch_loss(self, index: Tensor) -> Tensor:
        if self.temperature is None:
            return self.per_sample_loss(index).mean()
        losses = self.row_loss(index)
        codes = self.codes[index]
        totals = torch.zeros(self.domains, dtype=losses.dtype, device=losses.device)
        totals = totals.index_add(0, codes, losses)
        counts = torch.bincount(codes, minlength=self.domains).to(losses)
        present = counts > 0
        if self.reduction == "sum":
            per_domain = totals[present] / len(index)
        else:
            per_domain = totals[present] / counts[present]
        return torch.logsumexp(self.temperature * per_domain, dim=0) / self.temperature


def domain_objective(
    task: TrainTask, ctx: SiloContext, row_loss: Callable[[Tensor], Tensor]
) -> DomainObjective | None:
    """The objective a train task's `domain_weights` or `domain_temperature` asks for (None:
    neither), over the training split's domains; bad settings are refused before training."""
    weights, temperature = task.domain_weights, task.domain_temperature
    if weights is None and temperature is None:
        return None
    if weights is not None and temperature is not None:
        raise ValueError("a train task takes domain_weights or domain_temperature, not both")
    names, codes = split_domains(ctx, "train")
    if weights is not None:
        return DomainObjective(row_loss, codes, len(names), weights=_weights(weights, names, ctx))
    mu = float(temperature)
    if not (math.isfinite(mu) and mu > 0):
        raise ValueError(f"domain_temperature must be a positive number, not {temperature!r}")
    reduction = task.reduction
    if reduction not in DOMAIN_REDUCTIONS:
        raise ValueError(f"domain_reduction must be one of {DOMAIN_REDUCTIONS}, not {reduction!r}")
    return DomainObjective(row_loss, codes, len(names), temperature=mu, reduction=reduction)


def _weights(weights: Mapping[str, float], names: tuple[str, ...], ctx: SiloContext) -> Tensor:
    unknown = sorted(set(weights) - set(names))
    if unknown:
        raise ValueError(f"domain_weights names unknown domains {unknown}; known: {list(names)}")
    values = [float(weights.get(name, 0.0)) for name in names]
    if not all(math.isfinite(v) and v >= 0 for v in values):
        raise ValueError(f"domain_weights must be finite and >= 0, got {dict(weights)}")
    return torch.tensor(values, device=ctx.device)
