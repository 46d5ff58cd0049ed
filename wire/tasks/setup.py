"""The tasks before training: the initial model, the data schema, federated standardisation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedsilo.wire.tasks.codec import TaskConfig
from fedsilo.wire.tasks.release import Release


@dataclass(frozen=True, kw_only=True)
class InitTask(TaskConfig):
    """`init`: build the policy's model from `seed` and send its parameters (MODEL)."""

    KIND: ClassVar[str] = "init"
    SENDS: ClassVar[Release] = Release.NOTHING_PRIVATE
    seed: int


@dataclass(frozen=True, kw_only=True)
class SchemaTask(TaskConfig):
    """`schema`: the shape of one input row and the number of classes."""

    KIND: ClassVar[str] = "schema"
    SENDS: ClassVar[Release] = Release.NOTHING_PRIVATE


@dataclass(frozen=True, kw_only=True)
class FeatureMoments(TaskConfig):
    """`feature_moments`: the training features' MOMENT_COUNT, MOMENT_SUM, MOMENT_SUMSQ."""

    KIND: ClassVar[str] = "feature_moments"
    SENDS: ClassVar[Release] = Release.IN_THE_CLEAR


@dataclass(frozen=True, kw_only=True)
class Standardise(TaskConfig):
    """`standardise`: apply the consortium's scaler (tensors SCALER_MEAN, SCALER_STD)."""

    KIND: ClassVar[str] = "standardise"
    SENDS: ClassVar[Release] = Release.NOTHING_PRIVATE
