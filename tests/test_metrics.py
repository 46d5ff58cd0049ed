"""Prometheus metrics: what the coordinator and silo agents export, served over real HTTP on
loopback, and the deployment files (scrape config, Grafana dashboard) that read them."""

from __future__ import annotations

import json
import math
import re
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from fedsilo.coordinator.engine import RoundEngine, RoundRecord
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.metrics import CoordinatorMetrics, SiloMetrics, serve_metrics
from fedsilo.privacy.accounting import Mechanism
from fedsilo.privacy.accounting import total as privacy_total
from fedsilo.privacy.ledger import PrivacyLedger, payload_digest
from fedsilo.wire.messages import STATUS_ERROR, TaskMessage, TaskResult
from tests.fakes import constant_silo
from tests.test_engine import make_policy

DEPLOY = Path(__file__).resolve().parents[1] / "ops" / "deploy"
NAN = float("nan")
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def scrape(url: str) -> tuple[str, Samples]:
    """The raw exposition text at `url` and its samples keyed by (name, labels)."""
    with urllib.request.urlopen(url, timeout=5) as response:
        text = response.read().decode()
    samples = {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    return text, samples


def sample(samples: Samples, metric: str, /, **labels: str) -> float | None:
    return samples.get((metric, frozenset(labels.items())))


def value(registry: CollectorRegistry, metric: str, /, **labels: str) -> float | None:
    return registry.get_sample_value(metric, labels)


def three_rounds() -> list[RoundRecord]:
    """Round 1 fine, round 2 missed its quorum, round 3 lost silo b in training and evaluation."""
    return [
        RoundRecord(
            1,
            "completed",
            0.4,
            phases={
                "train": {
                    "answered": {s: {"num_samples": 100, "loss": 0.9} for s in "abc"},
                    "dropped": {},
                }
            },
            compute_seconds={"train": {"a": 0.3, "b": 0.2, "c": 0.25}},
        ),
        RoundRecord(2, "failed", 5.0, error="phase 'train': 0 of 3 silos answered, quorum is 2"),
        RoundRecord(
            3,
            "completed",
            1.7,
            phases={
                "train": {
                    "answered": {s: {"num_samples": 100, "loss": 0.6} for s in "ac"},
                    "dropped": {"b": "no reply before the deadline"},
                },
                "evaluate": {
                    "answered": {s: {"num_samples": 40, "accuracy": 0.7} for s in "ac"},
                    "dropped": {"b": "task failed at the silo (error): disk full"},
                },
            },
            compute_seconds={"train": {"a": 0.8, "c": 1.2}, "evaluate": {"a": 0.05, "c": 0.04}},
            evaluation={
                "a": {"accuracy": 0.75, "loss": 0.52, "auroc": NAN},
                "c": {"accuracy": 0.55, "loss": 0.71, "auroc": 0.6},
            },
            test_sizes={"a": 40, "c": 40},
            summary={
                "accuracy": {"mean": 0.65, "worst": 0.55, "gini": 0.077, "excluded": 0},
                "auroc": {"mean": 0.6, "worst": 0.6, "gini": NAN, "excluded": 1},
            },
        ),
    ]


@pytest.fixture
def coordinator() -> CoordinatorMetrics:
    metrics = CoordinatorMetrics()
    for record in three_rounds():
        metrics.on_round(record, 10)
    return metrics


# -- the coordinator, scraped over HTTP ---------------------------------------------------------


def test_a_scrape_over_http_shows_the_rounds_the_engine_observer_was_fed(
    coordinator: CoordinatorMetrics,
) -> None:
    with serve_metrics(coordinator.registry, 0) as server:
        text, samples = scrape(f"http://127.0.0.1:{server.port}/metrics")

    assert 'fedsilo_round{deployment=""} 3.0' in text.splitlines()
    assert sample(samples, "fedsilo_rounds_planned", deployment="") == 10
    assert sample(samples, "fedsilo_rounds_total", status="completed", deployment="") == 2
    assert sample(samples, "fedsilo_rounds_total", status="failed", deployment="") == 1
    assert sample(samples, "fedsilo_round_duration_seconds_count") == 3
    assert sample(samples, "fedsilo_round_duration_seconds_sum") == pytest.approx(7.1)
    assert sample(samples, "fedsilo_round_duration_seconds_bucket", le="1.0") == 1
    assert sample(samples, "fedsilo_dropouts_total", silo="b", deployment="") == 1
    assert sample(samples, "fedsilo_dropouts_total", silo="a", deployment="") is None
    assert sample(samples, "fedsilo_silo_metric", silo="a", name="accuracy", deployment="") == 0.75
    assert sample(samples, "fedsilo_silo_metric", silo="c", name="loss", deployment="") == 0.71
    assert (
        sample(samples, "fedsilo_summary_metric", name="accuracy", statistic="mean", deployment="")
        == 0.65
    )
    assert (
        sample(samples, "fedsilo_summary_metric", name="accuracy", statistic="worst", deployment="")
        == 0.55
    )
    assert sample(samples, "fedsilo_local_train_seconds_count", silo="a") == 2
    assert sample(samples, "fedsilo_local_train_seconds_count", silo="b") == 1
    assert sample(samples, "fedsilo_local_train_seconds_sum", silo="c") == pytest.approx(1.45)


def test_nan_results_are_left_out_rather_than_exported(coordinator: CoordinatorMetrics) -> None:
    registry = coordinator.registry
    assert value(registry, "fedsilo_silo_metric", silo="a", name="auroc", deployment="") is None
    assert value(registry, "fedsilo_silo_metric", silo="c", name="auroc", deployment="") == 0.6
    assert (
        value(registry, "fedsilo_summary_metric", name="auroc", statistic="gini", deployment="")
        is None
    )
    assert (
        value(registry, "fedsilo_summary_metric", name="auroc", statistic="excluded", deployment="")
        == 1
    )


def test_a_failed_round_is_counted_but_leaves_the_last_completed_round_in_place() -> None:
    metrics = CoordinatorMetrics()
    first, failed, _ = three_rounds()
    metrics.on_round(first, 10)
    metrics.on_round(failed, 10)
    assert value(metrics.registry, "fedsilo_round", deployment="") == 1
    assert value(metrics.registry, "fedsilo_rounds_total", status="failed", deployment="") == 1
    assert value(metrics.registry, "fedsilo_round_duration_seconds_count") == 2


def test_a_silo_dropped_from_several_phases_is_one_dropout_of_that_round(
    coordinator: CoordinatorMetrics,
) -> None:
    assert value(coordinator.registry, "fedsilo_dropouts_total", silo="b", deployment="") == 1


def test_only_training_phases_feed_the_local_train_histogram(
    coordinator: CoordinatorMetrics,
) -> None:
    # a trained in rounds 1 and 3 and was evaluated in round 3: two observations, not three
    assert value(coordinator.registry, "fedsilo_local_train_seconds_count", silo="a") == 2
    assert value(
        coordinator.registry, "fedsilo_local_train_seconds_sum", silo="a"
    ) == pytest.approx(1.1)


def test_the_metrics_follow_a_real_engine_run_as_its_observer() -> None:
    def failing_silo(payload: bytes) -> bytes:
        task = TaskMessage.decode(payload)
        if task.kind != "train":
            return constant_silo("b", [0.0, 0.0, 0.0])(payload)
        return TaskResult(
            task.task_id, "b", task.kind, STATUS_ERROR, error="out of memory"
        ).encode()

    endpoints = {"a": constant_silo("a", [1.0, 2.0, 3.0]), "b": failing_silo}
    policy = make_policy(rounds=2)
    metrics = CoordinatorMetrics()
    engine = RoundEngine(
        make_strategy(policy), InProcessTransport(endpoints), policy, sorted(endpoints), [metrics]
    )
    engine.run()

    registry = metrics.registry
    assert value(registry, "fedsilo_round", deployment="") == 2
    assert value(registry, "fedsilo_rounds_total", status="completed", deployment="") == 2
    assert value(registry, "fedsilo_dropouts_total", silo="b", deployment="") == 2
    assert value(registry, "fedsilo_local_train_seconds_count", silo="a") == 2
    assert value(registry, "fedsilo_silo_metric", silo="b", name="accuracy", deployment="") == 0.5
    assert (
        value(registry, "fedsilo_summary_metric", name="accuracy", statistic="mean", deployment="")
        == 0.5
    )


# -- what the transport reports -----------------------------------------------------------------


def test_transport_counters_add_up_per_silo_direction_and_reason() -> None:
    metrics = CoordinatorMetrics()
    metrics.count_bytes("to_silo", "a", 1000)
    metrics.count_bytes("to_silo", "a", 24)
    metrics.count_bytes("from_silo", "a", 512)
    metrics.count_rejected("replay")
    metrics.count_rejected("replay")
    metrics.count_rejected("unknown_silo")
    metrics.set_connected(3)

    registry = metrics.registry
    assert value(registry, "fedsilo_bytes_total", direction="to_silo", silo="a") == 1024
    assert value(registry, "fedsilo_bytes_total", direction="from_silo", silo="a") == 512
    assert value(registry, "fedsilo_rejected_messages_total", reason="replay") == 2
    assert value(registry, "fedsilo_rejected_messages_total", reason="unknown_silo") == 1
    assert value(registry, "fedsilo_silos_connected") == 3


def test_a_silo_is_in_exactly_one_status_at_a_time() -> None:
    metrics = CoordinatorMetrics()
    metrics.set_silo_status("a", "active")
    metrics.set_silo_status("a", "revoked")
    statuses = {
        status: value(metrics.registry, "fedsilo_silo_status", silo="a", status=status)
        for status in ("active", "retired", "revoked", "refused")
    }
    assert statuses == {"active": 0, "retired": 0, "revoked": 1, "refused": 0}


def test_new_mixing_weights_replace_the_old_ones_entirely() -> None:
    metrics = CoordinatorMetrics()
    metrics.set_mixing_weights({"a": 0.5, "b": 0.5})
    metrics.set_mixing_weights({"a": 0.25, "c": 0.75})
    registry = metrics.registry
    assert value(registry, "fedsilo_mixing_weight", silo="a", deployment="") == 0.25
    assert value(registry, "fedsilo_mixing_weight", silo="c", deployment="") == 0.75
    assert value(registry, "fedsilo_mixing_weight", silo="b", deployment="") is None


def test_an_unknown_direction_or_silo_status_is_refused() -> None:
    metrics = CoordinatorMetrics()
    with pytest.raises(ValueError, match="direction 'upstream'"):
        metrics.count_bytes("upstream", "a", 1)
    with pytest.raises(ValueError, match="silo status 'banned'"):
        metrics.set_silo_status("a", "banned")
    with pytest.raises(ValueError, match="direction"):
        SiloMetrics().count_bytes("sideways", 1)


# -- silo agents, and several services in one process -------------------------------------------


def test_a_silo_agent_records_its_tasks_traffic_refusals_and_connection() -> None:
    metrics = SiloMetrics()
    metrics.observe_task("train", "ok", 2.0)
    metrics.observe_task("train", "error", 0.1)
    metrics.observe_task("evaluate", "ok", 0.05)
    metrics.observe_local_train(1.5)
    metrics.count_bytes("to_silo", 4096)
    metrics.count_bytes("from_silo", 2048)
    metrics.count_rejected("bad_signature")
    metrics.set_connected(True)

    with serve_metrics(metrics.registry, 0) as server:
        _, samples = scrape(f"http://127.0.0.1:{server.port}/metrics")
    assert sample(samples, "fedsilo_silo_tasks_total", kind="train", status="ok") == 1
    assert sample(samples, "fedsilo_silo_tasks_total", kind="train", status="error") == 1
    assert sample(samples, "fedsilo_silo_task_seconds_count", kind="train") == 2
    assert sample(samples, "fedsilo_silo_task_seconds_sum", kind="evaluate") == 0.05
    assert sample(samples, "fedsilo_local_train_seconds_count") == 1
    assert sample(samples, "fedsilo_silo_bytes_total", direction="to_silo") == 4096
    assert sample(samples, "fedsilo_silo_bytes_total", direction="from_silo") == 2048
    assert sample(samples, "fedsilo_silo_rejected_messages_total", reason="bad_signature") == 1
    assert sample(samples, "fedsilo_silo_connected") == 1


def test_a_silo_exports_the_epsilon_its_ledger_books_per_job_and_over_all_jobs(
    tmp_path: Path,
) -> None:
    """As the silo agent's endpoint does after each booking (ops/silo_process.py)."""
    ledger = PrivacyLedger(tmp_path / "privacy-ledger.jsonl")
    train = Mechanism.dp_sgd(noise_multiplier=2.0, sample_rate=1.0, steps=5, max_grad_norm=1.0)
    metrics = SiloMetrics()

    def book(job: str, round_: int, delta: float | None) -> None:
        ledger.append(
            deployment=job,
            round=round_,
            task_id=f"train-{round_}",
            mechanism=train if delta is not None else Mechanism.none(),
            payload_digest=payload_digest(b"%s %d" % (job.encode(), round_)),
            delta=delta,
        )
        spent = ledger.spent(job)
        over_all = privacy_total([spent, ledger.spent_elsewhere(job)])
        metrics.set_epsilon("hospital-a", job, spent, over_all, 30.0)

    for round_ in range(2):
        book("heart-3f9a1c2e", round_, 1e-5)
    book("heart-77b0d4e1", 0, 1e-5)
    book("heart-open-0a1b2c3d", 0, None)

    with serve_metrics(metrics.registry, 0) as server:
        _, samples = scrape(server.url)
    first, second = ledger.spent("heart-3f9a1c2e"), ledger.spent("heart-77b0d4e1")
    spent = "fedsilo_silo_epsilon_spent"
    assert sample(samples, spent, silo="hospital-a", deployment="heart-3f9a1c2e") == first
    assert sample(samples, spent, silo="hospital-a", deployment="heart-77b0d4e1") == second
    assert sample(samples, spent, silo="hospital-a", deployment="heart-open-0a1b2c3d") is None
    total = sample(samples, "fedsilo_silo_epsilon_total", silo="hospital-a")
    assert total == pytest.approx(first + second) and first > 0 and second > 0
    remaining = sample(samples, "fedsilo_silo_epsilon_remaining", silo="hospital-a")
    assert remaining == pytest.approx(30.0 - first - second)

    # the site drops its total cap between jobs: no remaining is exported any more
    metrics.set_epsilon("hospital-a", "heart-77b0d4e1", second, total, None)
    assert value(metrics.registry, "fedsilo_silo_epsilon_remaining", silo="hospital-a") is None
    assert value(metrics.registry, "fedsilo_silo_epsilon_total", silo="hospital-a") == total


def test_two_services_in_one_process_do_not_share_metrics(
    coordinator: CoordinatorMetrics,
) -> None:
    other = CoordinatorMetrics()
    silo = SiloMetrics()
    silo.observe_local_train(3.0)
    with (
        serve_metrics(coordinator.registry, 0) as first,
        serve_metrics(other.registry, 0) as second,
        serve_metrics(silo.registry, 0) as agent,
    ):
        assert len({first.port, second.port, agent.port}) == 3
        _, fed = scrape(first.url)
        _, fresh = scrape(second.url)
        _, local = scrape(agent.url)

    assert sample(fed, "fedsilo_round", deployment="") == 3
    assert sample(fresh, "fedsilo_round", deployment="") == 0
    assert sample(fresh, "fedsilo_dropouts_total", silo="b", deployment="") is None
    assert sample(fresh, "fedsilo_local_train_seconds_count", silo="a") is None
    assert sample(local, "fedsilo_local_train_seconds_count") == 1
    assert not any(name.startswith("fedsilo_silo_tasks") for name, _ in fed)
    assert not any(name == "fedsilo_round" for name, _ in local)


def test_the_endpoint_listens_on_loopback_by_default_and_reports_its_real_port() -> None:
    with serve_metrics(CollectorRegistry(), 0) as server:
        assert server.host == "127.0.0.1"
        assert server.port > 0
        assert server.url == f"http://127.0.0.1:{server.port}/metrics"


def test_close_frees_the_port_for_a_new_server_and_can_be_repeated() -> None:
    server = serve_metrics(CoordinatorMetrics().registry, 0)
    port = server.port
    scrape(server.url)
    server.close()
    server.close()
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5)

    with serve_metrics(SiloMetrics().registry, port) as again:
        assert again.port == port
        _, samples = scrape(again.url)
    assert sample(samples, "fedsilo_silo_connected") == 0


