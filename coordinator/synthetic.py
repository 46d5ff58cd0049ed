"""FedEvg's synthetic data at the coordinator (docs/algorithms/fedevg.md, "Coordinator"): the
balanced labelled set that starts as noise, the server's Langevin (SGLD) step on the mixture of
the silos' energies, its step-size schedule, and the classifier trained on the set.

The mixture gradient at synthetic point j is sum_i w_i s_ij g_ij / sum_i w_i s_ij (w_i the
silos' sample shares, s_ij = exp(-sign E_i(x_j)), g_ij the clipped input gradient of silo i's
energy): a ratio of two weighted sums, which the engine computes as two weighted means over the
silos (secure aggregation applies to both), so the coordinator never holds one silo's signal.
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor, nn

COSINE_OFFSET = 0.008  # s of the improved-DDPM cosine schedule


def initial_synthetic_set(
    samples_per_class: int, classes: int, input_shape: tuple[int, ...], generator: torch.Generator
) -> tuple[Tensor, Tensor]:
    """X~_0 ~ N(0, I) (not clipped: clipping starts with the first step) and the balanced labels,
    class k at `samples_per_class` consecutive points."""
    n = samples_per_class * classes
    x = torch.randn((n, *input_shape), generator=generator)
    return x, torch.arange(classes).repeat_interleave(samples_per_class)


def step_sizes(rounds: int, largest: float, smallest: float) -> np.ndarray:
    """eta_t for t = 1..rounds (index t - 1): eta_max + (eta_min - eta_max) beta_t, beta_t of the
    improved-DDPM cosine schedule (alpha-bar(u) = cos^2(((u/T) + s)/(1 + s) pi/2) / alpha-bar(0),
    beta_t = 1 - alpha-bar(t) / alpha-bar(t-1)): about eta_max for most rounds, eta_min at T."""
    u = np.arange(rounds + 1) / rounds
    alpha_bar = np.cos((u + COSINE_OFFSET) / (1 + COSINE_OFFSET) * math.pi / 2) ** 2
    alpha_bar = alpha_bar / alpha_bar[0]
    beta = 1 - alpha_bar[1:] / alpha_bar[:-1]
    return largest + (smallest - largest) * beta


def mixture_gradient(weighted_gradients: Tensor, weights: Tensor) -> Tensor:
    """The mixture energy's input gradient per point: the weighted mean of s g over the weighted
    mean of s (the silos' weights cancel in the ratio)."""
    return weighted_gradients / weights.reshape(-1, *([1] * (weighted_gradients.dim() - 1)))


def langevin_step(
    x: Tensor, gradient: Tensor, step: float, noise: float, generator: torch.Generator
) -> Tensor:
    """clip(x - step * gradient + noise * xi, 0, 1), xi ~ N(0, I)."""
    xi = torch.randn(x.shape, generator=generator, dtype=x.dtype)
    return (x - step * gradient + noise * xi).clamp(0.0, 1.0)


def train_classifier(
    model: nn.Module,
    data: tuple[Tensor, Tensor],
    epochs: int,
    batch_size: int,
    lr: float,
    generator: torch.Generator,
) -> nn.Module:
    """`model` trained on (x, y) with Adam and cross-entropy for `epochs` shuffled passes."""
    x, y = data
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    model.train()
    for _ in range(epochs):
        order = torch.randperm(len(y), generator=generator)
        for start in range(0, len(y), batch_size):
            rows = order[start : start + batch_size]
            optimizer.zero_grad(set_to_none=True)
            nn.functional.cross_entropy(model(x[rows]), y[rows]).backward()
            optimizer.step()
    model.eval()
    return model
