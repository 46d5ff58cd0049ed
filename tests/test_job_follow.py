"""Following a job from the operator's CLI against a real `fedsilo coordinator serve` and three
silo agents (separate processes, mTLS): `job submit --wait` prints the job's status as it
changes and exits 0 once it completed, 1 with the reason when it was refused; `job logs JOB
--follow` prints the coordinator's lines while the job runs and ends by itself with the job;
`job status --json` carries the job's progress (round of rounds) and its refusals; a job id
shortened as `job list` prints it, or an unambiguous start of it, names the job, and an
ambiguous one is refused naming the candidates. The follower and the waiter find the
operator's kit in $FEDSILO_KIT."""

from __future__ import annotations

import os
import re

from click.testing import CliRunner

from fedsilo.ops.cli import main
from fedsilo.ops.job_cli import short_id
from tests.deployment import SILOS, Consortium, policy_document, wait_for
from tests.test_admin_cli import as_json, cli

ALL_THREE = {"min_silos": 3, "phase_timeout_s": 30}  # a job waits for the silo that is not up


def test_submit_wait_and_logs_follow_see_a_job_through_to_its_end(
    consortium: Consortium,
) -> None:
    consortium.start_serve()
    consortium.wait_for_log("coordinator", "serving mTLS gRPC")
    for silo in SILOS[:2]:
        consortium.start_silo(silo)
    policy = consortium.write_policy(
        policy_document(rounds=2, name="study-followed", participants=ALL_THREE), "followed.yaml"
    )
    environment = {**os.environ, "FEDSILO_KIT": str(consortium.kits / "operator")}
    consortium.start("waiter", "job", "submit", str(policy), "--wait", env=environment)
    consortium.wait_for_log("waiter", " as job ")
    job = re.search(r" as job (\S+)", consortium.log("waiter")).group(1)
    shortened = short_id(job, len(job) - 4)
    assert "…" in shortened
    consortium.start("follower", "job", "logs", shortened, "--follow", env=environment)
    consortium.wait_for_log("follower", f"job {job} starts")
    # the job waits for silo-2 to join: it runs, and both still follow it
    assert as_json(consortium, "job", "status", job)["job"]["status"] == "running"
    assert consortium.processes["follower"].poll() is None
    assert consortium.processes["waiter"].poll() is None

    consortium.start_silo(SILOS[2])
    assert consortium.wait("waiter") == 0, consortium.log("waiter")
    assert consortium.wait("follower") == 0, consortium.log("follower")
    waited = consortium.log("waiter").splitlines()
    assert waited[-1] == f"job {job}: completed, round 2 of 2"
    assert f"job {job}: running" in waited
    assert consortium.log("follower") == cli(consortium, "job", "logs", job)
    assert f"job {job} complete at round 2" in consortium.log("follower")

    status = as_json(consortium, "job", "status", job[:10])["job"]
    assert status["job_id"] == job
    progress = status["progress"]
    assert (progress["round"], progress["rounds"], progress["metrics"]["round"]) == (2, 2, 2)
    assert set(progress["metrics"]["values"]) >= {"accuracy", "loss"}
    assert status["refusals"] == {}


def test_submit_wait_exits_1_with_the_reason_and_job_ids_resolve_from_a_prefix(
    consortium: Consortium,
) -> None:
    consortium.serve_with_silos({"silo-2": consortium.write_silo_config("silo-2", max_rounds=2)})
    strict = consortium.write_policy(
        policy_document(rounds=3, name="study-strict", participants=ALL_THREE), "strict.yaml"
    )
    kit = ["--kit", str(consortium.kits / "operator")]
    result = CliRunner().invoke(main, ["job", "submit", str(strict), "--wait", *kit])
    assert result.exit_code == 1, result.output
    job = re.search(r" as job (\S+)", result.output).group(1)
    assert "  refused by silo-2: max_rounds: the policy asks for 3 > 2" in result.output
    assert result.output.splitlines()[-1] == (
        f"Error: job {job} refused: refused by silo-2: 2 of 3 silos accepted the policy, "
        "min_silos is 3"
    )
    assert "Traceback" not in result.output

    status = as_json(consortium, "job", "status", short_id(job, len(job) - 3))["job"]
    assert status["job_id"] == job
    assert status["progress"] is None  # no round ran
    assert status["refusals"] == {"silo-2": "max_rounds: the policy asks for 3 > 2"}

    other = consortium.write_policy(
        policy_document(rounds=1, name="study-other", participants=ALL_THREE), "other.yaml"
    )
    second = cli(consortium, "job", "submit", str(other)).split(" as job ")[1].split()[0]
    wait_for(
        lambda: as_json(consortium, "job", "status", second)["job"]["finished_at"],
        60,
        "the second job to end",
        consortium,
    )
    ambiguous = CliRunner().invoke(main, ["job", "status", "study-", *kit])
    assert ambiguous.exit_code == 1
    assert ambiguous.output == (
        f"Error: JOB 'study-' is ambiguous: it names 2 jobs, {job}, {second}; give more of the id\n"
    )
    assert f"job {second} starts" in cli(consortium, "job", "logs", "study-o")
    aborted = CliRunner().invoke(main, ["job", "abort", "study-o", *kit])
    assert second in aborted.output  # resolved: the coordinator answers for the full id
