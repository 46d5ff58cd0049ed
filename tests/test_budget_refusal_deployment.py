"""A silo refuses a job it cannot afford before it books anything: its privacy plan
(silo/budget_plan.py) for the job, computed from its own copy of the policy and its own rows
when the policy arrives, is above its site rules (`rules.epsilon_cap` per job,
`rules.total_epsilon_cap` over all jobs of its ledger).

With real processes (`coordinator serve`, three silo agents, mTLS on 127.0.0.1): a DP job that
needs every silo is refused by the site whose cap is below its plan; no round runs, no ledger
changes, and `fedsilo job status --json` names the site and both numbers. Once the site raises
its cap (silo.yaml is read again per job) the job's second attempt runs to its end and every
site's ledger books exactly its plan. In process: a silo whose ledger holds an earlier job's
spending refuses a job its total cap cannot hold, naming what was spent elsewhere and the cap.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from fedsilo.ops.cli import main
from fedsilo.ops.job_id import job_id
from fedsilo.ops.sim_silos import ConsortiumKeys
from fedsilo.policies.loading import load_policy
from fedsilo.privacy.accounting import Mechanism
from fedsilo.privacy.ledger import PrivacyLedger, payload_digest
from fedsilo.privacy.policy_signing import policy_digest
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.budget_plan import fmt
from fedsilo.silo.config import load_silo_config
from tests.deployment import SILOS, Consortium, policy_document, wait_for

DP = {"delta": 1e-5, "dp_sgd": {"noise_multiplier": 1.0}}
REFUSING = "silo-2"


def dp_policy(rounds: int = 2) -> dict:
    return policy_document(
        rounds=rounds,
        name="budget-refusal",
        participants={"min_silos": len(SILOS), "phase_timeout_s": 30},
        privacy=DP,
    )


def planned_epsilon(policy_path: Path, silo_yaml: Path, silo: str) -> float:
    """What the job of `policy_path` will book at `silo`, planned as its agent plans it: from
    the same policy, the site's own data (as silo.yaml selects it) and a roster of SILOS."""
    policy = load_policy(policy_path)
    config = load_silo_config(silo_yaml)
    data = config.data.load(policy.seed, base_dir=silo_yaml.parent)
    agent = SiloAgent(silo, data, policy, keys=ConsortiumKeys.generate(SILOS).of(silo))
    planned = agent.budget_plan().epsilon
    assert planned is not None and math.isfinite(planned) and planned > 0
    return planned


def operator(consortium: Consortium, *args: str) -> Result:
    return CliRunner().invoke(main, [*args, "--kit", str(consortium.kits / "operator")])


def job_status(consortium: Consortium, job: str) -> dict:
    result = operator(consortium, "job", "status", job, "--json")
    assert result.exit_code == 0, result.output
    return json.loads(result.output)["job"]


def wait_until_ended(consortium: Consortium, job: str, timeout: float = 120) -> dict:
    return wait_for(
        lambda: (info := job_status(consortium, job))["finished_at"] is not None and info,
        timeout,
        f"job {job} to end",
        consortium,
        0.3,
    )


def ledger_path(consortium: Consortium, silo: str) -> Path:
    return consortium.root / "sites" / silo / "privacy-ledger.jsonl"


def ledgers(consortium: Consortium) -> dict[str, bytes | None]:
    """Each site's ledger as bytes (None where it does not exist)."""
    return {
        silo: path.read_bytes() if (path := ledger_path(consortium, silo)).exists() else None
        for silo in SILOS
    }


