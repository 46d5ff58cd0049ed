"""Experiment tracking (`--track`, ops/tracking.py) as its users read it back: a simulation tracked
to MLflow and TensorBoard at once, read with MLflow's client and TensorBoard's event reader; a
served deployment whose job is a run of its own, and a resumed job going on in it; a bad `--track`
value or a missing package as one message; a tracker that breaks mid-run, which the job
outlives."""

from __future__ import annotations

import json
import logging
import sqlite3
import sys
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from mlflow import MlflowClient
from mlflow.entities import Run
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from fedsilo.coordinator.engine import RoundRecord
from fedsilo.coordinator.jobs import ABORTED
from fedsilo.coordinator.state import digest_policy
from fedsilo.ops.cli import main
from fedsilo.ops.job_id import job_id
from fedsilo.ops.simulate import simulate
from fedsilo.ops.tracking import INSTALL, TrackTarget, deployment_tracking, simulation_tracking
from fedsilo.policies.loading import parse_policy
from tests.deployment import Consortium, policy_document, wait_until_ended

ROUNDS = 3
SUMMARY = "accuracy/weighted_mean"
DP_POLICY = policy_document(
    rounds=ROUNDS,
    name="tracked-dp",
    privacy={"delta": 1e-5, "dp_sgd": {"noise_multiplier": 1.0}},
)


def store(folder: Path) -> str:
    return f"sqlite:///{folder / 'mlflow.db'}"


def run_of(client: MlflowClient, experiment: str, job: str) -> Run:
    """The one run named `job` in `experiment`."""
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no experiment {experiment!r}"
    (run,) = client.search_runs([found.experiment_id], f"attributes.run_name = '{job}'")
    return run


def steps(client: MlflowClient, run_id: str, metric: str) -> list[int]:
    return [m.step for m in client.get_metric_history(run_id, metric)]


def scalars(folder: Path) -> EventAccumulator:
    events = EventAccumulator(str(folder), size_guidance={"images": 0, "scalars": 0})
    events.Reload()
    return events


