"""The robust rules' maths (docs/robust-aggregation.md): pure float64 numpy, one row of
`updates` per silo (its model minus the round's model, flattened), new arrays out.

- coordinate-wise median and trimmed mean (Yin et al. 2018): one vote per silo, weights unused;
- Krum and Multi-Krum (Blanchard et al. 2017): each update scored by the sum of its squared
  distances to its n - f - 2 nearest other updates; Krum keeps the lowest-scored one,
  Multi-Krum the weighted mean of the m lowest (ties go to the earlier row: silos in sorted
  order);
- norm-bounded averaging (Sun et al. 2019): each update scaled down to norm at most M, then the
  weighted mean.
"""

from __future__ import annotations

import numpy as np

from fedsilo.policies.algorithms.robust import (
    KrumRule,
    MedianRule,
    MultiKrumRule,
    NormBoundedRule,
    RobustRuleBase,
    TrimmedMeanRule,
)


def coordinate_median(updates: np.ndarray) -> np.ndarray:
    """Every coordinate's median over the rows (the mean of the two middle values when the
    number of rows is even)."""
    return np.median(updates, axis=0)


def trimmed_mean(updates: np.ndarray, trim: int) -> np.ndarray:
    """Every coordinate's mean over the rows once its `trim` largest and `trim` smallest values
    are dropped; at least one value must be left."""
    n = len(updates)
    if trim < 0 or n - 2 * trim < 1:
        raise ValueError(f"trimming {trim} of {n} values from each end leaves none")
    return np.sort(updates, axis=0)[trim : n - trim].mean(axis=0)


def squared_distances(updates: np.ndarray) -> np.ndarray:
    """The n x n matrix of squared Euclidean distances between the rows (computed as the sum
    of squared differences, not from the Gram matrix, which would cancel catastrophically for
    close rows)."""
    return np.stack([np.square(updates - row).sum(axis=1) for row in updates])


def krum_scores(updates: np.ndarray, f: int) -> np.ndarray:
    """Each row's Krum score: the sum of its squared distances to its n - f - 2 nearest other
    rows; needs n > 2f + 2 rows."""
    n = len(updates)
    if n <= 2 * f + 2:
        raise ValueError(f"Krum withstands f = {f} faulty rows only among n > {2 * f + 2}, not {n}")
    distances = squared_distances(updates)
    nearest = n - f - 2
    others = [np.delete(distances[i], i) for i in range(n)]
    return np.array([np.sort(row)[:nearest].sum() for row in others])


def krum_selection(updates: np.ndarray, f: int, m: int) -> np.ndarray:
    """The indices of the `m` rows with the lowest Krum scores, lowest first (ties: the
    earlier row)."""
    return np.argsort(krum_scores(updates, f), kind="stable")[:m]


def weighted_mean(updates: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """sum_k w_k u_k / sum_k w_k."""
    return (weights[:, None] * updates).sum(axis=0) / weights.sum()


def multi_krum(updates: np.ndarray, weights: np.ndarray, f: int, m: int) -> np.ndarray:
    """The weighted mean of the `m` rows with the lowest Krum scores (m = 1: Krum)."""
    chosen = krum_selection(updates, f, m)
    return weighted_mean(updates[chosen], weights[chosen])


def clipped(updates: np.ndarray, max_norm: float) -> np.ndarray:
    """Each row scaled by min(1, M / ||row||): a row longer than M shortened to norm M."""
    norms = np.sqrt(np.square(updates).sum(axis=1))
    longer = norms > max_norm
    scale = np.ones_like(norms)
    scale[longer] = max_norm / norms[longer]
    return updates * scale[:, None]


def norm_bounded_mean(updates: np.ndarray, weights: np.ndarray, max_norm: float) -> np.ndarray:
    """The weighted mean of the rows, each first clipped to norm `max_norm`."""
    return weighted_mean(clipped(updates, max_norm), weights)


def robust_update(rule: RobustRuleBase, updates: np.ndarray, weights: np.ndarray) -> np.ndarray:
    """`rule`'s combination of `updates` (n x d, float64; `weights`: each row's weight, > 0):
    the update the round's model moves by."""
    n = len(updates)
    if isinstance(rule, MedianRule):
        return coordinate_median(updates)
    if isinstance(rule, TrimmedMeanRule):
        return trimmed_mean(updates, rule.trimmed(n))
    if isinstance(rule, KrumRule):
        return multi_krum(updates, weights, rule.f, 1)
    if isinstance(rule, MultiKrumRule):
        return multi_krum(updates, weights, rule.f, rule.m or n - rule.f)
    if isinstance(rule, NormBoundedRule):
        return norm_bounded_mean(updates, weights, rule.max_norm)
    raise TypeError(f"no robust rule {rule.name!r}")
