"""Regression as a user meets it: each silo reports R² (scikit-learn's `r2_score`) beside MSE,
RMSE and MAE; the cross-silo summary pools it (1 - sum SSE / sum SST, not a mean of the silos'
R²); and the shipped regression example simulates, naming its task and the pooled R²."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from click.testing import CliRunner
from sklearn.metrics import r2_score

from fedsilo.coordinator.summary import pooled_r2, summarize_metrics
from fedsilo.ops.cli import main
from fedsilo.silo.evaluation import HIGHER_IS_BETTER, regression_metrics, task_metrics

EXAMPLE = Path(__file__).resolve().parents[1] / "policies" / "examples"
POLICY = EXAMPLE / "blood-pressure-regression.yaml"


def test_regression_reports_r2_as_scikit_learn_computes_it() -> None:
    y = torch.tensor([3.0, -0.5, 2.0, 7.0])
    pred = torch.tensor([2.5, 0.0, 2.0, 8.0])
    metrics = regression_metrics(pred, y)
    assert metrics["r2"] == pytest.approx(r2_score(y.numpy(), pred.numpy()))
    sse, sst = float(((y - pred) ** 2).sum()), float(((y - y.mean()) ** 2).sum())
    assert metrics["r2"] == pytest.approx(1 - sse / sst)
    assert "r2" in task_metrics("regression") and HIGHER_IS_BETTER["r2"] is True


def test_r2_of_constant_targets_is_undefined() -> None:
    assert np.isnan(regression_metrics(torch.tensor([1.0, 2.0]), torch.tensor([4.0, 4.0]))["r2"])


def test_the_summary_pools_r2_over_every_silos_sums_of_squares() -> None:
    rng = np.random.default_rng(0)
    ys = {"a": rng.normal(0, 1, 50), "b": rng.normal(0, 5, 200)}
    preds = {"a": ys["a"] + rng.normal(0, 0.9, 50), "b": ys["b"] + rng.normal(0, 1, 200)}
    per_silo = {
        s: regression_metrics(torch.from_numpy(preds[s]), torch.from_numpy(ys[s])) for s in ys
    }
    sizes = {s: len(ys[s]) for s in ys}
    sse = sum(float(((ys[s] - preds[s]) ** 2).sum()) for s in ys)
    sst = sum(float(((ys[s] - ys[s].mean()) ** 2).sum()) for s in ys)
    expected = 1 - sse / sst
    summary = summarize_metrics(per_silo, sizes, HIGHER_IS_BETTER)["r2"]
    assert summary.weighted_mean == pytest.approx(expected, rel=1e-9)
    assert pooled_r2(per_silo, sizes) == pytest.approx(expected, rel=1e-9)
    size_weighted = sum(per_silo[s]["r2"] * sizes[s] for s in ys) / sum(sizes.values())
    assert abs(summary.weighted_mean - size_weighted) > 0.01  # pooled, not a mean of R²s
    assert summary.mean == pytest.approx((per_silo["a"]["r2"] + per_silo["b"]["r2"]) / 2)


def test_the_regression_example_simulates_and_reports_r2(tmp_path: Path) -> None:
    out = tmp_path / "run"
    result = CliRunner().invoke(main, ["simulate", "--policy", str(POLICY), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "regression task" in result.output and "pooled R²" in result.output
    results = json.loads((out / "results.json").read_text())
    assert results["task"] == "regression"
    for metrics in results["final"]["per_silo"].values():
        assert 0.0 < metrics["r2"] < 1.0
    pooled = results["final"]["summary"]["r2"]["weighted_mean"]
    assert 0.3 < pooled < 1.0


def test_the_blood_pressure_table_is_written_again_byte_for_byte(tmp_path: Path) -> None:
    """The shipped synthetic table is what its generator writes from its seed."""
    root = Path(__file__).resolve().parents[1]
    script = root / "examples" / "datasets" / "make_blood_pressure.py"
    spec = importlib.util.spec_from_file_location("make_blood_pressure", script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.main(tmp_path / "again.csv")
    shipped = root / "silo" / "datasets" / "blood_pressure" / "blood_pressure.csv"
    assert (tmp_path / "again.csv").read_bytes() == shipped.read_bytes()
