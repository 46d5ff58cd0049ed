"""Jobs again: a job that ended failed, refused or aborted runs again as a new attempt at the
same signed policy (`fedsilo job submit --retry JOB`), which the operator signs and every silo
checks; the attempt is part of the job's id, so its task ids and ledger records never meet the
earlier attempt's. With real processes: a job a site's rule refused runs to its end once the
site fixes the rule. In process: a silo refuses an attempt the operator did not sign."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner, Result
from nacl.signing import SigningKey

from fedsilo.ops.cli import main
from fedsilo.policies.schema import Policy
from fedsilo.privacy.ledger import PrivacyLedger
from fedsilo.privacy.policy_signing import policy_digest, sign_attempt
from fedsilo.silo.client import PolicyRefused
from tests.deployment import Consortium, policy_document, wait_for
from tests.test_failure_reports import POLICY_TEXT, FakeCoordinator, client


def fedsilo(consortium: Consortium, *args: str) -> Result:
    return CliRunner().invoke(main, [*args, "--kit", str(consortium.kits / "operator")])


def job_status(consortium: Consortium, job: str) -> dict:
    result = fedsilo(consortium, "job", "status", job, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["job"]


def wait_until_ended(consortium: Consortium, job: str) -> str:
    info = wait_for(
        lambda: (i := job_status(consortium, job))["finished_at"] is not None and i,
        90,
        f"job {job} to end",
        consortium,
        0.3,
    )
    return info["status"]


def test_a_job_a_site_refused_runs_to_its_end_as_a_second_attempt_once_the_site_fixes_its_rule(
    consortium: Consortium,
) -> None:
    consortium.serve_with_silos({"silo-2": consortium.write_silo_config("silo-2", max_rounds=2)})
    policy = consortium.write_policy(
        policy_document(rounds=3, participants={"min_silos": 3, "phase_timeout_s": 20})
    )
    submitted = fedsilo(consortium, "job", "submit", str(policy))
    assert submitted.exit_code == 0, submitted.output
    first = submitted.output.split(" as job ")[1].split()[0]
    assert wait_until_ended(consortium, first) == "refused"

    again = fedsilo(consortium, "job", "submit", str(policy))
    assert again.exit_code == 1
    assert f"`fedsilo job submit --retry {first}`" in again.output
    assert len(again.output.strip().splitlines()) == 1

    consortium.write_silo_config("silo-2", max_rounds=3)  # the site fixes its rule
    retried = fedsilo(consortium, "job", "submit", "--retry", first)
    assert retried.exit_code == 0, retried.output
    second = f"{first}-attempt2"
    assert f"submitted attempt 2 at the policy of job {first} as job {second}" in retried.output
    assert wait_until_ended(consortium, second) == "completed"
    assert consortium.processes["silo-2"].poll() is None  # the same agent, still connected

    decisions = [
        json.loads(line)
        for line in (consortium.root / "sites" / "silo-2" / "accepted_policies.jsonl")
        .read_text()
        .splitlines()
    ]
    assert [(d["attempt"], d["accepted"]) for d in decisions] == [(1, False), (2, True)]
    for silo in ("silo-0", "silo-1", "silo-2"):
        ledger = PrivacyLedger(consortium.root / "sites" / silo / "privacy-ledger.jsonl")
        records = ledger.records()
        assert records and {r.deployment for r in records} == {second}
        assert all(r.task_id.startswith(f"{second}/") for r in records)

    completed = fedsilo(consortium, "job", "submit", "--retry", second)
    assert completed.exit_code == 1
    assert completed.output == (
        f"Error: job {second} is completed: --retry runs again only a job that failed, was "
        "refused or was aborted\n"
    )
    superseded = fedsilo(consortium, "job", "submit", "--retry", first)
    assert superseded.exit_code == 1
    assert f"the latest attempt at its policy is {second} (completed)" in superseded.output


# -- the silo's side: only the operator starts an attempt --------------------------------------


def started_attempts(coordinator: FakeCoordinator) -> list[int]:
    attempts: list[int] = []

    def start_agent(policy: Policy, digest: str, attempt: int, roster: object):
        attempts.append(attempt)
        return lambda payload: payload

    client(coordinator, start_agent).join()
    return attempts


OPERATOR = SigningKey.generate()
DIGEST = policy_digest(POLICY_TEXT.encode())
FORGED = {
    "unsigned": {"attempt": 2},
    "not a signature": {"attempt": 2, "attempt_signature": "00" * 64},
    "another attempt's": {"attempt": 3, "attempt_signature": sign_attempt(OPERATOR, DIGEST, 2)},
    "another key's": {
        "attempt": 2,
        "attempt_signature": sign_attempt(SigningKey.generate(), DIGEST, 2),
    },
    "another policy's": {
        "attempt": 2,
        "attempt_signature": sign_attempt(OPERATOR, policy_digest(b"name: other\n"), 2),
    },
    "attempt 0": {"attempt": 0},
    "a text": {"attempt": "2"},
}


def test_a_silo_starts_an_attempt_the_operator_signed_under_that_attempt() -> None:
    coordinator = FakeCoordinator(operator=OPERATOR)
    coordinator.policy_fields = {
        "attempt": 2,
        "attempt_signature": sign_attempt(OPERATOR, DIGEST, 2),
    }
    assert started_attempts(coordinator) == [2]
    assert started_attempts(FakeCoordinator(operator=OPERATOR)) == [1]  # no attempt: the first


@pytest.mark.parametrize("forged", FORGED.values(), ids=FORGED.keys())
def test_a_silo_refuses_an_attempt_the_operator_did_not_sign(forged: dict) -> None:
    coordinator = FakeCoordinator(operator=OPERATOR)
    coordinator.policy_fields = forged
    with pytest.raises(PolicyRefused, match="attempt"):
        started_attempts(coordinator)
    assert [label for label, _ in coordinator.sent] == ["join"]  # neither accepted nor refused
