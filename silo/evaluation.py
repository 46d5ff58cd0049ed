"""Per-silo metrics and the training loss, computed at the silo on its own test/val split.

Classification reports loss (mean cross-entropy), accuracy and AUROC; regression reports loss
(MSE), RMSE and MAE. `HIGHER_IS_BETTER` tells the coordinator which direction is good.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor

TASKS = ("classification", "regression")

HIGHER_IS_BETTER: dict[str, bool] = {
    "loss": False,
    "accuracy": True,
    "auroc": True,
    "rmse": False,
    "mae": False,
}

LossFunction = Callable[[Tensor, Tensor], Tensor]


def classification_metrics(logits: Tensor, y: Tensor) -> dict[str, float]:
    """Loss, accuracy and AUROC of `logits` (n, C) against integer labels `y` (n,).

    AUROC uses softmax probabilities: for C = 2 the probability of class 1; for C > 2 the
    one-vs-rest AUROC of each class present in `y`, averaged unweighted (macro), which is
    sklearn's `multi_class="ovr"` when every class is present. When `y` holds a single class
    AUROC is undefined and is returned as float("nan"); the coordinator excludes it.
    """
    logits, y = logits.detach().cpu(), y.detach().cpu()
    if logits.dim() != 2 or logits.shape[1] < 2 or logits.shape[0] != y.shape[0]:
        raise ValueError(
            f"need logits (n, C>=2) for labels (n,), got {tuple(logits.shape)} and {tuple(y.shape)}"
        )
    return {
        "loss": F.cross_entropy(logits.double(), y).item(),
        "accuracy": (logits.argmax(dim=1) == y).double().mean().item(),
        "auroc": _auroc(torch.softmax(logits.double(), dim=1), y),
    }


def regression_metrics(pred: Tensor, y: Tensor) -> dict[str, float]:
    """Loss (mean squared error), RMSE and MAE of predictions `pred` (n,) against `y` (n,)."""
    pred, y = pred.detach().cpu().double(), y.detach().cpu().double()
    if pred.shape != y.shape or pred.dim() != 1:
        raise ValueError(
            f"need pred and y of the same shape (n,), got {tuple(pred.shape)} and {tuple(y.shape)}"
        )
    mse = F.mse_loss(pred, y).item()
    return {"loss": mse, "rmse": math.sqrt(mse), "mae": F.l1_loss(pred, y).item()}


def metrics_for(task: str, output: Tensor, y: Tensor) -> dict[str, float]:
    """The metrics of `task` for a model's `output`; regression output (n, 1) is squeezed."""
    _check_task(task)
    if task == "classification":
        return classification_metrics(output, y)
    return regression_metrics(_squeeze_regression(output), y)


def loss_function(task: str) -> LossFunction:
    """The training loss of `task` (mean reduction): cross-entropy, or MSE on squeezed output."""
    _check_task(task)
    if task == "classification":
        return F.cross_entropy
    return _regression_loss


def per_sample_loss_function(task: str) -> LossFunction:
    """The training loss of `task` for each row, unreduced (shape (n,)): what DP-SGD clips."""
    _check_task(task)
    if task == "classification":
        return partial(F.cross_entropy, reduction="none")
    return partial(_regression_loss, reduction="none")


def _regression_loss(output: Tensor, y: Tensor, reduction: str = "mean") -> Tensor:
    pred = _squeeze_regression(output)
    return F.mse_loss(pred, y.to(pred.dtype), reduction=reduction)


def _squeeze_regression(output: Tensor) -> Tensor:
    return output.squeeze(1) if output.dim() == 2 and output.shape[1] == 1 else output


def _check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown task '{task}'; allowed: {', '.join(TASKS)}")


def _auroc(probabilities: Tensor, y: Tensor) -> float:
    present = torch.unique(y).tolist()
    if len(present) < 2:
        return float("nan")
    from sklearn.metrics import (
        roc_auc_score,
    )  # only here: services that never evaluate start faster

    labels, scores = y.numpy(), probabilities.numpy()
    if scores.shape[1] == 2:
        return float(roc_auc_score(labels, scores[:, 1]))
    per_class = [roc_auc_score(labels == c, scores[:, c]) for c in present]
    return float(sum(per_class) / len(per_class))
