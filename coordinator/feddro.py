"""FedDRO's coordinator-side mathematics (docs/algorithms/feddro.md): the initial
clouds and the free-support Wasserstein barycenter of the silos' clouds (Cuturi and Doucet
2014), group by group, with POT's `ot.lp.free_support_barycenter`."""

from __future__ import annotations

from collections.abc import Mapping

import numpy as np


def initial_clouds(groups: int, points: int, dim: int, rng: np.random.Generator) -> np.ndarray:
    """`groups` clouds of `points` points drawn from N(0, I) in `dim` dimensions."""
    return rng.standard_normal((groups, points, dim))


def barycenter(
    clouds: Mapping[str, np.ndarray], present: Mapping[str, np.ndarray], previous: np.ndarray
) -> np.ndarray:
    """Per group, the free-support barycenter (uniform weights over the silos that hold the
    group, uniform point weights) of the silos' clouds (groups, points, dim), started from the
    previous barycenter's support; a group no silo holds keeps its previous support."""
    import ot  # POT loads with FedDRO only (it brings scipy and scikit-learn)

    result = previous.copy()
    for g in range(previous.shape[0]):
        holders = [s for s in sorted(clouds) if present[s][g] > 0]
        if not holders:
            continue
        measures = [clouds[s][g] for s in holders]
        weights = [ot.unif(len(m)) for m in measures]
        result[g] = ot.lp.free_support_barycenter(
            measures, weights, previous[g], weights=ot.unif(len(holders))
        )
    return result
