"""`init`: build the policy's model from the run's seed and send its parameters and spec.

It depends on nothing of the silo's data (not even its size), so it is a public release."""

from __future__ import annotations

from fedsilo.privacy.accounting import Mechanism
from fedsilo.silo.tasks.base import MODEL, SiloContext, flat_parameters, parameter_spec
from fedsilo.wire.messages import TaskMessage, TaskResult


def public_release(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    """A task whose answer does not depend on the silo's data."""
    return [Mechanism.public()]


def initialise(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    model = ctx.new_model(int(message.config["seed"]))
    spec = parameter_spec(model)
    return TaskResult(
        task_id=message.task_id,
        silo=ctx.name,
        kind=message.kind,
        tensors={MODEL: flat_parameters(model, spec)},
        spec=spec,
    )
