"""`boost_probe`: Federated MultiBoost's report (docs/algorithms/multiboost.md, wire/tasks/
multiboost.py). The silo evaluates the ensemble f = sum_j alpha_j h_j on its rows, h_j(x) =
2 P_j(y = 1 | x) - 1 the margin of base classifier j (a binary classifier of the policy's
model), and answers either the exponential loss sum A = sum_i exp(-y_i f(x_i)) and the edges
E_j = sum_i exp(-y_i f(x_i)) y_i h_j(x_i) of the base classifiers the task names (y in
{-1, +1}), or, with `evaluate`, the held-out metrics of P(y = 1 | x) = sigmoid(2 f(x)) as an
`evaluate` task reports them.

Under DP each row's term is clipped to the policy's `reports.loss_bound` (A's to [0, B], each
edge's to [-B, B]) and every sum gets Gaussian noise of std sigma B (silo/reports.py
`clipped_sum`): the task books 1 + len(edges) reports, and the count once per split.
"""

from __future__ import annotations

import torch

from fedsilo.models.zoo import load_flat
from fedsilo.privacy.accounting import Mechanism
from fedsilo.silo.reports import reports_mechanism
from fedsilo.silo.tasks.base import SiloContext, config_of, parameter_spec
from fedsilo.silo.tasks.evaluate import EVAL_BATCH, evaluated_metrics, measured
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tasks import BoostProbe
from fedsilo.wire.tasks.multiboost import LOSS_SUM, edge_metric
from fedsilo.wire.tasks.tensor_names import BOOST_ALPHA, BOOST_LEARNERS
from fedsilo.wire.tensors import WireError


def boost_probe(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    probe = config_of(message, BoostProbe)
    learners, alpha = _ensemble(message, ctx)
    x, y = ctx.split(probe.split)
    reports = ctx.reports(message.task_id, probe.split)
    if probe.evaluate:
        metrics = measured(
            ctx.data.task,
            lambda rows: (2 * _margins(learners, rows) @ alpha).float().unsqueeze(1),
            (x, y),
            evaluated_metrics(ctx),
            reports,
        )
    else:
        margins = torch.cat(
            [_margins(learners, x[i : i + EVAL_BATCH]) for i in range(0, len(x), EVAL_BATCH)]
        )
        signs = 2.0 * y.double().cpu() - 1.0
        weights = torch.exp(-signs * (margins @ alpha))
        metrics = {LOSS_SUM: reports.clipped_sum(weights)}
        for j in probe.edges:
            if not 0 <= j < len(learners):
                raise WireError(f"boost_probe: no base classifier {j}")
            edge = weights * signs * margins[:, j]
            metrics[edge_metric(j)] = reports.clipped_sum(edge, signed=True)
    ctx.released_count(probe.split)
    return TaskResult(
        message.task_id, ctx.name, message.kind, num_samples=reports.count(len(y)), metrics=metrics
    )


def boost_probe_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    probe = config_of(message, BoostProbe)
    count = ctx.unreleased_counts(probe.split)
    reports = len(evaluated_metrics(ctx)) if probe.evaluate else 1 + len(probe.edges)
    return reports_mechanism(ctx.privacy, count + reports)


def _ensemble(message: TaskMessage, ctx: SiloContext) -> tuple[list[torch.nn.Module], torch.Tensor]:
    """The base classifiers (built as the policy's model, loaded with their rows) and alpha."""
    if ctx.data.task != "classification" or ctx.data.output_dim > 2:
        raise ValueError("multiboost needs a binary classification task")
    rows, alpha = message.tensors.get(BOOST_LEARNERS), message.tensors.get(BOOST_ALPHA)
    if rows is None or alpha is None or rows.dim() != 2 or alpha.shape != (len(rows),):
        raise WireError("boost_probe carries no ensemble (learners and one alpha each)")
    learners = []
    for row in rows:
        model = ctx.new_model(seed=0)
        if message.spec is None or parameter_spec(model) != message.spec:
            raise WireError("the base classifiers do not fit this silo's model")
        learners.append(load_flat(model, row.to(ctx.device)).eval())
    return learners, alpha.double()


def _margins(learners: list[torch.nn.Module], x: torch.Tensor) -> torch.Tensor:
    """h_j(x) = 2 P_j(y = 1 | x) - 1 for every row and base classifier: shape (n, J), float64
    on the CPU (one logit: tanh(logit / 2); two: tanh of half their difference)."""
    columns = []
    with torch.no_grad():
        for model in learners:
            output = model(x).double().cpu()
            logit = output[:, 0] if output.shape[1] == 1 else output[:, 1] - output[:, 0]
            columns.append(torch.tanh(logit / 2))
    return torch.stack(columns, dim=1)
