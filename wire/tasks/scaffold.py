"""SCAFFOLD's task (Karimireddy et al. 2020): local training with the control-variate
correction, answered with the trained model and the change of the silo's control variate."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fedsilo.wire.tasks.codec import TaskConfig, flattened
from fedsilo.wire.tasks.release import Release
from fedsilo.wire.tasks.training import LocalTraining


@dataclass(frozen=True, kw_only=True)
class ScaffoldTrain(TaskConfig):
    """`scaffold_train`: train the model sent (MODEL) with every step's gradient corrected by
    c - c_i, c the server's control variate sent (CONTROL), c_i the silo's own, kept in its
    local state; answer the model (MODEL) and c_i+ - c_i (CONTROL_DELTA, option II)."""

    KIND: ClassVar[str] = "scaffold_train"
    SENDS: ClassVar[Release] = Release.IN_THE_CLEAR
    local: LocalTraining = flattened()
