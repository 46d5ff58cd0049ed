"""`fedsilo status` and `fedsilo privacy audit` for eyes, at a terminal's width (80 columns and
wider, drawn by Hypothesis as tests/test_job_tables.py draws `job list`'s): every line within
the width; in `status`, each silo's name whole on its row, its state whole, every value shown
whole, each metric either a column or named as not shown at this width; in `privacy audit`,
each job's row with its id whole or shortened keeping its digest (and attempt), and its
numbers whole."""

from __future__ import annotations

import io
import re
from pathlib import Path

from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from fedsilo.ops import privacy_cli
from fedsilo.ops.epsilon import fmt_epsilon
from fedsilo.ops.report import fmt_metric
from fedsilo.ops.status import DeploymentStatus
from fedsilo.ops.status_view import print_status
from fedsilo.privacy.ledger import AuditReport, DeploymentAudit

METRICS = ("accuracy", "auc", "balanced_accuracy", "brier", "c_index", "f1", "loss", "mae", "r2")
STATES = ("active", "accepted", "retired", "revoked", "refused")
REASONS = (
    "",
    "left the study",
    "max_rounds: the policy asks for 40 > 20",
    "budget_exhausted: this task would bring epsilon to 8.5, over the site's cap 8",
)
widths = st.integers(min_value=80, max_value=160)
silo_names = st.from_regex(r"[a-z][a-z0-9-]{2,23}", fullmatch=True)
values = st.one_of(st.none(), st.floats(min_value=-1e6, max_value=1e6, allow_nan=False))


@st.composite
def reports(draw: st.DrawFn) -> tuple[DeploymentStatus, list[str]]:
    silos = draw(st.lists(silo_names, min_size=1, max_size=6, unique=True))
    metrics = draw(st.lists(st.sampled_from(METRICS), max_size=len(METRICS), unique=True))
    noised = draw(st.booleans())
    participants = {
        silo: (draw(st.sampled_from(STATES)), draw(st.sampled_from(REASONS)))
        for silo in silos
        if draw(st.booleans()) or silo == silos[0]
    }
    evaluation = {
        silo: {metric: draw(values) for metric in metrics if draw(st.booleans())}
        for silo in participants
    }
    epsilon = {silo: draw(st.floats(0, 1e4)) for silo in silos} if noised else {}
    report = DeploymentStatus(
        deployment="heart-fedavg-3f9a1c2e",
        rounds_planned=40,
        last_round=31,
        last_status="completed",
        participants=participants,
        last_evaluation={
            s: {m: v for m, v in e.items() if v is not None} for s, e in evaluation.items()
        },
        evaluated_round=31,
        dropouts={silo: draw(st.integers(0, 400)) for silo in silos},
        failed_rounds=0,
        epsilon=epsilon,
        epsilon_cap=draw(st.sampled_from([None, 8.0, 12.5])) if noised else None,
        noised=noised,
    )
    return report, silos


def rendered(width: int, report: DeploymentStatus, silos: list[str]) -> str:
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    print_status(console, report, silos)
    return console.export_text()


@settings(max_examples=150, deadline=None)
@given(width=widths, drawn=reports())
def test_status_keeps_each_silo_its_state_and_its_values_whole(
    width: int, drawn: tuple[DeploymentStatus, list[str]]
) -> None:
    report, silos = drawn
    text = rendered(width, report, silos)
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), text
    metrics = sorted({m for values in report.last_evaluation.values() for m in values})
    hidden = next((line for line in lines if "not shown at this width:" in line), "")
    caption = " ".join(lines[lines.index(hidden) :]) if hidden else ""
    shown = [m for m in metrics if f" {m} " not in f" {caption.replace(',', ' ')} "]
    for silo in silos:
        (row,) = [line for line in lines if line.startswith(f"│ {silo} ")]
        cells = [cell.strip() for cell in row.split("│")[1:-1]]
        state = report.participants.get(silo, ("never joined", ""))[0]
        assert cells[1].startswith(state.split()[0]), text
        assert cells[2] == str(report.dropouts[silo])
        epsilon = [fmt_epsilon(report.epsilon.get(silo))] if report.epsilon else []
        evaluation = report.last_evaluation.get(silo, {})
        numbers = [*epsilon, *(fmt_metric(evaluation.get(m)) for m in shown)]
        assert cells[3:] == numbers, text
    for metric in set(metrics) - set(shown):
        assert metric in caption


ids = st.builds(
    lambda name, digest, attempt: f"{name}-{digest}" + (f"-attempt{attempt}" if attempt else ""),
    st.from_regex(r"[a-z][a-z0-9-]{0,39}[a-z0-9]", fullmatch=True),
    st.from_regex(r"[0-9a-f]{8}", fullmatch=True),
    st.sampled_from([0, 0, 2, 13]),
)
epsilons = st.floats(min_value=1e-3, max_value=1e4)  # what a site spends, and caps
DIGEST_TAIL = re.compile(r"-[0-9a-f]{8}(?:-attempt\d+)?$")  # what tells a job id apart


@settings(max_examples=150, deadline=None)
@given(
    width=widths,
    jobs=st.lists(ids, min_size=1, max_size=5, unique=True),
    spent=st.lists(st.one_of(st.none(), epsilons), min_size=5, max_size=5),
    cap=st.one_of(st.none(), epsilons),
    accountant=st.sampled_from(["rdp", "prv"]),
)
def test_the_privacy_audit_keeps_each_jobs_id_and_its_numbers_whole(
    width: int, jobs: list[str], spent: list[float | None], cap: float | None, accountant: str
) -> None:
    audits = tuple(
        DeploymentAudit(
            deployment=job,
            records=3 * (i + 1),
            delta=None if epsilon is None else 1e-5,
            accountant=None if epsilon is None else accountant,
            booked=epsilon,
            recomputed=epsilon,
            cap=None if epsilon is None else cap,
            problem=None,
        )
        for i, (job, epsilon) in enumerate(zip(jobs, spent, strict=False))
    )
    report = AuditReport(Path("/var/lib/fedsilo/site-ledger.jsonl"), (), None, audits)
    site = privacy_cli._SiteTotal.of(report, cap)
    table, shortened = privacy_cli._audit_table(report, site, width)
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    console.print(table)
    text = console.export_text()
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), text
    whole = {job: short for short, job in shortened.items()}
    for audit in audits:
        label = whole.get(audit.deployment, audit.deployment)
        assert label.endswith(DIGEST_TAIL.search(audit.deployment).group()), label
        (row,) = [line for line in lines if line.lstrip().startswith(f"{label} ")]
        words = row.split()
        assert words[0] == label and words[1] == str(audit.records), text
        if audit.booked is None:
            assert words[2:4] == ["no", "DP"], text
        else:
            booked = privacy_cli._fmt(audit.booked)
            assert words[2:4] == [booked, booked], text
