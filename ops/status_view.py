"""How `fedsilo status` shows a deployment: one summary line and a table of the silos, the same
whether it was read from the coordinator's state file (`--kit COORDINATOR_KIT --state`) or
asked of a running coordinator over the admin channel (`--kit OPERATOR_KIT`); and one line on
the kit's own TLS certificate (`print_certificate`): how long it is valid, and from 30 days
before it expires, to renew it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

from fedsilo.ops.epsilon import fmt_epsilon
from fedsilo.ops.report import fmt_metric
from fedsilo.ops.shown_metrics import NOISED
from fedsilo.ops.status import DeploymentStatus
from fedsilo.privacy.certificate_files import CertificateError, expiry_note, read_certificate

STATUS_WIDTH = 40  # the most the status column reserves for its longest word


def print_status(console: Console, report: DeploymentStatus, silos: Iterable[str]) -> None:
    """The deployment's round, participants, last metrics and dropouts, for `silos`; under DP
    each silo's epsilon and the metrics marked as noised."""
    planned = f" of {report.rounds_planned}" if report.rounds_planned else ""
    console.print(
        f"deployment {report.deployment}: round {report.last_round}{planned} "
        f"({report.last_status}), {report.failed_rounds} failed round(s)"
    )
    evaluated = (
        "no round evaluated yet"
        if report.evaluated_round is None
        else f"metrics of round {report.evaluated_round}"
    )
    table = Table(title=f"silos ({evaluated})")
    if report.noised:
        table.caption = (
            f"{NOISED}: reported with Gaussian noise (DP), not exact; shown clipped into each "
            "metric's range"
        )
    metric_names = sorted({m for values in report.last_evaluation.values() for m in values})
    rows = {silo: report.participants.get(silo, ("never joined", "")) for silo in sorted(silos)}
    table.add_column("silo")
    # as wide as its longest word, so a reason wraps between words, never inside one
    words = [w for state, reason in rows.values() for w in f"{state} {reason}".split()]
    table.add_column("status", min_width=min(STATUS_WIDTH, max(map(len, words), default=6)))
    table.add_column("rounds with a dropout", justify="right")
    show_epsilon = report.noised or bool(report.epsilon)
    if show_epsilon:
        cap = f" (cap {report.epsilon_cap:g})" if report.epsilon_cap is not None else ""
        table.add_column(f"ε{cap}", justify="right")
    for metric in metric_names:
        table.add_column(f"{metric} {NOISED}" if report.noised else metric, justify="right")
    for silo, (state, reason) in rows.items():
        values = report.last_evaluation.get(silo, {})
        epsilon = [fmt_epsilon(report.epsilon.get(silo))] if show_epsilon else []
        table.add_row(
            silo,
            f"{state} {reason}".strip(),
            str(report.dropouts.get(silo, 0)),
            *epsilon,
            *(fmt_metric(values.get(m)) for m in metric_names),
        )
    console.print(table)


def status_from_json(data: dict[str, Any]) -> DeploymentStatus:
    """A `DeploymentStatus` from its `dataclasses.asdict` form sent as JSON (pairs as lists)."""
    fields = {name: data[name] for name in DeploymentStatus.__dataclass_fields__ if name in data}
    fields["participants"] = {
        silo: (str(state), str(reason)) for silo, (state, reason) in data["participants"].items()
    }
    return DeploymentStatus(**fields)


def print_certificate(console: Console, party: str, path: Path) -> None:
    """The line on `party`'s certificate in `path`: valid until when, or expired."""
    try:
        note = expiry_note(path, read_certificate(path))
    except CertificateError as exc:
        note = str(exc)
    console.print(f"certificate of the {party}: {note}", soft_wrap=True, highlight=False)
