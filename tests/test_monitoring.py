"""Monitoring an operator can run: which silo is down (`fedsilo_silo_up`, its heartbeat age),
the jobs of `coordinator serve` by status and how they ended (`fedsilo_jobs`,
`fedsilo_jobs_ended_total`, a bounded reason), the job each round and result series belongs to
(`deployment`), the process metrics of both services, and the dashboard panels that show them.
Scraped over real HTTP from `serve_metrics`, and once from a real `coordinator serve` whose silo
is killed."""

from __future__ import annotations

import json
import re
import sqlite3
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fedsilo.coordinator.engine import RoundRecord, RunAborted
from fedsilo.coordinator.hub import SiloHub
from fedsilo.coordinator.jobs import JobQueue, QueuedPolicy
from fedsilo.coordinator.state import StateError
from fedsilo.ops.coordinator_process import DeploymentError, JobRefused
from fedsilo.ops.coordinator_serve import ServeBackend
from fedsilo.ops.demo import free_port
from fedsilo.ops.job_outcomes import failure_reason
from fedsilo.ops.metrics import JOB_END_REASONS, CoordinatorMetrics, SiloMetrics, serve_metrics
from tests.deployment import SILOS, Consortium, metric, policy_document, sample, scrape, wait_for

DEPLOY = Path(__file__).resolve().parents[1] / "ops" / "deploy"
WINDOW_S = 10.0


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def scraped(metrics: CoordinatorMetrics | SiloMetrics) -> str:
    with serve_metrics(metrics.registry, 0) as server:
        return scrape(server.port)


# -- each silo's up and heartbeat age, read from the hub at each scrape -------------------------


def test_each_roster_silo_is_up_or_down_with_its_heartbeat_age_at_each_scrape() -> None:
    clock = FakeClock()
    hub = SiloHub(["a", "b", "c", "d"], clock=clock, heartbeat_window_s=WINDOW_S)
    metrics = CoordinatorMetrics()
    metrics.watch_silos(hub.heard_ages, WINDOW_S, lambda: frozenset(hub.revoked))
    hub.seen("a")
    hub.seen("b")
    hub.seen("d")
    hub.revoke("d")
    clock.now += 4.0
    hub.seen("a")

    with serve_metrics(metrics.registry, 0) as server:
        first = scrape(server.port)
        clock.now += 7.0  # b: 11 s silent, past the window; a: 7 s
        second = scrape(server.port)

    up, age = "fedsilo_silo_up", "fedsilo_silo_heartbeat_age_seconds"
    assert sample(first, up, silo="a") == 1 and sample(first, up, silo="b") == 1
    assert sample(first, age, silo="a") == 0.0 and sample(first, age, silo="b") == 4.0
    assert sample(first, up, silo="c") == 0  # never heard: down, no age
    assert sample(first, age, silo="c") is None
    assert sample(first, up, silo="d") is None  # revoked: fedsilo_silo_status says so
    # the same registry, scraped later: computed then, never a stale value
    assert sample(second, up, silo="a") == 1 and sample(second, age, silo="a") == 7.0
    assert sample(second, up, silo="b") == 0 and sample(second, age, silo="b") == 11.0


def test_the_silo_families_are_exported_before_a_hub_is_watched() -> None:
    names = {f.name for f in CoordinatorMetrics().registry.collect()}
    assert {"fedsilo_silo_up", "fedsilo_silo_heartbeat_age_seconds", "fedsilo_jobs"} <= names


# -- jobs: by status on the queue, and how each ended --------------------------------------------


def queued(queue: JobQueue, job: str) -> None:
    queue.submit(job, job, QueuedPolicy(job, f"name: {job}", "sig", f"digest-{job}"), "op")


def test_the_queues_jobs_by_status_are_read_at_each_scrape(tmp_path: Path) -> None:
    queue = JobQueue(tmp_path / "state.db")
    metrics = CoordinatorMetrics()
    metrics.watch_jobs(queue.count_by_status)
    for job in ("j1", "j2", "j3"):
        queued(queue, job)
    queue.mark_running("j1")
    with serve_metrics(metrics.registry, 0) as server:
        first = scrape(server.port)
        queue.mark_ended("j1", "failed", "boom")
        queue.mark_running("j2")
        second = scrape(server.port)
        queue.close()  # a coordinator stopping: the scrape still answers, without jobs
        third = scrape(server.port)

    def jobs(text: str) -> dict[str, float | None]:
        statuses = ("queued", "running", "completed", "failed", "refused", "aborted")
        return {s: sample(text, "fedsilo_jobs", status=s) for s in statuses}

    assert jobs(first) == {
        "queued": 2,
        "running": 1,
        "completed": 0,
        "failed": 0,
        "refused": 0,
        "aborted": 0,
    }
    assert jobs(second) == {**jobs(first), "queued": 1, "running": 1, "failed": 1}
    assert set(jobs(third).values()) == {None}
    assert sample(third, "fedsilo_silos_connected") == 0


