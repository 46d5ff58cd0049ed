"""The Radon machine's aggregate (FedDC, docs/algorithms/feddc.md "Radon point"; Kamp et al.
2017): the Radon point of r = d + 2 parameter vectors in R^d, the iterated Radon point of many, and
`RadonAggregator`, which applies the iterated Radon point to model state dicts.

A Radon point of r points lies in the convex hulls of both parts of a partition of them, so it
is a centre of depth at least 2: one arbitrarily bad point per group cannot pull it out of the
hull of the others, and the iterated Radon point of height h tolerates fewer than 2^h bad
models wherever they sit. The Radon point needs every individual model, so it cannot run under
secure aggregation or HE; it is computed in float64 on the coordinator.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import torch


class RadonError(ValueError):
    """The models cannot be aggregated to a Radon point (too few, mismatched, not finite)."""


def radon_number(dim: int) -> int:
    """The number of points in R^dim a Radon point needs: dim + 2."""
    return dim + 2


def radon_height(num_models: int, dim: int) -> int:
    """The largest h with r^h <= num_models (r = dim + 2): how many levels the models fill."""
    r = radon_number(dim)
    height, needed = 0, r
    while needed <= num_models:
        height, needed = height + 1, needed * r
    return height


def radon_point(points: np.ndarray) -> np.ndarray:
    """The Radon point of r = d + 2 points in R^d, given as the rows of `points` (shape (r, d)).

    With lambda a nonzero solution of sum_i lambda_i x_i = 0, sum_i lambda_i = 0, oriented so that
    lambda_1 >= 0 (the appendix fixes lambda_1 = 1), and I = {i : lambda_i > 0}, the point is
    sum_{i in I} lambda_i x_i / sum_{i in I} lambda_i. It equals the same combination over the
    negative coefficients, so it lies in the convex hull of both parts.

    Degenerate points (affinely dependent, e.g. repeated or collinear) still give a point of
    both hulls, never NaN: the solution space is then larger than a line and one of its vectors
    is used. All-identical points return that point exactly.
    """
    pts = _as_points(points)
    count, dim = pts.shape
    if count != radon_number(dim):
        raise RadonError(
            f"a Radon point in R^{dim} takes exactly r = d + 2 = {radon_number(dim)} points; "
            f"got {count}"
        )
    centred = pts - pts.mean(axis=0)
    scale = np.max(np.abs(centred), initial=0.0)
    if scale == 0.0:
        return pts[0].copy()
    coefficients = _radon_coefficients(centred / scale)
    positive = coefficients > 0
    return coefficients[positive] @ pts[positive] / coefficients[positive].sum()


def _radon_coefficients(points: np.ndarray) -> np.ndarray:
    """A unit lambda with points^T lambda = 0 and sum(lambda) = 0, oriented so lambda_1 >= 0.

    The (d + 1) x (d + 2) system [points^T; 1 ... 1] always has a null space, and the last right
    singular vector lies in it exactly (backward-stable SVD), whatever the rank. The appendix's
    alternative, fixing lambda_1 = 1 and solving the square system (R-FedDC uses lstsq), is
    inconsistent whenever every null vector has lambda_1 = 0 (e.g. a repeated point), and lstsq
    then returns a least-squares vector that is not a Radon partition at all. The callers centre
    and scale the points first: that leaves the null space unchanged (sum(lambda) = 0) and puts
    the coordinate rows on the scale of the row of ones, so a large common offset does not swamp
    it. The orientation only picks which part's combination computes the point (both give it in
    exact arithmetic); fixing it keeps the result independent of the SVD's sign convention.
    """
    system = np.vstack([points.T, np.ones(len(points))])
    null_vector = np.linalg.svd(system)[2][-1]
    return null_vector if null_vector[0] >= 0 else -null_vector


def iterated_radon_point(models: np.ndarray, iterations: int) -> np.ndarray:
    """The iterated Radon point of height h of the rows of `models` (shape (m, d)).

    Rule for m != r^h (r = d + 2): the height is
    h = min(iterations, radon_height(m, d)), i.e. the requested height, lowered while fewer than
    r^h models are given; exactly the first r^h models in the given order are used and the rest
    are dropped. Each level replaces consecutive groups of r points by their Radon point, so h
    levels end in one point. The rule is deterministic; callers that want FedDC's random
    choice and grouping pass the models in a seeded random order, and the dropped ones are the
    rows from r^h on.
    """
    pts = _as_points(models)
    count, dim = pts.shape
    if iterations < 1:
        raise RadonError(f"the iterated Radon point needs at least 1 iteration; got {iterations}")
    r = radon_number(dim)
    if count < r:
        raise RadonError(
            f"{count} models given, but the Radon point of models with d = {dim} parameters "
            f"needs at least r = d + 2 = {r}"
        )
    height = min(iterations, radon_height(count, dim))
    level = pts[: r**height]
    for _ in range(height):
        level = np.stack([radon_point(group) for group in level.reshape(len(level) // r, r, dim)])
    return level[0]


def _as_points(points: np.ndarray) -> np.ndarray:
    pts = np.asarray(points, dtype=np.float64)
    if pts.ndim != 2:
        raise RadonError(f"points must be a 2-D array (one point per row); got shape {pts.shape}")
    if not np.all(np.isfinite(pts)):
        raise RadonError("points must be finite; got NaN or infinity")
    return pts


class RadonAggregator:
    """Aggregates model state dicts to their iterated Radon point.

    Every floating-point tensor takes part: each model becomes one float64 vector (its float
    tensors flattened in sorted-name order), and the result is cut back into the original
    shapes and dtypes. Other tensors (integer buffers such as `num_batches_tracked`) must be
    identical in every model and are copied through.
    """

    def aggregate(
        self, models: Sequence[Mapping[str, torch.Tensor]], iterations: int
    ) -> dict[str, torch.Tensor]:
        """The iterated Radon point of `models` with the given height (see iterated_radon_point
        for which models are used when their number is not r^height)."""
        if not models:
            raise RadonError("no models to aggregate")
        template = models[0]
        for model in models[1:]:
            _check_same_layout(template, model)
        floats = sorted(name for name, tensor in template.items() if tensor.is_floating_point())
        _check_fixed_tensors_agree(models, [name for name in template if name not in floats])
        vectors = np.stack([_flatten(model, floats) for model in models])
        point = iterated_radon_point(vectors, iterations)
        aggregate = _unflatten(point, template, floats)
        return {
            name: aggregate[name] if name in aggregate else template[name].clone()
            for name in template
        }


def _check_same_layout(
    template: Mapping[str, torch.Tensor], model: Mapping[str, torch.Tensor]
) -> None:
    if template.keys() != model.keys():
        differing = sorted(template.keys() ^ model.keys())
        raise RadonError(f"models have different tensors: {differing}")
    for name, tensor in template.items():
        other = model[name]
        if other.shape != tensor.shape or other.dtype != tensor.dtype:
            raise RadonError(
                f"tensor {name!r} differs between models: {tuple(tensor.shape)} {tensor.dtype} "
                f"vs {tuple(other.shape)} {other.dtype}"
            )


def _check_fixed_tensors_agree(
    models: Sequence[Mapping[str, torch.Tensor]], names: Sequence[str]
) -> None:
    for name in names:
        if not all(torch.equal(model[name], models[0][name]) for model in models[1:]):
            raise RadonError(
                f"non-float tensor {name!r} differs between models; a Radon point cannot combine it"
            )


def _flatten(model: Mapping[str, torch.Tensor], names: Sequence[str]) -> np.ndarray:
    parts = [model[name].detach().cpu().to(torch.float64).reshape(-1).numpy() for name in names]
    return np.concatenate(parts) if parts else np.zeros(0)


def _unflatten(
    vector: np.ndarray, template: Mapping[str, torch.Tensor], names: Sequence[str]
) -> dict[str, torch.Tensor]:
    out, start = {}, 0
    for name in names:
        like = template[name]
        stop = start + like.numel()
        values = torch.from_numpy(vector[start:stop].copy()).reshape(like.shape)
        out[name] = values.to(dtype=like.dtype, device=like.device)
        start = stop
    return out
