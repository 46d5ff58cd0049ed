"""The job queue of a long-running coordinator (coordinator/jobs.py), in a real state file."""

from __future__ import annotations

import sqlite3
from collections.abc import Iterator
from pathlib import Path

import pytest

from fedsilo.coordinator.jobs import (
    ABORTED,
    COMPLETED,
    FAILED,
    QUEUED,
    REFUSED,
    RUNNING,
    JobError,
    JobQueue,
    QueuedPolicy,
    recorded_jobs,
)
from fedsilo.coordinator.state import StateStore


@pytest.fixture
def queue(tmp_path: Path) -> Iterator[JobQueue]:
    state = tmp_path / "state.db"
    StateStore(state).close()  # the state file first, as the coordinator makes it
    jobs = JobQueue(state)
    yield jobs
    jobs.close()


def submit(queue: JobQueue, job: str) -> None:
    queue.submit(job, job, QueuedPolicy(job, f"name: {job}\n", "sig", f"digest-{job}"), "operator")


def test_jobs_run_in_submission_order(queue: JobQueue) -> None:
    for job in ("b", "a", "c"):
        submit(queue, job)
    assert queue.next_to_run() == "b"
    queue.mark_running("b")
    queue.mark_ended("b", COMPLETED)
    assert queue.next_to_run() == "a"
    assert [j.job_id for j in queue.jobs()] == ["b", "a", "c"]


def test_a_job_left_running_is_resumed_before_older_queued_ones(queue: JobQueue) -> None:
    for job in ("first", "second", "third"):
        submit(queue, job)
    queue.mark_running("second")  # as a coordinator killed mid-job left it
    assert queue.next_to_run() == "second"


def test_the_queue_and_the_running_job_outlive_the_connection(tmp_path: Path) -> None:
    state = tmp_path / "state.db"
    StateStore(state).close()
    queue = JobQueue(state)
    submit(queue, "one")
    submit(queue, "two")
    queue.mark_running("two")
    queue.close()
    reopened = JobQueue(state)
    assert reopened.next_to_run() == "two"
    assert [(j.job_id, j.status) for j in reopened.jobs()] == [("one", QUEUED), ("two", RUNNING)]
    reopened.close()


def test_the_same_job_is_refused_a_second_time_even_after_it_ended(queue: JobQueue) -> None:
    submit(queue, "job")
    with pytest.raises(JobError, match="already submitted \\(queued\\)"):
        submit(queue, "job")
    queue.mark_running("job")
    queue.mark_ended("job", FAILED, "every round failed")
    with pytest.raises(JobError, match="already submitted \\(failed\\)") as refused:
        submit(queue, "job")
    assert "`fedsilo job submit --retry job`" in str(refused.value)


def test_a_policy_submitted_again_after_a_retry_is_refused_naming_its_latest_attempt(
    queue: JobQueue,
) -> None:
    submit(queue, "job")
    queue.mark_ended("job", REFUSED, "refused by silo-2")
    queue.retry("job", "job-attempt2", "attempt signature", "operator")
    with pytest.raises(JobError, match="job job-attempt2 was already submitted \\(queued\\)"):
        submit(queue, "job")


@pytest.mark.parametrize("status", [FAILED, REFUSED, ABORTED])
def test_a_retry_queues_the_same_signed_policy_as_the_next_attempt(
    queue: JobQueue, status: str
) -> None:
    submit(queue, "job")
    queue.mark_ended("job", status, "why")
    retried = queue.retry("job", "job-attempt2", "attempt signature", "operator")
    assert (retried.job_id, retried.attempt, retried.status) == ("job-attempt2", 2, QUEUED)
    first, second = queue.policy("job"), queue.policy("job-attempt2")
    assert (second.text, second.signature, second.digest) == (
        first.text,
        first.signature,
        first.digest,
    )
    assert (second.attempt, second.attempt_signature) == (2, "attempt signature")
    assert queue.next_to_run() == "job-attempt2"


@pytest.mark.parametrize("status", [QUEUED, RUNNING, COMPLETED])
def test_a_job_that_has_not_ended_or_completed_is_not_retried(queue: JobQueue, status: str) -> None:
    submit(queue, "job")
    if status != QUEUED:
        queue.mark_running("job")
    if status == COMPLETED:
        queue.mark_ended("job", COMPLETED)
    with pytest.raises(JobError) as refused:
        queue.retry("job", "job-attempt2", "attempt signature", "operator")
    assert str(refused.value) == (
        f"job job is {status}: --retry runs again only a job that failed, was refused or was "
        "aborted"
    )
    assert [j.job_id for j in queue.jobs()] == ["job"]


