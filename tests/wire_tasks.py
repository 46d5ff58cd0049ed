"""Task configs for tests: one of every kind, and tasks as any coordinator can word them on
the wire (a task message's bytes with its header's kind and config replaced by any JSON, typed
or not: what a deviating coordinator sends)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fedsilo.wire.messages import TaskMessage
from fedsilo.wire.tasks import (
    CkksConfirm,
    CkksDecrypt,
    CkksJoin,
    CkksKeygen,
    DaisyEvaluate,
    DaisyReceive,
    DaisyTrain,
    EncryptedInput,
    EnergySignals,
    EvaluateTask,
    FeatureMoments,
    InitTask,
    LocalTraining,
    LossProbe,
    MaskedInput,
    ScaffoldTrain,
    SchemaTask,
    SecAggAdvertise,
    SecAggConfirm,
    SecAggShare,
    SecAggUnmask,
    Standardise,
    SuperFedEvaluate,
    SuperFedTrain,
    TaskConfig,
    TrainTask,
)
from fedsilo.wire.tensors import decode_tensors, encode_tensors

LOCAL = LocalTraining(epochs=1, batch_size=8, optimizer="sgd", lr=0.1, seed=0)
TRAIN = TrainTask(local=LOCAL)
SILOS = ("silo-0", "silo-1", "silo-2")

# A config of every kind a silo handles (their values beside the point).
ONE_PER_KIND: dict[str, TaskConfig] = {
    config.KIND: config
    for config in (
        InitTask(seed=0),
        SchemaTask(),
        TRAIN,
        EvaluateTask(),
        LossProbe(),
        FeatureMoments(),
        Standardise(),
        SecAggAdvertise(),
        SecAggShare(advertisements={}),
        MaskedInput(inner=TRAIN, weights={}, shares={}, tensors=("model",)),
        SecAggConfirm(survivors=SILOS),
        SecAggUnmask(survivors=SILOS, signatures={}),
        CkksKeygen(recipients=SILOS),
        CkksJoin(key_holder="silo-0", context_digest="00"),
        EncryptedInput(inner=TRAIN, weights={}, tensors=("model",)),
        CkksConfirm(contributors=SILOS),
        CkksDecrypt(length=1, weights={}, contributors=SILOS),
        DaisyTrain(train=TRAIN),
        DaisyReceive(),
        DaisyEvaluate(),
        SuperFedTrain(local=LOCAL, mixing="model", mixing_on=False, local_seed=0),
        ScaffoldTrain(local=LOCAL),
        SuperFedEvaluate(local_seed=0),
        EnergySignals(
            local=LOCAL,
            sgld_steps=1,
            sgld_step=1.0,
            sgld_noise=0.01,
            gradient_clip=3.0,
            synthetic_ce_weight=0.1,
            model_seed=0,
        ),
    )
}


def reworded(
    message: TaskMessage, config: Mapping[str, Any] | None = None, kind: str | None = None
) -> bytes:
    """`message` encoded with `config` (any JSON object) and `kind` in its header instead."""
    tensors, header = decode_tensors(message.encode())
    if config is not None:
        header["config"] = dict(config)
    if kind is not None:
        header["kind"] = kind
    return encode_tensors(tensors, header)
