"""The built-in survival task (`task: survival`): targets y of shape (n, 2), each row's
(time, event) with event 1 for an observed death and 0 for a censored row; the model's one
output is each row's relative risk (log-hazard score).

The loss is the Cox partial likelihood as FLamby's Fed-TCGA-BRCA computes it
(flamby/datasets/fed_tcga_brca/loss.py): the batch's rows ordered by time, latest first (a
stable sort: rows of tied times keep their batch order), row i's term
log sum_{j <= i} exp(s_j) - s_i counted when i is an event, the sum divided by the batch's rows
(censored rows count in the mean). Each row's risk set is the rest of its batch, so the loss has
no per-row decomposition: DP-SGD, which clips each row's gradient, is refused.

The metric is the concordance index, Harrell's C, as FLamby computes it:
`lifelines.utils.concordance_index(time, -score, event)` (a higher score, an earlier death).
"""

from __future__ import annotations

import torch
from torch import Tensor

TIME, EVENT = 0, 1  # the columns of y
NO_PER_ROW_LOSS = (
    "the survival task's Cox partial-likelihood loss has no per-row loss: each row's term "
    "depends on its risk set, the other rows of its batch"
)


class SurvivalTask:
    """Cox proportional hazards on (time, event) targets; a `TaskPlugin` (silo/data/plugins.py)
    without `per_sample_loss`."""

    higher_is_better = {"loss": False, "c_index": True}
    selection = "c_index"

    def output_dim(self, y: Tensor) -> int:
        return 1

    def loss(self, output: Tensor, y: Tensor) -> Tensor:
        """The mean over the batch of the events' negative partial log-likelihood terms."""
        return cox_loss(output.reshape(-1), y[:, TIME].to(output), y[:, EVENT].to(output))

    def metrics(self, output: Tensor, y: Tensor) -> dict[str, float]:
        return {"c_index": concordance_index(output.reshape(-1), y[:, TIME], y[:, EVENT])}


def cox_loss(score: Tensor, time: Tensor, event: Tensor) -> Tensor:
    """FLamby's Cox loss: rows sorted by time descending (stable), row i's term
    logsumexp(score[:i+1]) - score[i], times event i, averaged over all rows."""
    order = torch.sort(time, descending=True, stable=True).indices
    score, event = score[order], event[order]
    terms = torch.logcumsumexp(score, dim=0) - score
    return (terms * event).mean()


def concordance_index(score: Tensor, time: Tensor, event: Tensor) -> float:
    """Harrell's C of risk `score` for (time, event), by lifelines; NaN without a comparable
    pair (lifelines refuses those, e.g. a split without an event), and NaN for scores that are
    not all finite (a model that diverged: lifelines refuses them too)."""
    from lifelines.utils import concordance_index as lifelines_c_index  # slow import: here only

    if not bool(torch.isfinite(score).all()):
        return float("nan")
    try:
        return float(
            lifelines_c_index(
                time.double().numpy(), -score.double().numpy(), event.double().numpy()
            )
        )
    except ZeroDivisionError:
        return float("nan")
