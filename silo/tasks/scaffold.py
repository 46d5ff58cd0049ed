"""`scaffold_train`: SCAFFOLD's local training at a silo (the maths in silo/scaffold.py, the
round in coordinator/strategies/scaffold.py; docs/algorithms/scaffold.md).

The task carries the global model x (MODEL) and the server's control variate c (CONTROL). The
silo's own control variate c_i is its latest version from a round before this one (silo/
state.py: on disk in a deployment, so a round the coordinator runs again starts from the same
c_i and repeats bit for bit), zeros before its first round. It runs the `train` task on x with
the correction c - c_i added to every step's gradient, then keeps c_i+ = c_i - c + (x - y_i) /
(K lr) as this round's version and answers y_i (MODEL) and c_i+ - c_i (CONTROL_DELTA), both of
which the coordinator averages (so secure aggregation applies). It releases what `train`
releases: c_i+ - c_i is computed from y_i, x and c alone (post-processing).
"""

from __future__ import annotations

from dataclasses import replace

import torch

from fedsilo.privacy.accounting import Mechanism
from fedsilo.silo.scaffold import OWN_CONTROL, next_control
from fedsilo.silo.schedule import LocalSchedule
from fedsilo.silo.tasks.base import SiloContext, config_of, task_result
from fedsilo.silo.tasks.train import train, train_releases
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tasks import ScaffoldTrain, TrainTask
from fedsilo.wire.tasks.tensor_names import CONTROL, CONTROL_CORRECTION, CONTROL_DELTA, MODEL


def scaffold_train(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    task = config_of(message, ScaffoldTrain)
    sent, server = _sent(message)
    own = own_control(ctx, message.round, sent)
    inner = _as_train(message, task, {MODEL: sent, CONTROL_CORRECTION: server - own})
    result = train(inner, ctx)
    trained = result.tensors[MODEL]
    steps = LocalSchedule.of(task.local, len(ctx.split("train")[1])).steps
    updated = next_control(own, server, sent, trained.to(sent), steps, float(task.local.lr))
    ctx.state.save(OWN_CONTROL, message.round, {CONTROL: updated})
    tensors = {MODEL: trained, CONTROL_DELTA: updated - own}
    return task_result(message, ctx, tensors, result.num_samples, result.metrics, result.spec)


def scaffold_train_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    """What `train` releases: the control variate's change is post-processing of the model."""
    return train_releases(_as_train(message, config_of(message, ScaffoldTrain), {}), ctx)


def own_control(ctx: SiloContext, before_round: int, like: torch.Tensor) -> torch.Tensor:
    """The silo's control variate c_i as of the rounds before `before_round` (zeros: none)."""
    stored = ctx.state.latest(OWN_CONTROL, before_round)
    if stored is None:
        return torch.zeros_like(like)
    own = stored[CONTROL]
    if own.shape != like.shape:
        raise ValueError(
            "the silo's stored control variate does not fit the policy's model (its size "
            "differs); a new deployment starts from zeros"
        )
    return own.to(like)


def _sent(message: TaskMessage) -> tuple[torch.Tensor, torch.Tensor]:
    """The global model x and the server's control variate c the task carries."""
    missing = [name for name in (MODEL, CONTROL) if name not in message.tensors]
    if missing:
        raise ValueError(f"scaffold_train carries no {' and no '.join(missing)}")
    sent, server = message.tensors[MODEL], message.tensors[CONTROL]
    if server.shape != sent.shape:
        raise ValueError(
            f"scaffold_train's control variate has shape {tuple(server.shape)}, its model "
            f"{tuple(sent.shape)}"
        )
    return sent, server.to(sent)


def _as_train(
    message: TaskMessage, task: ScaffoldTrain, tensors: dict[str, torch.Tensor]
) -> TaskMessage:
    """The `train` task that runs SCAFFOLD's local steps, with this task's ids."""
    return replace(message, config=TrainTask(local=task.local), tensors=tensors)
