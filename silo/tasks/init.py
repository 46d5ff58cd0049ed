"""`init`: build the policy's model from the run's seed and send its parameters and spec, with
the shape of one input row and the number of classes it was built for (so a coordinator whose
silos built different models can say which silo differs and how).
`schema`: the shape of one input row and the number of classes (the data dictionary's facts).

Neither depends on the silo's rows (not even their number), so both are public releases."""

from __future__ import annotations

from fedsilo.privacy.accounting import Mechanism
from fedsilo.silo.tasks.base import SiloContext, config_of, flat_parameters, parameter_spec
from fedsilo.wire.messages import TaskMessage, TaskResult, schema_metrics
from fedsilo.wire.tasks import InitTask
from fedsilo.wire.tasks.tensor_names import MODEL


def public_release(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    """A task whose answer does not depend on the silo's data."""
    return [Mechanism.public()]


def initialise(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    model = ctx.new_model(config_of(message, InitTask).seed)
    spec = parameter_spec(model)
    return TaskResult(
        task_id=message.task_id,
        silo=ctx.name,
        kind=message.kind,
        metrics=schema_metrics(ctx.data.input_shape, ctx.data.num_classes),
        tensors={MODEL: flat_parameters(model, spec)},
        spec=spec,
    )


def describe(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    data = ctx.data
    return TaskResult(
        task_id=message.task_id,
        silo=ctx.name,
        kind=message.kind,
        metrics=schema_metrics(data.input_shape, data.num_classes),
    )
