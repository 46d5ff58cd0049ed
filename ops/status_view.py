"""How `fedsilo status` shows a consortium: the running coordinator's view of its silos and
queue, the job shown (running, or the one that ended last) with its status, and a table of the
silos in that job's rounds; the same whether it was read from the coordinator's state file
(`--kit COORDINATOR_KIT --state`) or asked of a running coordinator over the admin channel
(`--kit OPERATOR_KIT`): both render the document `--json` prints (ops/status.py). Then one line
on the kit's own TLS certificate (`print_certificate`): how long it is valid, and from 30 days
before it expires, to renew it."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from fedsilo.coordinator.jobs import RUNNING, JobInfo
from fedsilo.ops.epsilon import fmt_epsilon
from fedsilo.ops.report import fmt_metric
from fedsilo.ops.shown_metrics import NOISED
from fedsilo.ops.status import FROM_COORDINATOR, DeploymentStatus
from fedsilo.privacy.certificate_files import CertificateError, expiry_note, read_certificate

STATUS_WIDTH = 40  # the most the status column reserves for its longest word


def print_consortium(console: Console, document: Mapping[str, Any]) -> None:
    """The status document (`consortium_document`) for eyes: who is connected and queued (from
    a running coordinator), the job shown and how it ended or stands, and its silos' table."""
    silos = document["silos"]
    if document["source"] == FROM_COORDINATOR:
        connected = [name for name, silo in silos.items() if silo["connected"]]
        console.print(
            f"consortium {document['consortium']}: running {document['running'] or 'no job'}, "
            f"{len(document['queued'])} queued; connected silos: {', '.join(connected) or 'none'}",
            soft_wrap=True,
        )
    job = None if document["job"] is None else JobInfo.from_json(document["job"])
    progress = document["progress"]
    if job is None and progress is None:
        console.print("no job has run yet")
        return
    if progress is None:
        assert job is not None
        why = f"; {job.error}" if job.error else ""
        console.print(f"{job_heading(job)}: no round ran{why}", soft_wrap=True)
        for silo, reason in job.refusals.items():
            console.print(f"  {silo} refused: {reason}", soft_wrap=True)
        return
    print_status(console, DeploymentStatus.from_json(progress), silos, job)


def job_heading(job: JobInfo) -> str:
    """`job X (running)`, or `latest job X (aborted)` for one that ended."""
    if job.status == RUNNING:
        return f"job {job.job_id} (running{', abort requested' if job.abort_requested else ''})"
    return f"latest job {job.job_id} ({job.status})"


def print_status(
    console: Console,
    report: DeploymentStatus,
    silos: Iterable[str],
    job: JobInfo | None = None,
) -> None:
    """The deployment's round, participants, last metrics and dropouts, for `silos`; under DP
    each silo's epsilon and the metrics marked as noised. With `job` (a coordinator that
    serves jobs), the job's status heads it, and why it ended if it did not complete."""
    planned = f" of {report.rounds_planned}" if report.rounds_planned else ""
    if job is None:
        console.print(
            f"deployment {report.deployment}: round {report.last_round}{planned} "
            f"({report.last_status}), {report.failed_rounds} failed round(s)"
        )
    else:
        why = f"; {job.error}" if job.error else ""
        console.print(
            f"{job_heading(job)}: round {report.last_round}{planned}, "
            f"{report.failed_rounds} failed round(s){why}",
            soft_wrap=True,
        )
    evaluated = (
        "no round evaluated yet"
        if report.evaluated_round is None
        else f"metrics of round {report.evaluated_round}"
    )
    metric_names = sorted({m for values in report.last_evaluation.values() for m in values})
    rows = {silo: report.participants.get(silo, ("never joined", "")) for silo in sorted(silos)}
    show_epsilon = report.noised or bool(report.epsilon)
    cap = f" (cap {report.epsilon_cap:g})" if report.epsilon_cap is not None else ""
    cells = {
        silo: {
            "status": f"{state} {reason}".strip(),
            "dropouts": str(report.dropouts.get(silo, 0)),
            "epsilon": fmt_epsilon(report.epsilon.get(silo)) if show_epsilon else "",
            **{m: fmt_metric(report.last_evaluation.get(silo, {}).get(m)) for m in metric_names},
        }
        for silo, (state, reason) in rows.items()
    }
    columns = [
        ("silo", "silo", "left"),
        ("status", "status", "left"),
        ("dropouts", "rounds with a dropout", "right"),
        *([("epsilon", f"ε{cap}", "right")] if show_epsilon else []),
        *((m, f"{m} {NOISED}" if report.noised else m, "right") for m in metric_names),
    ]
    widths = _column_widths(columns, cells, console.width)
    shown = [column for column in columns if column[0] in widths]
    table = Table(title=f"silos ({evaluated})")
    captions = []
    if report.noised:
        captions.append(
            f"{NOISED}: reported with Gaussian noise (DP), not exact; shown clipped into each "
            "metric's range"
        )
    if hidden := [name for name, _, _ in columns if name not in widths]:
        captions.append(
            f"not shown at this width: {', '.join(hidden)} (`--json` shows every metric)"
        )
    table.caption = "\n".join(captions) or None
    for key, header, justify in shown:
        table.add_column(header, justify=justify, min_width=widths[key], max_width=widths[key])
    for silo, row in cells.items():
        table.add_row(Text(silo), *(row[key] for key, _, _ in shown[1:]))
    console.print(table)


def _column_widths(
    columns: list[tuple[str, str, str]], cells: Mapping[str, Mapping[str, str]], width: int
) -> dict[str, int]:
    """The width of each column of the silos' table that fits in `width` columns: every
    column at least as wide as its longest word (a header wraps between its words, a status
    reason too; the status column needs at most STATUS_WIDTH for that) and the silo's whole
    name; the metrics that fit after the silo, status, dropout and epsilon columns (the others
    are left out); then what is left makes each header whole, then the status column wider, so
    that its reason wraps less."""
    rows = list(cells.values())

    def longest_word(key: str, header: str) -> int:
        words = [w for text in (header, *(row.get(key, "") for row in rows)) for w in text.split()]
        return max(map(len, words), default=1)

    widths: dict[str, int] = {"silo": max(len("silo"), *map(len, cells), 1)}
    # each column has one space either side and a rule after it, and the table one before all
    left = width - 1 - (widths["silo"] + 3)
    for key, header, _ in columns[1:]:
        needed = longest_word(key, header)
        if key == "status":
            needed = min(needed, STATUS_WIDTH)
        if needed + 3 > left and key not in ("status", "dropouts", "epsilon"):
            break  # this metric and the ones after it do not fit
        widths[key] = needed
        left -= needed + 3
    # what is left: first each header whole on one line, then the status column
    for key, header, _ in columns[1:]:
        if key in widths and key != "status":
            whole = max([len(header), *(len(row[key]) for row in rows)])
            grown = max(0, min(left, whole - widths[key]))
            widths[key] += grown
            left -= grown
    whole = max([len("status"), *(len(row["status"]) for row in rows)])
    widths["status"] += max(0, min(left, whole - widths["status"]))
    return widths


def print_certificate(console: Console, party: str, path: Path) -> None:
    """The line on `party`'s certificate in `path`: valid until when, or expired."""
    try:
        note = expiry_note(path, read_certificate(path))
    except CertificateError as exc:
        note = str(exc)
    console.print(f"certificate of the {party}: {note}", soft_wrap=True, highlight=False)
