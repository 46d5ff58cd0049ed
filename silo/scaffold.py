"""SCAFFOLD at a silo (Karimireddy et al. 2020; docs/algorithms/scaffold.md): the correction
c - c_i its local steps add to every gradient, and the option II update of its control variate.

The correction is the gradient of the linear term <w, c - c_i>, which does not depend on the
data: plain steps add the term to each minibatch's loss, DP-SGD adds its gradient after
clipping and noise (as FedProx's proximal term, silo/proximal.py). c_i is a function of the
silo's earlier released models and the coordinator's c, so it costs no privacy.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from fedsilo.wire.tasks.tensor_names import CONTROL_CORRECTION
from fedsilo.wire.tensors import ParameterSpec

# the silo's local state: its control variate c_i, a flat vector like the model
OWN_CONTROL = "scaffold_control"


class ControlCorrection:
    """<w, c - c_i> over every parameter of `model`, whose gradient is c - c_i."""

    def __init__(self, model: torch.nn.Module, correction: list[torch.Tensor]) -> None:
        self.model = model
        self.correction = correction

    @classmethod
    def of(
        cls, tensors: Mapping[str, torch.Tensor], model: torch.nn.Module, spec: ParameterSpec
    ) -> ControlCorrection | None:
        """The correction a task's `CONTROL_CORRECTION` holds (None when it holds none)."""
        if CONTROL_CORRECTION not in tensors:
            return None
        values = spec.unflatten(tensors[CONTROL_CORRECTION]).values()
        return cls(model, [v.to(p) for p, v in zip(model.parameters(), values, strict=True)])

    def value(self) -> torch.Tensor:
        """<w, c - c_i>, differentiable in w."""
        return sum(
            (p * d).sum() for p, d in zip(self.model.parameters(), self.correction, strict=True)
        )  # type: ignore[return-value]

    @torch.no_grad()
    def add_gradient(self) -> None:
        """Add c - c_i to every parameter's gradient (DP-SGD: after clipping and noise)."""
        for p, d in zip(self.model.parameters(), self.correction, strict=True):
            p.grad.add_(d)


def next_control(
    own: torch.Tensor,
    server: torch.Tensor,
    sent: torch.Tensor,
    trained: torch.Tensor,
    steps: int,
    lr: float,
) -> torch.Tensor:
    """Option II: c_i+ = c_i - c + (x - y_i) / (K lr), K local steps at rate lr from x to y_i."""
    return own - server + (sent - trained) / (steps * lr)
