"""FedEvg at a silo (docs/algorithms/fedevg.md, "Silo"): a classifier f read as an energy-based
model (JEM), its local training against Langevin samples started at the coordinator's synthetic
points, and the energy signals the silo sends back.

Energies: joint E(x, y) = -f(x)[y] (the reference's), or marginal E(x) = -log sum_y exp f(x)[y]
(JEM's; the label is then ignored). A round at the silo:

    buffer <- X0 (the synthetic points received); a fresh model (or the last one, persisted)
    for each minibatch (x, y) of the silo's rows:
        J <- min(b, N) synthetic points without replacement; z <- buffer[J]
        K_c times: z <- z - alpha clip(grad_z E(z, y~_J), -tau, tau) + sigma eps
        buffer[J] <- clip(z, 0, 1)                         (persistent chains)
        loss <- mean E(x, y) - mean E(z, y~_J) + CE(f(x), y) + lambda_ce CE(f(X0[J]), y~_J)
    g <- clip(grad_X E(X0, y~), -tau, tau); s <- exp(-sign E(X0, y~))    (|E| < 1e-12: sign 0)
    send s * g and s (the two sums of the mixture gradient), and the sample count

Under DP-SGD the rows' terms (E(x_i, y_i) + CE(f(x_i), y_i)) are clipped and noised row by row;
the synthetic terms read no private data (the synthetic points are public, the model is DP-SGD's
iterate), so their gradient joins after the noise, as FedProx's does, and the signals are
post-processing of the DP-SGD run. A spectrally normalised last layer (the reference's) draws its
power-iteration vectors from the task's seed under a lock on torch's global generator, so
concurrent silos in one process stay reproducible.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from fedsilo.models.global_rng import seeded_global_rng
from fedsilo.wire.tasks import EnergySignals

ENERGIES = ("joint", "marginal")
SIGN_ZERO = 1e-12  # |E| below this has sign 0 (s = 1)


def energy_of(logits: Tensor, y: Tensor, kind: str) -> Tensor:
    """Each row's energy from its logits: -f(x)[y] (`joint`) or -logsumexp f(x) (`marginal`)."""
    if kind == "joint":
        return -logits.gather(1, y.reshape(-1, 1)).squeeze(1)
    return -torch.logsumexp(logits, dim=1)


def energy(model: nn.Module, x: Tensor, y: Tensor, kind: str) -> Tensor:
    return energy_of(model(x), y, kind)


def input_gradient(model: nn.Module, x: Tensor, y: Tensor, kind: str, clip: float) -> Tensor:
    """grad_x E(x, y) row by row (the energies summed: each row's gradient is its own), clipped
    elementwise to [-clip, clip]; the model's parameters get no gradient."""
    x = x.detach().requires_grad_(True)
    (gradient,) = torch.autograd.grad(energy(model, x, y, kind).sum(), x)
    return gradient.clamp(-clip, clip)


def with_spectral_norm(model: nn.Sequential, seed: int) -> nn.Sequential:
    """`model` with its last layer spectrally normalised, the power iteration's vectors drawn
    from `seed` (torch draws them from its global generator: seeded and restored here)."""
    with seeded_global_rng(seed):
        nn.utils.parametrizations.spectral_norm(model[-1])
    return model


@dataclass(frozen=True)
class EnergySettings:
    """One round's FedEvg settings at a silo, as the task carries them."""

    kind: str
    sgld_steps: int
    sgld_step: float
    sgld_noise: float
    clip: float
    synthetic_ce_weight: float

    @classmethod
    def of(cls, task: EnergySignals) -> EnergySettings:
        kind = task.energy
        if kind not in ENERGIES:
            raise ValueError(f"energy must be one of {ENERGIES}, not {kind!r}")
        settings = cls(
            kind,
            task.sgld_steps,
            float(task.sgld_step),
            float(task.sgld_noise),
            float(task.gradient_clip),
            float(task.synthetic_ce_weight),
        )
        if settings.sgld_steps < 0 or settings.clip <= 0:
            raise ValueError("sgld_steps must be >= 0 and gradient_clip > 0")
        return settings


