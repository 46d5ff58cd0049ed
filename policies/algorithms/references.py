"""The two references every comparison wants: pooled (central) and isolated (local) training."""

from __future__ import annotations

from typing import ClassVar, Literal

from fedsilo.policies.algorithms.base import AlgorithmBase


class CentralConfig(AlgorithmBase):
    """Reference: one model trained on the pooled union of the silos' training data."""

    averages: ClassVar[bool] = False
    name: Literal["central"]


class LocalConfig(AlgorithmBase):
    """Reference: each silo trains alone and is evaluated with its own model."""

    averages: ClassVar[bool] = False
    name: Literal["local"]
