"""`evaluate` and `loss`: held-out metrics of a received model, and a loss report.

`evaluate` returns the task's metrics (accuracy, AUROC, loss, or RMSE, MAE, loss, or a task
plug-in's metrics and loss) on one split;
`loss` returns only the mean loss on a split (train by default), the scalar that the
distributionally robust strategies consume. Both report through silo/reports.py: in a DP
deployment only the noisy count, accuracy and clipped mean loss leave; a forbidden kind never.

A `loss` task with `mixup_alpha` a and `seed` s (DRFLM's probe) reports instead the mean mixed
loss over the split's n rows in order, row i mixed with a partner drawn uniformly with
replacement at a Beta(a, a) ratio, all drawn with s (silo/mixup.py): one loss report, clipped
and noised under DP exactly as the plain one, and booked the same (`loss_releases`); with
`mixup_on: embedding` the rows mix on the model's embedding.

A `loss` task with `by_domain: true` (AgnosticFedAvg over `data.domain`'s domains) reports,
for every domain name d, the sum of its rows' losses and its row count (wire/messages.py
`domain_metric`), instead of the mean loss: under DP clipped and noised per domain, and booked
as two reports (a record is in one domain: silo/reports.py `domain_losses`).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from fedsilo.privacy.accounting import Mechanism
from fedsilo.silo.domains import split_domains
from fedsilo.silo.evaluation import (
    metrics_for,
    per_sample_loss_function,
    predicted_classes,
    task_metrics,
)
from fedsilo.silo.mixup import MixupDraws, mixed_losses, mixup_on
from fedsilo.silo.reports import DOMAIN_REPORTS, LOSSES, METRICS, Reports, reports_mechanism
from fedsilo.silo.tasks.base import SiloContext, config_of
from fedsilo.wire.messages import (
    DOMAIN_COUNT,
    DOMAIN_LOSS_SUM,
    TaskMessage,
    TaskResult,
    domain_metric,
)
from fedsilo.wire.tasks import EvaluateTask, LossProbe
from fedsilo.wire.tensors import WireError

EVAL_BATCH = 4096
# Metrics with a bounded sensitivity, the only ones a DP deployment reports (besides the loss);
# a task plug-in's metrics have no known sensitivity: under DP only its loss leaves.
BOUNDED_METRICS = {"classification": ("accuracy",), "regression": ()}


def evaluate(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    return _report(message, ctx, evaluated_metrics(ctx))


def report_loss(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    probe = config_of(message, LossProbe)
    if probe.by_domain:
        return _domain_losses(message, ctx)
    if probe.mixup_alpha is None:
        return _report(message, ctx, _loss_only(ctx))
    return _mixed_loss(message, probe, ctx)


def _domain_losses(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    """AgnosticFedAvg's probe: every domain's loss sum and row count on the split."""
    _loss_only(ctx)
    model, _ = ctx.load_model(message)
    split = _split(message)
    x, y = ctx.split(split)
    names, codes = split_domains(ctx, split)
    per_row = _per_row_losses(ctx, model, x, y)
    reports = ctx.reports(message.task_id, split)
    sums, counts = reports.domain_losses(per_row, codes, len(names))
    metrics = {domain_metric(DOMAIN_LOSS_SUM, d): v for d, v in zip(names, sums, strict=True)}
    metrics |= {domain_metric(DOMAIN_COUNT, d): v for d, v in zip(names, counts, strict=True)}
    ctx.released_count(split)
    return TaskResult(
        message.task_id, ctx.name, message.kind, num_samples=reports.count(len(y)), metrics=metrics
    )


def _per_row_losses(
    ctx: SiloContext, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor
) -> torch.Tensor:
    model.eval()
    loss = per_sample_loss_function(ctx.data.task)
    with torch.no_grad():
        return torch.cat(
            [
                loss(model(x[i : i + EVAL_BATCH]), y[i : i + EVAL_BATCH])
                for i in range(0, len(x), EVAL_BATCH)
            ]
        )


def _mixed_loss(message: TaskMessage, probe: LossProbe, ctx: SiloContext) -> TaskResult:
    """DRFLM's probe: the mean mixed loss over the split's rows in order, each mixed with a
    partner at a ratio drawn with the task's `seed` (silo/mixup.py), reported like a loss."""
    _loss_only(ctx)
    assert probe.mixup_alpha is not None
    if probe.seed is None:
        raise ValueError("a loss task with mixup_alpha needs a seed for its mixup draws")
    model, _ = ctx.load_model(message)
    split = probe.split
    x, y = ctx.split(split)
    draws = MixupDraws(probe.mixup_alpha, probe.seed, len(y))
    partners, gamma = draws.draw(len(y))
    rows = torch.arange(len(y), device=x.device)
    model.eval()
    per_row = []
    with torch.no_grad():
        for start in range(0, len(y), EVAL_BATCH):
            batch = slice(start, start + EVAL_BATCH)
            per_row.append(
                mixed_losses(
                    ctx.data.task,
                    model,
                    x,
                    y,
                    rows[batch],
                    partners[batch],
                    gamma[batch],
                    mixup_on(probe.mixup_site),
                )
            )
    reports = ctx.reports(message.task_id, split)
    metrics = {"loss": reports.mean_loss(torch.cat(per_row))}
    ctx.released_count(split)
    return TaskResult(
        message.task_id, ctx.name, message.kind, num_samples=reports.count(len(y)), metrics=metrics
    )


