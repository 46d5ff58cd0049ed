"""Per-silo metrics and the training loss, computed at the silo on its own test/val split.

Classification reports loss (mean cross-entropy), accuracy and AUROC; a model with one logit
(`logistic`) is binary: binary cross-entropy on the logit, P(class 1) its sigmoid, accuracy at
0.5. Regression reports loss (MSE), RMSE, MAE and R² (`r2`, the coefficient of determination,
scikit-learn's `r2_score`; NaN where the split's targets are all equal). `HIGHER_IS_BETTER`
tells the coordinator which direction is good. Any other task is a `TaskPlugin`
(silo/data/plugins.py): the built-in survival task (silo/data/survival.py: Cox loss, c_index)
or an installed task plug-in named by its entry point value: its loss, its per-row loss when it
defines one, and its metrics (plus the mean loss).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

from fedsilo.policies.data import SURVIVAL
from fedsilo.silo.data.plugins import is_plugin_task, task_plugin
from fedsilo.silo.data.survival import NO_PER_ROW_LOSS

TASKS = ("classification", "regression")

HIGHER_IS_BETTER: dict[str, bool] = {
    "loss": False,
    "accuracy": True,
    "auroc": True,
    "rmse": False,
    "mae": False,
    "r2": True,
    "c_index": True,
}

LossFunction = Callable[[Tensor, Tensor], Tensor]


def classification_metrics(logits: Tensor, y: Tensor) -> dict[str, float]:
    """Loss, accuracy and AUROC of `logits` (n, C) against integer labels `y` (n,); C = 1 is
    one binary logit (loss: binary cross-entropy, accuracy: the sigmoid at 0.5).

    AUROC uses the class probabilities (`class_probabilities`): for two classes the probability
    of class 1; for C > 2 the one-vs-rest AUROC of each class present in `y`, averaged
    unweighted (macro), which is sklearn's `multi_class="ovr"` when every class is present.
    When `y` holds a single class AUROC is undefined and is returned as float("nan"); the
    coordinator excludes it.
    """
    logits, y = logits.detach().cpu(), y.detach().cpu()
    if logits.dim() != 2 or logits.shape[0] != y.shape[0]:
        raise ValueError(
            f"need logits (n, C) for labels (n,), got {tuple(logits.shape)} and {tuple(y.shape)}"
        )
    return {
        "loss": classification_loss(logits.double(), y).item(),
        "accuracy": (predicted_classes(logits) == y).double().mean().item(),
        "auroc": _auroc(class_probabilities(logits.double()), y),
    }


def classification_loss(logits: Tensor, y: Tensor, reduction: str = "mean") -> Tensor:
    """Cross-entropy of `logits` (n, C) against labels `y`; one logit (C = 1): binary
    cross-entropy on the logit."""
    if logits.shape[1] == 1:
        return F.binary_cross_entropy_with_logits(
            logits[:, 0], y.to(logits.dtype), reduction=reduction
        )
    return F.cross_entropy(logits, y, reduction=reduction)


def class_probabilities(logits: Tensor) -> Tensor:
    """Each row's class probabilities, (n, C): the softmax of the logits; one logit z gives
    (1 - sigmoid(z), sigmoid(z))."""
    if logits.shape[1] == 1:
        positive = torch.sigmoid(logits)
        return torch.cat([1 - positive, positive], dim=1)
    return torch.softmax(logits, dim=1)


def predicted_classes(logits: Tensor) -> Tensor:
    """Each row's most probable class: the argmax; one logit: class 1 where it is > 0."""
    if logits.shape[1] == 1:
        return (logits[:, 0] > 0).long()
    return logits.argmax(dim=1)


def regression_metrics(pred: Tensor, y: Tensor) -> dict[str, float]:
    """Loss (mean squared error), RMSE, MAE and R² of predictions `pred` (n,) against `y` (n,).

    R² is 1 - SSE / SST, SST the squared deviations of `y` from its own mean; targets that are
    all equal (SST 0) leave it undefined: float("nan"), which the coordinator excludes."""
    pred, y = pred.detach().cpu().double(), y.detach().cpu().double()
    if pred.shape != y.shape or pred.dim() != 1:
        raise ValueError(
            f"need pred and y of the same shape (n,), got {tuple(pred.shape)} and {tuple(y.shape)}"
        )
    mse = F.mse_loss(pred, y).item()
    return {
        "loss": mse,
        "rmse": math.sqrt(mse),
        "mae": F.l1_loss(pred, y).item(),
        "r2": _r2(pred, y),
    }


