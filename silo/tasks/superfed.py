"""`superfed_train` and `superfed_evaluate`: SuPerFed's tasks at a silo (the maths in
silo/superfed.py, the round in coordinator/strategies/superfed.py).

`superfed_train` takes the train task's settings plus `mixing` (model | layer), `mixing_on`,
`prox_mu`, `prox_form` and `ortho_nu`. The federated model starts as the global model it
carries; the local model is the silo's latest version from a round before this one (silo/
state.py: on disk in a deployment, so it outlives the process and a re-run round starts where
the first attempt did), else a fresh one from the task's `local_seed` (one per silo, unlike the
global model's: the two endpoints start apart, as the method needs; the reference seeds it with
the client id). It answers with the federated model only, as
`train` would (same tensors, same released count), and keeps the local model as this round's
version while mixing. It releases what `train` releases: without DP both exactly, under DP-SGD
one run over the two models together (silo/superfed.py), booked as `train` books it.

`superfed_evaluate` mixes the model it carries (the global model) with the local model at
`lambda_grid` evenly spaced lambdas in [0, 1] and measures each mixture on the test split and on
the selection split: the validation split, or the training split when validation has fewer than
`min_validation` rows. It reports the whole curve (`accuracy@0.30`, `selection_accuracy@0.30`,
...), lambda* (best selection accuracy, then loss, then the smaller lambda; the smallest
selection loss for regression) as `lambda_star`, the test metrics at lambda* under their plain
names (the personalised model), at lambda = 0 (`global_...`) and 1 (`local_...`), and the best
test value of the grid (`oracle_...`, chosen on test data: reported, never used). A silo that
has not trained a local model yet (before mixing starts, or never sampled since) reports the
global model's metrics alone, lambda* = 0. Under DP every point of both curves is a
noisy report (booked); lambda* and the rest are computed from those noisy values, so they are
post-processing.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import nn

from fedsilo.privacy.accounting import Mechanism
from fedsilo.silo.local_loop import local_steps, optimizer_for, released_training
from fedsilo.silo.reports import reports_mechanism
from fedsilo.silo.schedule import LocalSchedule
from fedsilo.silo.superfed import (
    LOCAL_MODEL,
    SuperFedRound,
    SuperFedTraining,
    mixable_layers,
    mixed,
    orthogonality,
)
from fedsilo.silo.tasks.base import SiloContext, config_of, flat_parameters, task_result
from fedsilo.silo.tasks.evaluate import evaluated_metrics, measured
from fedsilo.silo.tasks.train import train_releases
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tasks import SuperFedEvaluate, SuperFedTrain
from fedsilo.wire.tasks.tensor_names import MODEL

if TYPE_CHECKING:  # Opacus loads only on the DP path
    from fedsilo.silo.dp_training import DpSgdPlan

superfed_train_releases = train_releases


def superfed_train(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    task = config_of(message, SuperFedTrain)
    settings = SuperFedRound.of(task)
    model, spec = ctx.load_model(message)
    x, y = ctx.split("train")
    schedule = LocalSchedule.of(task.local, len(y))
    seed = task.local.seed
    local, _ = local_model(ctx, message, task.local_seed, message.round)
    training = SuperFedTraining(model, local, settings, seed, (x, y, ctx.data.task))
    optimizer = optimizer_for(training.parameters, task.local)
    model.train()

    def private(plan: DpSgdPlan, private_seed: int) -> list[float | None]:
        from fedsilo.silo.dp_training import ClippedSums, check_model, noisy_steps

        skeleton = ctx.new_model(seed=0)
        check_model(skeleton)
        with ClippedSums(skeleton, list(skeleton.parameters()), plan.max_grad_norm) as sums:
            return noisy_steps(
                plan,
                seed,
                private_seed,
                training.parameters,
                optimizer,
                training.private_gradients(skeleton, sums),
                after_noise=training.add_regulariser_gradient,
            )

    losses, metrics = local_steps(
        message, ctx, schedule, lambda batches: training.train(optimizer, batches), private
    )
    if settings.mixing_on:  # cos^2 only while the local model trains: else it is a fresh one
        ctx.state.save(LOCAL_MODEL, message.round, training.local)
        with torch.no_grad():
            metrics["orthogonality"] = float(orthogonality(training.federated, training.local))
    count = released_training(ctx, message, schedule, losses, metrics)
    return task_result(message, ctx, {MODEL: flat_parameters(model, spec)}, count, metrics, spec)


def local_model(
    ctx: SiloContext, message: TaskMessage, local_seed: int, before_round: int
) -> tuple[dict[str, torch.Tensor], bool]:
    """The silo's local model as of the rounds before `before_round`, and whether it was
    trained; a fresh one (not trained) from the task's `local_seed` when there is none yet."""
    stored = ctx.state.latest(LOCAL_MODEL, before_round)
    if stored is None:
        fresh = ctx.new_model(seed=local_seed)
        return {n: p.detach() for n, p in fresh.named_parameters()}, False
    shapes = {n: tuple(t.shape) for n, t in stored.items()}
    assert message.spec is not None  # load_model checked it
    if shapes != {entry.name: tuple(entry.shape) for entry in message.spec.entries}:
        raise ValueError(
            "the silo's stored local model does not fit the policy's model (its shapes differ); "
            "a new deployment starts a new local model"
        )
    return {n: t.to(ctx.device) for n, t in stored.items()}, True


