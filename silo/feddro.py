"""FedDRO's silo-side mathematics (docs/algorithms/feddro.md; the FedDRO paper, eqs. (3)-(5)): the
interpolating measure of Rakotomamonjy et al. (2023) between two point clouds through an exact
OT plan (POT's `ot.emd`), a silo's stage-A support step, the map of its records onto the
barycenter (barycentric projection), and stage B's penalty-form WDRO adversary (Sinha et al.
2018).

Everything here is float64 numpy for the OT and torch for the adversary; every random draw
comes from a generator the caller seeds.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from fedsilo.silo.evaluation import loss_function, per_sample_loss_function


def plan(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """The exact OT plan between uniform measures on the rows of `x` and `y`, squared Euclidean
    cost, the cost matrix scaled by its maximum when that is above 1 (R-FedWaD's `interp_meas`)."""
    import ot  # POT loads with FedDRO only (it brings scipy and scikit-learn)

    cost = ot.dist(x, y)  # squared Euclidean
    largest = float(cost.max()) if cost.size else 0.0
    if largest > 1.0:
        cost = cost / largest
    return ot.emd(ot.unif(len(x)), ot.unif(len(y)), cost)


def interpolate(x: np.ndarray, y: np.ndarray, t: float) -> np.ndarray:
    """The approximate McCann interpolation at time `t` from the cloud `x` towards `y`:
    (1 - t) x + t (n_x G) y, G the exact OT plan (each point moved towards its barycentric
    projection), with as many points as `x`."""
    return (1.0 - t) * x + t * (len(x) * plan(x, y)) @ y


def barycentric_map(records: np.ndarray, target: np.ndarray) -> np.ndarray:
    """Each record moved onto `target` by the barycentric projection of the exact OT plan from
    the records to the target cloud (the paper's T_i(x_i))."""
    return interpolate(records, target, 1.0)


def clip_rows(x: np.ndarray, radius: float) -> np.ndarray:
    """Each row scaled down to L2 norm at most `radius`."""
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    return x * np.minimum(1.0, radius / np.maximum(norms, 1e-300))


def support_step(
    support: np.ndarray,
    records: np.ndarray,
    barycenter: np.ndarray,
    t: float,
    noise: tuple[float, np.random.Generator] | None = None,
) -> np.ndarray:
    """One stage-A step of one group: eta_P = the interpolation from the silo's cloud towards
    its records, eta_Q = from the cloud towards the barycenter, and the new cloud the midpoint
    of the geodesic between them (eq. (4)). With `noise` (std, generator) eta_P gets Gaussian
    noise before it meets eta_Q, so the rest is post-processing."""
    towards_data = interpolate(support, records, t)
    if noise is not None:
        std, generator = noise
        towards_data = towards_data + generator.normal(0.0, std, size=towards_data.shape)
    towards_barycenter = interpolate(support, barycenter, t)
    return interpolate(towards_data, towards_barycenter, 0.5)


def point_cloud_sensitivity(points: int, t: float, clip: float) -> float:
    """The L2 sensitivity of one group's eta_P to one record, records clipped to norm `clip`:
    its data part t (n_s G) X moves each of the `points` points inside the ball of radius
    t * clip, whatever the plan, so each by at most 2 t clip."""
    return 2.0 * t * clip * float(np.sqrt(points))


def groups_of(x: np.ndarray, y: np.ndarray, variant: str, classes: int) -> list[np.ndarray | None]:
    """The silo's records as stage A's groups: per class (None for a class it lacks) with
    `classwise`, one group of (x, one-hot y) with `datawise`."""
    if variant == "classwise":
        return [x[y == c] if np.any(y == c) else None for c in range(classes)]
    return [np.concatenate([x, np.eye(classes)[y]], axis=1)]


def mapped_records(
    x: np.ndarray, y: np.ndarray, barycenter: np.ndarray, variant: str
) -> tuple[np.ndarray, np.ndarray]:
    """The silo's records mapped onto the barycenter (groups, points, dim): classwise, each
    class's rows onto that class's cloud, labels kept; datawise, (x, one-hot y) onto the one
    cloud, the label the mapped one-hot part's largest entry."""
    classes = barycenter.shape[0] if variant == "classwise" else barycenter.shape[2] - x.shape[1]
    if variant == "classwise":
        mapped = np.empty_like(x)
        for c in np.unique(y):
            rows = y == c
            mapped[rows] = barycentric_map(x[rows], barycenter[c])
        return mapped, y
    joint = barycentric_map(np.concatenate([x, np.eye(classes)[y]], axis=1), barycenter[0])
    return joint[:, : x.shape[1]], joint[:, x.shape[1] :].argmax(axis=1)


class WassersteinAdversary:
    """Stage B's objective (the paper's eq. (5), penalty form of Sinha et al. 2018): each row u is
    moved to u + theta by `steps` gradient-ascent steps of size `step` on
    loss(h(u + theta), y) - penalty ||theta||^2 from theta = 0, and the model's loss is taken
    there. The ascent's gradients do not reach the model's parameters."""

    def __init__(
        self,
        task: str,
        model: nn.Module,
        x: Tensor,
        y: Tensor,
        penalty: float,
        steps: int,
        step: float,
    ) -> None:
        self.model, self.x, self.y = model, x, y
        self.mean_loss = loss_function(task)
        self.row_loss = per_sample_loss_function(task)
        self.penalty, self.steps, self.step = penalty, steps, step

    def perturbed(self, index: Tensor) -> Tensor:
        u, y = self.x[index], self.y[index]
        theta = torch.zeros_like(u, requires_grad=True)
        for _ in range(self.steps):
            gain = self.row_loss(self.model(u + theta), y).sum()
            gain = gain - self.penalty * (theta**2).sum()
            (gradient,) = torch.autograd.grad(gain, theta)
            theta = (theta + self.step * gradient).detach().requires_grad_(True)
        return (u + theta).detach()

    def batch_loss(self, index: Tensor) -> Tensor:
        return self.mean_loss(self.model(self.perturbed(index)), self.y[index])

    def per_sample_loss(self, index: Tensor) -> Tensor:
        return self.row_loss(self.model(self.perturbed(index)), self.y[index])
