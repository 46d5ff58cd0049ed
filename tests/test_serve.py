"""`fedsilo coordinator serve`: one long-running coordinator runs the jobs it is given, one at a
time, while the silo agents, started once, stay connected and take part in job after job.
Real processes on 127.0.0.1 over mTLS; jobs are queued straight into the state file
(`ops.coordinator_serve.submit_local`)."""

from __future__ import annotations

import json
import queue
from collections.abc import Iterator
from pathlib import Path

import pytest
import yaml

from fedsilo.coordinator.admin_api import AdminError
from fedsilo.coordinator.hub import PostedTask, SiloHub
from fedsilo.coordinator.jobs import ABORTED, COMPLETED, JobQueue
from fedsilo.coordinator.state import StateStore
from fedsilo.coordinator.transport import Reply
from fedsilo.ops.coordinator_process import close_serving, open_serving
from fedsilo.ops.coordinator_serve import ServeBackend
from fedsilo.ops.provision import load_coordinator_kit
from fedsilo.privacy.identity import read_signing_key
from fedsilo.privacy.ledger import PrivacyLedger
from fedsilo.privacy.policy_signing import sign_policy
from tests.deployment import (
    SILOS,
    Consortium,
    policy_document,
    provision,
    wait_for,
    wait_until_ended,
)


def tasks_booked(consortium: Consortium, silo: str) -> dict[str, set[str]]:
    """The task ids the silo's ledger booked, by job."""
    ledger = PrivacyLedger(consortium.root / "sites" / silo / "privacy-ledger.jsonl")
    booked: dict[str, set[str]] = {}
    for record in ledger.records():
        booked.setdefault(record.deployment, set()).add(record.task_id)
    return booked


def participants(consortium: Consortium, job: str) -> dict[str, str]:
    with StateStore(consortium.root / "state.db") as store:
        return {silo: status for silo, (status, _) in store.participants(job).items()}


def test_silos_started_once_take_part_in_two_jobs_one_after_the_other(
    consortium: Consortium,
) -> None:
    consortium.start_serve()
    for silo in SILOS:
        consortium.start_silo(silo)
    first = consortium.submit(
        consortium.write_policy(policy_document(rounds=2, name="first"), "first.yaml")
    )
    assert wait_until_ended(consortium, first).status == COMPLETED
    assert all(consortium.processes[silo].poll() is None for silo in SILOS)

    second = consortium.submit(
        consortium.write_policy(policy_document(rounds=2, name="second"), "second.yaml")
    )
    assert wait_until_ended(consortium, second).status == COMPLETED
    jobs = consortium.root / "state.jobs"
    for job in (first, second):
        results = json.loads((jobs / job / "results" / "results.json").read_text())
        assert results["job"] == job
        assert f"job {job} complete at round 2" in (jobs / job / "coordinator.log").read_text()
        assert participants(consortium, job) == dict.fromkeys(SILOS, "active")
    for silo in SILOS:
        booked = tasks_booked(consortium, silo)
        assert booked[first] and booked[second]
        assert not booked[first] & booked[second]
        assert consortium.processes[silo].poll() is None  # still connected, for a next job


def test_a_silo_that_refuses_a_job_stays_connected_and_takes_part_in_the_next(
    consortium: Consortium,
) -> None:
    consortium.start_serve()
    consortium.start_silo("silo-0")
    consortium.start_silo("silo-1")
    consortium.start_silo("silo-2", consortium.write_silo_config("silo-2", max_rounds=2))
    refused = consortium.submit(
        consortium.write_policy(policy_document(rounds=3, name="long"), "long.yaml")
    )
    assert wait_until_ended(consortium, refused).status == COMPLETED
    assert participants(consortium, refused)["silo-2"] == "refused"
    assert consortium.processes["silo-2"].poll() is None

    accepted = consortium.submit(
        consortium.write_policy(policy_document(rounds=2, name="short"), "short.yaml")
    )
    assert wait_until_ended(consortium, accepted).status == COMPLETED
    assert participants(consortium, accepted)["silo-2"] == "active"
    decisions = [
        json.loads(line)
        for line in (consortium.root / "sites" / "silo-2" / "accepted_policies.jsonl")
        .read_text()
        .splitlines()
    ]
    assert [(d["policy"], d["accepted"]) for d in decisions] == [("long", False), ("short", True)]


