"""The alert rules that ship with fedsilo (ops/deploy/prometheus-alerts.yml): valid Prometheus
rules (`promtool check rules` where promtool is installed), every alert reading only metrics
the coordinator and silo agents really register, each with a `for`, a severity and a summary;
the ones an operator needs are there; the package ships them, and the compose Prometheus
loads them."""

from __future__ import annotations

import re
import shutil
import subprocess
from importlib.resources import files
from pathlib import Path

import pytest
import yaml

from fedsilo.ops.metrics import CoordinatorMetrics, SiloMetrics

ROOT = Path(__file__).resolve().parents[1]
ALERTS = ROOT / "ops" / "deploy" / "prometheus-alerts.yml"
COMPOSE = ROOT / "deploy" / "compose"
SEVERITIES = {"info", "warning", "critical"}
# PromQL words that are not metric names: operators, modifiers and the functions used
PROMQL_WORDS = {
    "and",
    "or",
    "unless",
    "on",
    "ignoring",
    "group_left",
    "group_right",
    "by",
    "without",
    "bool",
    "offset",
    "inf",
    "nan",
    # aggregation operators, which a grouping may follow before their "("
    "sum",
    "min",
    "max",
    "avg",
    "count",
    "stddev",
    "stdvar",
    "topk",
    "bottomk",
    "quantile",
    "count_values",
    "group",
}
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count"), "gauge": ("",)}


def registered_sample_names() -> set[str]:
    """Every sample name the real coordinator and silo registries can expose."""
    families = [*CoordinatorMetrics().registry.collect(), *SiloMetrics().registry.collect()]
    return {
        family.name + suffix for family in families for suffix in SUFFIXES.get(family.type, ("",))
    }


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: its identifiers less label matchers,
    strings, durations, grouping label lists, functions and keywords."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|`[^`]*`', "", expr)  # strings
    text = re.sub(r"\{[^}]*\}", "", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", "", text)  # range durations
    text = re.sub(r"\b\d+(ms|[smhdwy])\b", "", text)  # offsets
    text = re.sub(r"\b(on|ignoring|by|without|group_left|group_right)\s*\([^)]*\)", r"\1", text)
    names = set()
    for match in re.finditer(r"[A-Za-z_:][\w:]*", text):
        word = match.group()
        follows = text[match.end() :].lstrip()
        if word.lower() in PROMQL_WORDS or follows.startswith("("):
            continue
        names.add(word)
    return names


def alerts() -> list[dict]:
    document = yaml.safe_load(ALERTS.read_text())
    return [rule for group in document["groups"] for rule in group["rules"] if "alert" in rule]


def test_metric_names_reads_only_the_metrics_of_an_expression() -> None:
    expr = (
        'sum by (silo) (increase(fedsilo_x_total{a="b"}[5m])) '
        ">= on (deployment) group_left () 0.9 * fedsilo_cap unless y_metric offset 1h"
    )
    assert metric_names(expr) == {"fedsilo_x_total", "fedsilo_cap", "y_metric"}


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed")
def test_promtool_checks_the_rules() -> None:
    checked = subprocess.run(
        ["promtool", "check", "rules", str(ALERTS)], capture_output=True, text=True, timeout=60
    )
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_every_alert_reads_registered_metrics_and_has_for_severity_and_summary() -> None:
    registered = registered_sample_names()
    rules = alerts()
    assert rules
    for rule in rules:
        name = rule["alert"]
        read = metric_names(str(rule["expr"]))
        assert read, f"{name}: its expr reads no metric"
        assert read <= registered, f"{name}: {sorted(read - registered)} are not registered"
        assert re.fullmatch(r"\d+[smhdwy]", str(rule.get("for", ""))), f"{name}: no `for`"
        assert rule.get("labels", {}).get("severity") in SEVERITIES, name
        assert str(rule.get("annotations", {}).get("summary", "")).strip(), name
    assert len({rule["alert"] for rule in rules}) == len(rules)


@pytest.mark.parametrize(
    "metric",
    [
        "fedsilo_silo_up",  # a silo down
        "fedsilo_jobs_ended_total",  # a job failed
        "fedsilo_certificate_expiry_days",  # a certificate near expiry
        "fedsilo_privacy_epsilon_cap",  # a job's epsilon near the policy's cap
        "fedsilo_silo_epsilon_remaining",  # a site's epsilon near its own total cap
    ],
)
def test_an_alert_watches(metric: str) -> None:
    assert any(metric in metric_names(str(rule["expr"])) for rule in alerts()), metric


def test_the_rules_ship_in_the_package_beside_the_dashboard() -> None:
    deploy = files("fedsilo.ops") / "deploy"
    assert (deploy / "prometheus-alerts.yml").read_text() == ALERTS.read_text()
    assert (deploy / "grafana-dashboard.json").is_file()


def test_the_compose_prometheus_mounts_and_loads_the_rules() -> None:
    config = yaml.safe_load((COMPOSE / "prometheus.yml").read_text())
    compose = yaml.safe_load((COMPOSE / "compose.yaml").read_text())
    mounts = {
        target.removesuffix(":ro"): source
        for source, _, target in (
            volume.partition(":") for volume in compose["services"]["prometheus"]["volumes"]
        )
    }
    for rule_file in config["rule_files"]:
        assert rule_file in mounts, rule_file
        assert (COMPOSE / mounts[rule_file]).resolve() == ALERTS
