"""The generated Prometheus metrics reference (`reference/metrics.md`, docs/hooks/metrics_page.py):
every metric the coordinator and silo registries hold is on the page with its type and labels,
every one has a help text, and the site builds the page (mkdocs.yml names the hook and the
page)."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
import yaml

from fedsilo.ops.metrics import CoordinatorMetrics, SiloMetrics

ROOT = Path(__file__).resolve().parents[1]
HOOK = ROOT / "docs" / "hooks" / "metrics_page.py"


def hook() -> ModuleType:
    spec = importlib.util.spec_from_file_location("metrics_page", HOOK)
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def families() -> list:
    return [*CoordinatorMetrics().registry.collect(), *SiloMetrics().registry.collect()]


def page_rows(page: str) -> dict[str, list[str]]:
    """Each table row's cells by the metric it names (the last row of a name wins)."""
    found = {}
    for line in page.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split(" | ")]
        if line.startswith("| `") and len(cells) == 4:
            found[cells[0].strip("`")] = cells[1:]
    return found


@pytest.fixture(scope="module")
def page() -> str:
    return hook().metrics_page()


def test_every_registered_metric_is_on_the_page_with_its_type(page: str) -> None:
    rows = page_rows(page)
    for family in families():
        name = family.name + ("_total" if family.type == "counter" else "")
        assert re.search(rf"`{re.escape(name)}`", page), f"{name} is not on the page"
        assert rows[name][0].startswith(family.type), name


def test_every_metric_has_a_help_text(page: str) -> None:
    for family in families():
        assert family.documentation.strip(), f"{family.name} has no help text"
    rows = page_rows(page)
    assert rows and all(cells[2] for cells in rows.values())


@pytest.mark.parametrize(
    ("metric", "labels"),
    [
        ("fedsilo_silo_up", "`silo`"),
        ("fedsilo_silo_heartbeat_age_seconds", "`silo`"),
        ("fedsilo_jobs", "`status`"),
        ("fedsilo_jobs_ended_total", "`reason`, `status`"),
        ("fedsilo_round", "`deployment`"),
        ("fedsilo_silo_metric", "`deployment`, `name`, `silo`"),
        ("fedsilo_certificate_expiry_days", "`party`"),
        ("fedsilo_silos_connected", "none"),
    ],
)
def test_the_page_shows_a_metrics_labels(page: str, metric: str, labels: str) -> None:
    assert page_rows(page)[metric][1] == labels


def test_the_site_runs_the_hook_and_lists_the_page() -> None:
    config = yaml.load((ROOT / "mkdocs.yml").read_text(), Loader=yaml.BaseLoader)
    assert "docs/hooks/metrics_page.py" in config["hooks"]
    assert "reference/metrics.md" in yaml.safe_dump(config["nav"])
    assert "(reference/metrics.md)" in (ROOT / "docs" / "metrics.md").read_text()