def test_a_site_keeps_its_decisions_beside_its_ledger_so_silo_yaml_may_be_read_only(
    consortium: Consortium,
) -> None:
    """As in the container image: silo.yaml and the kit are read-only mounts, the ledger and
    everything else the agent writes live on the state volume."""
    consortium.start_serve()
    for silo in ("silo-0", "silo-1"):
        consortium.start_silo(silo)
    config = consortium.write_silo_config("silo-2")
    state = consortium.root / "state-volume"
    document = yaml.safe_load(config.read_text())
    document |= {"ledger": str(state / "privacy-ledger.jsonl"), "state": str(state / "silo")}
    config.write_text(yaml.safe_dump(document))
    consortium.start_silo("silo-2", config)
    job = consortium.submit(consortium.write_policy(policy_document(rounds=2)))
    assert wait_until_ended(consortium, job).status == COMPLETED
    (decision,) = (state / "accepted_policies.jsonl").read_text().splitlines()
    assert json.loads(decision)["accepted"] is True
    assert sorted(path.name for path in config.parent.iterdir()) == ["silo.yaml"]


def test_a_site_that_changes_its_rules_between_jobs_needs_no_restart_of_its_agent(
    consortium: Consortium,
) -> None:
    consortium.start_serve()
    for silo in ("silo-0", "silo-1"):
        consortium.start_silo(silo)
    consortium.start_silo("silo-2", consortium.write_silo_config("silo-2", max_rounds=3))
    first = consortium.submit(
        consortium.write_policy(policy_document(rounds=2, name="allowed"), "allowed.yaml")
    )
    assert wait_until_ended(consortium, first).status == COMPLETED
    assert participants(consortium, first)["silo-2"] == "active"

    consortium.write_silo_config("silo-2", max_rounds=1)  # the site tightens its rule
    second = consortium.submit(
        consortium.write_policy(policy_document(rounds=2, name="now-too-long"), "second.yaml")
    )
    assert wait_until_ended(consortium, second).status == COMPLETED
    assert participants(consortium, second)["silo-2"] == "refused"
    assert consortium.processes["silo-2"].poll() is None  # the same agent, still connected


def test_an_aborted_job_stops_keeps_its_rounds_and_the_next_job_runs(
    consortium: Consortium,
) -> None:
    consortium.start_serve()
    for silo in SILOS:
        consortium.start_silo(silo)
    endless = consortium.submit(
        consortium.write_policy(policy_document(rounds=500, name="endless"), "endless.yaml")
    )
    next_job = consortium.submit(
        consortium.write_policy(policy_document(rounds=2, name="next"), "next.yaml")
    )

    def rounds_saved() -> int:
        with StateStore(consortium.root / "state.db") as store:
            saved = store.last_round(endless)
        return 0 if saved is None else saved.round

    wait_for(lambda: rounds_saved() >= 2, 60, f"two rounds of {endless}", consortium)
    jobs = JobQueue(consortium.root / "state.db")
    jobs.request_abort(endless)  # what `fedsilo job abort` asks of the backend
    jobs.close()
    ended = wait_until_ended(consortium, endless)
    assert (ended.status, ended.error) == (ABORTED, "aborted by the operator")
    assert 2 <= rounds_saved() < 500
    assert wait_until_ended(consortium, next_job).status == COMPLETED
    assert all(consortium.processes[silo].poll() is None for silo in SILOS)


def test_a_silo_enrolled_while_the_coordinator_serves_takes_part_in_the_next_job(
    tmp_path: Path,
) -> None:
    consortium = provision(tmp_path, SILOS[:2])
    try:
        consortium.start_serve()
        for silo in SILOS[:2]:
            consortium.start_silo(silo)
        consortium.wait_for_log("coordinator", "serving mTLS gRPC")
        consortium.add_silo("silo-2")
        consortium.start_silo("silo-2")
        job = consortium.submit(consortium.write_policy(policy_document(rounds=2)))
        assert wait_until_ended(consortium, job).status == COMPLETED
        assert participants(consortium, job) == dict.fromkeys(SILOS, "active")
        assert tasks_booked(consortium, "silo-2")[job]
    finally:
        consortium.stop_all()


# -- in process: the hub between jobs, and the admin backend ----------------------------------


