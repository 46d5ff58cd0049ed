"""`fedsilo job list` and `job status` for eyes, at a terminal's width: every job's id (or its
shortened form, which keeps the digest and attempt), status, submitted and ended stay whole on
its one line at 80, 100 and 120 columns however long its note (a failure reason) is; the note
takes what is left, cut with an ellipsis. `job status` of a running job says its round, "round
R of N", from the admin STATUS reply's `progress` (the coordinator's state file)."""

from __future__ import annotations

import io
import re
import time
from pathlib import Path
from typing import Any

import click
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from rich.console import Console

from fedsilo.coordinator.admin_service import AdminService
from fedsilo.coordinator.jobs import JobInfo
from fedsilo.coordinator.state import StateStore
from fedsilo.ops import job_cli
from fedsilo.ops.coordinator_serve import ServeBackend
from fedsilo.wire.admin import STATUS, AdminReply
from tests.test_admin import JOB, FakeBackend
from tests.test_state import server_state

KEY_COLUMNS = ("job", "status", "submitted", "ended")
SUBMITTED = time.mktime((2026, 3, 14, 9, 26, 0, 0, 0, -1))


def job(
    job_id: str,
    status: str,
    error: str = "",
    ended: bool = True,
    abort_requested: bool = False,
) -> JobInfo:
    return JobInfo(
        job_id=job_id,
        name=job_id.rsplit("-", 1)[0],
        policy_digest="3f9a1c2e" * 8,
        status=status,
        submitted_by="operator",
        submitted_at=SUBMITTED,
        started_at=SUBMITTED + 60,
        finished_at=SUBMITTED + 7260 if ended else None,
        abort_requested=abort_requested,
        error=error,
    )


def jobs_with_notes(note: str) -> list[JobInfo]:
    return [
        job("heart-fedavg-3f9a1c2e", "completed"),
        job("breast-cancer-fedprox-3f9a1c2e", "failed", f"round 7 failed: {note}"),
        job("diabetes-readmission-fedprox-eu-3f9a1c2e-attempt2", "refused", note),
        job("heart-scaffold-3f9a1c2e", "running", ended=False, abort_requested=True),
        job("heart-dp-3f9a1c2e", "queued", ended=False),
    ]


def rendered(
    monkeypatch: pytest.MonkeyPatch, width: int, jobs: list[JobInfo], command: Any, **args: Any
) -> str:
    """What `command` (job_cli's `list` or `status`) prints at `width` columns, the admin
    channel answering `jobs` (a list) or a STATUS document (a dict)."""
    console = Console(width=width, record=True, color_system=None, file=io.StringIO())
    monkeypatch.setattr(job_cli, "console", console)
    data: Any = [info.to_json() for info in jobs] if isinstance(jobs, list) else jobs
    monkeypatch.setattr(job_cli, "_call", lambda *a, **k: AdminReply(ok=True, data=data))
    command.callback(kit_dir=Path("kit"), as_json=False, **args)
    return console.export_text()


def shown_id(line: str, job_id: str) -> bool:
    """`job_id` whole on `line`, or shortened: a start of its name, "…", and its digest (and
    attempt) whole."""
    if job_id in line:
        return True
    head, _, tail = job_id.partition("-3f9a1c2e")
    return re.search(f"│ {re.escape(head[:4])}[^ ]*…-3f9a1c2e{tail} ", line) is not None


def assert_key_columns_whole(text: str, width: int, jobs: list[JobInfo]) -> None:
    lines = text.splitlines()
    assert all(len(line) <= width for line in lines), text
    header = next(line for line in lines if "status" in line)
    for column in KEY_COLUMNS:
        assert f" {column} " in header, text
    for info in jobs:
        line = next((line for line in lines if shown_id(line, info.job_id)), None)
        assert line is not None, f"{info.job_id} not shown at {width} columns:\n{text}"
        submitted = time.strftime("%m-%d %H:%M", time.localtime(info.submitted_at))
        ended = (
            "-"
            if info.finished_at is None
            else time.strftime("%m-%d %H:%M", time.localtime(info.finished_at))
        )
        for value in (info.status, submitted, ended):
            assert f" {value} " in line, f"{value!r} of {info.job_id} at {width}:\n{text}"


