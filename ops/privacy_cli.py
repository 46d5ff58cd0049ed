"""The privacy officer's commands, `fedsilo privacy ...`: `audit` verifies a silo's ledger and
recomputes its epsilon, and with the coordinator's receipts proves it books every release the
coordinator received, as signed (without them it proves internal consistency only);
`receipts` exports those receipts from the coordinator's state; `report` plots epsilon over
rounds for one or more silos.

`ops/cli.py` registers the `privacy` group on the main command.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from pathlib import Path

import click
from nacl.signing import VerifyKey
from rich import box
from rich.console import Console
from rich.table import Table

from fedsilo.coordinator.state import StateError, StateStore
from fedsilo.ops.provision import KitError, load_silo_kit
from fedsilo.privacy.identity import IdentityError, parse_verify_key
from fedsilo.privacy.ledger import AuditReport, LedgerError, LedgerRecord, verify
from fedsilo.privacy.receipt_audit import ReceiptAudit, audit_receipts
from fedsilo.privacy.receipts import (
    Receipt,
    ReceiptError,
    read_receipts_document,
    receipts_document,
)

console = Console()

SHOWN_PROBLEMS = 3  # receipt findings printed; --json has all of them
INTERNAL_ONLY = (
    "this proves internal consistency only: a ledger cut after its last records, or rewritten "
    "whole with its hashes recomputed, passes too. Audit with --receipts (fedsilo privacy "
    "receipts) and --verify-key to hold it against the releases the coordinator received."
)


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
@click.option(
    "--receipts",
    "receipts_file",
    type=click.Path(path_type=Path),
    help="The silo's signed release receipts, as `fedsilo privacy receipts` exports them from "
    "the coordinator's state; the audit fails unless the ledger books each as signed.",
)
@click.option(
    "--verify-key",
    help="The silo's Ed25519 verify key (hex, as in the kits) or its kit folder: what checks "
    "the receipts' signatures.",
)
@click.option("--json", "as_json", is_flag=True, help="Print the audit as one JSON document.")
def audit(
    ledger_file: Path,
    anchor: str | None,
    cap: float | None,
    receipts_file: Path | None,
    verify_key: str | None,
    as_json: bool,
) -> None:
    """Verify a ledger and recompute its epsilon.

    Checks the hash chain, recomputes every deployment's epsilon from the booked mechanisms
    with Opacus, and shows what is spent and what remains; with --receipts, checks that every
    release the coordinator received is booked as the silo signed it. Exits 1 on any finding."""
    if (receipts_file is None) != (verify_key is None):
        raise click.ClickException("--receipts and --verify-key go together")
    report = _verified(ledger_file, anchor, cap)
    receipts = None
    if receipts_file is not None and verify_key is not None:
        silo, key = _verify_key(verify_key)
        receipts = audit_receipts(report, _receipts_of(receipts_file, silo), key)
    if as_json:
        document = report.to_json()
        if receipts is not None:
            document["receipts"] = {
                "checked": receipts.receipts,
                "problems": list(receipts.problems),
                "uncovered_seqs": list(receipts.uncovered),
            }
        document["proves"] = "receipts" if receipts is not None else "internal consistency only"
        click.echo(json.dumps(document, indent=2))
    else:
        console.print(_audit_table(report))
        for repair in report.repairs:
            console.print(
                f"repair at seq {repair.seq} ({repair.time}): a torn last line (an interrupted "
                f"booking, never sent) was set aside in {repair.task_id.split('/', 1)[1]}",
                soft_wrap=True,
            )
        if report.ok and (receipts is None or receipts.ok):
            console.print(_verdict(ledger_file, report, receipts), soft_wrap=True)
    if not report.ok:
        raise click.ClickException(report.reason)
    if receipts is not None and not receipts.ok:
        shown = "; ".join(receipts.problems[:SHOWN_PROBLEMS])
        more = len(receipts.problems) - SHOWN_PROBLEMS
        raise click.ClickException(
            f"{ledger_file}: {shown}"
            + (f"; and {more} more (--json lists all)" if more > 0 else "")
        )


@privacy_group.command("receipts")
@click.option(
    "--state",
    "state_file",
    required=True,
    type=click.Path(path_type=Path),
    help="The coordinator's state file (--state of `fedsilo coordinator start`).",
)
@click.option("--silo", help="Only this silo's receipts.")
@click.option("--deployment", help="Only this deployment's receipts.")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The JSON to write.")
def receipts_command(state_file: Path, silo: str | None, deployment: str | None, out: Path) -> None:
    """Export the silos' signed release receipts the coordinator kept (JSON).

    What `fedsilo privacy audit --receipts` holds a silo's ledger against."""
    if not state_file.is_file():
        raise click.ClickException(f"{state_file}: no such state file")
    try:
        with StateStore(state_file) as store:
            kept = [Receipt.from_json(r) for r in store.receipts(deployment, silo)]
    except (StateError, ReceiptError) as exc:
        raise click.ClickException(str(exc)) from None
    if not kept:
        raise click.ClickException(f"{state_file}: no receipts kept for these filters")
    try:
        out.write_text(json.dumps(receipts_document(kept), indent=2) + "\n")
    except OSError as exc:
        raise click.ClickException(f"{out}: cannot write: {exc.strerror or exc}") from None
    silos = sorted({r.silo for r in kept})
    console.print(f"wrote {len(kept)} receipts of {', '.join(silos)} to {out}", soft_wrap=True)


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


