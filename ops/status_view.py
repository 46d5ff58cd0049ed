"""How `fedsilo status` shows a deployment: one summary line and a table of the silos, the same
whether it was read from the coordinator's state file (`--kit COORDINATOR_KIT --state`) or
asked of a running coordinator over the admin channel (`--kit OPERATOR_KIT`)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from rich.console import Console
from rich.table import Table

from fedsilo.ops.report import fmt_metric
from fedsilo.ops.status import DeploymentStatus


def print_status(console: Console, report: DeploymentStatus, silos: Iterable[str]) -> None:
    """The deployment's round, participants, last metrics and dropouts, for `silos`."""
    planned = f" of {report.rounds_planned}" if report.rounds_planned else ""
    console.print(
        f"deployment {report.deployment}: round {report.last_round}{planned} "
        f"({report.last_status}), {report.failed_rounds} failed round(s)"
    )
    table = Table(title=f"silos (metrics of round {report.evaluated_round})")
    metric_names = sorted({m for values in report.last_evaluation.values() for m in values})
    for column in ("silo", "status", "rounds with a dropout", *metric_names):
        table.add_column(column)
    for silo in sorted(silos):
        state, reason = report.participants.get(silo, ("never joined", ""))
        values = report.last_evaluation.get(silo, {})
        table.add_row(
            silo,
            f"{state} {reason}".strip(),
            str(report.dropouts.get(silo, 0)),
            *(fmt_metric(values.get(m)) for m in metric_names),
        )
    console.print(table)


def status_from_json(data: dict[str, Any]) -> DeploymentStatus:
    """A `DeploymentStatus` from its `dataclasses.asdict` form sent as JSON (pairs as lists)."""
    fields = {name: data[name] for name in DeploymentStatus.__dataclass_fields__}
    fields["participants"] = {
        silo: (str(state), str(reason)) for silo, (state, reason) in data["participants"].items()
    }
    return DeploymentStatus(**fields)
