"""Across-silo summaries of per-silo metrics, as the AAggFF authors' evaluation computes them
(Hahn et al. 2024; docs/metrics.md).

For per-silo values v_k with test sizes n_k: the unweighted and size-weighted means, the
worst and best single silo, the size-weighted mean of the worst / best 10% of silos
(k = max(1, floor(0.1 * silos))), the Gini coefficient and the best-worst parity gap.
"Worst" follows the metric's direction: the lowest accuracy, but the highest loss.
Silos whose value is NaN (an undefined AUROC, say) are left out and counted in `excluded`.
R² (`r2`, regression) is a ratio, so its `weighted_mean` is the pooled R² instead,
1 - sum_k SSE_k / sum_k SST_k, from what each silo reports (SSE_k = n_k rmse_k^2,
SST_k = SSE_k / (1 - r2_k)): no silo sends its targets' mean or spread.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import asdict, dataclass, replace

LOWER_IS_BETTER_MARKERS = ("loss", "rmse", "mae", "error")
R2, RMSE = "r2", "rmse"


@dataclass(frozen=True)
class CrossSiloSummary:
    """One metric summarised over silos; every value is NaN when no silo had a value."""

    mean: float
    weighted_mean: float
    worst: float
    best: float
    worst_10: float
    best_10: float
    gini: float
    parity_gap: float
    excluded: int

    def as_dict(self) -> dict[str, float | int]:
        return asdict(self)


def summarize(
    values: Mapping[str, float], sizes: Mapping[str, int], higher_is_better: bool
) -> CrossSiloSummary:
    """Summarise one metric's per-silo `values`, weighting by the silos' test `sizes`.

    Ties in value are broken by silo name, so the worst / best 10% are deterministic.
    """
    kept = {silo: value for silo, value in values.items() if not math.isnan(value)}
    excluded = len(values) - len(kept)
    if not kept:
        nan = float("nan")
        return CrossSiloSummary(nan, nan, nan, nan, nan, nan, nan, nan, excluded)
    weights = _weights(kept, sizes)
    worst_first = sorted(kept, key=lambda silo: (kept[silo], silo), reverse=not higher_is_better)
    k = max(1, len(kept) // 10)
    worst, best = kept[worst_first[0]], kept[worst_first[-1]]
    return CrossSiloSummary(
        mean=sum(kept.values()) / len(kept),
        weighted_mean=_weighted_mean(kept, weights, list(kept)),
        worst=worst,
        best=best,
        worst_10=_weighted_mean(kept, weights, worst_first[:k]),
        best_10=_weighted_mean(kept, weights, worst_first[-k:]),
        gini=gini(list(kept.values())),
        parity_gap=abs(best - worst),
        excluded=excluded,
    )


def summarize_metrics(
    per_silo: Mapping[str, Mapping[str, float]],
    sizes: Mapping[str, int],
    higher_is_better: Mapping[str, bool],
) -> dict[str, CrossSiloSummary]:
    """A summary for every metric that all silos report.

    A metric's direction is taken from `higher_is_better`; a metric missing there counts as
    lower-is-better when its name contains loss, rmse, mae or error, else higher-is-better.
    """
    summaries = {
        name: summarize(
            {silo: reported[name] for silo, reported in per_silo.items()},
            sizes,
            higher_is_better.get(name, _guess_higher_is_better(name)),
        )
        for name in _common_metrics(per_silo)
    }
    if R2 in summaries and RMSE in summaries:
        summaries[R2] = replace(summaries[R2], weighted_mean=pooled_r2(per_silo, sizes))
    return summaries


def pooled_r2(per_silo: Mapping[str, Mapping[str, float]], sizes: Mapping[str, int]) -> float:
    """R² over every silo's test rows: 1 - sum SSE / sum SST, each silo's SST about its own
    mean, recovered from its rmse, r2 and test size. A silo whose R² is NaN (targets all equal)
    adds its SSE and no SST; NaN when a silo's rmse is not finite or its R² is exactly 1 (which
    leaves its SST unknown), or when the SSTs sum to 0."""
    sse = sst = 0.0
    for silo, reported in per_silo.items():
        r2, rmse = reported[R2], reported[RMSE]
        if not math.isfinite(rmse) or r2 >= 1.0:
            return float("nan")
        error = sizes[silo] * rmse**2
        sse, sst = sse + error, sst + (0.0 if math.isnan(r2) else error / (1.0 - r2))
    return 1.0 - sse / sst if sst > 0 else float("nan")


def gini(values: list[float]) -> float:
    """Gini coefficient: sum_i (2i - n - 1) x_(i) / (n * sum x), x ascending; 0 if sum is 0."""
    ordered = sorted(values)
    n, total = len(ordered), sum(ordered)
    if total == 0:
        return 0.0
    return sum((2 * i - n - 1) * x for i, x in enumerate(ordered, start=1)) / (n * total)


def _weights(kept: Mapping[str, float], sizes: Mapping[str, int]) -> dict[str, int]:
    missing = sorted(set(kept) - set(sizes))
    if missing:
        raise ValueError(f"no test size given for silo(s): {', '.join(missing)}")
    non_positive = sorted(silo for silo in kept if sizes[silo] <= 0)
    if non_positive:
        raise ValueError(f"test size must be positive for silo(s): {', '.join(non_positive)}")
    return {silo: sizes[silo] for silo in kept}


def _weighted_mean(
    values: Mapping[str, float], weights: Mapping[str, int], silos: list[str]
) -> float:
    total = sum(weights[silo] for silo in silos)
    return sum(values[silo] * weights[silo] for silo in silos) / total


def _common_metrics(per_silo: Mapping[str, Mapping[str, float]]) -> list[str]:
    reports = list(per_silo.values())
    if not reports:
        return []
    return [name for name in reports[0] if all(name in report for report in reports[1:])]


def _guess_higher_is_better(name: str) -> bool:
    lowered = name.lower()
    return not any(marker in lowered for marker in LOWER_IS_BETTER_MARKERS)