def test_ended_jobs_are_counted_by_status_and_a_bounded_reason() -> None:
    metrics = CoordinatorMetrics()
    metrics.count_job_ended("failed", "consortium")
    metrics.count_job_ended("completed", "none")
    with pytest.raises(ValueError, match="reason of a failed job 'min_silos is 3'"):
        metrics.count_job_ended("failed", "min_silos is 3")
    with pytest.raises(ValueError, match="job status 'queued'"):
        metrics.count_job_ended("queued", "none")
    text = scraped(metrics)
    ended = "fedsilo_jobs_ended_total"
    assert sample(text, ended, status="failed", reason="consortium") == 1
    assert sample(text, ended, status="completed", reason="none") == 1
    # every allowed pair is exported from the start (0), and nothing else ever is
    pairs = {(s, r) for s, reasons in JOB_END_REASONS.items() for r in reasons}
    exported = {
        (s.labels["status"], s.labels["reason"])
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == ended
    }
    assert exported == pairs
    assert len(pairs) <= 8


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (DeploymentError("2 of 3 silos accepted the policy within 6s"), "consortium"),
        (RunAborted("3 rounds in a row missed their quorum"), "rounds"),
        (ValueError("rounds: must be at least 1"), "policy"),
        (StateError("the state file is of another consortium"), "storage"),
        (OSError(28, "No space left on device"), "storage"),
        (sqlite3.OperationalError("database is locked"), "storage"),
        (KeyError("a bug"), "internal"),
        (JobRefused(1, 3, 2, {"silo-1": "no"}), "internal"),  # refused is a status of its own
    ],
)
def test_a_failed_jobs_error_falls_in_one_bucket(error: BaseException, reason: str) -> None:
    assert failure_reason(error) == reason
    assert reason in JOB_END_REASONS["failed"]


def test_aborting_a_queued_job_counts_it_as_aborted_by_the_operator(tmp_path: Path) -> None:
    queue = JobQueue(tmp_path / "state.db")
    metrics = CoordinatorMetrics()
    backend = ServeBackend(SimpleNamespace(metrics=metrics), queue, tmp_path / "jobs", tmp_path)
    queued(queue, "waiting")
    queued(queue, "started")
    queue.mark_running("started")
    backend.abort("waiting")
    backend.abort("started")  # counted once its runner stops it, not now
    queue.close()
    assert (
        metrics.registry.get_sample_value(
            "fedsilo_jobs_ended_total", {"status": "aborted", "reason": "operator"}
        )
        == 1
    )


# -- the job a round and result series belongs to ------------------------------------------------


def test_round_and_result_series_carry_their_job_and_a_new_job_replaces_the_gauges() -> None:
    metrics = CoordinatorMetrics(deployment="job-1")
    record = RoundRecord(
        2,
        "completed",
        0.5,
        phases={"train": {"answered": {}, "dropped": {"b": "offline"}}},
        evaluation={"a": {"accuracy": 0.8}},
        summary={"accuracy": {"mean": 0.8}},
        mixing={"a": 1.0},
    )
    metrics.on_round(record, 5)
    first = scraped(metrics)
    metrics.deployment = "job-2"
    second = scraped(metrics)

    job1, job2 = {"deployment": "job-1"}, {"deployment": "job-2"}
    assert sample(first, "fedsilo_round", **job1) == 2
    assert sample(first, "fedsilo_rounds_planned", **job1) == 5
    assert sample(first, "fedsilo_rounds_total", status="completed", **job1) == 1
    assert sample(first, "fedsilo_dropouts_total", silo="b", **job1) == 1
    assert sample(first, "fedsilo_silo_metric", silo="a", name="accuracy", **job1) == 0.8
    assert sample(first, "fedsilo_summary_metric", name="accuracy", statistic="mean", **job1)
    assert sample(first, "fedsilo_mixing_weight", silo="a", **job1) == 1.0
    # the next job: its round from 0, the last job's gauges gone, its counters kept
    assert sample(second, "fedsilo_round", **job2) == 0
    assert sample(second, "fedsilo_round", **job1) is None
    assert sample(second, "fedsilo_silo_metric", silo="a", name="accuracy", **job1) is None
    assert sample(second, "fedsilo_mixing_weight", silo="a", **job1) is None
    assert sample(second, "fedsilo_rounds_total", status="completed", **job1) == 1
    assert sample(second, "fedsilo_rounds_total", status="completed", **job2) == 0
    assert sample(second, "fedsilo_dropouts_total", silo="b", **job1) == 1