@pytest.mark.parametrize("width", [80, 100, 120])
def test_job_list_keeps_every_key_column_whole_beside_a_300_character_note(
    monkeypatch: pytest.MonkeyPatch, width: int
) -> None:
    jobs = jobs_with_notes("the silos' answers did not verify " + "x" * 266)
    text = rendered(monkeypatch, width, jobs, job_cli.list_jobs)
    assert_key_columns_whole(text, width, jobs)
    assert "round 7" in text and "…" in text  # the note, cut with an ellipsis to what is left


@settings(max_examples=40, deadline=None)
@given(
    note=st.text(st.sampled_from("ab cd-/:"), max_size=500),
    width=st.integers(min_value=80, max_value=200),
)
def test_job_list_keeps_its_key_columns_whatever_the_note_and_width(note: str, width: int) -> None:
    with pytest.MonkeyPatch.context() as monkeypatch:
        jobs = jobs_with_notes(note)
        assert_key_columns_whole(rendered(monkeypatch, width, jobs, job_cli.list_jobs), width, jobs)


def test_job_list_shows_whole_ids_when_they_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = jobs_with_notes("x" * 300)
    text = rendered(monkeypatch, 120, jobs, job_cli.list_jobs)
    assert all(info.job_id in text for info in jobs), text


def test_short_ids_leave_the_note_the_rest_of_80_columns(monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = [
        job("first-3f9a1c2e", "completed"),
        job("strict-3f9a1c2e", "refused", "refused by silo-2: 2 of 3 silos accepted the policy"),
    ]
    text = rendered(monkeypatch, 80, jobs, job_cli.list_jobs)
    assert_key_columns_whole(text, 80, jobs)
    assert "│ strict-3f9a1c2e │" in text and "refused by silo-2" in text, text


def running_status(progress: dict[str, Any] | None) -> dict[str, Any]:
    return {
        **job("heart-fedavg-3f9a1c2e", "running", ended=False).to_json(),
        "awaiting": [{"silo": "silo-1", "task_id": "t-31-fit", "since": 1.0e9, "until": None}],
        "progress": progress,
    }


@pytest.mark.parametrize("width", [80, 120])
def test_job_status_of_a_running_job_says_its_round_of_the_rounds(
    monkeypatch: pytest.MonkeyPatch, width: int
) -> None:
    data = running_status({"round": 31, "rounds": 40})
    text = rendered(monkeypatch, width, data, job_cli.job_status, job="heart-fedavg-3f9a1c2e")
    assert "round 31 of 40" in text and "task t-31-fit" in text


def test_job_status_before_any_round_or_from_an_older_coordinator_says_no_round(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for progress in (None, {"round": 0, "rounds": 40}):
        data = running_status(progress)
        text = rendered(monkeypatch, 80, data, job_cli.job_status, job="heart-fedavg-3f9a1c2e")
        assert "round" not in text, text
    data = running_status(None)
    del data["progress"]  # a coordinator from before `progress`
    text = rendered(monkeypatch, 80, data, job_cli.job_status, job="heart-fedavg-3f9a1c2e")
    assert "heart-fedavg-3f9a1c2e" in text


def test_the_status_reply_carries_the_jobs_progress() -> None:
    backend = FakeBackend()
    reply = AdminService.__new__(AdminService)
    reply.backend = backend
    data = reply._dispatch(STATUS, {"job": JOB}).data
    assert data["progress"] == {"round": 3, "rounds": 5}
    assert ("progress", (JOB,)) in backend.calls


def test_the_serving_coordinator_reads_a_jobs_progress_from_its_state_file(
    tmp_path: Path,
) -> None:
    state = tmp_path / "coordinator.db"
    with StateStore(state) as store:
        store.open_deployment("heart-3f9a1c2e", "1" * 64, '{"rounds": 40}')
        store.open_deployment("not-started-3f9a1c2e", "2" * 64, '{"rounds": 4}')
        for number in range(32):
            status = "setup" if number == 0 else "completed"
            store.save_round("heart-3f9a1c2e", number, status, server_state(), {"round": number})
    backend = ServeBackend.__new__(ServeBackend)
    backend.state = state
    assert backend.progress("heart-3f9a1c2e") == {"round": 31, "rounds": 40}
    assert backend.progress("not-started-3f9a1c2e") is None
    assert backend.progress("unknown-3f9a1c2e") is None


def evaluated_record(number: int, accuracy: float) -> dict[str, Any]:
    summary = {"weighted_mean": accuracy, "worst": accuracy, "best": accuracy}
    return {
        "round": number,
        "status": "completed",
        "seconds": 0.1,
        "evaluation": {"silo-0": {"accuracy": accuracy}},
        "test_sizes": {"silo-0": 40},
        "summary": {"accuracy": summary},
    }


def test_job_status_of_a_running_job_shows_its_last_evaluated_metrics(tmp_path: Path) -> None:
    """The serving coordinator reads the last round that evaluated (round 30 of 31 saved) from
    its state file, and `job status` shows its cross-silo means."""
    state = tmp_path / "coordinator.db"
    with StateStore(state) as store:
        store.open_deployment("heart-3f9a1c2e", "1" * 64, '{"rounds": 40}')
        store.save_round("heart-3f9a1c2e", 0, "setup", server_state(), {"round": 0})
        for number in range(1, 32):
            record = evaluated_record(number, number / 100) if number % 10 == 0 else {}
            store.save_round(
                "heart-3f9a1c2e", number, "completed", server_state(), record or {"round": number}
            )
    backend = ServeBackend.__new__(ServeBackend)
    backend.state = state
    progress = backend.progress("heart-3f9a1c2e")
    assert progress == {
        "round": 31,
        "rounds": 40,
        "metrics": {"round": 30, "values": {"accuracy": 0.3}},
    }


def test_metrics_under_dp_are_shown_clipped_and_marked_noised(tmp_path: Path) -> None:
    state = tmp_path / "coordinator.db"
    policy = '{"rounds": 4, "privacy": {"dp_sgd": {"noise_multiplier": 1.0}}}'
    with StateStore(state) as store:
        store.open_deployment("heart-3f9a1c2e", "1" * 64, policy)
        store.save_round("heart-3f9a1c2e", 0, "setup", server_state(), {"round": 0})
        store.save_round("heart-3f9a1c2e", 1, "completed", server_state(), evaluated_record(1, 1.2))
    backend = ServeBackend.__new__(ServeBackend)
    backend.state = state
    metrics = backend.progress("heart-3f9a1c2e")["metrics"]  # type: ignore[index]
    assert metrics == {"round": 1, "values": {"accuracy (noised)": 1.0}}


def test_job_status_prints_the_last_metrics(monkeypatch: pytest.MonkeyPatch) -> None:
    progress = {
        "round": 31,
        "rounds": 40,
        "metrics": {"round": 30, "values": {"accuracy": 0.9474, "loss": 0.17651}},
    }
    data = running_status(progress)
    text = rendered(monkeypatch, 80, data, job_cli.job_status, job="heart-fedavg-3f9a1c2e")
    assert "round 30: accuracy 0.9474, loss 0.1765" in text, text


IDS = [
    "heart-fedavg-3f9a1c2e",
    "heart-fedavg-3f9a1c2e-attempt2",
    "heart-fedprox-77aa0b1c",
    "diabetes-readmission-fedprox-eu-3f9a1c2e-attempt2",
]


@pytest.mark.parametrize("width", [24, 30, 40])
def test_a_shortened_id_as_job_list_prints_it_names_its_job(width: int) -> None:
    for job_id in IDS:
        assert job_cli.match_job(job_cli.short_id(job_id, width), IDS) == job_id


def test_a_start_of_an_id_names_its_job_and_an_ambiguous_one_names_the_candidates() -> None:
    assert job_cli.match_job("heart-fedp", IDS) == "heart-fedprox-77aa0b1c"
    assert job_cli.match_job("diab", IDS) == IDS[3]
    assert job_cli.match_job("heart-fedavg-3f9a1c2e", IDS) == IDS[0]  # whole: itself
    assert job_cli.match_job("lung", IDS) == "lung"  # none: the coordinator says so
    with pytest.raises(click.ClickException) as error:
        job_cli.match_job("heart-fedavg", IDS)
    assert error.value.message == (
        "JOB 'heart-fedavg' is ambiguous: it names 2 jobs, heart-fedavg-3f9a1c2e, "
        "heart-fedavg-3f9a1c2e-attempt2; give more of the id"
    )


def test_a_whole_id_is_sent_as_it_is_without_asking_for_the_list(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    asked: list[str] = []
    monkeypatch.setattr(
        job_cli, "_call", lambda kit, command, **a: asked.append(command) or AdminReply(True)
    )
    for job_id in IDS:
        assert job_cli.resolve_job(Path("kit"), job_id) == job_id
    assert asked == []
