"""A noised metric is never shown outside its range or unmarked (issue 37).

Under DP every metric a silo reports is a noised release, so on a small test split an accuracy
reads 1.2 or -0.3. Wherever a metric is shown (the `simulate` table and progress bar, the
coordinator's log line, its Prometheus gauges, `fedsilo status`) it is clipped into its range
and marked "(noised)"; results.json keeps the raw releases and says they are noised."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from rich.console import Console

from fedsilo.coordinator.engine import RoundRecord
from fedsilo.coordinator.state import StateStore
from fedsilo.coordinator.strategies.base import ServerState
from fedsilo.ops.cli import main
from fedsilo.ops.coordinator_process import _RoundLog
from fedsilo.ops.metrics import CoordinatorMetrics
from fedsilo.ops.shown_metrics import MetricDisplay, ShownRounds
from fedsilo.ops.status import deployment_status
from fedsilo.ops.status_view import print_status
from fedsilo.policies.loading import parse_policy
from fedsilo.wire.tensors import ParameterSpec
from tests.test_metrics import value

DP = {"dp_sgd": {"noise_multiplier": 1.0}, "reports": {"noise_multiplier": 50.0}}
RAW = {"Cleveland": {"accuracy": 1.31, "loss": -0.4}, "Hungary": {"accuracy": 0.52, "loss": 12.5}}
SIZES = {"Cleveland": 30, "Hungary": 29}
NOISED = MetricDisplay(noised=True, loss_bound=10.0)


def raw_round() -> RoundRecord:
    record = RoundRecord(1, "completed", 0.1, evaluation=RAW, test_sizes=SIZES)
    record.summary = {"accuracy": {"mean": 0.915, "worst": 0.52}}  # the engine's, from RAW
    return record


def test_a_noised_value_is_clipped_into_its_metrics_range_and_marked() -> None:
    shown = NOISED.record(raw_round())
    assert shown.evaluation == {
        "Cleveland": {"accuracy": 1.0, "loss": 0.0},
        "Hungary": {"accuracy": 0.52, "loss": 10.0},
    }
    assert shown.summary["accuracy"]["mean"] == pytest.approx(0.76)  # from the clipped values
    assert NOISED.label("accuracy") == "accuracy (noised)"
    exact = MetricDisplay.of(parse_policy({"version": 1}).privacy)
    assert exact.record(raw_round()) == raw_round() and exact.label("accuracy") == "accuracy"


def test_simulate_shows_noised_metrics_clipped_and_marked_and_keeps_them_raw_in_results(
    tmp_path: Path,
) -> None:
    policy = tmp_path / "dp.yaml"
    policy.write_text(yaml.safe_dump({"version": 1, "rounds": 2, "privacy": DP}))
    out = tmp_path / "out"
    result = CliRunner().invoke(main, ["simulate", "--policy", str(policy), "--out", str(out)])
    assert result.exit_code == 0, result.output
    assert "test accuracy (noised) per silo" in result.output
    assert "mean accuracy (noised)" in result.output  # the progress bar
    table = result.output[result.output.index("per silo") :]
    shown = [
        float(cell) for line in table.splitlines() for cell in line.split("│")[4:5] if cell.strip()
    ]
    assert shown and all(0.0 <= v <= 1.0 for v in shown), table
    results = json.loads((out / "results.json").read_text())
    assert results["metrics_noised"] is True
    raw = [m["accuracy"] for m in results["final"]["per_silo"].values()]
    assert any(not 0.0 <= v <= 1.0 for v in raw)  # 50 x 1/n noise: the raw releases, kept


def test_the_coordinators_log_line_shows_the_mean_as_shown_and_marked(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.INFO, logger="fedsilo.coordinator"):
        ShownRounds(_RoundLog(NOISED), NOISED).on_round(raw_round(), 3)
    assert "mean accuracy (noised) 0.7600" in caplog.text


def test_prometheus_gauges_hold_the_clipped_values_and_say_they_are_noised() -> None:
    metrics = CoordinatorMetrics()
    metrics.deployment = "job"
    metrics.set_privacy(None, noised=True)
    ShownRounds(metrics, NOISED).on_round(raw_round(), 3)
    registry = metrics.registry
    silo_metric = "fedsilo_silo_metric"
    assert value(registry, silo_metric, silo="Cleveland", name="accuracy", deployment="job") == 1.0
    assert value(registry, silo_metric, silo="Hungary", name="loss", deployment="job") == 10.0
    assert value(registry, "fedsilo_metrics_noised", deployment="job") == 1
    families = {f.name: f.documentation for f in registry.collect()}
    assert "(noised)" in families["fedsilo_silo_metric"]
    assert "(noised)" in families["fedsilo_summary_metric"]


def test_fedsilo_status_shows_the_last_metrics_clipped_and_marked(tmp_path: Path) -> None:
    policy = parse_policy({"version": 1, "name": "heart-dp", "privacy": DP})
    state = ServerState({}, ParameterSpec(()), {})
    with StateStore(tmp_path / "state.db") as store:
        store.open_deployment("heart", "digest", policy.model_dump_json())
        store.save_round("heart", 0, "setup", state, {"round": 0})
        store.save_round("heart", 1, "completed", state, raw_round().to_json())
    report = deployment_status(tmp_path / "state.db", "heart")
    assert report.last_evaluation["Cleveland"] == {"accuracy": 1.0, "loss": 0.0}
    console = Console(width=200, record=True)
    print_status(console, report, SIZES)
    text = console.export_text()
    assert "accuracy (noised)" in text and "1.310" not in text and "1.000" in text