def evaluate_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    count = ctx.unreleased_counts(_split(message))
    return reports_mechanism(ctx.privacy, count + len(evaluated_metrics(ctx)))


def loss_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    count = ctx.unreleased_counts(_split(message))
    losses = DOMAIN_REPORTS if config_of(message, LossProbe).by_domain else len(_loss_only(ctx))
    return reports_mechanism(ctx.privacy, count + losses)


def _split(message: TaskMessage) -> str:
    """The split an `evaluate` (test unless it names one) or `loss` task (train) reads."""
    config = message.config
    if not isinstance(config, EvaluateTask | LossProbe):
        raise WireError(f"a {message.kind} task names no split")
    return config.split


def evaluated_metrics(ctx: SiloContext) -> tuple[str, ...]:
    """The metrics an evaluate task reports under this silo's policy."""
    forbidden = ctx.privacy.reports.forbidden
    task = ctx.data.task
    if METRICS in forbidden:
        metrics: tuple[str, ...] = ()
    elif ctx.privacy.differentially_private:
        metrics = BOUNDED_METRICS.get(task, ())
    else:
        metrics = task_metrics(task)
    return metrics + (() if LOSSES in forbidden else ("loss",))


def _loss_only(ctx: SiloContext) -> tuple[str, ...]:
    if LOSSES in ctx.privacy.reports.forbidden:
        raise ValueError("this silo's policy forbids loss reports (privacy.reports.forbidden)")
    return ("loss",)


def measured(
    task: str,
    model: Callable[[torch.Tensor], torch.Tensor],
    data: tuple[torch.Tensor, torch.Tensor],
    names: tuple[str, ...],
    reports: Reports,
) -> dict[str, float]:
    """The metrics `names` of `model` on rows (x, y), as `reports` lets them leave: exact, or
    under DP only the noisy loss and accuracy (`BOUNDED_METRICS`)."""
    x, y = data
    with torch.no_grad():
        output = torch.cat([model(x[i : i + EVAL_BATCH]) for i in range(0, len(x), EVAL_BATCH)])
    output, y = output.cpu(), y.cpu()
    if reports.noised:
        return {
            name: reports.mean_loss(per_sample_loss_function(task)(output, y))
            if name == "loss"
            else reports.accuracy(predicted_classes(output) == y)
            for name in names
        }
    exact = metrics_for(task, output, y)
    return {name: exact[name] for name in names}


def _report(message: TaskMessage, ctx: SiloContext, names: tuple[str, ...]) -> TaskResult:
    model, _ = ctx.load_model(message)
    split = _split(message)
    model.eval()
    reports = ctx.reports(message.task_id, split)
    data = ctx.split(split)
    metrics = measured(ctx.data.task, model, data, names, reports)
    ctx.released_count(split)
    return TaskResult(
        message.task_id,
        ctx.name,
        message.kind,
        num_samples=reports.count(len(data[1])),
        metrics=metrics,
    )
