"""SuPerFed's local training at a silo (docs/algorithms/superfed.md): the mixture of the
federated and the local model, the proximity and orthogonality terms, and one round of training
of both models, with or without DP-SGD.

Every weight and bias of the zoo's dense and convolutional layers is mixable (biases too, unlike the
reference code's models, which have none). Layer m's weights in the forward pass are
(1 - lambda_m) w_f + lambda_m w_l; `model` mixing draws one lambda ~ U(0, 1) per minibatch for
every layer, `layer` mixing one per layer and minibatch. One backward pass gives both models
their gradients: (1 - lambda_m) g and lambda_m g, g the gradient at the mixed weights.

- R_prox = sum over the layers' tensors of ||w_f - w_global|| (`layer_l2`, the reference's
  non-squared norms; PyTorch's norm has a zero subgradient at 0, where every round starts) or
  ||w_f - w_global||^2 (`squared`).
- R_orth = cos^2(w_f, w_l) over the concatenation of all mixable tensors (one whole-model
  cosine), exact, with 1e-12 in the denominator.

Before mixing starts only the federated model trains (lambda = 0, no R_orth): the same
operations as the plain `train` task, so with mu = 0 a silo's update is FedAvg's bit for bit.

Under DP-SGD the two models are one parameter vector (w_f, w_l) to DP-SGD: each row's gradient
at the mixed weights is clipped with its norm scaled by sqrt((1 - lambda)^2 + lambda^2) per
layer (the norm of ((1 - lambda) g, lambda g)), the clipped sum is split between the models and
each gets its own Gaussian noise, so the federated model that leaves is post-processing of one
DP-SGD run; the regularisers depend on no data and join after the noise, like FedProx's term.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn
from torch.func import functional_call

from fedsilo.silo.evaluation import loss_function, per_sample_loss_function
from fedsilo.wire.tasks import SuperFedTrain

if TYPE_CHECKING:  # Opacus loads only on the DP path
    from fedsilo.silo.dp_training import ClippedSums

LOCAL_MODEL = "superfed-local"  # the name of the local model in the silo's LocalState
MIXINGS = ("model", "layer")
PROX_FORMS = ("layer_l2", "squared")
_LAMBDA_STREAM = 0x7375_7066  # "supf": keeps lambda's draws apart from the batch order


def mixable_layers(model: nn.Module) -> dict[str, list[str]]:
    """Each mixable layer (dense or convolutional) and the names of its parameters."""
    layers: dict[str, list[str]] = {}
    for name, module in model.named_modules():
        if isinstance(module, (nn.Linear, nn.Conv2d)):
            layers[name] = [f"{name}.{p}" for p, _ in module.named_parameters(recurse=False)]
    names = {p for ps in layers.values() for p in ps}
    if names != {name for name, _ in model.named_parameters()}:
        raise ValueError(
            "superfed mixes dense and convolutional layers only; this model has others"
        )
    return layers


def mixed(
    federated: Mapping[str, Tensor],
    local: Mapping[str, Tensor],
    lambdas: Mapping[str, float],
    layers: Mapping[str, list[str]],
) -> dict[str, Tensor]:
    """Every parameter as (1 - lambda) w_f + lambda w_l, lambda its layer's."""
    out = {}
    for layer, names in layers.items():
        lam = lambdas[layer]
        for name in names:
            out[name] = (1 - lam) * federated[name] + lam * local[name]
    return out


def proximity(federated: Mapping[str, Tensor], anchor: Mapping[str, Tensor], form: str) -> Tensor:
    """R_prox: the sum of per-tensor L2 norms (`layer_l2`) or the squared norm (`squared`)."""
    gaps = [torch.linalg.vector_norm(federated[n] - anchor[n]) for n in federated]
    return sum(gaps) if form == "layer_l2" else sum(g**2 for g in gaps)


def orthogonality(federated: Mapping[str, Tensor], local: Mapping[str, Tensor]) -> Tensor:
    """R_orth = cos^2 of the two models, each the concatenation of its mixable tensors."""
    f = torch.cat([federated[n].flatten() for n in federated]).float()
    ell = torch.cat([local[n].flatten() for n in federated]).float()
    inner = torch.dot(f, ell)
    return inner**2 / (f.square().sum() * ell.square().sum() + 1e-12)


@dataclass(frozen=True)
class SuperFedRound:
    """One round's SuPerFed settings, as the task carries them."""

    mixing: str  # model | layer
    mixing_on: bool  # this round trains the mixture (else the federated model alone)
    prox_mu: float
    prox_form: str
    ortho_nu: float

    @classmethod
    def of(cls, task: SuperFedTrain) -> SuperFedRound:
        mixing, form = task.mixing, task.prox_form
        if mixing not in MIXINGS:
            raise ValueError(f"superfed mixing must be one of {MIXINGS}, not {mixing!r}")
        if form not in PROX_FORMS:
            raise ValueError(f"prox_form must be one of {PROX_FORMS}, not {form!r}")
        mu, nu = float(task.local.prox_mu), float(task.ortho_nu)
        if not (math.isfinite(mu) and mu >= 0 and math.isfinite(nu) and nu >= 0):
            raise ValueError(f"prox_mu and ortho_nu must be finite and >= 0, got {mu}, {nu}")
        return cls(mixing, task.mixing_on, mu, form, nu)


