"""Specification of across-silo summaries (coordinator/summary.py)."""

from __future__ import annotations

import math

import pytest

from fedsilo.coordinator.summary import CrossSiloSummary, gini, summarize, summarize_metrics

# 20 silos: values 0.50, 0.52, ..., 0.88 and test sizes 10, 15, ..., 105; k = floor(0.1 * 20) = 2.
TWENTY_VALUES = {f"silo{i:02d}": 0.50 + 0.02 * i for i in range(20)}
TWENTY_SIZES = {f"silo{i:02d}": 10 + 5 * i for i in range(20)}
LOWEST_TWO = (0.50 * 10 + 0.52 * 15) / (10 + 15)
HIGHEST_TWO = (0.88 * 105 + 0.86 * 100) / (105 + 100)


def test_gini_of_1_2_3_4_is_a_quarter():
    assert gini([4.0, 1.0, 3.0, 2.0]) == pytest.approx(0.25)


def test_gini_of_equal_values_is_zero():
    assert gini([0.7, 0.7, 0.7]) == 0.0


def test_gini_of_all_zero_values_is_defined_as_zero():
    assert gini([0.0, 0.0]) == 0.0


def test_means_are_unweighted_and_size_weighted():
    summary = summarize({"a": 0.5, "b": 1.0}, {"a": 100, "b": 300}, higher_is_better=True)
    assert summary.mean == pytest.approx(0.75)
    assert summary.weighted_mean == pytest.approx((0.5 * 100 + 1.0 * 300) / 400)


def test_worst_and_best_10_percent_are_size_weighted_over_k_silos():
    summary = summarize(TWENTY_VALUES, TWENTY_SIZES, higher_is_better=True)
    assert summary.worst_10 == pytest.approx(LOWEST_TWO)
    assert summary.best_10 == pytest.approx(HIGHEST_TWO)
    assert summary.worst == pytest.approx(0.50)
    assert summary.best == pytest.approx(0.88)
    assert summary.parity_gap == pytest.approx(0.38)


def test_loss_like_metrics_flip_worst_and_best():
    summary = summarize(TWENTY_VALUES, TWENTY_SIZES, higher_is_better=False)
    assert summary.worst == pytest.approx(0.88)
    assert summary.best == pytest.approx(0.50)
    assert summary.worst_10 == pytest.approx(HIGHEST_TWO)
    assert summary.best_10 == pytest.approx(LOWEST_TWO)
    assert summary.parity_gap == pytest.approx(0.38)


def test_fewer_than_20_silos_still_take_one_silo_for_the_10_percent():
    summary = summarize({"a": 0.2, "b": 0.9, "c": 0.5}, {"a": 1, "b": 1, "c": 1}, True)
    assert (summary.worst_10, summary.best_10) == (0.2, 0.9)


def test_nan_values_are_excluded_and_counted():
    values = {"a": 0.6, "b": float("nan"), "c": 0.8}
    summary = summarize(values, {"a": 10, "b": 10, "c": 30}, higher_is_better=True)
    assert summary.excluded == 1
    assert summary.mean == pytest.approx(0.7)
    assert summary.weighted_mean == pytest.approx((0.6 * 10 + 0.8 * 30) / 40)
    assert summary.worst == 0.6


def test_all_nan_values_give_an_all_nan_summary():
    summary = summarize({"a": float("nan"), "b": float("nan")}, {"a": 1, "b": 2}, True)
    assert summary.excluded == 2
    fields = {k: v for k, v in summary.as_dict().items() if k != "excluded"}
    assert all(math.isnan(value) for value in fields.values())


def test_as_dict_names_every_field():
    summary = summarize({"a": 1.0, "b": 3.0}, {"a": 1, "b": 1}, higher_is_better=True)
    assert summary.as_dict() == {
        "mean": 2.0,
        "weighted_mean": 2.0,
        "worst": 1.0,
        "best": 3.0,
        "worst_10": 1.0,
        "best_10": 3.0,
        "gini": pytest.approx(0.25),
        "parity_gap": 2.0,
        "excluded": 0,
    }


def test_a_silo_without_a_positive_test_size_is_refused():
    with pytest.raises(ValueError, match="no test size given for silo.*: b"):
        summarize({"a": 1.0, "b": 2.0}, {"a": 1}, higher_is_better=True)
    with pytest.raises(ValueError, match="must be positive for silo.*: a"):
        summarize({"a": 1.0}, {"a": 0}, higher_is_better=True)


def test_summarize_metrics_covers_metrics_reported_by_every_silo():
    per_silo = {
        "a": {"loss": 0.2, "accuracy": 0.9, "auroc": 0.95},
        "b": {"loss": 0.4, "accuracy": 0.7},
    }
    summaries = summarize_metrics(per_silo, {"a": 1, "b": 1}, {"loss": False, "accuracy": True})
    assert set(summaries) == {"loss", "accuracy"}
    assert all(isinstance(s, CrossSiloSummary) for s in summaries.values())
    assert (summaries["loss"].worst, summaries["accuracy"].worst) == (0.4, 0.7)


def test_summarize_metrics_guesses_direction_from_the_name_only_when_not_given():
    per_silo = {
        "a": {"val_error": 0.1, "f1": 0.3, "odd": 0.1},
        "b": {"val_error": 0.5, "f1": 0.6, "odd": 0.5},
    }
    summaries = summarize_metrics(per_silo, {"a": 1, "b": 1}, {"odd": False})
    assert summaries["val_error"].worst == 0.5
    assert summaries["f1"].worst == 0.3
    assert summaries["odd"].worst == 0.5
