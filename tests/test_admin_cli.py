"""The operator's admin CLI against a real `fedsilo coordinator serve` and three silo agents
(separate processes, mTLS): what `job list`, `job status` and `fedsilo status` say about jobs
that completed, one its silos refused, one running and one aborted, for eyes (one line a job,
the label each job earned) and as `--json` (parsed here field by field; the shapes are
docs/how-to/operator.md's, "Scripting the admin CLI")."""

from __future__ import annotations

import json
from typing import Any

from click.testing import CliRunner

from fedsilo.ops.cli import main
from tests.deployment import Consortium, policy_document, wait_for

STRICT = {"min_silos": 3, "phase_timeout_s": 20}  # every silo must accept


def cli(consortium: Consortium, *args: str) -> str:
    """`fedsilo ARGS --kit kits/operator`, which must succeed; its output."""
    result = CliRunner().invoke(
        main, [*args, "--kit", str(consortium.kits / "operator")], catch_exceptions=False
    )
    assert result.exit_code == 0, result.output
    return result.output


def as_json(consortium: Consortium, *args: str) -> Any:
    return json.loads(cli(consortium, *args, "--json"))


def submit(consortium: Consortium, name: str, rounds: int, **overrides: object) -> str:
    policy = consortium.write_policy(
        policy_document(rounds=rounds, name=name, **overrides), f"{name}.yaml"
    )
    return cli(consortium, "job", "submit", str(policy)).split(" as job ")[1].split()[0]


def ended(consortium: Consortium, job: str, timeout: float = 60) -> dict[str, Any]:
    def info() -> dict[str, Any] | None:
        data = as_json(consortium, "job", "status", job)["job"]
        return data if data["finished_at"] is not None else None

    return wait_for(info, timeout, f"job {job} to end", consortium, 0.3)


def test_job_list_job_status_and_status_label_every_job_as_it_ended_and_say_so_in_json(
    consortium: Consortium,
) -> None:
    consortium.serve_with_silos({"silo-2": consortium.write_silo_config("silo-2", max_rounds=2)})
    first = submit(consortium, "first", rounds=2)
    second = submit(consortium, "second", rounds=2)
    refused = submit(consortium, "strict", rounds=3, participants=STRICT)
    assert ended(consortium, refused)["status"] == "refused"

    listed = as_json(consortium, "job", "list")
    assert listed["schema"] == 1
    assert [(job["job_id"], job["status"]) for job in listed["jobs"]] == [
        (first, "completed"),
        (second, "completed"),
        (refused, "refused"),
    ]
    strict = listed["jobs"][2]
    assert strict["refusals"] == {"silo-2": "max_rounds: the policy asks for 3 > 2"}
    assert (
        strict["note"]
        == strict["error"]
        == ("refused by silo-2: 2 of 3 silos accepted the policy, min_silos is 3")
    )
    assert (strict["attempt"], strict["name"], strict["abort_requested"]) == (1, "strict", False)
    assert strict["policy_digest"].startswith(refused.rsplit("-", 1)[1])
    assert strict["submitted_at"] <= strict["started_at"] <= strict["finished_at"]
    table = cli(consortium, "job", "list").splitlines()
    assert [line for line in table if refused in line] == [
        next(line for line in table if "refused by silo-2" in line)
    ]  # the refused job is one line, its note cut there, not a wrapped dict
    assert not any("{" in line for line in table)
    shown = cli(consortium, "job", "status", refused)
    assert "refused by silo-2" in shown and "max_rounds: the policy asks for 3 > 2" in shown

    status = as_json(consortium, "status")
    assert (status["schema"], status["source"], status["consortium"]) == (
        1,
        "coordinator",
        "test-consortium",
    )
    assert (status["running"], status["queued"], status["progress"]) == (None, [], None)
    assert (status["job"]["job_id"], status["job"]["status"]) == (refused, "refused")
    assert all(silo["connected"] and not silo["revoked"] for silo in status["silos"].values())
    certificate = status["certificate"]  # the operator kit's own
    assert (certificate["party"], certificate["path"]) == (
        "operator",
        str(consortium.kits / "operator" / "client.crt"),
    )
    assert 364 < certificate["days_left"] <= 365
    assert certificate["valid_until"].endswith("+00:00")
    said = " ".join(cli(consortium, "status").split())
    assert "no job has run yet" not in said
    assert f"latest job {refused} (refused): no round ran" in said
    assert "silo-2 refused: max_rounds: the policy asks for 3 > 2" in said

    endless = submit(consortium, "endless", rounds=500)
    running = wait_for(
        lambda: (
            (s := as_json(consortium, "status"))["progress"]
            and s["progress"]["last_round"] >= 2
            and s
        ),
        60,
        f"two rounds of {endless}",
        consortium,
        0.3,
    )
    assert (running["running"], running["job"]["status"]) == (endless, "running")
    progress = running["progress"]
    assert (progress["deployment"], progress["rounds_planned"]) == (endless, 500)
    assert progress["silos"]["silo-0"]["status"] == "active"
    assert progress["silos"]["silo-2"]["status"] == "refused"
    assert set(progress["silos"]["silo-0"]["metrics"]) >= {"accuracy", "loss"}
    assert f"job {endless} (running): round" in " ".join(cli(consortium, "status").split())

    cli(consortium, "job", "abort", endless)
    aborted = ended(consortium, endless)
    assert (aborted["status"], aborted["note"]) == ("aborted", "aborted by the operator")
    status = as_json(consortium, "status")
    assert (status["job"]["job_id"], status["job"]["status"]) == (endless, "aborted")
    assert status["progress"]["last_round"] >= 2
    assert all(s["rounds_with_a_dropout"] == 0 for s in status["progress"]["silos"].values())
    heading = cli(consortium, "status").splitlines()[1]
    assert heading.startswith(f"latest job {endless} (aborted): round ")
    assert heading.endswith("; aborted by the operator")

    # on the coordinator host, from the state file: the same job and rounds, no connections
    local = CliRunner().invoke(
        main,
        [
            "status",
            "--kit",
            str(consortium.kits / "coordinator"),
            "--state",
            str(consortium.root / "state.db"),
            "--json",
        ],
    )
    assert local.exit_code == 0, local.output
    read = json.loads(local.output)
    assert (read["schema"], read["source"], read["running"]) == (1, "state file", None)
    assert all(silo["connected"] is None for silo in read["silos"].values())
    assert (read["job"], read["progress"]) == (status["job"], status["progress"])
    assert read["certificate"]["party"] == "coordinator" and read["certificate"]["days_left"] > 364