class LambdaDraws:
    """lambda ~ U(0, 1) per minibatch: one for every layer (`model`) or one per layer
    (`layer`); 0 for every layer while mixing is off."""

    def __init__(self, settings: SuperFedRound, layers: list[str], seed: int) -> None:
        self.settings, self.layers = settings, layers
        self.generator = torch.Generator().manual_seed(seed ^ _LAMBDA_STREAM)

    def draw(self) -> dict[str, float]:
        if not self.settings.mixing_on:
            return dict.fromkeys(self.layers, 0.0)
        if self.settings.mixing == "model":
            return dict.fromkeys(self.layers, float(torch.rand(1, generator=self.generator)))
        values = torch.rand(len(self.layers), generator=self.generator).tolist()
        return dict(zip(self.layers, values, strict=True))


class SuperFedTraining:
    """One round of SuPerFed at a silo: the federated model (the model received, trained in
    place), the local model, and the rows (x, y) of a `task` they train on."""

    def __init__(
        self,
        model: nn.Module,
        local: Mapping[str, Tensor],
        settings: SuperFedRound,
        seed: int,
        data: tuple[Tensor, Tensor, str],
    ) -> None:
        self.model = model
        self.layers = mixable_layers(model)
        self.federated = dict(model.named_parameters())
        self.local = {
            n: local[n].detach().clone().to(p).requires_grad_(settings.mixing_on)
            for n, p in self.federated.items()
        }
        self.anchor = {n: p.detach().clone() for n, p in self.federated.items()}
        self.settings = settings
        self.lambdas = LambdaDraws(settings, list(self.layers), seed)
        self.x, self.y, task = data
        self.loss = loss_function(task)
        self.row_loss = per_sample_loss_function(task)
        self._layer_of = {n: layer for layer, names in self.layers.items() for n in names}

    @property
    def parameters(self) -> list[Tensor]:
        """What the optimiser steps: the federated weights, and the local ones while mixing."""
        local = list(self.local.values()) if self.settings.mixing_on else []
        return [*self.federated.values(), *local]

    def regulariser(self) -> Tensor | None:
        """mu R_prox + (while mixing) nu R_orth; None when both are off."""
        settings, terms = self.settings, []
        if settings.prox_mu > 0:
            prox = proximity(self.federated, self.anchor, settings.prox_form)
            terms.append(settings.prox_mu * prox)
        if settings.mixing_on and settings.ortho_nu > 0:
            terms.append(settings.ortho_nu * orthogonality(self.federated, self.local))
        return sum(terms) if terms else None

    def add_regulariser_gradient(self) -> None:
        """Add the regularisers' gradient to the parameters' (they read no data)."""
        term = self.regulariser()
        if term is None:
            return
        params = self.parameters
        for p, g in zip(params, torch.autograd.grad(term, params, allow_unused=True), strict=True):
            if g is not None:
                p.grad.add_(g)

    def step_loss(self, index: Tensor) -> Tensor:
        """The mean loss of rows `index` at this step's mixture (the model itself while mixing
        is off: the plain `train` task's operations)."""
        if not self.settings.mixing_on:
            return self.loss(self.model(self.x[index]), self.y[index])
        weights = mixed(self.federated, self.local, self.lambdas.draw(), self.layers)
        return self.loss(functional_call(self.model, weights, self.x[index]), self.y[index])

    def train(self, optimizer: torch.optim.Optimizer, batches: Iterable[Tensor]) -> list[float]:
        """Non-private training over `batches` of row indices; each step's loss."""
        losses = []
        for index in batches:
            optimizer.zero_grad(set_to_none=True)
            index = index.to(self.x.device)
            loss = self.step_loss(index)
            term = self.regulariser()
            (loss + term if term is not None else loss).backward()
            optimizer.step()
            losses.append(float(loss.detach()))
        return losses

    def private_gradients(
        self, skeleton: nn.Module, clipped_sums: ClippedSums
    ) -> Callable[[Tensor], tuple[list[Tensor], float]]:
        """DP-SGD's clipped sums for `parameters`, one batch at a time: `skeleton` (a model of
        the same shape, watched by `clipped_sums`) takes the step's mixed weights, each row's
        gradient there is clipped with its norm scaled by sqrt((1 - lambda)^2 + lambda^2), and
        the sums are split between the models as (1 - lambda) S and lambda S."""
        own = dict(skeleton.named_parameters())

        def gradients(index: Tensor) -> tuple[list[Tensor], float]:
            lambdas = self.lambdas.draw()
            with torch.no_grad():
                for name, value in mixed(self.federated, self.local, lambdas, self.layers).items():
                    own[name].copy_(value)
            per_sample = self.row_loss(skeleton(self.x[index]), self.y[index])
            share = {n: lambdas[self._layer_of[n]] for n in own}
            scales = {own[n]: math.hypot(1 - share[n], share[n]) for n in own}
            sums = dict(zip(own, clipped_sums(per_sample, scales), strict=True))
            grads = [(1 - share[n]) * sums[n] for n in self.federated]
            if self.settings.mixing_on:
                grads += [share[n] * sums[n] for n in self.federated]
            return grads, float(per_sample.detach().mean())

        return gradients
