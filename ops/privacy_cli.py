"""The privacy officer's commands, `fedsilo privacy ...`: `audit` verifies a silo's ledger and
recomputes its epsilon, `report` plots epsilon over rounds for one or more silos.

`ops/cli.py` registers the `privacy` group on the main command.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import click
from rich import box
from rich.console import Console
from rich.table import Table

from fedsilo.privacy.ledger import AuditReport, LedgerError, LedgerRecord, verify

console = Console()


@click.group("privacy")
def privacy_group() -> None:
    """Audit and plot the silos' privacy ledgers."""


@privacy_group.command("audit")
@click.option(
    "--ledger",
    "ledger_file",
    required=True,
    type=click.Path(path_type=Path),
    help="A silo's ledger file (JSONL).",
)
@click.option(
    "--anchor",
    help="A record hash the coordinator was shown (a silo reports its ledger head with every "
    "result); the audit fails unless the ledger still holds that record.",
)
@click.option(
    "--cap",
    type=click.FloatRange(min=0, min_open=True),
    help="Epsilon cap per deployment: show what remains, fail where a deployment went over it.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the audit as one JSON document.")
def audit(ledger_file: Path, anchor: str | None, cap: float | None, as_json: bool) -> None:
    """Verify a ledger and recompute its epsilon.

    Checks the hash chain, recomputes every deployment's epsilon from the booked mechanisms
    with Opacus, and shows what is spent and what remains; exits 1 on any finding."""
    report = _verified(ledger_file, anchor, cap)
    if as_json:
        click.echo(json.dumps(report.to_json(), indent=2))
    else:
        console.print(_audit_table(report))
        if report.ok:
            console.print(
                f"[green]OK[/green] {ledger_file}: {len(report.records)} records, chain intact, "
                f"every booked epsilon recomputed; head {report.head}",
                soft_wrap=True,
            )
    if not report.ok:
        raise click.ClickException(report.reason)


@privacy_group.command("report")
@click.option(
    "--ledger",
    "ledger_files",
    required=True,
    multiple=True,
    type=click.Path(path_type=Path),
    help="A silo's ledger file (repeatable: one per silo).",
)
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The PNG to write.")
def report(ledger_files: tuple[Path, ...], out: Path) -> None:
    """Plot epsilon over rounds per silo (PNG).

    One line per silo and deployment; every ledger is audited first, and one that fails its
    audit is refused."""
    series: dict[str, list[tuple[int, float]]] = {}
    for path, silo in zip(ledger_files, _silo_labels(ledger_files), strict=True):
        audited = _verified(path, None, None)
        if not audited.ok:
            raise click.ClickException(audited.reason)
        for deployment, points in _epsilon_by_round(audited.records).items():
            series[f"{silo}: {deployment}"] = points
    if not series:
        raise click.ClickException("no deployment in these ledgers books epsilon (none uses DP)")
    try:
        _plot(series, out)
    except OSError as exc:
        raise click.ClickException(f"{out}: cannot write the plot: {exc.strerror or exc}") from None
    for label, points in series.items():
        unbounded = [r for r, eps in points if eps == math.inf]
        if unbounded:
            console.print(
                f"{label}: epsilon is unbounded (a release without noise) from round "
                f"{unbounded[0]} on; those rounds are not plotted"
            )
    console.print(f"wrote {out}", soft_wrap=True)


def _verified(path: Path, anchor: str | None, cap: float | None) -> AuditReport:
    try:
        return verify(path, anchor, cap)
    except LedgerError as exc:
        raise click.ClickException(str(exc)) from None


def _audit_table(report: AuditReport) -> Table:
    table = Table(title=f"privacy ledger {report.path}", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("deployment")
    for column in ("records", "booked ε", "recomputed ε", "δ", "cap", "remaining"):
        table.add_column(column, justify="right")
    for audit in report.deployments:
        accounted = audit.delta is not None
        table.add_row(
            audit.deployment,
            str(audit.records),
            _fmt(audit.booked) if accounted else "no DP",
            _fmt(audit.recomputed) if accounted else "no DP",
            f"{audit.delta:g} ({audit.accountant})" if accounted else "-",
            _fmt(audit.cap),
            _fmt(audit.remaining),
        )
    return table


def _epsilon_by_round(records: Sequence[LedgerRecord]) -> dict[str, list[tuple[int, float]]]:
    """Per deployment that books epsilon: (round, cumulative epsilon at the round's end)."""
    by_round: dict[str, dict[int, float]] = {}
    for record in records:
        if record.epsilon_cumulative is not None:
            rounds = by_round.setdefault(record.deployment, {})
            rounds[record.round] = record.epsilon_cumulative
    return {name: sorted(rounds.items()) for name, rounds in by_round.items()}


def _plot(series: dict[str, list[tuple[int, float]]], out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(7, 4))
    for label, points in series.items():
        rounds = [r for r, _ in points]
        spent = [eps if math.isfinite(eps) else math.nan for _, eps in points]
        ax.step(rounds, spent, where="post", marker="o", markersize=3, label=label)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(bottom=0)
    ax.set_xlabel("round")
    ax.set_ylabel("cumulative ε")
    ax.set_title("privacy spent per silo and deployment")
    ax.legend(fontsize=8)
    fig.tight_layout()
    try:
        fig.savefig(out, dpi=120)
    finally:
        plt.close(fig)


def _silo_labels(paths: Sequence[Path]) -> list[str]:
    """Each ledger's file name without suffix, or its whole path where names repeat."""
    stems = [path.stem for path in paths]
    return stems if len(set(stems)) == len(stems) else [str(path) for path in paths]


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if value == math.inf else f"{value:.6g}"
