"""`init`: build the policy's model from the run's seed and send its parameters and spec."""

from __future__ import annotations

from fedsilo.silo.tasks.base import MODEL, SiloContext, flat_parameters, parameter_spec
from fedsilo.wire.messages import TaskMessage, TaskResult


def initialise(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    model = ctx.new_model(int(message.config["seed"]))
    spec = parameter_spec(model)
    return TaskResult(
        task_id=message.task_id,
        silo=ctx.name,
        kind=message.kind,
        num_samples=len(ctx.data.y_train),
        tensors={MODEL: flat_parameters(model, spec)},
        spec=spec,
    )
