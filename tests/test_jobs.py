"""A consortium runs many jobs: each signed policy run has its own id (the policy's name and a
short digest), which its task ids, ledger deployment, state rows and metric labels carry. A
silo's one ledger spans every job: the policy's epsilon cap holds per job, and the site rule
`rules.total_epsilon_cap` holds over all of them."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from pydantic import ValidationError

from fedsilo.coordinator.engine import RoundEngine, RunHistory
from fedsilo.coordinator.state import StateStore, digest_policy
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.coordinator_process import revoke
from fedsilo.ops.job_id import job_id
from fedsilo.ops.report import write_deployment_results
from fedsilo.ops.sim_silos import ConsortiumKeys
from fedsilo.ops.status import deployment_status
from fedsilo.policies.loading import parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.privacy.ledger import PrivacyLedger, verify
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.config import LocalRules
from fedsilo.wire.messages import STATUS_BUDGET_EXHAUSTED
from tests.test_tasks import separable

pytestmark = [
    pytest.mark.filterwarnings("ignore:Full backward hook is firing"),
    pytest.mark.filterwarnings("ignore:Secure RNG turned off"),
]

SILOS = ("cleveland", "hungary")
KEYS = ConsortiumKeys.generate(SILOS)  # the silos' identities, which outlive every job
DP = {"delta": 1e-5, "dp_sgd": {"noise_multiplier": 1.0}}


def policy(name: str, dp: bool, rounds: int = 2) -> Policy:
    return parse_policy(
        {
            "version": 1,
            "name": name,
            "rounds": rounds,
            "model": {"name": "linear"},
            "training": {"epochs": 1, "batch_size": 16, "lr": 0.1},
            "participants": {"min_silos": 1, "phase_timeout_s": 60},
            **({"privacy": DP} if dp else {}),
        }
    )


def run_job(
    tmp_path: Path, job: Policy, total_cap: float | None = None, attempt: int = 1
) -> tuple[str, RunHistory, dict[str, SiloAgent]]:
    """Run attempt `attempt` at `job` on silos built from it whose ledgers and state folders
    (in `tmp_path`) and identities (`KEYS`) outlive the job."""
    digest = digest_policy(job)
    name = job_id(job.name, digest, attempt)
    agents = {
        silo: SiloAgent(
            silo,
            separable(seed=index),
            job,
            policy_digest=digest,
            secret=silo.encode(),
            ledger=PrivacyLedger(tmp_path / f"{silo}.jsonl"),
            deployment=name,
            total_epsilon_cap=total_cap,
            keys=KEYS.of(silo),
            state=tmp_path / f"{silo}-state",
        )
        for index, silo in enumerate(SILOS)
    }
    with StateStore(tmp_path / "state.db") as store:
        store.open_consortium("heart")
        engine = RoundEngine(
            make_strategy(job),
            InProcessTransport({n: a.handle_bytes for n, a in agents.items()}),
            job,
            list(SILOS),
            deployment=name,
            store=store,
            policy_digest=digest,
        )
        return name, engine.run(), agents


def test_a_job_id_is_the_policys_name_and_a_short_digest_of_the_signed_policy() -> None:
    assert job_id("heart-fedavg", "3f9a1c2e" + "0" * 56) == "heart-fedavg-3f9a1c2e"
    assert job_id("heart-fedavg", "3f9a1c2e" + "0" * 56, 2) == "heart-fedavg-3f9a1c2e-attempt2"
    with pytest.raises(ValueError, match="attempts count from 1"):
        job_id("heart-fedavg", "3f9a1c2e", 0)
    fedavg, dp = policy("heart-fedavg", dp=False), policy("heart-fedavg", dp=True)
    assert job_id(fedavg.name, digest_policy(fedavg)) != job_id(dp.name, digest_policy(dp))


def test_a_second_attempt_at_a_policy_runs_anew_on_the_same_ledgers_its_ids_its_own(
    tmp_path,
) -> None:
    """The silos answered every position of attempt 1 (their answer stores and aggregation logs
    keep them); attempt 2 is answered afresh, booked apart, and spends its own budget."""
    job = policy("heart-dp", dp=True)
    first, done, _ = run_job(tmp_path, job)
    second, again, agents = run_job(tmp_path, job, attempt=2)
    assert second == f"{first}-attempt2"
    assert all(r.status == "completed" for r in [*done.records, *again.records])
    for silo, agent in agents.items():
        booked: dict[str, set[str]] = {}
        for record in agent.ledger.records():
            booked.setdefault(record.deployment, set()).add(record.task_id)
        assert set(booked) == {first, second}
        assert booked[first] and booked[second] and not booked[first] & booked[second]
        assert agent.ledger.spent(second) == pytest.approx(agent.ledger.spent(first)), silo
        assert verify(agent.ledger.path).ok


def test_a_dp_job_after_a_non_dp_job_runs_on_the_same_ledgers_and_state(tmp_path) -> None:
    plain, first, _ = run_job(tmp_path, policy("heart-fedavg", dp=False))
    private, second, agents = run_job(tmp_path, policy("heart-dp", dp=True))
    assert all(r.status == "completed" for r in [*first.records, *second.records])
    for agent in agents.values():
        records = agent.ledger.records()
        by_job = {plain: set(), private: set()}
        for record in records:
            by_job[record.deployment].add(record.task_id)
            assert record.task_id.startswith(f"{record.deployment}/")
        assert by_job[plain] and by_job[private] and not by_job[plain] & by_job[private]
        report = verify(agent.ledger.path)
        assert report.ok, report.reason
        audits = {audit.deployment: audit for audit in report.deployments}
        assert audits[plain].delta is None and audits[plain].booked is None
        assert audits[private].delta == 1e-5 and audits[private].booked > 0
        assert agent.ledger.spent(private) == audits[private].booked


def test_the_site_cap_over_all_jobs_refuses_in_a_later_job_because_of_what_earlier_spent(
    tmp_path,
) -> None:
    first_job, _, agents = run_job(tmp_path, policy("heart-dp", dp=True))
    spent = agents["cleveland"].ledger.spent(first_job)
    # The second job alone would stay far below the site's cap; the first job's spending
    # takes the silo over it.
    second_job, history, agents = run_job(
        tmp_path, policy("heart-dp-again", dp=True), total_cap=spent * 1.2
    )
    assert history.records[0].retired
    refusals = [
        why
        for record in history.records
        for phase in record.phases.values()
        for why in phase["dropped"].values()
    ]
    assert refusals and all(STATUS_BUDGET_EXHAUSTED in why for why in refusals)
    assert all("rules.total_epsilon_cap" in why for why in refusals)
    for agent in agents.values():
        assert agent.ledger.spent(second_job) == 0.0  # only refusals were booked
        assert agent.ledger.spent_elsewhere(second_job) == pytest.approx(spent, rel=0.5)
        assert verify(agent.ledger.path).ok


def test_the_per_job_cap_is_the_policys_and_a_new_job_starts_its_own_budget(tmp_path) -> None:
    first_job, _, agents = run_job(tmp_path, policy("heart-dp", dp=True))
    spent = agents["cleveland"].ledger.spent(first_job)
    capped = policy("heart-dp-capped", dp=True)
    capped = capped.model_copy(
        update={"privacy": capped.privacy.model_copy(update={"epsilon_cap": spent * 1.5})}
    )
    second_job, history, agents = run_job(tmp_path, capped)
    assert all(r.status == "completed" and not r.retired for r in history.records)
    assert agents["cleveland"].ledger.spent(second_job) == pytest.approx(spent)


def test_total_epsilon_cap_is_a_positive_site_rule_that_a_non_dp_policy_does_not_break() -> None:
    rules = LocalRules(total_epsilon_cap=10.0)
    assert rules.violations(policy("heart-fedavg", dp=False)) == []
    with pytest.raises(ValidationError, match="total_epsilon_cap"):
        LocalRules(total_epsilon_cap=0.0)


def test_one_state_file_holds_every_job_and_revocations_outlive_them(tmp_path) -> None:
    revoke(tmp_path / "state.db", "heart", "hungary", "left the consortium")  # before any job
    plain, _, _ = run_job(tmp_path, policy("heart-fedavg", dp=False))
    private, _, _ = run_job(tmp_path, policy("heart-dp", dp=True))
    with StateStore(tmp_path / "state.db") as store:
        assert store.last_round(plain) is not None and store.last_round(private) is not None
        assert store.latest_job("heart") == private
    status = deployment_status(tmp_path / "state.db", "heart")
    assert status.deployment == private
    assert status.participants["hungary"] == ("revoked", "left the consortium")


def test_a_jobs_results_name_the_job(tmp_path) -> None:
    job = policy("heart-fedavg", dp=False, rounds=1)
    name, history, _ = run_job(tmp_path, job)
    write_deployment_results(tmp_path / "results", job, history, job=name)
    assert json.loads((tmp_path / "results" / "results.json").read_text())["job"] == name
