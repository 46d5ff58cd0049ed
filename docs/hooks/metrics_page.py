"""The Prometheus metrics reference, generated from the real registries each time the site
builds, so a metric added to the coordinator or the silo agent is documented without anyone
writing it down.

An MkDocs hook (mkdocs.yml, `hooks:`): `on_files` adds `reference/metrics.md`, one table for the
coordinator and one for a silo agent, one row per metric their registries hold
(`CoordinatorMetrics`, `SiloMetrics` in ops/metrics.py, the process collectors included): the
name a scrape shows, its type, its labels and its help text. `metrics_page` builds the page's
text (tests/test_metrics_reference.py calls it).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from prometheus_client import CollectorRegistry
from prometheus_client.metrics import MetricWrapperBase

from fedsilo.ops.metrics import CoordinatorMetrics, SiloMetrics

PATH = "reference/metrics.md"
# what a scrape shows of a family of each type: its samples' suffixes
SUFFIXES = {"counter": ("_total",), "histogram": ("_bucket", "_sum", "_count")}
NOT_LABELS = {"le", "quantile"}  # a histogram's or a summary's own


def exposed_name(name: str, kind: str) -> str:
    """The name a scrape shows: a counter's with `_total`; a histogram's base name."""
    return name + "_total" if kind == "counter" else name


def declared_labels(service: object) -> dict[str, tuple[str, ...]]:
    """Each metric the service object declares, by name, with its label names."""
    return {
        metric._name: tuple(metric._labelnames)  # prometheus_client keeps them only there
        for metric in vars(service).values()
        if isinstance(metric, MetricWrapperBase)
    }


def rows(registry: CollectorRegistry, declared: dict[str, tuple[str, ...]]) -> list[str]:
    """One table row for each metric family `registry` collects, in name order."""
    found = []
    for family in sorted(registry.collect(), key=lambda family: family.name):
        labels = set(declared.get(family.name, ()))
        labels |= {key for s in family.samples for key in s.labels} - NOT_LABELS
        name = exposed_name(family.name, family.type)
        shown = ", ".join(f"`{label}`" for label in sorted(labels)) or "none"
        kind = family.type + (
            " (`_bucket`, `_sum`, `_count`)" if family.type == "histogram" else ""
        )
        found.append(f"| `{name}` | {kind} | {shown} | {cell(family.documentation)} |")
    return found


def cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def table(title: str, intro: str, service: Any) -> list[str]:
    return [
        f"## {title}",
        "",
        intro,
        "",
        "| Metric | Type | Labels | Description |",
        "| --- | --- | --- | --- |",
        *rows(service.registry, declared_labels(service)),
        "",
    ]


def services() -> tuple[CoordinatorMetrics, SiloMetrics]:
    """The two services' metrics as they start, their scrape-time series given a source so
    that their labels show."""
    coordinator = CoordinatorMetrics()
    coordinator.watch_silos(lambda: {"silo": 0.0}, 1.0)
    coordinator.watch_jobs(dict)
    return coordinator, SiloMetrics()


def metrics_page() -> str:
    """The text of `reference/metrics.md`."""
    coordinator, silo = services()
    lines: Iterable[str] = [
        "# Prometheus metrics",
        "",
        "Every metric the coordinator and the silo agents serve at `/metrics` (`--metrics-port`, "
        "silo.yaml's `metrics_port`), generated from their code each time this site builds. "
        "What they are for, and the alert rules and dashboard that read them: "
        "[Metrics](../metrics.md#prometheus-monitoring).",
        "",
        "A counter shows with `_total` after its name, a histogram as its `_bucket`, `_sum` and "
        "`_count` series. `deployment` is the id of the job a series belongs to "
        "(`fedsilo job list`). The `process_*` metrics are there where the platform has "
        "`/proc` (Linux).",
        "",
        *table(
            "Coordinator",
            "`fedsilo coordinator start` and `fedsilo coordinator serve`; `fedsilo_jobs` and "
            "`fedsilo_jobs_ended_total` count the jobs of `coordinator serve`.",
            coordinator,
        ),
        *table("Silo agent", "`fedsilo silo start`.", silo),
    ]
    return "\n".join(lines)


def on_files(files: Any, config: Any) -> Any:
    from mkdocs.structure.files import File

    files.append(File.generated(config, PATH, content=metrics_page()))
    return files
