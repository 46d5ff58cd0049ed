"""Federated MultiBoost's task (Cortes et al. 2021, as the survey of Tyagi & Chukkapalli
federates it; docs/algorithms/multiboost.md): the ensemble's loss sum and its edges on the
silo's rows, or its held-out metrics."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedsilo.wire.tasks.codec import TaskConfig
from fedsilo.wire.tasks.release import Release

LOSS_SUM = "boost_loss_sum"  # the metric of A, the exponential loss sum


def edge_metric(learner: int) -> str:
    """The metric name of base classifier `learner`'s edge sum E_j."""
    return f"boost_edge[{learner}]"


def edges_in(metrics: dict[str, float]) -> dict[int, float]:
    """The edge sums a result's metrics report, by base classifier."""
    prefix = "boost_edge["
    return {int(k[len(prefix) : -1]): v for k, v in metrics.items() if k.startswith(prefix)}


@dataclass(frozen=True, kw_only=True)
class BoostProbe(TaskConfig):
    """`boost_probe`: the ensemble f = sum_j alpha_j h_j (BOOST_LEARNERS, BOOST_ALPHA; h_j the
    j-th base classifier's margin 2 P(y = 1 | x) - 1) on `split`. With `evaluate`, the metrics
    an `evaluate` task reports, of the classifier P(y = 1 | x) = sigmoid(2 f(x)); else the
    exponential loss sum A = sum_i exp(-y_i f(x_i)) (y in {-1, +1}) and, for each base
    classifier j in `edges`, E_j = sum_i exp(-y_i f(x_i)) y_i h_j(x_i)."""

    KIND: ClassVar[str] = "boost_probe"
    SENDS: ClassVar[Release] = Release.NOTHING_PRIVATE
    split: str = "train"
    evaluate: bool = False
    edges: tuple[int, ...] = ()