# -- deployment files ---------------------------------------------------------------------------


def exposed_sample_names() -> set[str]:
    """Every sample name the coordinator and the silo agents can expose."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}
    families = [
        *CoordinatorMetrics().registry.collect(),
        *SiloMetrics().registry.collect(),
    ]
    return {f.name + suffix for f in families for suffix in suffixes[f.type]}


def dashboard() -> dict:
    return json.loads((DEPLOY / "grafana-dashboard.json").read_text())


def panel_exprs() -> dict[str, list[str]]:
    return {p["title"]: [t["expr"] for t in p["targets"]] for p in dashboard()["panels"]}


def test_the_dashboard_is_grafana_json_with_a_prometheus_datasource_variable() -> None:
    board = dashboard()
    assert board["schemaVersion"] == 39
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids))
    for panel in board["panels"]:
        assert panel["datasource"] == {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
        assert panel["targets"], panel["title"]
        assert {"x", "y", "w", "h"} <= panel["gridPos"].keys()


def test_every_dashboard_query_names_only_metrics_the_services_expose() -> None:
    exposed = exposed_sample_names()
    for title, exprs in panel_exprs().items():
        for expr in exprs:
            named = set(re.findall(r"\bfedsilo_\w+", expr))
            assert named, f"{title}: {expr!r} names no fedsilo metric"
            assert named <= exposed, f"{title}: {sorted(named - exposed)} are not exported"


def test_the_dashboard_shows_rounds_results_silos_and_traffic() -> None:
    shown = " ".join(expr for exprs in panel_exprs().values() for expr in exprs)
    for metric in (
        "fedsilo_round",
        "fedsilo_round_duration_seconds_bucket",
        "fedsilo_silos_connected",
        'fedsilo_silo_metric{name="accuracy"}',
        "fedsilo_summary_metric",
        "fedsilo_dropouts_total",
        "fedsilo_rejected_messages_total",
        "fedsilo_bytes_total",
        "fedsilo_mixing_weight",
        "fedsilo_local_train_seconds_bucket",
        "fedsilo_privacy_epsilon",
    ):
        assert metric in shown
    quantiles = re.findall(r"histogram_quantile\((0\.\d+)", shown)
    assert {"0.5", "0.95"} <= set(quantiles)


def test_the_epsilon_panel_draws_each_silos_epsilon_against_the_policys_cap() -> None:
    (panel,) = [p for p in dashboard()["panels"] if "fedsilo_privacy_epsilon{" in str(p)]
    exprs = {t["refId"]: t["expr"] for t in panel["targets"]}
    assert exprs["A"].startswith("fedsilo_privacy_epsilon{")
    assert exprs["B"].startswith("fedsilo_privacy_epsilon_cap{")
    assert panel["targets"][0]["legendFormat"] == "{{silo}}"
    (cap,) = panel["fieldConfig"]["overrides"]
    assert cap["matcher"] == {"id": "byFrameRefID", "options": "B"}
    assert {"id": "displayName", "value": "cap"} in cap["properties"]


def test_the_policys_epsilon_cap_and_noised_metrics_are_exported_for_the_running_job() -> None:
    metrics = CoordinatorMetrics()
    metrics.deployment = "job-1"
    metrics.set_privacy(None, noised=False)
    assert value(metrics.registry, "fedsilo_privacy_epsilon_cap", deployment="job-1") is None
    assert value(metrics.registry, "fedsilo_metrics_noised", deployment="job-1") == 0
    metrics.set_privacy(8.0, noised=True)
    assert value(metrics.registry, "fedsilo_privacy_epsilon_cap", deployment="job-1") == 8.0
    assert value(metrics.registry, "fedsilo_metrics_noised", deployment="job-1") == 1


def test_the_scrape_config_names_the_coordinator_and_silo_jobs_the_dashboard_filters_on() -> None:
    config = yaml.safe_load((DEPLOY / "prometheus.yml").read_text())
    jobs = {
        job["job_name"]: [t for group in job["static_configs"] for t in group["targets"]]
        for job in config["scrape_configs"]
    }
    assert jobs["fedsilo-coordinator"] == ["localhost:9464"]
    assert jobs["fedsilo-silos"] == ["localhost:9465", "localhost:9466", "localhost:9467"]
    filtered = {
        job
        for exprs in panel_exprs().values()
        for e in exprs
        for job in re.findall(r'job="([^"]+)"', e)
    }
    assert filtered <= jobs.keys()


def test_histogram_buckets_span_ten_milliseconds_to_an_hour() -> None:
    metrics = CoordinatorMetrics()
    metrics.on_round(RoundRecord(1, "completed", 0.005), 1)
    metrics.on_round(RoundRecord(2, "completed", 3599.0), 2)
    registry = metrics.registry
    assert value(registry, "fedsilo_round_duration_seconds_bucket", le="0.01") == 1
    assert value(registry, "fedsilo_round_duration_seconds_bucket", le="3600.0") == 2
    assert math.isclose(value(registry, "fedsilo_round_duration_seconds_sum"), 3599.005)