class EnergyTraining:
    """One silo's round: the model, its rows (x, y), the synthetic set and its chains."""

    def __init__(
        self,
        model: nn.Module,
        data: tuple[Tensor, Tensor],
        synthetic: tuple[Tensor, Tensor],
        settings: EnergySettings,
        seed: int,
    ) -> None:
        self.model = model
        self.x, self.y = data
        self.x0, self.labels = synthetic
        self.buffer = self.x0.clone()
        self.settings = settings
        self.generator = torch.Generator(device=self.x0.device).manual_seed(seed)

    def negatives(self, batch: int) -> tuple[Tensor, Tensor]:
        """This step's synthetic indices J and their chains after K_c Langevin steps, written
        back to the buffer."""
        settings, n = self.settings, len(self.labels)
        rows = torch.randperm(n, generator=self.generator, device=self.x0.device)[: min(batch, n)]
        z, labels = self.buffer[rows], self.labels[rows]
        self.model.eval()  # the chains move on the model as it is (no power iteration)
        for _ in range(settings.sgld_steps):
            gradient = input_gradient(self.model, z, labels, settings.kind, settings.clip)
            noise = torch.randn(z.shape, generator=self.generator, device=z.device, dtype=z.dtype)
            z = z - settings.sgld_step * gradient + settings.sgld_noise * noise
        self.model.train()
        z = z.detach().clamp(0.0, 1.0)
        self.buffer[rows] = z
        return rows, z

    def row_loss(self, index: Tensor) -> Tensor:
        """The private rows' terms, row by row: E(x_i, y_i) + CE(f(x_i), y_i)."""
        x, y = self.x[index], self.y[index]
        logits = self.model(x)
        own = energy_of(logits, y, self.settings.kind)
        return own + nn.functional.cross_entropy(logits, y, reduction="none")

    def synthetic_loss(self, rows: Tensor, z: Tensor) -> Tensor:
        """The public terms: -mean E(z, y~_J) + lambda_ce CE(f(X0[J]), y~_J)."""
        labels = self.labels[rows]
        contrast = -energy(self.model, z, labels, self.settings.kind).mean()
        weight = self.settings.synthetic_ce_weight
        if weight == 0:
            return contrast
        ce = nn.functional.cross_entropy(self.model(self.x0[rows]), labels)
        return contrast + weight * ce

    def train(self, optimizer: torch.optim.Optimizer, batches: Iterable[Tensor]) -> list[float]:
        """Non-private training; each step's loss."""
        losses = []
        for index in batches:
            index = index.to(self.x.device)
            rows, z = self.negatives(len(index))
            optimizer.zero_grad(set_to_none=True)
            loss = self.row_loss(index).mean() + self.synthetic_loss(rows, z)
            loss.backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        return losses

    def private_gradients(
        self, clipped_sums: Callable[..., list[Tensor]], unwatched: Callable
    ) -> tuple[Callable[[Tensor], tuple[list[Tensor], float]], Callable[[], None]]:
        """DP-SGD's pieces: the clipped sums of the rows' terms for a batch, and (after the
        noise) the synthetic terms' gradient added to the parameters, computed with the
        clipping hooks paused (`unwatched`)."""
        pending: list[tuple[Tensor, Tensor]] = []

        def gradients(index: Tensor) -> tuple[list[Tensor], float]:
            with unwatched():
                pending.append(self.negatives(len(index)))
            per_sample = self.row_loss(index)
            return clipped_sums(per_sample), float(per_sample.detach().mean())

        def add_synthetic_gradient() -> None:
            if not pending:  # an empty Poisson batch drew no negatives: nothing to add
                return
            rows, z = pending.pop()
            params = [p for p in self.model.parameters() if p.requires_grad]
            with unwatched():
                grads = torch.autograd.grad(self.synthetic_loss(rows, z), params)
            for p, g in zip(params, grads, strict=True):
                p.grad.add_(g)

        return gradients, add_synthetic_gradient

    def signals(self) -> tuple[Tensor, Tensor]:
        """s * g and s at the received points (eval mode), s = exp(-sign E)."""
        self.model.eval()
        settings = self.settings
        gradient = input_gradient(self.model, self.x0, self.labels, settings.kind, settings.clip)
        with torch.no_grad():
            energies = energy(self.model, self.x0, self.labels, settings.kind).float()
        sign = torch.where(energies.abs() < SIGN_ZERO, torch.zeros_like(energies), energies.sign())
        weights = torch.exp(-sign)
        return weights.reshape(-1, *([1] * (gradient.dim() - 1))) * gradient, weights
