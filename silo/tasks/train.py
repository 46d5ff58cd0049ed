"""`train`: local optimisation of a received model on this silo's training split.

Epochs or a fixed number of steps, minibatches drawn from a seeded generator, SGD (with
momentum and weight decay) or Adam, and the optional FedProx proximal term
(mu/2)||w - w_received||^2. Returns the trained parameters, the sample count, and the mean
training loss of the round's last epoch (or of all steps when training by steps).

When the silo's own policy asks for DP-SGD (`privacy.dp_sgd`), training runs through
`silo/dp_training.py` with the DP parameters of that policy, whatever the task says, and
the result also reports `dp_noise_multiplier`, `dp_sample_rate` and `dp_steps` (the plan's
public parameters). The sample count then leaves as a noisy report and the training loss not
at all (silo/reports.py); `train_releases` is what the task releases.

With `privacy.client_dp` (DP-FedAvg) the silo clips its update (trained - received) to L2 norm
S before it leaves, and with distributed noise adds its share N(0, (z S)^2 / m) of the
round's noise, m the silos the task says the round asked (at most the consortium the silo
knows: a coordinator that claims more cannot shrink the share below (z S)^2 / K). Without
DP-SGD the share is what the silo books: a Gaussian release of sensitivity S and std
z S / sqrt(m) (the coordinator sees each update; only their sum carries the full noise).
With DP-SGD the model is booked as DP-SGD's run, and clipping and the share are
post-processing of it.

Three options serve DRFA and DRFLM (spec robust-and-daisy-chain.md §4.4, §5.3):

* `checkpoint_step` t (an int in 0..the run's local steps; absent or None: none): the result
  also carries `CHECKPOINT`, the flat parameters (the model's `spec`) after exactly t
  optimiser steps (0: the model received), with or without DP-SGD. It releases nothing more:
  without DP it is exact like the model (`Mechanism.none()`); with DP-SGD it is an
  intermediate iterate of the same run, which DP-SGD's accounting already covers (the analysis
  releases every iterate), so it is post-processing and booked once with the model. With
  `privacy.client_dp` it is refused (its clipping and noise share cover one update per task;
  DRFA does not clip updates, so a policy never combines the two).
* `mixup_alpha` a (a float > 0; absent or None: off): every step trains on the batch's rows
  mixed with partners at Beta(a, a) ratios (silo/mixup.py; the batches idx are those of a plain
  run with the same seed), on the inputs or, with `mixup_on: embedding`, on the embedding the
  model's last layer reads. Under DP-SGD each mixed row's gradient is clipped as a sample's.
* `update_scale` s (a finite float; absent: 1): the model leaves as received + s (trained -
  received), DRFA's R-FedTorch variant, whose importance weights lambda_k K need not sum to
  one (spec §4.6): a uniform mean of the scaled models is then its update. Post-processing of
  the trained model; refused with client-level DP (whose clip bounds the unscaled update).

Two options serve AgnosticFedAvg and ApproxFedAvg on silos whose rows belong to domains
(`data.domain`; silo/domains.py):

* `domain_weights` {domain: omega} (absent: none): row j's loss counts omega of its domain
  (AgnosticFedAvg's alpha_i, normalised by the coordinator so that equal alphas are weight 1;
  a domain the map does not name counts 0). Under DP-SGD each weighted row is clipped as a
  sample's, and the weights are public, so the booking is unchanged.
* `domain_temperature` mu with `domain_reduction` (`sum` or `mean`): ApproxFedAvg's batch
  loss (1/mu) log sum_i exp(mu F_i) over the domains i present in the batch, F_i the sum of
  their rows' losses divided by the batch size (`sum`, the survey's form at the scale of a
  mean loss) or their mean (`mean`). One domain: the plain mean loss. Refused under DP-SGD.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import torch

from fedsilo.privacy.accounting import Mechanism
from fedsilo.silo.domains import domain_objective
from fedsilo.silo.evaluation import loss_function, per_sample_loss_function
from fedsilo.silo.mixup import MixupDraws, mixed_loss_of, mixup_on
from fedsilo.silo.reports import LOSSES, reports_mechanism
from fedsilo.silo.schedule import LocalSchedule, shuffled_batches
from fedsilo.silo.tasks.base import MODEL, SiloContext, flat_parameters
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tensors import ParameterSpec

if TYPE_CHECKING:  # Opacus loads only on the DP path
    from fedsilo.silo.dp_training import DpSgdPlan

PROX_ANCHOR = "prox_anchor"
CHECKPOINT = "checkpoint"


def train_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    """The trained model (DP-SGD's run, or the client-level noise share) and the noisy sample
    count; without DP, both exact."""
    privacy = ctx.privacy
    if not privacy.differentially_private:
        return [Mechanism.none()]
    if privacy.dp_sgd is not None:
        from fedsilo.silo.dp_training import dp_sgd_plan

        plan = dp_sgd_plan(privacy, message.config, len(ctx.data.y_train), ctx.rounds)
        model = plan.mechanism()
    else:
        clip = privacy.client_dp.clip
        model = Mechanism.gaussian(sensitivity=clip, noise_std=_share_std(message, ctx))
    return [model, *reports_mechanism(privacy, ctx.unreleased_counts("train"))]


def train(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    config = message.config
    model, spec = ctx.load_model(message)
    x, y = ctx.split("train")
    n = len(y)
    if n == 0:
        raise ValueError(f"silo {ctx.name!r} has no training samples")
    schedule = LocalSchedule.of(config, n)

    optimizer = optimizer_for(model.parameters(), config)
    loss_fn, per_sample_fn = loss_function(ctx.data.task), per_sample_loss_function(ctx.data.task)
    mu = float(config.get("prox_mu", 0.0))
    anchor = _anchor(message, model, spec) if mu > 0 else []
    seed = int(config["seed"])

    def per_sample_loss(index: torch.Tensor) -> torch.Tensor:
        return per_sample_fn(model(x[index]), y[index])

    alpha = config.get("mixup_alpha")
    if alpha is not None:  # DRFLM: every step on mixed rows
        draws = MixupDraws(alpha, seed, n)
        per_sample_loss = mixed_loss_of(ctx.data.task, model, x, y, draws, mixup_on(config))
    objective = domain_objective(config, ctx, per_sample_loss)
    scale = _update_scale(config, ctx)
    checkpoint = _Checkpoint(_checkpoint_step(config, schedule.steps, ctx), model, spec)

    model.train()
    metrics: dict[str, float] = {"steps": float(schedule.steps)}
    if ctx.privacy.dp_sgd is None:
        losses: list[float | None] = []
        batches = shuffled_batches(schedule, torch.Generator().manual_seed(seed))
        for step, index in enumerate(batches, start=1):
            optimizer.zero_grad(set_to_none=True)
            index = index.to(x.device)
            if objective is not None:  # per-domain weights or ApproxFedAvg's soft maximum
                loss = objective.batch_loss(index)
            elif alpha is None:
                loss = loss_fn(model(x[index]), y[index])
            else:  # the mean over the batch's mixed rows
                loss = per_sample_loss(index).mean()
            (loss + _proximal(model, anchor, mu) if mu > 0 else loss).backward()
            optimizer.step()
            losses.append(float(loss.detach()))
            checkpoint.after_step(step)
    else:
        # Opacus loads only when a policy asks for DP: a coordinator or a non-private silo never
        # pays its start-up time and memory.
        from fedsilo.silo.dp_training import dp_sgd_plan, train_private

        plan = dp_sgd_plan(ctx.privacy, config, n, ctx.rounds)
        losses = train_private(
            model,
            optimizer,
            plan,
            seed,
            ctx.private_seed(message.task_id, "dp-sgd"),
            objective.per_sample_loss if objective is not None else per_sample_loss,
            after_noise=(lambda: _add_proximal_gradient(model, anchor, mu)) if mu > 0 else None,
            after_step=checkpoint.after_step,
        )
        metrics |= plan.public_metrics()
    count = released_training(ctx, message, schedule, losses, metrics)
    trained = flat_parameters(model, spec)
    if scale != 1.0:
        received = message.tensors[MODEL].to(trained)
        trained = received + scale * (trained - received)
    if ctx.privacy.client_dp is not None:
        trained = _clipped_update(message, ctx, message.tensors[MODEL].to(trained), trained)
    tensors = {MODEL: trained} | checkpoint.tensors()

    return TaskResult(
        task_id=message.task_id,
        silo=ctx.name,
        kind=message.kind,
        num_samples=count,
        metrics=metrics,
        tensors=tensors,
        spec=spec,
    )


@torch.no_grad()
def _clipped_update(
    message: TaskMessage, ctx: SiloContext, received: torch.Tensor, trained: torch.Tensor
) -> torch.Tensor:
    """received + the update clipped to norm S, plus the silo's noise share (distributed)."""
    update = (trained - received).double()
    clip = ctx.privacy.client_dp.clip
    update *= min(1.0, clip / max(float(update.norm()), 1e-300))
    if ctx.privacy.client_dp.noise == "distributed":
        generator = ctx.noise_generator(message.task_id, "client-dp")
        update += torch.normal(
            0.0, _share_std(message, ctx), update.shape, generator=generator, dtype=torch.float64
        ).to(update.device)
    return received + update.to(received.dtype)


def _share_std(message: TaskMessage, ctx: SiloContext) -> float:
    """This silo's share of a round's client-level noise: z S / sqrt(m), m the silos the
    round asked (as the task says, at most the consortium this silo knows, at least 1)."""
    client_dp = ctx.privacy.client_dp
    cohort = max(1, min(int(message.config.get("cohort", 1)), ctx.consortium))
    return client_dp.noise_multiplier * client_dp.clip / math.sqrt(cohort)


def local_steps(
    message: TaskMessage,
    ctx: SiloContext,
    schedule: LocalSchedule,
    plain: Callable[[Iterator[torch.Tensor]], list[float]],
    private: Callable[[DpSgdPlan, int], list[float | None]],
) -> tuple[list[float | None], dict[str, float]]:
    """A training task's steps: `plain(batches)` over the task seed's shuffled batches, or under
    the silo's DP-SGD `private(plan, private_seed)`; each step's loss, and the metrics (the
    steps, and the DP plan's public parameters)."""
    metrics = {"steps": float(schedule.steps)}
    if ctx.privacy.dp_sgd is None:
        seed = int(message.config["seed"])
        return list(plain(shuffled_batches(schedule, torch.Generator().manual_seed(seed)))), metrics
    from fedsilo.silo.dp_training import dp_sgd_plan  # Opacus loads only on the DP path

    plan = dp_sgd_plan(ctx.privacy, message.config, schedule.n, ctx.rounds)
    losses = private(plan, ctx.private_seed(message.task_id, "dp-sgd"))
    return losses, metrics | plan.public_metrics()


def released_training(
    ctx: SiloContext,
    message: TaskMessage,
    schedule: LocalSchedule,
    losses: list[float | None],
    metrics: dict[str, float],
) -> int:
    """What a training task reports besides the model: the mean loss of its last window into
    `metrics` (when losses may leave exactly), and the training count as it is released."""
    reports = ctx.reports(message.task_id, "train")
    if reports.allows(LOSSES) and not reports.noised:
        recent = [loss for loss in losses[-schedule.window :] if loss is not None]
        metrics["train_loss"] = sum(recent) / len(recent) if recent else float("nan")
    ctx.released_count("train")
    return reports.count(schedule.n)


def _update_scale(config: Mapping[str, Any], ctx: SiloContext) -> float:
    """The task's `update_scale` (1 when absent): finite, and never with client-level DP."""
    scale = float(config.get("update_scale", 1.0))
    if not math.isfinite(scale):
        raise ValueError(f"update_scale must be a finite number, not {scale}")
    if scale != 1.0 and ctx.privacy.client_dp is not None:
        raise ValueError(
            "update_scale cannot be combined with privacy.client_dp: its clip bounds the "
            "unscaled update"
        )
    return scale


def _checkpoint_step(config: Mapping[str, Any], steps: int, ctx: SiloContext) -> int | None:
    """The task's `checkpoint_step`, checked before any training: a whole number in 0..steps,
    and never with client-level DP."""
    step = config.get("checkpoint_step")
    if step is None:
        return None
    if ctx.privacy.client_dp is not None:
        raise ValueError(
            "checkpoint_step cannot be combined with privacy.client_dp: its clipping and noise "
            "share cover one update per task"
        )
    number = isinstance(step, int | float) and not isinstance(step, bool)
    if number and not 0 <= step <= steps:
        raise ValueError(f"checkpoint_step {step} is outside the run's 0..{steps} local steps")
    if not number or int(step) != step:
        raise ValueError(f"checkpoint_step must be a whole number of local steps, not {step!r}")
    return int(step)


class _Checkpoint:
    """DRFA's random checkpoint: the flat parameters after optimiser step `step` (None: no
    checkpoint; 0: the model received, taken at once), taken by `after_step`, which the
    training calls after every step."""

    def __init__(self, step: int | None, model: torch.nn.Module, spec: ParameterSpec) -> None:
        self.step = step
        self.model = model
        self.spec = spec
        self.taken: dict[str, torch.Tensor] = {}
        self.after_step(0)

    def after_step(self, step: int) -> None:
        if step == self.step:
            self.taken[CHECKPOINT] = flat_parameters(self.model, self.spec)

    def tensors(self) -> dict[str, torch.Tensor]:
        """{CHECKPOINT: parameters} once taken, else nothing."""
        return self.taken


def _anchor(message: TaskMessage, model: torch.nn.Module, spec: Any) -> list[torch.Tensor]:
    """FedProx's anchor: the task's `PROX_ANCHOR` when it sends one (FedDC: the model of the
    last exchange), else the model received."""
    if PROX_ANCHOR not in message.tensors:
        return [p.detach().clone() for p in model.parameters()]
    values = spec.unflatten(message.tensors[PROX_ANCHOR]).values()
    return [v.to(p) for p, v in zip(model.parameters(), values, strict=True)]


def _proximal(model: torch.nn.Module, anchor: list[torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx: (mu/2) ||w - w_received||^2 over every parameter."""
    return (
        0.5
        * mu
        * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor, strict=True))
    )


@torch.no_grad()
def _add_proximal_gradient(model: torch.nn.Module, anchor: list[torch.Tensor], mu: float) -> None:
    """FedProx under DP-SGD: the proximal term's gradient mu (w - w_received) does not depend
    on the data, so it joins the gradient after clipping and noise."""
    for p, a in zip(model.parameters(), anchor, strict=True):
        p.grad.add_(p - a, alpha=mu)


def optimizer_for(params: Any, config: Mapping[str, Any]) -> torch.optim.Optimizer:
    lr, decay = float(config["lr"]), float(config.get("weight_decay", 0.0))
    if config["optimizer"] == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=decay)
    if config["optimizer"] == "sgd":
        return torch.optim.SGD(
            params, lr=lr, momentum=float(config.get("momentum", 0.0)), weight_decay=decay
        )
    raise ValueError(f"unknown optimizer {config['optimizer']!r}; use sgd or adam")
