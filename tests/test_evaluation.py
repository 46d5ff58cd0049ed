"""Specification of per-silo metrics and the training loss (silo/evaluation.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from sklearn.metrics import roc_auc_score

from fedsilo.silo.evaluation import (
    HIGHER_IS_BETTER,
    classification_metrics,
    loss_function,
    metrics_for,
    regression_metrics,
)


def logits_with_class_1_probability(p: list[float]) -> torch.Tensor:
    probability = torch.tensor(p, dtype=torch.float64)
    return torch.stack([torch.zeros_like(probability), torch.logit(probability)], dim=1)


def test_classification_reports_loss_accuracy_and_auroc():
    metrics = classification_metrics(torch.randn(6, 3), torch.tensor([0, 1, 2, 0, 1, 2]))
    assert set(metrics) == {"loss", "accuracy", "auroc"}
    assert all(isinstance(value, float) for value in metrics.values())


def test_accuracy_is_the_fraction_of_argmax_hits():
    logits = torch.tensor([[2.0, 0.0], [0.0, 2.0], [3.0, 1.0], [1.0, 0.0]])
    assert classification_metrics(logits, torch.tensor([0, 1, 1, 1]))["accuracy"] == 0.5


def test_loss_is_the_mean_cross_entropy():
    logits = torch.tensor([[0.0, 0.0], [math.log(3.0), 0.0]])
    expected = (math.log(2.0) + -math.log(3.0 / 4.0)) / 2
    loss = classification_metrics(logits, torch.tensor([1, 0]))["loss"]
    assert loss == pytest.approx(expected)


def test_binary_auroc_ranks_the_probability_of_class_1():
    logits = logits_with_class_1_probability([0.1, 0.4, 0.35, 0.8])
    assert classification_metrics(logits, torch.tensor([0, 0, 1, 1]))["auroc"] == 0.75


def test_binary_auroc_matches_sklearn():
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(50, 2, generator=generator)
    y = torch.randint(0, 2, (50,), generator=generator)
    expected = roc_auc_score(y.numpy(), torch.softmax(logits, dim=1)[:, 1].numpy())
    assert classification_metrics(logits, y)["auroc"] == pytest.approx(expected)


def test_multiclass_auroc_is_sklearn_one_vs_rest_macro():
    generator = torch.Generator().manual_seed(1)
    logits = torch.randn(60, 4, generator=generator)
    y = torch.arange(60) % 4
    probabilities = torch.softmax(logits.double(), dim=1).numpy()
    expected = roc_auc_score(y.numpy(), probabilities, multi_class="ovr", average="macro")
    assert classification_metrics(logits, y)["auroc"] == pytest.approx(expected)


def test_multiclass_auroc_averages_over_the_classes_present():
    generator = torch.Generator().manual_seed(2)
    logits = torch.randn(40, 4, generator=generator)
    y = torch.arange(40) % 2 * 3
    probabilities = torch.softmax(logits.double(), dim=1).numpy()
    per_class = [roc_auc_score(y.numpy() == c, probabilities[:, c]) for c in (0, 3)]
    assert classification_metrics(logits, y)["auroc"] == pytest.approx(sum(per_class) / 2)


@pytest.mark.parametrize("classes", [2, 3])
def test_auroc_is_nan_when_only_one_class_is_present(classes):
    metrics = classification_metrics(torch.randn(5, classes), torch.ones(5, dtype=torch.int64))
    assert math.isnan(metrics["auroc"])
    assert not math.isnan(metrics["accuracy"])


def test_classification_refuses_mismatched_shapes():
    with pytest.raises(ValueError, match="logits"):
        classification_metrics(torch.randn(5, 2), torch.zeros(4, dtype=torch.int64))


def test_regression_reports_mse_loss_rmse_and_mae():
    pred, y = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([1.0, 0.0, 3.0, 8.0])
    metrics = regression_metrics(pred, y)
    assert metrics["loss"] == pytest.approx((0 + 4 + 0 + 16) / 4)
    assert metrics["rmse"] == pytest.approx(math.sqrt(5.0))
    assert metrics["mae"] == pytest.approx((0 + 2 + 0 + 4) / 4)


def test_regression_refuses_shapes_that_would_broadcast():
    with pytest.raises(ValueError, match="same shape"):
        regression_metrics(torch.zeros(4, 1), torch.zeros(4))


def test_metrics_for_dispatches_on_task_and_squeezes_regression_output():
    pred, y = torch.tensor([[1.0], [3.0]]), torch.tensor([0.0, 3.0])
    assert metrics_for("regression", pred, y) == regression_metrics(pred.squeeze(1), y)
    logits, labels = torch.randn(4, 2), torch.tensor([0, 1, 0, 1])
    assert metrics_for("classification", logits, labels) == classification_metrics(logits, labels)


@pytest.mark.parametrize(
    "call",
    [
        lambda: metrics_for("ranking", torch.zeros(1), torch.zeros(1)),
        lambda: loss_function("ranking"),
    ],
)
def test_unknown_tasks_are_refused_naming_the_allowed_ones(call):
    with pytest.raises(ValueError, match="classification, regression"):
        call()


def test_classification_loss_is_mean_cross_entropy():
    logits, y = torch.randn(5, 3), torch.tensor([0, 1, 2, 1, 0])
    assert torch.equal(loss_function("classification")(logits, y), F.cross_entropy(logits, y))


def test_regression_loss_is_mse_on_squeezed_output_and_differentiable():
    output = torch.tensor([[1.0], [2.0]], requires_grad=True)
    loss = loss_function("regression")(output, torch.tensor([0.0, 0.0], dtype=torch.float64))
    assert loss.item() == pytest.approx(2.5)
    loss.backward()
    assert output.grad is not None


def test_direction_of_every_metric_is_declared():
    assert HIGHER_IS_BETTER == {
        "accuracy": True,
        "auroc": True,
        "loss": False,
        "rmse": False,
        "mae": False,
        "r2": True,
        "c_index": True,
    }
