"""Every task kind's config class, and decoding a config by its kind."""

from __future__ import annotations

from typing import Any

from fedsilo.wire.tasks.ckks import (
    CkksConfirm,
    CkksDecrypt,
    CkksJoin,
    CkksKeygen,
    EncryptedInput,
)
from fedsilo.wire.tasks.codec import TaskConfig
from fedsilo.wire.tasks.daisy import DaisyEvaluate, DaisyReceive, DaisyTrain
from fedsilo.wire.tasks.evaluation import EvaluateTask, LossProbe, SuperFedEvaluate
from fedsilo.wire.tasks.feddro import FedDroSupport, FedDroTrain
from fedsilo.wire.tasks.multiboost import BoostProbe
from fedsilo.wire.tasks.scaffold import ScaffoldTrain
from fedsilo.wire.tasks.secure_sum import (
    MaskedInput,
    SecAggAdvertise,
    SecAggConfirm,
    SecAggShare,
    SecAggUnmask,
)
from fedsilo.wire.tasks.setup import FeatureMoments, InitTask, SchemaTask, Standardise
from fedsilo.wire.tasks.training import EnergySignals, SuperFedTrain, TrainTask
from fedsilo.wire.tensors import WireError

TASK_CONFIGS: dict[str, type[TaskConfig]] = {
    cls.KIND: cls
    for cls in (
        InitTask,
        SchemaTask,
        TrainTask,
        EvaluateTask,
        LossProbe,
        FeatureMoments,
        Standardise,
        SecAggAdvertise,
        SecAggShare,
        MaskedInput,
        SecAggConfirm,
        SecAggUnmask,
        CkksKeygen,
        CkksJoin,
        EncryptedInput,
        CkksConfirm,
        CkksDecrypt,
        DaisyTrain,
        DaisyReceive,
        DaisyEvaluate,
        SuperFedTrain,
        SuperFedEvaluate,
        EnergySignals,
        ScaffoldTrain,
        FedDroSupport,
        FedDroTrain,
        BoostProbe,
    )
}


def decode_task_config(kind: str, data: Any) -> TaskConfig:
    """The config of a `kind` task from its JSON; an unknown kind, an unknown key or a value of
    the wrong type is a WireError."""
    if kind not in TASK_CONFIGS:
        raise WireError(f"unknown task kind {kind!r}")
    return TASK_CONFIGS[kind].from_json(data)