def test_a_site_refuses_a_job_above_its_epsilon_cap_before_booking_and_runs_it_once_raised(
    consortium: Consortium,
) -> None:
    policy = consortium.write_policy(dp_policy())
    configs = {silo: consortium.write_silo_config(silo) for silo in SILOS}
    plans = {silo: planned_epsilon(policy, configs[silo], silo) for silo in SILOS}
    cap = plans[REFUSING] / 2
    configs[REFUSING] = consortium.write_silo_config(REFUSING, epsilon_cap=cap)
    consortium.serve_with_silos(configs)
    before = ledgers(consortium)

    submitted = operator(consortium, "job", "submit", str(policy))
    assert submitted.exit_code == 0, submitted.output
    first = submitted.output.split(" as job ")[1].split()[0]
    digest = policy_digest(policy.read_bytes())
    assert first == job_id("budget-refusal", digest)

    ended = wait_until_ended(consortium, first)
    assert ended["status"] == "refused", ended
    assert ended["started_at"] is not None  # it gathered its members, and ran no round
    assert set(ended["refusals"]) == {REFUSING}, ended
    reason = ended["refusals"][REFUSING]
    assert "privacy budget" in reason
    assert f"epsilon {fmt(plans[REFUSING])} here" in reason
    assert f"above rules.epsilon_cap {cap:g}" in reason
    assert str(consortium.root) not in reason  # no path of the site leaves it
    assert REFUSING in ended["error"]
    assert ledgers(consortium) == before  # nothing booked anywhere
    shown = operator(consortium, "status", "--json")
    assert shown.exit_code == 0, shown.output
    document = json.loads(shown.output)
    assert document["job"]["job_id"] == first
    assert document["job"]["refusals"] == {REFUSING: reason}
    assert document["progress"] is None  # no round ran
    assert not (consortium.root / "state.jobs" / first / "results").exists()

    consortium.write_silo_config(REFUSING, epsilon_cap=plans[REFUSING] * 2)  # the site raises it
    retried = operator(consortium, "job", "submit", "--retry", first)
    assert retried.exit_code == 0, retried.output
    second = job_id("budget-refusal", digest, 2)
    assert f"as job {second}" in retried.output
    done = wait_until_ended(consortium, second)
    assert done["status"] == "completed", (done, consortium.log("coordinator"))
    assert done["refusals"] == {}

    for silo in SILOS:
        ledger = PrivacyLedger(ledger_path(consortium, silo))
        assert ledger.spent(first) == 0.0  # the refused attempt booked nothing
        assert ledger.spent(second) == pytest.approx(plans[silo], rel=1e-9), silo
        assert {r.deployment for r in ledger.records()} == {second}

    # a job that needs only two silos runs without the site that cannot afford it, and its
    # record still says who refused it, and why
    consortium.write_silo_config(REFUSING, epsilon_cap=cap)
    spent = ledgers(consortium)
    quorum = consortium.write_policy(
        {**dp_policy(), "name": "budget-quorum", "participants": {"min_silos": 2}},
        "quorum.yaml",
    )
    third = operator(consortium, "job", "submit", str(quorum))
    assert third.exit_code == 0, third.output
    third_job = third.output.split(" as job ")[1].split()[0]
    done = wait_until_ended(consortium, third_job)
    assert done["status"] == "completed", (done, consortium.log("coordinator"))
    assert set(done["refusals"]) == {REFUSING}, done
    assert f"above rules.epsilon_cap {cap:g}" in done["refusals"][REFUSING]
    assert ledgers(consortium)[REFUSING] == spent[REFUSING]


# -- in process: the cap over all jobs ----------------------------------------------------------


def test_a_silo_refuses_a_job_its_total_cap_cannot_hold_after_an_earlier_jobs_spending(
    tmp_path: Path,
) -> None:
    policy_path = tmp_path / "policy.yaml"
    policy_path.write_text(json.dumps(dp_policy(rounds=3)))
    silo_yaml = Consortium(tmp_path, 0).write_silo_config("silo-0")
    policy = load_policy(policy_path)
    data = load_silo_config(silo_yaml).data.load(policy.seed, base_dir=silo_yaml.parent)
    keys = ConsortiumKeys.generate(SILOS).of("silo-0")

    ledger = PrivacyLedger(tmp_path / "ledger.jsonl")
    ledger.append(  # an earlier job's spending
        deployment="earlier-job-00000000",
        round=1,
        task_id="earlier-job-00000000/1/train/silo-0",
        mechanism=Mechanism.gaussian(sensitivity=1.0, noise_std=1.0),
        payload_digest=payload_digest(b"an earlier answer"),
        delta=1e-5,
    )
    spent = ledger.spent("earlier-job-00000000")
    assert spent is not None and spent > 0

    def agent(total_cap: float | None) -> SiloAgent:
        return SiloAgent(
            "silo-0",
            data,
            policy,
            ledger=ledger,
            deployment="budget-refusal-11111111",
            total_epsilon_cap=total_cap,
            keys=keys,
        )

    plan = agent(None).budget_plan()
    assert plan.epsilon is not None and plan.epsilon > 0
    assert agent(None).budget_refusal(plan) is None
    # the job alone fits the cap; with what the earlier job spent it does not
    total_cap = plan.epsilon + spent / 2
    problem = agent(total_cap).budget_refusal(plan)
    assert problem is not None
    assert f"epsilon {fmt(plan.epsilon)} here" in problem
    assert f"the {fmt(spent)} spent by earlier jobs" in problem
    assert f"that is {fmt(plan.epsilon + spent)}" in problem
    assert f"above rules.total_epsilon_cap {total_cap:g}" in problem
    assert agent(plan.epsilon + spent * 2).budget_refusal(plan) is None
    assert [r.deployment for r in ledger.records()] == ["earlier-job-00000000"]  # booked nothing