def _verdict(path: Path, report: AuditReport, receipts: ReceiptAudit | None) -> str:
    verdict = (
        f"[green]OK[/green] {path}: {len(report.records)} records, chain intact, every booked "
        f"epsilon recomputed; head {report.head}"
    )
    if receipts is None:
        return f"{verdict}\n{INTERNAL_ONLY}"
    verdict += (
        f"\nevery release the coordinator received ({receipts.receipts} signed receipts) is "
        "booked as signed, at the signed epsilon"
    )
    if receipts.uncovered:
        first, last = receipts.uncovered[0], receipts.uncovered[-1]
        verdict += (
            f"\n{len(receipts.uncovered)} record(s) after the last receipt (seq {first} to "
            f"{last}) are covered by no receipt (answers the coordinator did not keep, e.g. "
            "late ones, or repairs); they can only add to the epsilon booked"
        )
    return verdict


def _verify_key(text: str) -> tuple[str | None, VerifyKey]:
    """The silo's name (from a kit; None for a bare key) and its verify key."""
    if Path(text).is_dir():
        try:
            kit = load_silo_kit(Path(text))
        except KitError as exc:
            raise click.ClickException(str(exc)) from None
        return kit.name, kit.signing_key.verify_key
    try:
        return None, parse_verify_key(text, "--verify-key")
    except IdentityError as exc:
        raise click.ClickException(
            f"{exc} (give the silo's verify key or its kit folder)"
        ) from None


def _receipts_of(path: Path, silo: str | None) -> list[Receipt]:
    """The receipts in `path` of `silo` (a bare key: the file must hold one silo's)."""
    try:
        receipts = read_receipts_document(path.read_text(), str(path))
    except OSError as exc:
        raise click.ClickException(f"{path}: cannot read: {exc.strerror or exc}") from None
    except ReceiptError as exc:
        raise click.ClickException(str(exc)) from None
    names = sorted({r.silo for r in receipts})
    if silo is None and len(names) > 1:
        raise click.ClickException(
            f"{path} holds receipts of several silos ({', '.join(names)}): export one silo's "
            "(fedsilo privacy receipts --silo NAME) or give its kit as --verify-key"
        )
    mine = [r for r in receipts if silo is None or r.silo == silo]
    if not mine:
        raise click.ClickException(
            f"{path} holds no receipts" + (f" of silo {silo}" if silo else "")
        )
    return mine


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