def superfed_evaluate(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    task = config_of(message, SuperFedEvaluate)
    model, _ = ctx.load_model(message)
    local, trained = local_model(ctx, message, task.local_seed, message.round + 1)
    grid = _grid(message, ctx)
    test_names, selection_names = _metric_names(ctx)
    selection = _selection_split(ctx, task)
    test, chosen = ctx.split("test"), ctx.split(selection)
    reports = ctx.reports(message.task_id, "test")
    federated = {n: p.detach().clone() for n, p in model.named_parameters()}
    layers = mixable_layers(model)
    model.eval()
    curve, selected = [], []
    for lam in grid:
        weights = mixed(federated, local, dict.fromkeys(layers, float(lam)), layers)
        _load(model, weights)
        curve.append(measured(ctx.data.task, model, test, test_names, reports))
        if trained:
            selected.append(measured(ctx.data.task, model, chosen, selection_names, reports))
    star = _best(selected, ctx.data.task) if trained else 0
    metrics = {name: curve[star][name] for name in test_names}
    metrics |= {f"global_{name}": curve[0][name] for name in test_names}
    metrics |= {"lambda_star": float(grid[star]), "local_trained": float(trained)}
    if trained:
        headline = test_names[0]
        values = [point[headline] for point in curve]
        metrics |= {f"local_{name}": curve[-1][name] for name in test_names}
        metrics |= {
            f"oracle_{headline}": max(values) if headline == "accuracy" else min(values),
            "selection_on_validation": float(selection == "val"),
        }
        for lam, point, chosen_point in zip(grid, curve, selected, strict=True):
            metrics |= {f"{name}@{lam:.2f}": value for name, value in point.items()}
            metrics |= {f"selection_{name}@{lam:.2f}": v for name, v in chosen_point.items()}
    ctx.released_count("test")
    return TaskResult(
        message.task_id,
        ctx.name,
        message.kind,
        num_samples=reports.count(len(test[1])),
        metrics=metrics,
    )


def superfed_evaluate_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    """Every point of both curves a report (the global model's metrics alone while the silo has
    no trained local model), and the test count once."""
    test_names, selection_names = _metric_names(ctx)
    trained = ctx.state.latest(LOCAL_MODEL, message.round + 1) is not None
    per_point = len(test_names) + (len(selection_names) if trained else 0)
    points = len(_grid(message, ctx)) * per_point
    return reports_mechanism(ctx.privacy, ctx.unreleased_counts("test") + points)


def superfed_trained(message: TaskMessage, ctx: SiloContext) -> None:
    """What a `superfed_train` leaves for the planner: a local model from the round on which
    the mixture trains, whose evaluation then reports the whole grid (its tensors are not
    needed to plan, only that it exists)."""
    if SuperFedRound.of(config_of(message, SuperFedTrain)).mixing_on:
        ctx.state.save(LOCAL_MODEL, message.round, {})


def _grid(message: TaskMessage, ctx: SiloContext) -> np.ndarray:
    """The lambdas evaluated: the grid once the silo has trained a local model, else only 0
    (a fresh local model's curve says nothing)."""
    if ctx.state.latest(LOCAL_MODEL, message.round + 1) is None:
        return np.zeros(1)
    return lambda_grid(config_of(message, SuperFedEvaluate))


def lambda_grid(task: SuperFedEvaluate) -> np.ndarray:
    points = task.lambda_grid
    if points < 2:
        raise ValueError(f"lambda_grid needs at least 2 points, not {points}")
    return np.linspace(0.0, 1.0, points)


def _metric_names(ctx: SiloContext) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The test metrics at every lambda (headline first) and the selection split's."""
    names = evaluated_metrics(ctx)
    if "loss" not in names:
        raise ValueError("superfed chooses lambda by loss reports, which this policy forbids")
    selection = ("accuracy", "loss") if ctx.data.task == "classification" else ("loss",)
    return names, selection


def _selection_split(ctx: SiloContext, task: SuperFedEvaluate) -> str:
    enough = len(ctx.data.y_val) >= task.min_validation
    return "val" if enough else "train"


def _best(selected: list[dict[str, float]], task: str) -> int:
    """lambda*: the best selection accuracy, then the lowest loss, then the smaller lambda
    (regression: the lowest loss, then the smaller lambda)."""
    if task == "classification":
        return min(
            range(len(selected)), key=lambda i: (-selected[i]["accuracy"], selected[i]["loss"], i)
        )
    return min(range(len(selected)), key=lambda i: (selected[i]["loss"], i))


@torch.no_grad()
def _load(model: nn.Module, weights: dict[str, torch.Tensor]) -> None:
    for name, parameter in model.named_parameters():
        parameter.copy_(weights[name])
