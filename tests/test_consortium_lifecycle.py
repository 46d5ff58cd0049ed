"""A consortium's life in one run, every party a real process over mTLS: `coordinator serve`
and three silo agents start once and the operator administers them remotely with its own kit.

Three jobs are submitted with `fedsilo job submit` (FedAvg, DP FedAvg, DP SuPerFed). Between
jobs 1 and 2 a silo is revoked: it is refused in jobs 2 and 3 and shown as revoked. The
coordinator is killed with SIGKILL in the middle of job 2 and started again with the same
command: job 2 resumes and ends with the model of an uninterrupted run, then job 3 runs. A
fourth silo enrolled with `fedsilo consortium add-silo` before job 3 takes part in it. Every
ledger audits clean with distinct task ids per job, and the site rule
`rules.total_epsilon_cap` has a silo refuse job 3, before booking anything, because its plan
for job 3 and what it spent in job 2 would pass it.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from fedsilo.coordinator.jobs import JobInfo
from fedsilo.ops.admin_client import AdminConnection
from fedsilo.ops.cli import main
from fedsilo.ops.provision import load_operator_kit
from fedsilo.privacy.ledger import PrivacyLedger, verify
from fedsilo.wire.admin import CONSORTIUM, STATUS
from fedsilo.wire.tensors import decode_tensors
from tests.deployment import SILOS, Consortium, fedsilo, policy_document, wait_for

DATA = {"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": 4}}
DP = {"delta": 1e-5, "dp_sgd": {"noise_multiplier": 1.0}}
PARTICIPANTS = {"min_silos": 2, "phase_timeout_s": 30}


def job_policy(name: str, rounds: int, **overrides: object) -> dict:
    return policy_document(
        rounds=rounds, name=name, data=DATA, participants=PARTICIPANTS, **overrides
    )


def submit(consortium: Consortium, policy: Path) -> str:
    """`fedsilo job submit POLICY --kit kits/operator`; the job id it prints."""
    result = CliRunner().invoke(
        main,
        ["job", "submit", str(policy), "--kit", str(consortium.kits / "operator")],
        catch_exceptions=False,
    )
    assert result.exit_code == 0, result.output
    return result.output.split(" as job ")[1].split()[0]


def job_info(consortium: Consortium, job: str) -> JobInfo:
    with AdminConnection(load_operator_kit(consortium.kits / "operator")) as admin:
        return JobInfo.from_json(admin.call(STATUS, job=job).data)


def wait_for_job(consortium: Consortium, job: str, timeout: float = 120) -> JobInfo:
    wait_for(
        lambda: job_info(consortium, job).status in {"completed", "failed", "aborted"},
        timeout,
        f"job {job} to end",
        consortium,
        0.3,
    )
    info = job_info(consortium, job)
    assert info.status == "completed", (info, consortium.log("coordinator"))
    return info


def results(consortium: Consortium, job: str) -> Path:
    out = consortium.root / "fetched" / job
    fedsilo("job", "results", job, "--kit", str(consortium.kits / "operator"), "--out", str(out))
    return out


def final_model(folder: Path) -> dict[str, torch.Tensor]:
    tensors, _ = decode_tensors((folder / "final_model.safetensors").read_bytes())
    return tensors


def uninterrupted_job_2(root: Path, consortium: Consortium, policy: dict) -> tuple[Path, float]:
    """Job 2 run once without interruption by `coordinator start`, on the same kits (the same
    keys, so the same noise) with silo-1 revoked: its results folder, and the epsilon silo-2
    spent on it."""
    reference = consortium.sharing_kits(root)
    try:
        signed = reference.write_policy(policy, "job-2.yaml")
        reference.revoke("silo-1")
        reference.start_coordinator(signed, "--out", "results")
        for silo in ("silo-0", "silo-2"):
            reference.start_silo(silo, reference.write_silo_config(silo, data=DATA))
        assert reference.wait("coordinator", timeout=120) == 0, reference.log("coordinator")
        ledger = PrivacyLedger(root / "sites" / "silo-2" / "privacy-ledger.jsonl")
        (job,) = {r.deployment for r in ledger.records()}
        return root / "results", ledger.spent(job) or 0.0
    finally:
        reference.stop_all()


def test_three_jobs_on_agents_started_once_with_a_revocation_an_enrolment_and_a_crash(
    consortium: Consortium, tmp_path_factory: pytest.TempPathFactory
) -> None:
    job_1 = job_policy("lifecycle-fedavg", rounds=2)
    job_2 = job_policy("lifecycle-dp-fedavg", rounds=6, privacy=DP)
    job_3 = job_policy(
        "lifecycle-dp-superfed",
        rounds=3,
        privacy=DP,
        algorithm={"name": "superfed", "start_fraction": 0.5},
    )
    reference, spent_on_job_2 = uninterrupted_job_2(
        tmp_path_factory.mktemp("reference"), consortium, job_2
    )
    assert spent_on_job_2 > 0

    # Job 3 alone stays below silo-2's cap over all jobs (it is shorter than job 2 under the
    # same DP-SGD), but with job 2's spending silo-2 is over it from job 3's first round.
    cap = 1.2 * spent_on_job_2
    configs = {silo: consortium.write_silo_config(silo, data=DATA) for silo in SILOS}
    configs["silo-2"] = consortium.write_silo_config("silo-2", data=DATA, total_epsilon_cap=cap)
    consortium.start_serve()
    consortium.wait_for_log("coordinator", "serving mTLS gRPC")
    for silo, config in configs.items():
        consortium.start_silo(silo, config)

    first = submit(consortium, consortium.write_policy(job_1, "job-1.yaml"))
    wait_for_job(consortium, first)

    consortium.revoke("silo-1")
    assert consortium.wait("silo-1", timeout=60) != 0  # refused by the coordinator: it stops
    assert "refuses this silo" in consortium.log("silo-1")
    consortium.processes.pop("silo-1")  # it exited as it should

    second = submit(consortium, consortium.write_policy(job_2, "job-2.yaml"))
    consortium.wait_for_log("coordinator", "round 2/6 completed", timeout=120, interval=0.02)
    consortium.kill("coordinator")
    consortium.start_serve(name="restarted")  # the same command
    consortium.wait_for_log("restarted", "serving mTLS gRPC")
    wait_for_job(consortium, second, timeout=180)
    resumed = consortium.log("restarted")
    assert "round 1/6" not in resumed and "round 2/6" not in resumed
    assert "round 6/6 completed" in resumed
    fetched_2 = results(consortium, second)
    expected, got = final_model(reference), final_model(fetched_2)
    assert expected.keys() == got.keys()
    for name in expected:
        assert torch.equal(got[name], expected[name]), name

    consortium.add_silo("silo-3")
    consortium.start_silo("silo-3", consortium.write_silo_config("silo-3", data=DATA))
    third = submit(consortium, consortium.write_policy(job_3, "job-3.yaml"))
    refused = wait_for_job(consortium, third, timeout=180).refusals

    # who took part in each job, as the results and the coordinator's status say
    results_2 = json.loads((fetched_2 / "results.json").read_text())
    results_3 = json.loads((results(consortium, third) / "results.json").read_text())
    assert [silo["name"] for silo in results_2["silos"]] == ["silo-0", "silo-2"]
    assert [silo["name"] for silo in results_3["silos"]] == ["silo-0", "silo-3"]
    assert set(refused) == {"silo-2"}  # its plan for job 3 on top of job 2 passes its cap
    assert "spent by earlier jobs" in refused["silo-2"]
    assert f"above rules.total_epsilon_cap {cap:g}" in refused["silo-2"]
    with AdminConnection(load_operator_kit(consortium.kits / "operator")) as admin:
        status = admin.call(CONSORTIUM).data  # what `fedsilo status --kit OPERATOR_KIT` shows
    assert status["silos"]["silo-1"]["revoked"] and not status["silos"]["silo-1"]["connected"]
    assert (status["job"]["job_id"], status["job"]["status"]) == (third, "completed")
    assert status["progress"]["silos"]["silo-1"]["status"] == "revoked"
    assert status["progress"]["silos"]["silo-1"]["rounds_with_a_dropout"] == 0

    # every silo's ledger audits clean, and no task id repeats across jobs
    for silo in ("silo-0", "silo-1", "silo-2", "silo-3"):
        path = consortium.root / "sites" / silo / "privacy-ledger.jsonl"
        report = verify(path)
        assert report.ok, (silo, report.reason)
        tasks_by_job: dict[str, set[str]] = {}
        for record in PrivacyLedger(path).records():
            tasks_by_job.setdefault(record.deployment, set()).add(record.task_id)
            assert record.task_id.startswith(f"{record.deployment}/")
        jobs = list(tasks_by_job.values())
        assert all(not a & b for i, a in enumerate(jobs) for b in jobs[i + 1 :])
    silo_2 = PrivacyLedger(consortium.root / "sites" / "silo-2" / "privacy-ledger.jsonl")
    assert {record.deployment for record in silo_2.records()} == {first, second}  # none of job 3