def metrics_for(task: str, output: Tensor, y: Tensor) -> dict[str, float]:
    """The metrics of `task` for a model's `output`; regression output (n, 1) is squeezed."""
    if is_plugin_task(task):
        return _plugin_metrics(task, output, y)
    _check_task(task)
    if task == "classification":
        return classification_metrics(output, y)
    return regression_metrics(_squeeze_regression(output), y)


def loss_function(task: str) -> LossFunction:
    """The training loss of `task` (mean reduction): cross-entropy (binary on one logit), MSE on
    squeezed output, or the task's `TaskPlugin` loss (survival's Cox loss)."""
    if is_plugin_task(task):
        return task_plugin(task).loss
    _check_task(task)
    if task == "classification":
        return classification_loss
    return _regression_loss


def per_sample_loss_function(task: str) -> LossFunction:
    """The training loss of `task` for each row, unreduced (shape (n,)): what DP-SGD clips, the
    mixing schedules' probes report and domain weights weigh. A task plug-in without
    `per_sample_loss` is refused."""
    if is_plugin_task(task):
        per_row = getattr(task_plugin(task), "per_sample_loss", None)
        if per_row is None:
            reason = (
                NO_PER_ROW_LOSS
                if task == SURVIVAL
                else f"task plug-in '{task}' defines no per_sample_loss"
            )
            raise ValueError(
                f"{reason}; per-row losses are what DP-SGD, the mixing schedules' loss probes, "
                "domain weights and SuPerFed need"
            )
        return per_row
    _check_task(task)
    if task == "classification":
        return partial(classification_loss, reduction="none")
    return partial(_regression_loss, reduction="none")


def task_metrics(task: str) -> tuple[str, ...]:
    """The metrics an evaluation of `task` reports besides the loss."""
    if is_plugin_task(task):
        return tuple(name for name in task_plugin(task).higher_is_better if name != "loss")
    _check_task(task)
    return ("accuracy", "auroc") if task == "classification" else ("rmse", "mae", "r2")


def _plugin_metrics(task: str, output: Tensor, y: Tensor) -> dict[str, float]:
    plugin = task_plugin(task)
    output, y = output.detach().cpu(), y.detach().cpu()
    metrics = {name: float(value) for name, value in plugin.metrics(output, y).items()}
    if "loss" not in metrics:
        metrics["loss"] = float(plugin.loss(output, y))
    return metrics


def _regression_loss(output: Tensor, y: Tensor, reduction: str = "mean") -> Tensor:
    pred = _squeeze_regression(output)
    return F.mse_loss(pred, y.to(pred.dtype), reduction=reduction)


def _squeeze_regression(output: Tensor) -> Tensor:
    return output.squeeze(1) if output.dim() == 2 and output.shape[1] == 1 else output


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(
            f"unknown task '{task}'; allowed: {', '.join(TASKS)}, or a task plug-in 'module:attr'"
        )


def _r2(pred: Tensor, y: Tensor) -> float:
    if len(y) < 2 or bool((y == y[0]).all()) or not bool(torch.isfinite(pred).all()):
        return float("nan")  # SST is 0 (one row, equal targets); scikit-learn refuses NaN
    from sklearn.metrics import r2_score  # only here: services that never evaluate start faster

    return float(r2_score(y.numpy(), pred.numpy()))


def _auroc(probabilities: Tensor, y: Tensor) -> float:
    present = torch.unique(y).tolist()
    if len(present) < 2 or not bool(torch.isfinite(probabilities).all()):
        return float("nan")  # one class, or a model that diverged: scikit-learn refuses NaN
    from sklearn.metrics import (
        roc_auc_score,
    )  # only here: services that never evaluate start faster

    labels, scores = y.numpy(), probabilities.numpy()
    if scores.shape[1] == 2:
        return float(roc_auc_score(labels, scores[:, 1]))
    per_class = [roc_auc_score(labels == c, scores[:, c]) for c in present]
    return float(sum(per_class) / len(per_class))