# -- process metrics -----------------------------------------------------------------------------


@pytest.mark.parametrize("service", [CoordinatorMetrics, SiloMetrics])
def test_both_services_export_their_process_metrics(service: type) -> None:
    text = scraped(service())
    assert sample(text, "process_resident_memory_bytes") > 0
    assert sample(text, "process_cpu_seconds_total") >= 0
    assert sample(text, "process_start_time_seconds") > 0
    assert any(
        s.name == "python_info"
        for family in text_string_to_metric_families(text)
        for s in family.samples
    )


# -- the dashboard -------------------------------------------------------------------------------


def panels() -> dict[str, list[str]]:
    board = json.loads((DEPLOY / "grafana-dashboard.json").read_text())
    return {p["title"]: [t["expr"] for t in p["targets"]] for p in board["panels"]}


@pytest.mark.parametrize(
    "metric_name",
    [
        "fedsilo_certificate_expiry_days",
        "fedsilo_silo_up",
        "fedsilo_silo_heartbeat_age_seconds",
        "fedsilo_jobs",
        "fedsilo_jobs_ended_total",
    ],
)
def test_the_dashboard_has_a_panel_for(metric_name: str) -> None:
    shown = [
        title
        for title, exprs in panels().items()
        if any(re.search(rf"\b{metric_name}\b", e) for e in exprs)
    ]
    assert shown, f"no panel queries {metric_name}"


# -- a real `coordinator serve` ------------------------------------------------------------------


def test_a_killed_silo_shows_down_with_a_growing_heartbeat_age_and_a_failed_job_is_counted(
    consortium: Consortium,
) -> None:
    port = free_port()
    consortium.start_serve(
        *("--heartbeat-window", "2", "--join-timeout", "6", "--metrics-port", str(port))
    )
    consortium.wait_for_log("coordinator", "serving mTLS gRPC")
    for silo in ("silo-0", "silo-1", "silo-2"):
        consortium.start_silo(silo)

    def all_up() -> bool:
        text = scrape(port)
        return all(sample(text, "fedsilo_silo_up", silo=s) == 1 for s in SILOS)

    wait_for(all_up, 60, "3 silos up", consortium)
    assert metric(port, "process_resident_memory_bytes") > 0
    consortium.kill("silo-2")
    wait_for(
        lambda: sample(scrape(port), "fedsilo_silo_up", silo="silo-2") == 0,
        10,
        "silo-2 down",
        consortium,
    )
    age = "fedsilo_silo_heartbeat_age_seconds"
    before = metric(port, age, silo="silo-2")
    time.sleep(1.5)
    after = scrape(port)
    assert sample(after, age, silo="silo-2") >= before + 1.0 > 3.0
    assert sample(after, "fedsilo_silo_up", silo="silo-0") == 1
    assert sample(after, age, silo="silo-0") < 2

    everyone = {"min_silos": 3, "phase_timeout_s": 600}
    job = consortium.submit(consortium.write_policy(policy_document(participants=everyone)))
    consortium.wait_for_log("coordinator", f"job {job} failed", timeout=60)
    ended = {"status": "failed", "reason": "consortium"}
    wait_for(
        lambda: metric(port, "fedsilo_jobs_ended_total", **ended) == 1,
        10,
        "the failed job counted",
        consortium,
    )
    text = scrape(port)
    assert sample(text, "fedsilo_jobs", status="failed") == 1
    assert sample(text, "fedsilo_jobs", status="queued") == 0
    assert sample(text, "fedsilo_round", deployment=job) == 0
