"""FedDRO's task contracts (docs/algorithms/feddro.md): a stage-A support step and stage-B
training on the records mapped onto the barycenter. Both carry no algorithm setting: a silo
reads them (the interpolation time, the variant, the point clouds' clip and noise, the
adversary) from its own copy of the signed policy, so a coordinator cannot change them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedsilo.wire.tasks.codec import TaskConfig, flattened
from fedsilo.wire.tasks.release import Release
from fedsilo.wire.tasks.training import LocalTraining


@dataclass(frozen=True, kw_only=True)
class FedDroSupport(TaskConfig):
    """`feddro_support`: from the silo's last cloud (SUPPORT) and the barycenter (BARYCENTER),
    both (groups, points, dim), one stage-A step; answers the new cloud (SUPPORT) and which
    groups the silo holds (PRESENT)."""

    KIND: ClassVar[str] = "feddro_support"
    SENDS: ClassVar[Release] = Release.DATA


@dataclass(frozen=True, kw_only=True)
class FedDroTrain(TaskConfig):
    """`feddro_train`: local training from MODEL on the silo's training rows mapped onto the
    barycenter sent (BARYCENTER), adversarially when the policy sets `adversarial_penalty`."""

    KIND: ClassVar[str] = "feddro_train"
    SENDS: ClassVar[Release] = Release.IN_THE_CLEAR
    local: LocalTraining = flattened()
