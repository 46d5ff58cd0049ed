"""The task contracts: one typed config per task kind (built by the coordinator's strategies,
read by the silo's handlers, exactly one JSON object on the wire) and the names of the tensors
tasks carry. `TASK_CONFIGS` holds every kind's class, `decode_task_config` reads one."""

from fedsilo.wire.tasks.ckks import (
    CkksConfirm,
    CkksDecrypt,
    CkksJoin,
    CkksKeygen,
    EncryptedInput,
)
from fedsilo.wire.tasks.codec import TaskConfig
from fedsilo.wire.tasks.daisy import (
    DaisyEvaluate,
    DaisyReceive,
    DaisyTrain,
    Handoff,
)
from fedsilo.wire.tasks.evaluation import EvaluateTask, LossProbe, SuperFedEvaluate
from fedsilo.wire.tasks.feddro import FedDroSupport, FedDroTrain
from fedsilo.wire.tasks.multiboost import BoostProbe
from fedsilo.wire.tasks.registry import TASK_CONFIGS, decode_task_config
from fedsilo.wire.tasks.scaffold import ScaffoldTrain
from fedsilo.wire.tasks.secure_sum import (
    MaskedInput,
    NextAggregation,
    SecAggAdvertise,
    SecAggConfirm,
    SecAggShare,
    SecAggUnmask,
)
from fedsilo.wire.tasks.setup import FeatureMoments, InitTask, SchemaTask, Standardise
from fedsilo.wire.tasks.training import (
    EnergySignals,
    LocalTraining,
    Quantization,
    SuperFedTrain,
    TrainTask,
)

__all__ = [
    "TASK_CONFIGS",
    "BoostProbe",
    "CkksConfirm",
    "CkksDecrypt",
    "CkksJoin",
    "CkksKeygen",
    "DaisyEvaluate",
    "DaisyReceive",
    "DaisyTrain",
    "EncryptedInput",
    "EnergySignals",
    "FedDroSupport",
    "FedDroTrain",
    "EvaluateTask",
    "FeatureMoments",
    "Handoff",
    "InitTask",
    "LocalTraining",
    "LossProbe",
    "MaskedInput",
    "NextAggregation",
    "Quantization",
    "ScaffoldTrain",
    "SchemaTask",
    "SecAggAdvertise",
    "SecAggConfirm",
    "SecAggShare",
    "SecAggUnmask",
    "Standardise",
    "SuperFedEvaluate",
    "SuperFedTrain",
    "TaskConfig",
    "TrainTask",
    "decode_task_config",
]