def test_a_join_between_jobs_waits_for_the_next_job_and_a_refusal_lasts_one_job() -> None:
    hub = SiloHub(["s0", "s1"])
    assert hub.wait_for_job("s0", 0.05) is None  # no job yet: the service answers IDLE
    hub.start_job("job-1")
    assert hub.wait_for_job("s0", 0.05) == "job-1"
    hub.refuse("s1", "max_rounds")
    assert hub.wait_for_job("s1", 0.05) is None  # it is not asked to refuse job-1 again
    hub.end_job()
    assert hub.finished.is_set() and hub.wait_for_job("s0", 0.05) is None
    hub.start_job("job-2")
    assert not hub.finished.is_set() and hub.refused == {} and hub.accepted == set()
    assert hub.wait_for_job("s1", 0.05) == "job-2"


def test_an_aborted_job_fails_its_waiting_tasks_and_every_task_posted_later() -> None:
    hub = SiloHub(["s0", "s1"])
    hub.start_job("job")
    hub.accept("s0")
    replies: queue.Queue[Reply] = queue.Queue()
    hub.post(PostedTask("s0", "job/r1/train/s0", 1, b"task"), replies)
    hub.abort("aborted by the operator")
    assert replies.get_nowait().failure == "aborted by the operator"
    assert hub.next_task("s0", 0.01) is None
    hub.post(PostedTask("s0", "job/r2/train/s0", 2, b"task"), replies)
    assert replies.get_nowait().failure == "aborted by the operator"
    assert hub.wait_for_members(2, 30) == ["s0"]  # returns at once
    hub.start_job("next")
    assert hub.aborted is None


@pytest.fixture
def backend(tmp_path: Path) -> Iterator[ServeBackend]:
    consortium = provision(tmp_path)
    kit = load_coordinator_kit(consortium.kits / "coordinator")
    serving = open_serving(kit, tmp_path / "state.db", None, 0.5, 1 << 20, None, workers=4)
    jobs = JobQueue(tmp_path / "state.db")
    yield ServeBackend(serving, jobs, tmp_path / "state.jobs", tmp_path / "state.db")
    jobs.close()
    close_serving(serving)


def signed(backend: ServeBackend, document: dict) -> tuple[str, str]:
    path = backend.state.parent / "policy.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    operator = read_signing_key(backend.state.parent / "kits" / "operator" / "operator.key")
    return path.read_text(), sign_policy(path, operator).read_text().strip()


def test_the_backend_queues_a_signed_policy_once(backend: ServeBackend) -> None:
    text, signature = signed(backend, policy_document())
    job = backend.submit(text, signature, "operator")
    assert (job.status, job.name) == ("queued", "breast-cancer-deployed")
    with pytest.raises(AdminError, match="already submitted"):
        backend.submit(text, signature, "operator")
    status = backend.consortium_status()
    assert (status["running"], status["queued"], status["job"]) == (None, [job.job_id], None)
    assert status["silos"] == {
        s: {"connected": False, "revoked": False, "reason": ""} for s in SILOS
    }


def test_the_backend_refuses_a_tampered_an_invalid_or_a_central_policy(
    backend: ServeBackend,
) -> None:
    text, signature = signed(backend, policy_document())
    with pytest.raises(AdminError, match="signature"):
        backend.submit(text.replace("seed: 7", "seed: 8"), signature, "operator")
    with pytest.raises(AdminError, match="rounds"):
        backend.submit(*signed(backend, policy_document(rounds=0)), "operator")
    with pytest.raises(AdminError, match="central"):
        backend.submit(*signed(backend, policy_document(algorithm={"name": "central"})), "op")
    assert backend.jobs() == []


def test_the_backend_gives_results_and_logs_only_of_known_jobs_and_results_once_ended(
    backend: ServeBackend,
) -> None:
    job = backend.submit(*signed(backend, policy_document()), "operator").job_id
    with pytest.raises(AdminError, match="has not ended"):
        backend.results(job)
    with pytest.raises(AdminError, match="no job 'nope'"):
        backend.logs("nope", None)
    assert backend.abort(job).status == ABORTED
    with pytest.raises(AdminError, match="without results"):
        backend.results(job)
    with pytest.raises(AdminError, match="already ended"):
        backend.abort(job)
    folder = backend.jobs_folder / job
    (folder / "results").mkdir(parents=True)
    (folder / "results" / "results.json").write_text("{}")
    (folder / "coordinator.log").write_text("one\ntwo\nthree\n")
    assert backend.results(job) == {"results.json": b"{}"}
    assert backend.logs(job, 2) == "two\nthree\n"
