"""The job queue of a long-running coordinator (coordinator/jobs.py), in a real state file."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from fedsilo.coordinator.jobs import (
    ABORTED,
    COMPLETED,
    FAILED,
    QUEUED,
    RUNNING,
    JobError,
    JobQueue,
    QueuedPolicy,
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
    with pytest.raises(JobError, match="already submitted \\(failed\\)"):
        submit(queue, "job")


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


def test_a_job_ends_only_as_completed_failed_or_aborted(queue: JobQueue) -> None:
    submit(queue, "job")
    with pytest.raises(ValueError, match="not 'queued'"):
        queue.mark_ended("job", QUEUED)
