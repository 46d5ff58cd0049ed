"""Model factories for the plug-in tests, registered as entry points by monkeypatching
`fedsilo.models.plugins.installed_factories` (nothing is installed)."""

from __future__ import annotations

import math

import torch
from torch import nn


class SmallNet(nn.Module):
    def __init__(self, width: int, hidden: int, output_dim: int, norm: bool = False) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(width, hidden)
        self.bn1 = nn.BatchNorm1d(hidden) if norm else nn.Identity()
        self.act = nn.ReLU()
        self.fc2 = nn.Linear(hidden, output_dim)

    def forward(self, x):
        return self.fc2(self.act(self.bn1(self.fc1(self.flatten(x)))))


def small_net(input_shape: tuple[int, ...], output_dim: int, hidden: int = 8) -> nn.Module:
    """Two linear layers, initialised by PyTorch from the global RNG."""
    return SmallNet(math.prod(input_shape), hidden, output_dim)


class DropoutNet(nn.Module):
    """small_net with dropout after its hidden layer: randomness from torch's global generator
    on every training step."""

    def __init__(self, width: int, output_dim: int, p: float) -> None:
        super().__init__()
        self.flatten = nn.Flatten()
        self.fc1 = nn.Linear(width, 16)
        self.drop = nn.Dropout(p)
        self.fc2 = nn.Linear(16, output_dim)

    def forward(self, x):
        return self.fc2(self.drop(torch.relu(self.fc1(self.flatten(x)))))


def dropout_net(input_shape: tuple[int, ...], output_dim: int, p: float = 0.5) -> nn.Module:
    return DropoutNet(math.prod(input_shape), output_dim, p)


def wide_net(input_shape: tuple[int, ...], output_dim: int) -> nn.Module:
    """small_net's layers, twice as wide: another architecture under the same names."""
    return SmallNet(math.prod(input_shape), 16, output_dim)


def batchnorm_net(input_shape: tuple[int, ...], output_dim: int) -> nn.Module:
    """small_net with BatchNorm after its first layer, which DP-SGD cannot train."""
    return SmallNet(math.prod(input_shape), 8, output_dim, norm=True)


def not_a_module(input_shape: tuple[int, ...], output_dim: int) -> list[int]:
    return [output_dim]
