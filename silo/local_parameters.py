"""Parameters a silo keeps to itself, as its own copy of the policy's algorithm names them
(`local_parameters()`, shell-style patterns of parameter names: FedBN's normalisation layers).

The coordinator has no say: the patterns come from the silo's own policy, never from a task.
A model a task carries is trained and evaluated with the silo's own values of those parameters
(the latest it kept before the task's round; before its first training, the values received),
and a trained model leaves with the values it was received with in their place, so the answer
says nothing about them and their weighted mean is the value every silo received. The kept
values live in the silo's `LocalState` (silo/state.py), so a round run again after a restart
starts from the same ones.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

import torch
from torch import nn

from fedsilo.wire.tensors import ParameterSpec

KEPT = "local-parameters"  # the name of the kept values in the silo's LocalState


def local_names(patterns: tuple[str, ...], model: nn.Module) -> list[str]:
    """The names of `model`'s parameters that match any of `patterns`."""
    return [
        name
        for name, _ in model.named_parameters()
        if any(fnmatchcase(name, pattern) for pattern in patterns)
    ]


def use_own(model: nn.Module, names: list[str], kept: dict[str, torch.Tensor] | None) -> None:
    """Set the parameters `names` of `model` to this silo's `kept` values (none kept yet: as
    they are)."""
    if not names or kept is None:
        return
    parameters = dict(model.named_parameters())
    with torch.no_grad():
        for name in names:
            parameters[name].copy_(kept[name].to(parameters[name]))


def own_values(model: nn.Module, names: list[str]) -> dict[str, torch.Tensor]:
    """The current values of the parameters `names` of `model`, to keep."""
    parameters = dict(model.named_parameters())
    return {name: parameters[name].detach().clone() for name in names}


def as_received(
    trained: torch.Tensor, received: torch.Tensor, spec: ParameterSpec, names: list[str]
) -> torch.Tensor:
    """`trained` (a flat vector in `spec`'s layout) with the entries of the parameters `names`
    set back to their `received` values."""
    if not names:
        return trained
    out = trained.clone()
    offset = 0
    for entry in spec.entries:
        size = entry.numel
        if entry.name in names:
            out[offset : offset + size] = received[offset : offset + size].to(out)
        offset += size
    return out
