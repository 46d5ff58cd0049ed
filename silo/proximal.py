"""FedProx's proximal term (mu/2) ||w - w_anchor||^2 in a silo's local run: its value, added to
each minibatch's loss, and its gradient mu (w - w_anchor), added after DP-SGD's clipping and noise
(the term does not depend on the data, so it is not clipped).

The anchor is the model received, or the task's `PROX_ANCHOR` when it sends one (FedDC: the
model of the last exchange).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedsilo.wire.tasks.tensor_names import PROX_ANCHOR
from fedsilo.wire.tensors import ParameterSpec


class Proximal:
    """(mu/2) ||w - anchor||^2 over every parameter of `model`."""

    def __init__(self, model: torch.nn.Module, anchor: list[torch.Tensor], mu: float) -> None:
        self.model = model
        self.anchor = anchor
        self.mu = mu

    @classmethod
    def of(
        cls,
        mu: float,
        tensors: Mapping[str, torch.Tensor],
        model: torch.nn.Module,
        spec: ParameterSpec,
    ) -> Proximal | None:
        """The term a task's `prox_mu` asks for (None when it is not positive), anchored at the
        task's `PROX_ANCHOR` when its `tensors` hold one, else at the model as received."""
        mu = float(mu)
        if not mu > 0:
            return None
        if PROX_ANCHOR not in tensors:
            return cls(model, [p.detach().clone() for p in model.parameters()], mu)
        values = spec.unflatten(tensors[PROX_ANCHOR]).values()
        return cls(model, [v.to(p) for p, v in zip(model.parameters(), values, strict=True)], mu)

    def value(self) -> torch.Tensor:
        """(mu/2) ||w - anchor||^2, differentiable in w."""
        return (
            0.5
            * self.mu
            * sum(
                ((p - a) ** 2).sum()
                for p, a in zip(self.model.parameters(), self.anchor, strict=True)
            )
        )

    @torch.no_grad()
    def add_gradient(self) -> None:
        """Add mu (w - anchor) to every parameter's gradient (DP-SGD: after clipping and noise)."""
        for p, a in zip(self.model.parameters(), self.anchor, strict=True):
            p.grad.add_(p - a, alpha=self.mu)
