"""A site's own training step: a `TrainingStep` from an installed package (entry point group
`fedsilo.steps`), named and pinned by the silo's own copy of the policy (`training.step`), that
owns one step of a `train` task's local loop: augmentation, gradient accumulation, early
stopping on the site's validation split, mixed precision on CUDA.

What the step can touch is what `StepTools` hands it: the batch's rows, the model (for its own
forward passes), the task's per-row loss, a seeded generator, and `descend`, the only way to
turn losses into an update. It returns nothing: the task's answer is the model and the reports
the silo's own rules release, as without a plug-in.

Under the silo's DP-SGD (`privacy.dp_sgd`), `descend` is the privacy engine's step
(silo/dp_training.py): each row's loss is clipped and the batch's sum noised before the
optimiser moves. A step that goes around it is refused, with one message, as it happens: one
that back-propagates into the parameters itself (their gradients accumulate), changes them
itself, or does not descend exactly once a batch. What DP-SGD's accounting cannot cover is
refused before training: early stopping (when to stop would depend on the validation rows,
which no noise covers), accumulation over batches (the booked mechanism is one noisy step per
batch), and mixed precision (the clipping arithmetic is checked in full precision).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, field
from importlib.metadata import EntryPoint, entry_points
from typing import Any

import torch
from torch import Tensor, nn

from fedsilo.policies.package_pin import pin_problem
from fedsilo.policies.plugin_loading import load_or_refuse
from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.policies.training import StepPlugin

GROUP = "fedsilo.steps"
KEY = "training.step"


class TrainingStepError(ValueError):
    """A training step plug-in this silo does not run: one message naming `training.step`."""


class TrainingStep:
    """The base of a site's training step: override what the site needs.

    `accumulate`: how many batches' gradients each optimiser update sums (1: every batch);
    `mixed_precision`: forward passes under `torch.autocast` (bfloat16) on CUDA."""

    accumulate: int = 1
    mixed_precision: bool = False

    def augment(self, x: Tensor, y: Tensor, generator: torch.Generator) -> tuple[Tensor, Tensor]:
        """The batch's rows as the step trains on them (none changed here). Row i of what it
        returns must come from row i of `x` alone, so a row's loss stays one record's."""
        return x, y

    def stop_early(self, epoch: int, validation_loss: float) -> bool:
        """After each pass over the training rows (`epoch`, from 1), with the model's mean loss
        on the site's validation split: True ends this round's local training (never here)."""
        return False

    def step(self, rows: Tensor, tools: StepTools) -> None:
        """One step on the batch of row indices `rows`: its rows, augmented, their losses, and
        one descent. Override to own the step; it must descend through `tools.descend`."""
        x, y = tools.batch(rows)
        x, y = self.augment(x, y, tools.generator)
        tools.descend(tools.row_losses(x, y))


@dataclass
class StepTools:
    """What a step may use. `model`: the network being trained (for forward passes of its
    own; under DP-SGD each layer runs once a batch); `generator`: seeded for the task (under
    DP-SGD from the silo's secret); `batch(rows)`: the rows' features and targets;
    `row_losses(x, y)`: the task's loss of each row; `descend(losses)`: the step's update."""

    model: nn.Module
    generator: torch.Generator
    x: Tensor
    y: Tensor
    per_row_loss: Callable[[Tensor, Tensor], Tensor]
    on_descend: Callable[[Tensor], None]
    descents: int = field(default=0, init=False)

    def batch(self, rows: Tensor) -> tuple[Tensor, Tensor]:
        return self.x[rows], self.y[rows]

    def row_losses(self, x: Tensor, y: Tensor) -> Tensor:
        """The task's loss of each row of (x, y) under the model, shape (rows,)."""
        return self.per_row_loss(self.model(x), y)

    def descend(self, losses: Tensor) -> None:
        """Move the model down the mean of `losses` (one per row): plain gradient steps, or
        under the silo's DP-SGD its clipped, noised step."""
        if losses.dim() != 1:
            raise TrainingStepError(
                f"{KEY}: descend takes one loss per row (shape (rows,)), not shape "
                f"{tuple(losses.shape)}"
            )
        self.descents += 1
        self.on_descend(losses)


def installed_steps() -> list[EntryPoint]:
    return list(entry_points(group=GROUP))


def load_step(config: StepPlugin) -> TrainingStep:
    """The step `config` names, built with its args, once the installed package is the pinned
    one; a TrainingStepError naming `training.step` otherwise."""
    entry_point = next((ep for ep in installed_steps() if ep.value == config.plugin), None)
    if entry_point is None:
        installed = sorted(ep.value for ep in installed_steps())
        raise TrainingStepError(
            f"{KEY}.plugin: {config.plugin!r} is not installed at this site (entry points "
            f"{GROUP}: {', '.join(installed) or 'none'})"
        )
    problem = pin_problem(entry_point, config.package, f"{KEY}.package")
    if problem is not None:
        raise TrainingStepError(problem)
    cls = load_or_refuse(entry_point, TrainingStepError, f"{KEY}.plugin: {config.plugin!r}")
    if not (isinstance(cls, type) and issubclass(cls, TrainingStep)):
        raise TrainingStepError(
            f"{KEY}.plugin: {config.plugin!r} is not a subclass of fedsilo.TrainingStep"
        )
    try:
        step = cls(**config.args)
    except Exception as error:
        raise TrainingStepError(
            f"{KEY}.args: {config.plugin!r} refuses {config.args}: {type(error).__name__}: {error}"
        ) from None
    if not (isinstance(step.accumulate, int) and step.accumulate >= 1):
        raise TrainingStepError(
            f"{KEY}: {config.plugin!r} accumulates {step.accumulate!r} batches; a whole "
            "number from 1"
        )
    return step


def dp_sgd_problem(step: TrainingStep, privacy: PrivacyConfig) -> str | None:
    """What of `step` the silo's DP-SGD cannot account for (None: nothing, or no DP-SGD)."""
    if privacy.dp_sgd is None:
        return None
    name = type(step).__name__
    if type(step).stop_early is not TrainingStep.stop_early:
        return (
            f"{KEY}: {name} stops early on the validation split, which no noise covers (when "
            "to stop would release it); drop stop_early or privacy.dp_sgd"
        )
    if step.accumulate != 1:
        return (
            f"{KEY}: {name} accumulates {step.accumulate} batches per update, and DP-SGD's "
            "booked mechanism is one noisy step per batch; raise training.batch_size instead"
        )
    if step.mixed_precision:
        return (
            f"{KEY}: {name} asks for mixed precision, and DP-SGD's per-row clipping runs in "
            "full precision; set mixed_precision = False"
        )
    return None


def autocast(step: TrainingStep, device: torch.device) -> AbstractContextManager[Any]:
    """Mixed precision (bfloat16) for the step's forward passes on CUDA; none elsewhere."""
    if step.mixed_precision and device.type == "cuda":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return nullcontext()


def plain_steps(
    step: TrainingStep,
    tools: Callable[[Callable[[Tensor], None]], StepTools],
    optimizer: torch.optim.Optimizer,
    batches: Iterator[Tensor],
    batches_per_epoch: int,
    validation_loss: Callable[[], float] | None,
    regulariser: Callable[[], Tensor] | None = None,
    after_step: Callable[[int], None] | None = None,
) -> list[float]:
    """Plain training through `step`: each batch's descent back-propagates its mean loss (over
    `accumulate`), the optimiser updates every `accumulate` batches (and after the last), and
    after each pass over the rows `stop_early` may end the run. The batches' mean losses."""
    losses: list[float] = []

    def descend(row_losses: Tensor) -> None:
        loss = row_losses.mean()
        total = loss + regulariser() if regulariser is not None else loss
        (total / step.accumulate).backward()
        losses.append(float(loss.detach()))

    optimizer.zero_grad(set_to_none=True)
    pending = 0
    for number, rows in enumerate(batches, start=1):
        tools_ = tools(descend)
        with autocast(step, rows.device):
            step.step(rows, tools_)
        _descended_once(step, tools_)
        pending += 1
        if pending == step.accumulate:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            pending = 0
        if after_step is not None:
            after_step(number)
        epoch_ends = validation_loss is not None and number % batches_per_epoch == 0
        if epoch_ends and step.stop_early(number // batches_per_epoch, validation_loss()):
            break
    if pending:
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return losses


def guarded_private_step(
    step: TrainingStep,
    tools: Callable[[Callable[[Tensor], None]], StepTools],
    params: list[Tensor],
    clipped_sums: Callable[[Tensor], list[Tensor]],
) -> Callable[[Tensor], tuple[list[Tensor], float]]:
    """A batch's clipped per-row gradient sums and mean loss, from `step` run under DP-SGD: its
    one descent goes through the privacy engine's clipping (`clipped_sums`); a step that
    back-propagates into the parameters, changes them or does not descend once is refused."""

    def gradients(rows: Tensor) -> tuple[list[Tensor], float]:
        captured: list[tuple[list[Tensor], float]] = []

        def descend(row_losses: Tensor) -> None:
            captured.append((clipped_sums(row_losses), float(row_losses.detach().mean())))

        hooks = [p.register_post_accumulate_grad_hook(_refuse_backward(step)) for p in params]
        versions = [p._version for p in params]
        try:
            tools_ = tools(descend)
            step.step(rows, tools_)
        finally:
            for hook in hooks:
                hook.remove()
        if [p._version for p in params] != versions:
            raise TrainingStepError(
                f"{KEY}: {type(step).__name__} bypasses the privacy engine: it changed the "
                "model's parameters itself under privacy.dp_sgd; only tools.descend may move them"
            )
        _descended_once(step, tools_)
        return captured[0]

    return gradients


def _refuse_backward(step: TrainingStep) -> Callable[[Tensor], None]:
    """A hook on a parameter that refuses the gradient a plain backward pass accumulates into
    it: under DP-SGD only the privacy engine computes gradients (it takes them at the layers'
    outputs and leaves the parameters' own untouched)."""

    def refuse(parameter: Tensor) -> None:
        raise TrainingStepError(
            f"{KEY}: {type(step).__name__} bypasses the privacy engine: it back-propagated into "
            "the model's parameters itself under privacy.dp_sgd; pass each row's loss to "
            "tools.descend, which clips and noises them"
        )

    return refuse


def _descended_once(step: TrainingStep, tools: StepTools) -> None:
    if tools.descents != 1:
        raise TrainingStepError(
            f"{KEY}: {type(step).__name__} descended {tools.descents} times in one batch; a "
            "step descends exactly once (tools.descend)"
        )
