"""`train`: local optimisation of a received model on this silo's training split.

Epochs or a fixed number of steps, minibatches drawn from a seeded generator, SGD (with
momentum and weight decay) or Adam. Returns the trained parameters, the sample count, and the
mean training loss of the round's last epoch (or of all steps when training by steps).

The task composes one local loop (silo/local_loop.py) from the pieces its config asks for:

* the objective (silo/objectives.py): the plain loss; with `mixup_alpha` a (DRFLM) every step
  trains on the batch's rows mixed with partners at Beta(a, a) ratios (silo/mixup.py, on the
  inputs or, with `mixup_on: embedding`, on the embedding the model's last layer reads; the
  batches are those of a plain run with the same seed); with `domain_weights` or
  `domain_temperature` (AgnosticFedAvg, ApproxFedAvg) the rows' domains weigh in
  (silo/domains.py);
* with `prox_mu` > 0, FedProx's proximal term (silo/proximal.py);
* with a `CONTROL_CORRECTION` tensor (SCAFFOLD), c - c_i added to every gradient
  (silo/scaffold.py);
* with `checkpoint_step`, DRFA's checkpoint, and with `update_scale`, its scaled update
  (silo/drfa_training.py);
* with the silo's `privacy.client_dp`, the update clipped and noised before it leaves
  (silo/client_dp.py);
* with `compression` (the silo's own `compression:` section), the update, last of all,
  quantized (silo/compression.py).

When the silo's own policy asks for DP-SGD (`privacy.dp_sgd`), the loop runs through
silo/dp_training.py with the DP parameters of that policy, whatever the task says, each row of
the objective clipped as a sample (ApproxFedAvg's objective, and a task plug-in without
`per_sample_loss`, have no per-row loss: refused). The
sample count then leaves as a noisy report and the training loss not at all (silo/reports.py);
`train_releases` is what the task releases.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

from fedsilo.policies.data import SURVIVAL
from fedsilo.privacy.accounting import Mechanism
from fedsilo.silo.client_dp import clipped_update, share_mechanism
from fedsilo.silo.compression import compressed_model
from fedsilo.silo.data.plugins import is_plugin_task, per_sample_loss_of
from fedsilo.silo.data.survival import NO_PER_ROW_LOSS
from fedsilo.silo.domains import domain_objective
from fedsilo.silo.drfa_training import Checkpoint, checkpoint_step, scaled, update_scale
from fedsilo.silo.evaluation import loss_function, per_sample_loss_function
from fedsilo.silo.local_loop import (
    gradient_steps,
    local_steps,
    local_training,
    optimizer_for,
    released_training,
)
from fedsilo.silo.mixup import MixupDraws, mixed_loss_of, mixup_on
from fedsilo.silo.objectives import MeanOfRows, Objective, RowLoss
from fedsilo.silo.proximal import Proximal
from fedsilo.silo.reports import reports_mechanism
from fedsilo.silo.scaffold import ControlCorrection
from fedsilo.silo.schedule import LocalSchedule
from fedsilo.silo.tasks.base import SiloContext, config_of, flat_parameters, task_result
from fedsilo.silo.training_step import (
    StepTools,
    TrainingStep,
    TrainingStepError,
    dp_sgd_problem,
    guarded_private_step,
    load_step,
    plain_steps,
)
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tasks import TrainTask
from fedsilo.wire.tasks.tensor_names import MODEL
from fedsilo.wire.tensors import read_only

if TYPE_CHECKING:  # Opacus loads only on the DP path
    from fedsilo.silo.dp_training import DpSgdPlan


def train_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    """The trained model (DP-SGD's run, or the client-level noise share) and the noisy sample
    count; without DP, both exact."""
    privacy = ctx.privacy
    if not privacy.differentially_private:
        return [Mechanism.none()]
    if privacy.dp_sgd is not None:
        from fedsilo.silo.dp_training import dp_sgd_plan

        local = local_training(message.config)
        rows = len(ctx.data.y_train)
        model = dp_sgd_plan(privacy, local, rows, ctx.rounds, ctx.job_noise()).mechanism()
    else:
        model = share_mechanism(message, ctx)
    return [model, *reports_mechanism(privacy, ctx.unreleased_counts("train"))]


def train(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    task = config_of(message, TrainTask)
    local = task.local
    _refuse_dp_sgd_without_rows(ctx)
    model, spec = ctx.load_model(message)
    x, y = ctx.split("train")
    n = len(y)
    if n == 0:
        raise ValueError(f"silo {ctx.name!r} has no training samples")
    schedule = LocalSchedule.of(local, n)
    optimizer = optimizer_for(model.parameters(), local)
    proximal = Proximal.of(local.prox_mu, message.tensors, model, spec) or ControlCorrection.of(
        message.tensors, model, spec
    )  # a data-independent term: FedProx's, or SCAFFOLD's correction
    objective = _objective(task, ctx, model, x, y)
    scale = update_scale(task.scale, ctx.privacy)
    step = checkpoint_step(task.checkpoint_step, schedule.steps, ctx.privacy)
    checkpoint = Checkpoint(step, model, spec)
    seed = local.seed

    after_noise = proximal.add_gradient if proximal is not None else None
    regulariser = proximal.value if proximal is not None else None
    own = _site_step(ctx, task)

    def private(plan: DpSgdPlan, private_seed: int) -> list[float | None]:
        from fedsilo.silo.dp_training import private_run, train_private

        if own is None:
            return train_private(
                model,
                optimizer,
                plan,
                seed,
                private_seed,
                objective.per_sample_loss,
                after_noise=after_noise,
                after_step=checkpoint.after_step,
            )
        generator = torch.Generator().manual_seed(ctx.private_seed(message.task_id, "step"))
        return private_run(
            model,
            optimizer,
            plan,
            seed,
            private_seed,
            lambda params, sums: guarded_private_step(
                own, _tools(ctx, model, x, y, generator), params, sums
            ),
            after_noise=after_noise,
            after_step=checkpoint.after_step,
        )

    def plain(batches: Iterator[Tensor]) -> list[float]:
        if own is None:
            return gradient_steps(
                optimizer,
                objective.batch_loss,
                batches,
                x.device,
                regulariser=regulariser,
                after_step=checkpoint.after_step,
            )
        generator = torch.Generator().manual_seed(seed)
        return plain_steps(
            own,
            _tools(ctx, model, x, y, generator),
            optimizer,
            (rows.to(x.device) for rows in batches),
            -(-n // schedule.batch),
            _validation_loss(ctx, model) if _has_validation_rows(ctx) else None,
            regulariser=regulariser,
            after_step=checkpoint.after_step,
        )

    model.train()
    losses, metrics = local_steps(message, ctx, schedule, plain, private)
    count = released_training(ctx, message, schedule, losses, metrics)
    received = read_only(message.tensors, MODEL)
    trained = scaled(
        received, ctx.keep_local(message, model, spec, flat_parameters(model, spec)), scale
    )
    if ctx.privacy.client_dp is not None:
        trained = clipped_update(message, ctx, received.to(trained), trained)
    released = (  # quantized last of all, as the silo's own policy asks
        {MODEL: trained}
        if task.compression is None
        else compressed_model(message, ctx, task.compression, received, trained, spec)
    )
    return task_result(message, ctx, released | checkpoint.tensors(), count, metrics, spec)


def _site_step(ctx: SiloContext, task: TrainTask) -> TrainingStep | None:
    """The site's own training step (`training.step` of its own policy), checked against the
    task and the silo's DP-SGD; None without one."""
    config = ctx.policy.training.step
    if config is None:
        return None
    if task.mixup_alpha is not None or task.domain_weights or task.domain_temperature:
        raise TrainingStepError(
            "training.step: this task trains on mixed or domain-weighted rows, which a step "
            "plug-in does not compose with"
        )
    step = load_step(config)
    problem = dp_sgd_problem(step, ctx.privacy)
    if problem is not None:
        raise TrainingStepError(problem)
    return step


def _tools(
    ctx: SiloContext, model: nn.Module, x: Tensor, y: Tensor, generator: torch.Generator
) -> Callable[[Callable[[Tensor], None]], StepTools]:
    per_row = per_sample_loss_function(ctx.data.task)
    return lambda descend: StepTools(model, generator, x, y, per_row, descend)


def _has_validation_rows(ctx: SiloContext) -> bool:
    return len(ctx.data.y_val) > 0


def _validation_loss(ctx: SiloContext, model: nn.Module) -> Callable[[], float]:
    """The model's mean loss on the site's validation split, in evaluation mode."""
    x, y = ctx.split("val")
    mean_loss = loss_function(ctx.data.task)

    def loss() -> float:
        model.eval()
        with torch.no_grad():
            value = float(mean_loss(model(x), y))
        model.train()
        return value

    return loss


def _refuse_dp_sgd_without_rows(ctx: SiloContext) -> None:
    task = ctx.data.task
    if ctx.privacy.dp_sgd is not None and is_plugin_task(task) and per_sample_loss_of(task) is None:
        reason = (
            NO_PER_ROW_LOSS
            if task == SURVIVAL
            else f"task plug-in '{task}' defines no per_sample_loss"
        )
        raise ValueError(f"privacy.dp_sgd: DP-SGD clips each row's loss, and {reason}")


def _objective(
    task: TrainTask, ctx: SiloContext, model: nn.Module, x: Tensor, y: Tensor
) -> Objective:
    """The loss of `model` on the rows of (x, y), each mixed under `mixup_alpha`, weighted by
    domain when the task asks."""
    objective: Objective = RowLoss(ctx.data.task, model, x, y)
    if task.mixup_alpha is not None:  # DRFLM: every step on mixed rows
        draws = MixupDraws(task.mixup_alpha, task.local.seed, len(y))
        on = mixup_on(task.mixup_site)
        objective = MeanOfRows(mixed_loss_of(ctx.data.task, model, x, y, draws, on))
    by_domain = domain_objective(task, ctx, objective.per_sample_loss)
    return by_domain if by_domain is not None else objective
