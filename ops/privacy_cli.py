"""The privacy officer's commands, `fedsilo privacy ...`: `audit` verifies a silo's ledger and
recomputes its epsilon, and with the coordinator's receipts proves it books every release the
coordinator received, as signed (without them it proves internal consistency only);
`receipts` exports those receipts from the coordinator's state; `report` plots epsilon over
rounds for one or more silos; `plan` (ops/plan_cli.py) shows what a job will book at each
silo before it runs.

`ops/cli.py` registers the `privacy` group on the main command.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click
from nacl.signing import VerifyKey
from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from fedsilo.coordinator.state import StateError, StateStore
from fedsilo.ops.epsilon import plot_epsilon
from fedsilo.ops.job_id import DIGEST_CHARS
from fedsilo.ops.plan_cli import plan_command
from fedsilo.ops.provision import KitError, load_silo_kit
from fedsilo.policies.loading import PolicyError
from fedsilo.privacy.accounting import total
from fedsilo.privacy.identity import IdentityError, parse_verify_key
from fedsilo.privacy.ledger import (
    AuditReport,
    DeploymentAudit,
    LedgerError,
    LedgerRecord,
    verify,
)
from fedsilo.privacy.receipt_audit import ReceiptAudit, audit_receipts
from fedsilo.privacy.receipts import (
    Receipt,
    ReceiptError,
    read_receipts_document,
    receipts_document,
)

if TYPE_CHECKING:
    from fedsilo.silo.config import SiloConfig

console = Console()

SHOWN_PROBLEMS = 3  # receipt findings printed; --json has all of them
INTERNAL_ONLY = (
    "this proves internal consistency only: a ledger cut after its last records, or rewritten "
    "whole with its hashes recomputed, passes too. Audit with --receipts (fedsilo privacy "
    "receipts) and --verify-key to hold it against the releases the coordinator received."
)


@click.group("privacy")
def privacy_group() -> None:
    """Plan a job's budget; audit and plot the silos' privacy ledgers."""


privacy_group.add_command(plan_command)


@privacy_group.command("audit")
@click.option(
    "--ledger",
    "ledger_file",
    type=click.Path(path_type=Path),
    help="A silo's ledger file (JSONL); by default the one --config names.",
)
@click.option(
    "--config",
    "config_file",
    type=click.Path(path_type=Path),
    help="The site's silo.yaml: its ledger (`ledger`), its cap per job (`rules.epsilon_cap`) "
    "and over all jobs (`rules.total_epsilon_cap`); --ledger, --cap and --total-cap override.",
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
    "--total-cap",
    type=click.FloatRange(min=0, min_open=True),
    help="The site's epsilon cap over all jobs: show what remains, fail where they went over it.",
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
    ledger_file: Path | None,
    config_file: Path | None,
    anchor: str | None,
    cap: float | None,
    total_cap: float | None,
    receipts_file: Path | None,
    verify_key: str | None,
    as_json: bool,
) -> None:
    """Verify a ledger and recompute its epsilon.

    Checks the hash chain, recomputes every deployment's epsilon from the booked mechanisms
    with Opacus, and shows what is spent and what remains; with --receipts, checks that every
    release the coordinator received is booked as the silo signed it; with a total cap
    (--total-cap, or the site's rules.total_epsilon_cap with --config), shows the site's epsilon
    over all jobs and what remains of it. Exits 1 on any finding."""
    if (receipts_file is None) != (verify_key is None):
        raise click.ClickException("--receipts and --verify-key go together")
    if config_file is not None:
        site = _site_config(config_file)
        ledger_file = ledger_file or site.ledger_path(config_file)
        cap = cap if cap is not None else site.rules.epsilon_cap
        total_cap = total_cap if total_cap is not None else site.rules.total_epsilon_cap
    if ledger_file is None:
        raise click.ClickException("give the ledger: --ledger FILE, or --config silo.yaml")
    report = _verified(ledger_file, anchor, cap)
    total = _SiteTotal.of(report, total_cap)
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
        document["site"] = total.to_json()
        document["proves"] = "receipts" if receipts is not None else "internal consistency only"
        click.echo(json.dumps(document, indent=2))
    else:
        table, shortened = _audit_table(report, total, console.width)
        console.print(table)
        for short, whole in shortened.items():
            console.print(f"{short} is job {whole}", soft_wrap=True, markup=False, highlight=False)
        for repair in report.repairs:
            console.print(
                f"repair at seq {repair.seq} ({repair.time}): a torn last line (an interrupted "
                f"booking, never sent) was set aside in {repair.task_id.split('/', 1)[1]}",
                soft_wrap=True,
            )
        if report.ok and total.problem is None and (receipts is None or receipts.ok):
            console.print(_verdict(ledger_file, report, receipts), soft_wrap=True)
    if not report.ok:
        raise click.ClickException(report.reason)
    if total.problem is not None:
        raise click.ClickException(f"{ledger_file}: {total.problem}")
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
    "ledgers",
    required=True,
    multiple=True,
    help="A silo's ledger file, or NAME=FILE to label it NAME (repeatable: one per silo). "
    "Unnamed, a ledger is labelled by its file name, or by its folder where file names repeat "
    "(sites/NAME/privacy-ledger.jsonl).",
)
@click.option("--cap", type=float, help="The epsilon cap to draw (the policy's epsilon_cap).")
@click.option("--out", required=True, type=click.Path(path_type=Path), help="The PNG to write.")
def report(ledgers: tuple[str, ...], cap: float | None, out: Path) -> None:
    """Plot epsilon over rounds per silo (PNG), one panel per silo with the cap drawn.

    One line per deployment in a silo's panel; every ledger is audited first, and one that
    fails its audit is refused."""
    if cap is not None and not cap > 0:
        raise click.ClickException(f"--cap: must be a positive epsilon, got {cap:g}")
    named = [_named_ledger(text) for text in ledgers]
    panels: dict[str, dict[str, list[tuple[int, float]]]] = {}
    for silo, path in _silo_labels(named):
        audited = _verified(path, None, None)
        if not audited.ok:
            raise click.ClickException(audited.reason)
        panels[silo] = _epsilon_by_round(audited.records)
    if not any(panels.values()):
        raise click.ClickException("no deployment in these ledgers books epsilon (none uses DP)")
    try:
        plot_epsilon(out, panels, cap, "cumulative ε per silo, one line per deployment")
    except OSError as exc:
        raise click.ClickException(f"{out}: cannot write the plot: {exc.strerror or exc}") from None
    for silo, lines in panels.items():
        for deployment, points in lines.items():
            unbounded = [r for r, eps in points if eps == math.inf]
            if unbounded:
                console.print(
                    f"{silo}: {deployment}: epsilon is unbounded (a release without noise) from "
                    f"round {unbounded[0]} on; those rounds are not plotted"
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


def _site_config(path: Path) -> SiloConfig:
    from fedsilo.silo.config import load_silo_config  # the site's data loaders: only if asked

    try:
        return load_silo_config(path)
    except PolicyError as exc:
        raise click.ClickException(str(exc)) from None


def _verified(path: Path, anchor: str | None, cap: float | None) -> AuditReport:
    try:
        return verify(path, anchor, cap)
    except LedgerError as exc:
        raise click.ClickException(str(exc)) from None


@dataclass(frozen=True)
class _SiteTotal:
    """The site's epsilon over all the ledger's jobs (sequential composition: their sum), held
    against its total cap (rules.total_epsilon_cap) where there is one."""

    records: int
    booked: float
    recomputed: float
    cap: float | None

    @classmethod
    def of(cls, report: AuditReport, cap: float | None) -> _SiteTotal:
        return cls(
            records=len(report.records),
            booked=total([audit.booked for audit in report.deployments]),
            recomputed=total([audit.recomputed for audit in report.deployments]),
            cap=cap,
        )

    @property
    def remaining(self) -> float | None:
        """What the total cap leaves (never below 0), or None without one."""
        return None if self.cap is None else max(self.cap - self.booked, 0.0)

    @property
    def problem(self) -> str | None:
        if self.cap is None or not max(self.booked, self.recomputed) > self.cap:
            return None
        return (
            f"the site's epsilon over all jobs, {_fmt(self.booked)}, is over its total cap "
            f"{self.cap:g}"
        )

    def to_json(self) -> dict[str, Any]:
        def number(value: float | None) -> float | str | None:
            return "inf" if value == math.inf else value

        return {
            "booked": number(self.booked),
            "recomputed": number(self.recomputed),
            "total_cap": self.cap,
            "remaining": self.remaining,
            "problem": self.problem,
        }


ALL_JOBS = "all jobs"  # the site's row, below the jobs'
MIN_JOB_HEAD = 3  # the least of a shortened id's start kept before "…" and its digest
JOB_TAIL = re.compile(rf"-[0-9a-f]{{{DIGEST_CHARS}}}(?:-attempt\d+)?$")  # ops/job_id.py


def _audit_table(report: AuditReport, site: _SiteTotal, width: int) -> tuple[Table, dict[str, str]]:
    """The audit's table for a console `width` wide, and the job ids it had to shorten (as
    shown, to whole): one row per job (deployment), then the site's total over all of them.

    The job column gets what the numbers leave (δ may wrap at its space), at least what keeps
    each id's digest (and attempt) whole after a few characters of its start; an id longer
    than that is shortened in the middle, never cut at its end."""
    names = [audit.deployment for audit in report.deployments]
    deltas = [_delta(audit) for audit in report.deployments]
    wraps = max(map(len, deltas), default=1) - max(
        (len(word) for text in deltas for word in text.split()), default=1
    )
    others = _natural_width(_table_of(report, site, dict.fromkeys(names, ""))) - len(ALL_JOBS)
    least = max([len(ALL_JOBS), *(min(len(n), MIN_JOB_HEAD + 1 + _tail(n)) for n in names)])
    labels = _fit_job_names(names, max(width - others + wraps, least))
    shortened = {labels[name]: name for name in names if labels[name] != name}
    return _table_of(report, site, labels), shortened


def _table_of(report: AuditReport, site: _SiteTotal, labels: dict[str, str]) -> Table:
    table = Table(
        title=f"privacy ledger {report.path}", box=box.SIMPLE_HEAD, pad_edge=False, show_edge=False
    )
    # never cut: a cut id could pass for another job's (a shortened one keeps its distinct tail)
    table.add_column("job", overflow="fold", no_wrap=True)
    for column in ("records", "booked\nε", "recomputed\nε", "δ", "cap", "remaining"):
        table.add_column(column, justify="right", no_wrap=column != "δ")
    for audit, delta in zip(report.deployments, map(_delta, report.deployments), strict=True):
        accounted = audit.delta is not None
        table.add_row(
            Text(labels[audit.deployment]),  # an id is no markup
            str(audit.records),
            _fmt(audit.booked) if accounted else "no DP",
            _fmt(audit.recomputed) if accounted else "no DP",
            delta,
            _fmt(audit.cap),
            _fmt(audit.remaining),
        )
    table.add_section()
    table.add_row(
        ALL_JOBS,
        str(site.records),
        _fmt(site.booked),
        _fmt(site.recomputed),
        "-",
        _fmt(site.cap),
        _fmt(site.remaining),
        style="bold",
    )
    return table


def _delta(audit: DeploymentAudit) -> str:
    return "-" if audit.delta is None else f"{audit.delta:g} ({audit.accountant})"


def _natural_width(table: Table) -> int:
    """How wide `table` renders where nothing squeezes it."""
    return Console(width=1000).measure(table).maximum


def _fit_job_names(names: Sequence[str], width: int) -> dict[str, str]:
    """Each name as shown in a column `width` wide: whole where it fits, else shortened in the
    middle (`heart-fa…3f9a1c2e-attempt2`), keeping its start and enough of its end to tell it
    from every other name (a job id ends in its policy's digest, then its attempt; ops/job_id.py).
    Names that cannot be told apart so are shown whole (the column folds them)."""
    labels: dict[str, str] = {}
    for name in names:
        if len(name) <= width:
            labels[name] = name
            continue
        distinct = 1 + max(
            (_common_suffix(name, other) for other in names if other != name), default=0
        )
        tail = min(max(distinct, _tail(name), (width - 1) // 2), width - 1 - MIN_JOB_HEAD)
        head = width - 1 - tail
        labels[name] = f"{name[:head]}…{name[-tail:]}" if head >= 3 else name
    if len(set(labels.values())) < len(labels):
        return {name: name for name in names}
    return labels


def _tail(name: str) -> int:
    """How much of a job id's end tells it apart: its digest and attempt (ops/job_id.py)."""
    match = JOB_TAIL.search(name)
    return len(match.group()) if match else 0


def _common_suffix(a: str, b: str) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[-1 - n] == b[-1 - n]:
        n += 1
    return n


def _epsilon_by_round(records: Sequence[LedgerRecord]) -> dict[str, list[tuple[int, float]]]:
    """Per deployment that books epsilon: (round, cumulative epsilon at the round's end)."""
    by_round: dict[str, dict[int, float]] = {}
    for record in records:
        if record.epsilon_cumulative is not None:
            rounds = by_round.setdefault(record.deployment, {})
            rounds[record.round] = record.epsilon_cumulative
    return {name: sorted(rounds.items()) for name, rounds in by_round.items()}


def _named_ledger(text: str) -> tuple[str | None, Path]:
    """`NAME=FILE` as (NAME, FILE); a bare FILE (also one whose name holds "=") as (None, FILE)."""
    name, sep, rest = text.partition("=")
    if sep and name and "/" not in name and not Path(text).exists():
        return name, Path(rest)
    return None, Path(text)


def _silo_labels(named: Sequence[tuple[str | None, Path]]) -> list[tuple[str, Path]]:
    """Each ledger with its label: the name given, else its file name without suffix, else
    (where those repeat) its folder's name, else its whole path."""
    paths = [path for _, path in named]
    for label in (lambda p: p.stem, lambda p: p.resolve().parent.name, str):
        labels = [name or label(path) for name, path in named]
        if len(set(labels)) == len(labels):
            return list(zip(labels, paths, strict=True))
    return [(name or str(path), path) for name, path in named]


def _fmt(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if value == math.inf else f"{value:.6g}"
