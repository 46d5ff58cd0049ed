"""The silo's one built network, refilled for each task that carries a model instead of built
anew: building a network allocates (and the first write page-faults) its parameters and draws
an initialisation that the task's model overwrites at once, which for a 1M-parameter MLP costs
as much as a 256-sample epoch of training.

Refilled, it is the network a fresh build would be once loaded: the task's parameters
(`load_flat`, by the caller), the build's buffers (e.g. normalisation statistics), no
gradients, every parameter trainable, in training mode. Only zoo networks are kept: a plugin
model is the user's code and may keep state of its own, so it is built for every task.
A silo agent runs one task at a time (`SiloAgent`'s lock), and a task loads one model this way.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn


class ModelSkeleton:
    def __init__(self) -> None:
        self._model: nn.Module | None = None
        self._buffers: dict[str, torch.Tensor] = {}

    def take(self, build: Callable[[], nn.Module]) -> nn.Module:
        """The kept network reset to how `build()` leaves one (built on first use)."""
        if self._model is None:
            self._model = build()
            self._buffers = {n: b.detach().clone() for n, b in self._model.named_buffers()}
            return self._model
        model = self._model
        model.train()
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.grad = None
                parameter.requires_grad_(True)
            for name, buffer in model.named_buffers():
                buffer.copy_(self._buffers[name])
        return model
