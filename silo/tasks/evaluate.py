"""`evaluate` and `loss`: held-out metrics of a received model, and a loss report.

`evaluate` returns the task's metrics (accuracy, AUROC, loss, or RMSE, MAE, loss) on one split;
`loss` returns only the mean loss on a split (train by default), the scalar that the
distributionally robust strategies consume.
"""

from __future__ import annotations

import torch

from fedsilo.silo.evaluation import metrics_for
from fedsilo.silo.tasks.base import SiloContext
from fedsilo.wire.messages import TaskMessage, TaskResult

EVAL_BATCH = 4096


def evaluate(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    metrics, n = _metrics(message, ctx, default_split="test")
    return TaskResult(message.task_id, ctx.name, message.kind, num_samples=n, metrics=metrics)


def report_loss(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    metrics, n = _metrics(message, ctx, default_split="train")
    return TaskResult(
        message.task_id, ctx.name, message.kind, num_samples=n, metrics={"loss": metrics["loss"]}
    )


def _metrics(
    message: TaskMessage, ctx: SiloContext, default_split: str
) -> tuple[dict[str, float], int]:
    model, _ = ctx.load_model(message)
    x, y = ctx.split(str(message.config.get("split", default_split)))
    model.eval()
    with torch.no_grad():
        output = torch.cat([model(x[i : i + EVAL_BATCH]) for i in range(0, len(x), EVAL_BATCH)])
    return metrics_for(ctx.data.task, output.cpu(), y.cpu()), len(y)
