"""The cross-site validation matrix (coordinator/cross_site.py) as people and files read it: a
table of the headline metric, rows the models and columns the sites (`fedsilo simulate`,
`fedsilo job validate`), `cross_site.csv` beside silos.csv, and the document `job validate`
reads from a serving coordinator's state file (`job_cross_site`). Under a DP policy every cell
is a noised release, shown clipped into its metric's range and marked as the other tables mark
them (ops/shown_metrics.py); files keep the values as the silos released them."""

from __future__ import annotations

import csv
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from rich.console import Console
from rich.table import Table

from fedsilo.coordinator.admin_api import AdminError
from fedsilo.coordinator.cross_site import CrossSiteMatrix
from fedsilo.coordinator.jobs import ENDED, JobInfo
from fedsilo.ops.shown_metrics import MetricDisplay
from fedsilo.policies.schema import Policy

if TYPE_CHECKING:  # the coordinator shows matrices without loading the silo side
    from fedsilo.ops.simulate import SimulationResult

CSV_NAME = "cross_site.csv"


def headline_metric(matrix: CrossSiteMatrix) -> str | None:
    """The metric a table shows: accuracy, else rmse, else the first any cell reports."""
    names = sorted({m for row in matrix.rows.values() for cell in row.values() for m in cell})
    return next((m for m in ("accuracy", "rmse") if m in names), next(iter(names), None))


def cross_site_table(
    matrix: CrossSiteMatrix, metric: str, display: MetricDisplay, title: str = ""
) -> Table:
    """One row per model, one column per site: `metric` on the site's test split, as shown
    (`display`); "-" where the site gave no answer."""
    table = Table(
        title=f"{title}cross-site validation: test {display.label(metric)}",
        caption="rows: models, columns: the sites' test splits",
    )
    table.add_column("model")
    sites = matrix.sites
    for site in sites:
        table.add_column(site, justify="right")
    for row, cells in matrix.rows.items():
        values = [cells.get(site, {}).get(metric) for site in sites]
        table.add_row(
            row, *("-" if v is None else f"{display.value(metric, v):.3f}" for v in values)
        )
    return table


def print_cross_site(
    console: Console,
    matrix: CrossSiteMatrix,
    metric: str,
    display: MetricDisplay,
    title: str = "",
) -> None:
    """The table, then its note and the cells no answer filled, one line each."""
    console.print(cross_site_table(matrix, metric, display, title))
    if matrix.note:
        console.print(f"[yellow]Note:[/yellow] {matrix.note}", highlight=False, soft_wrap=True)
    for row, dropped in matrix.dropped.items():
        for site, why in sorted(dropped.items()):
            console.print(f"  {row} on {site}: no answer ({why})", highlight=False, soft_wrap=True)


def print_job_cross_site(console: Console, document: Mapping[str, Any]) -> None:
    """`fedsilo job validate`'s view of the document `job_cross_site` makes."""
    matrix = CrossSiteMatrix.from_json(document["cross_site"])
    display = MetricDisplay(bool(document["metrics_noised"]), float(document["loss_bound"]))
    console.print(
        f"job {document['job']} ({document['status']}), round {document['round']}",
        soft_wrap=True,
        highlight=False,
    )
    metric = document["metric"]
    if metric is None:
        console.print("no site answered any row", highlight=False)
        return
    print_cross_site(console, matrix, metric, display)


def print_simulated(console: Console, results: Mapping[str, SimulationResult]) -> None:
    """`fedsilo simulate`'s cross-site table of each run whose policy asked for one."""
    for name, result in results.items():
        found = result.history.final.cross_site
        if found is None:
            continue
        title = f"{name}: " if len(results) > 1 else ""
        display = MetricDisplay.of(result.policy.privacy)
        print_cross_site(
            console, CrossSiteMatrix.from_json(found), result.headline_metric, display, title
        )


def write_cross_site_csv(path: Path, matrix: CrossSiteMatrix) -> None:
    """One line per (model, site): every metric the site released for that model."""
    cells = [(row, site, m) for row, by_site in matrix.rows.items() for site, m in by_site.items()]
    metrics = sorted({name for _, _, m in cells for name in m})
    with path.open("w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(["model", "site", *metrics])
        for row, site, values in cells:
            writer.writerow([row, site, *(values.get(name, "") for name in metrics)])


def job_cross_site(info: JobInfo, policy: Policy, record: Mapping[str, Any] | None) -> dict:
    """What `fedsilo job validate --json` prints for job `info` of `policy`, from `record`, its
    last evaluated round as the state file keeps it; an AdminError in one line when its policy
    asks for no matrix (naming `evaluation.cross_site`) or the job has none (yet)."""
    job = info.job_id
    if not policy.evaluation.cross_site:
        raise AdminError(
            f"job {job}: its policy asks for no cross-site validation (evaluation.cross_site "
            "is false); set evaluation: {cross_site: true} in the policy of a new job"
        )
    found = (record or {}).get("cross_site")
    if record is None or found is None:
        if info.status not in ENDED:
            raise AdminError(
                f"job {job} is {info.status}: its cross-site validation runs after its final "
                "evaluation"
            )
        raise AdminError(
            f"job {job} ended {info.status} without a cross-site matrix: its last round did "
            "not complete and evaluate (`fedsilo job results` has what it did)"
        )
    matrix = CrossSiteMatrix.from_json(found)
    return {
        "job": job,
        "status": info.status,
        "round": record["round"],
        "metric": headline_metric(matrix),
        "metrics_noised": policy.privacy.differentially_private,
        "loss_bound": policy.privacy.reports.loss_bound,
        "cross_site": matrix.to_json(),
    }