def test_only_the_latest_attempt_at_a_policy_is_retried(queue: JobQueue) -> None:
    submit(queue, "job")
    queue.mark_ended("job", FAILED, "why")
    queue.retry("job", "job-attempt2", "attempt signature", "operator")
    with pytest.raises(JobError, match="latest attempt at its policy is job-attempt2 \\(queued\\)"):
        queue.retry("job", "job-attempt3", "attempt signature", "operator")


def test_a_refused_job_keeps_each_silos_reason_and_its_note_is_one_line(queue: JobQueue) -> None:
    submit(queue, "job")
    queue.mark_running("job")
    reasons = {"silo-2": "max_rounds: the policy asks for 3 > 2", "silo-4": "no data"}
    info = queue.mark_ended("job", REFUSED, "refused by silo-2, silo-4: 1 of 3 ...", reasons)
    assert (info.status, info.refusals) == (REFUSED, reasons)
    assert info.note == "refused by silo-2, silo-4: 1 of 3 ..."
    assert info.to_json()["refusals"] == reasons and info.to_json()["note"] == info.note


def test_a_jobs_table_written_before_attempts_is_upgraded_and_keeps_its_jobs(
    tmp_path: Path,
) -> None:
    state = tmp_path / "state.db"
    StateStore(state).close()
    with sqlite3.connect(state) as db:  # the table as coordinators wrote it before attempts
        db.execute(
            "CREATE TABLE jobs (seq INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL "
            "UNIQUE, name TEXT NOT NULL, policy_digest TEXT NOT NULL, policy_text TEXT NOT "
            "NULL, signature TEXT NOT NULL, submitted_by TEXT NOT NULL, status TEXT NOT NULL "
            "CHECK (status IN ('queued', 'running', 'completed', 'failed', 'aborted')), "
            "abort_requested INTEGER NOT NULL DEFAULT 0, error TEXT NOT NULL DEFAULT '', "
            "submitted_at REAL NOT NULL, started_at REAL, finished_at REAL)"
        )
        db.execute(
            "INSERT INTO jobs (job_id, name, policy_digest, policy_text, signature, "
            "submitted_by, status, error, submitted_at, finished_at) VALUES "
            "('old', 'old', 'digest-old', 'name: old', 'sig', 'operator', 'failed', "
            "'2 of 3 silos accepted', 1.0, 2.0)"
        )
    assert [(j.job_id, j.attempt, j.status) for j in recorded_jobs(state)] == [("old", 1, FAILED)]
    queue = JobQueue(state)
    try:
        assert [(j.job_id, j.attempt, j.error) for j in queue.jobs()] == [
            ("old", 1, "2 of 3 silos accepted")
        ]
        submit(queue, "new")
        queue.mark_ended("new", REFUSED, "refused by silo-2", {"silo-2": "no"})
        assert queue.retry("old", "old-attempt2", "sig2", "operator").attempt == 2
    finally:
        queue.close()
    assert [j.job_id for j in recorded_jobs(state)] == ["old", "new", "old-attempt2"]


def test_the_jobs_of_a_state_file_without_a_queue_are_none(tmp_path: Path) -> None:
    StateStore(tmp_path / "state.db").close()  # `coordinator start`'s: no jobs table
    assert recorded_jobs(tmp_path / "state.db") == []


def test_aborting_a_queued_job_ends_it_at_once_and_it_never_runs(queue: JobQueue) -> None:
    submit(queue, "job")
    info = queue.request_abort("job")
    assert (info.status, info.abort_requested) == (ABORTED, True)
    assert info.finished_at is not None and info.started_at is None
    assert queue.next_to_run() is None


def test_aborting_a_running_job_asks_its_runner_to_stop(queue: JobQueue) -> None:
    submit(queue, "job")
    queue.mark_running("job")
    assert not queue.abort_requested("job")
    info = queue.request_abort("job")
    assert (info.status, info.abort_requested) == (RUNNING, True)
    assert queue.abort_requested("job")
    ended = queue.mark_ended("job", ABORTED, "aborted by the operator")
    assert (ended.status, ended.error) == (ABORTED, "aborted by the operator")


@pytest.mark.parametrize("status", [COMPLETED, FAILED, ABORTED])
def test_an_ended_job_cannot_be_aborted(queue: JobQueue, status: str) -> None:
    submit(queue, "job")
    queue.mark_running("job")
    queue.mark_ended("job", status)
    with pytest.raises(JobError, match=f"already ended \\({status}\\)"):
        queue.request_abort("job")


def test_an_unknown_job_is_refused_by_name(queue: JobQueue) -> None:
    with pytest.raises(JobError, match="no job 'nope'"):
        queue.request_abort("nope")
    with pytest.raises(JobError, match="no job 'nope'"):
        queue.job("nope")


def test_a_job_ends_only_as_completed_failed_refused_or_aborted(queue: JobQueue) -> None:
    submit(queue, "job")
    with pytest.raises(ValueError, match="not 'queued'"):
        queue.mark_ended("job", QUEUED)