@pytest.fixture(scope="module")
def tracked_simulation(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """`fedsilo simulate` of a DP policy and FedProx beside it, tracked to MLflow and TensorBoard
    at once, through the real command line."""
    folder = tmp_path_factory.mktemp("tracked")
    (folder / "policy.yaml").write_text(yaml.safe_dump(DP_POLICY, sort_keys=False))
    result = CliRunner().invoke(
        main,
        [
            "simulate",
            "--policy",
            str(folder / "policy.yaml"),
            "--compare",
            "fedprox",
            "--out",
            str(folder / "results"),
            "--track",
            f"mlflow:{store(folder)}",
            "--track",
            f"tensorboard:{folder / 'tb'}",
        ],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    return folder


def simulated_job(algorithm: str) -> str:
    """The job id (the run's name) of the simulation of DP_POLICY with `algorithm`."""
    policy = parse_policy(DP_POLICY)
    if algorithm != policy.algorithm.name:
        policy = policy.with_algorithm(algorithm)
    return job_id(policy.name, digest_policy(policy))


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox"])
def test_each_simulated_algorithm_is_one_mlflow_run_with_the_flattened_policy_and_its_rounds(
    tracked_simulation: Path, algorithm: str
) -> None:
    client = MlflowClient(store(tracked_simulation))
    run = run_of(client, "tracked-dp", simulated_job(algorithm))
    params = run.data.params
    assert run.info.status == "FINISHED"
    assert params["algorithm.name"] == algorithm
    assert params["training.lr"] == "0.05"
    assert params["rounds"] == str(ROUNDS)
    assert params["fedsilo.job"] == simulated_job(algorithm)
    assert params["fedsilo.policy_digest"].startswith(simulated_job(algorithm).rsplit("-")[-1])
    assert steps(client, run.info.run_id, "round/completed") == [1, 2, 3]
    assert steps(client, run.info.run_id, f"noised/{SUMMARY}") == [1, 2, 3]


def test_under_dp_every_tracked_summary_is_marked_noised_and_shown_clipped(
    tracked_simulation: Path,
) -> None:
    client = MlflowClient(store(tracked_simulation))
    run = run_of(client, "tracked-dp", simulated_job("fedavg"))
    assert run.data.tags["fedsilo.metrics_noised"] == "true"
    summaries = [m for m in run.data.metrics if m.split("/")[0] in ("accuracy", "loss")]
    assert summaries == [], "a noised summary tracked without its mark"
    results = json.loads((tracked_simulation / "results" / "fedavg" / "results.json").read_text())
    raw = {r["round"]: r["summary"]["accuracy"]["worst"] for r in results["history"]}
    tracked = client.get_metric_history(run.info.run_id, "noised/accuracy/worst")
    assert {m.step: m.value for m in tracked} == {k: min(max(v, 0.0), 1.0) for k, v in raw.items()}


def test_each_silos_epsilon_is_tracked_per_round_as_its_record_reports_it(
    tracked_simulation: Path,
) -> None:
    client = MlflowClient(store(tracked_simulation))
    run = run_of(client, "tracked-dp", simulated_job("fedavg"))
    results = json.loads((tracked_simulation / "results" / "fedavg" / "results.json").read_text())
    for silo, points in results["privacy"]["epsilon_per_round"].items():
        history = client.get_metric_history(run.info.run_id, f"epsilon/{silo}")
        assert [[m.step, m.value] for m in history] == points


def test_the_results_are_logged_as_artifacts_but_the_silos_ledgers(
    tracked_simulation: Path,
) -> None:
    client = MlflowClient(store(tracked_simulation))
    run = run_of(client, "tracked-dp", simulated_job("fedavg"))
    logged = {artifact.path for artifact in client.list_artifacts(run.info.run_id)}
    written = {p.name for p in (tracked_simulation / "results" / "fedavg").iterdir()}
    assert {"final_model.safetensors", "metric_per_round.png", "epsilon_per_round.png"} <= logged
    assert logged == written - {"ledgers", ".fedsilo-results.json"}
    artifacts = Path(run.info.artifact_uri.removeprefix("file://"))
    assert artifacts.is_relative_to(tracked_simulation.resolve()), "artifacts beside the database"


@pytest.mark.parametrize("algorithm", ["fedavg", "fedprox"])
def test_each_simulated_algorithm_is_one_tensorboard_run_with_a_scalar_per_round(
    tracked_simulation: Path, algorithm: str
) -> None:
    events = scalars(tracked_simulation / "tb" / simulated_job(algorithm))
    assert [e.step for e in events.Scalars(f"noised/{SUMMARY}")] == [1, 2, 3]
    assert [e.value for e in events.Scalars("round/completed")] == [1.0, 1.0, 1.0]
    assert any(tag.startswith("epsilon/") for tag in events.Tags()["scalars"])
    assert "plots/metric_per_round" in events.Tags()["images"]
    kept = tracked_simulation / "tb" / simulated_job(algorithm) / "artifacts"
    assert (kept / "final_model.safetensors").is_file()


COMMANDS = {
    "simulate": ["simulate"],
    "coordinator start": ["coordinator", "start", "--kit", "kit", "--state", "s.db"],
    "coordinator serve": ["coordinator", "serve", "--kit", "kit", "--state", "s.db"],
}


@pytest.mark.parametrize("value", ["foo", "tensorboard", "tensorboard:", "mlflow:", "wandb:x"])
@pytest.mark.parametrize("command", sorted(COMMANDS))
def test_a_bad_track_value_is_one_message_naming_the_option_and_exit_status_1(
    value: str, command: str
) -> None:
    result = CliRunner().invoke(main, [*COMMANDS[command], "--track", value])
    assert result.exit_code == 1
    assert result.output.strip().splitlines() == [
        f"Error: --track {value}: give mlflow, mlflow:URI (e.g. mlflow:sqlite:///mlflow.db) or "
        "tensorboard:DIR"
    ]


@pytest.mark.parametrize(
    ("value", "module", "package"),
    [
        ("mlflow", "mlflow", "mlflow-skinny"),
        ("mlflow:sqlite:///mlflow.db", "sqlalchemy", "sqlalchemy"),
        ("tensorboard:tb", "tensorboard", "tensorboard"),
    ],
)
def test_a_missing_package_is_one_message_saying_how_to_install_it(
    value: str, module: str, package: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, module, None)  # what Python does for one not installed
    result = CliRunner().invoke(main, ["simulate", "--track", value])
    assert result.exit_code == 1
    kind = value.partition(":")[0]
    assert result.output.strip() == f"Error: --track {kind} needs the {package} package: {INSTALL}"


class BreakStore:
    """What happens to a tracking store mid-run (its database's tables dropped by someone
    else): after round 1, MLflow's metrics tables are gone."""

    def __init__(self, database: Path) -> None:
        self.database = database

    def on_round(self, record: RoundRecord, total_rounds: int) -> None:
        if record.round == 1:
            with sqlite3.connect(self.database) as db:
                db.executescript("DROP TABLE latest_metrics; DROP TABLE metrics;")


def test_a_tracker_failing_mid_run_logs_one_warning_and_the_job_and_other_trackers_go_on(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    policy = parse_policy(policy_document(rounds=ROUNDS))
    mlflow = TrackTarget("mlflow", store(tmp_path))
    tensorboard = TrackTarget("tensorboard", str(tmp_path / "tb"))
    with (
        caplog.at_level(logging.WARNING, logger="fedsilo.tracking"),
        simulation_tracking([mlflow, tensorboard], policy) as tracking,
    ):
        result = simulate(policy, observers=[BreakStore(tmp_path / "mlflow.db"), tracking])
        tracking.finish(result.history, None)
    assert [r.status for r in result.history.records] == ["completed"] * ROUNDS
    warnings = [r.getMessage() for r in caplog.records if r.name == "fedsilo.tracking"]
    assert len(warnings) == 1
    assert warnings[0].startswith(f"tracking to {mlflow} stopped (logging round 1 failed: ")
    events = scalars(tmp_path / "tb" / job_id(policy.name, digest_policy(policy)))
    assert [e.step for e in events.Scalars(SUMMARY)] == [1, 2, 3]


def test_a_deployed_job_resumed_after_a_stop_goes_on_in_its_run_and_folder(tmp_path: Path) -> None:
    policy = parse_policy(policy_document(rounds=2))
    targets = [TrackTarget("mlflow", store(tmp_path)), TrackTarget("tensorboard", str(tmp_path))]
    for round_no in (1, 2):  # the coordinator stopped after round 1, then restarted
        with deployment_tracking(targets, "consortium", "job-1", policy, "digest") as tracking:
            tracking.on_round(RoundRecord(round_no, "completed", 0.1), policy.rounds)
            if round_no == 1:
                tracking.end(ABORTED)
    client = MlflowClient(store(tmp_path))
    run = run_of(client, "consortium", "job-1")
    assert run.info.status == "FINISHED"
    assert steps(client, run.info.run_id, "round/completed") == [1, 2]
    assert [e.step for e in scalars(tmp_path / "job-1").Scalars("round/completed")] == [1, 2]


def test_a_served_deployment_tracks_its_job_as_a_run_named_by_the_job_id(
    consortium: Consortium,
) -> None:
    root = consortium.root
    consortium.start_serve("--track", f"mlflow:{store(root)}", "--track", "tensorboard:tb")
    consortium.wait_for_log("coordinator", "serving mTLS gRPC")
    for silo in ("silo-0", "silo-1", "silo-2"):
        consortium.start_silo(silo)
    job = consortium.submit(consortium.write_policy(policy_document(rounds=2)))
    assert wait_until_ended(consortium, job, timeout=120).status == "completed"

    client = MlflowClient(store(root))
    run = run_of(client, "test-consortium", job)
    assert run.info.status == "FINISHED"
    assert run.data.params["fedsilo.job"] == job
    assert run.data.tags["fedsilo.metrics_noised"] == "false"
    assert steps(client, run.info.run_id, SUMMARY) == [1, 2]
    logged = {artifact.path for artifact in client.list_artifacts(run.info.run_id)}
    assert {"final_model.safetensors", "history.json", "metric_per_round.png"} <= logged
    assert [e.step for e in scalars(root / "tb" / job).Scalars(SUMMARY)] == [1, 2]
