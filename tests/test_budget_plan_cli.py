"""The privacy planner on the command line: `fedsilo privacy plan` shows what a job will book at
each silo before it runs (the policy's own consortium, a silo of N rows, or this site with its
caps and verdict); `policy validate` and `simulate` print the same planned line, and `simulate`
refuses, before anything runs or is written, a policy whose own epsilon_cap is below a silo's
plan. Every number expected here comes from `plan_job`, the planner the silos use."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner, Result

from fedsilo.ops.cli import main
from fedsilo.ops.sim_silos import ConsortiumKeys, build_agent
from fedsilo.ops.simulate import load_silos
from fedsilo.policies.loading import load_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.budget_plan import BudgetPlan, fmt, plan_job
from fedsilo.silo.data import SiloDataset
from tests.deployment import provision

FEDAVG_DP = Path(__file__).parents[1] / "policies" / "examples" / "fedavg_dp.yaml"
HEART_FEDAVG = Path(__file__).parents[1] / "policies" / "examples" / "heart-fedavg.yaml"


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def plans(policy: Policy, datasets: list[SiloDataset]) -> list[BudgetPlan]:
    keys = ConsortiumKeys.generate(d.name for d in datasets)
    cpu = torch.device("cpu")
    return [plan_job(build_agent(policy, d.name, d, cpu, keys).context) for d in datasets]


@pytest.fixture(scope="module")
def fedavg_dp() -> tuple[Policy, list[SiloDataset], list[BudgetPlan]]:
    policy = load_policy(FEDAVG_DP)
    datasets = load_silos(policy, FEDAVG_DP.parent)
    return policy, datasets, plans(policy, datasets)


def refused(result: Result, *expected: str) -> str:
    """The one error message of a refused command, holding each of `expected`."""
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    message = result.output.strip().splitlines()[-1]
    assert message.startswith("Error: ") and result.output.count("Error:") == 1, result.output
    for text in expected:
        assert text in message, message
    return message


def test_the_plan_shows_each_silos_epsilon_split_by_purpose(fedavg_dp) -> None:
    policy, _, planned = fedavg_dp
    result = invoke("privacy", "plan", str(FEDAVG_DP))
    assert result.exit_code == 0, result.output
    assert f"{policy.name}: {policy.rounds} rounds, delta 1e-05 (rdp)" in result.output
    rows = {line.split()[0]: line.split() for line in result.output.splitlines() if line.strip()}
    for plan in planned:
        split = plan.by_purpose()
        assert rows[plan.silo] == [
            plan.silo,
            str(plan.train_rows),
            fmt(plan.epsilon),
            fmt(split["training"]),
            fmt(split["evaluation"]),
        ]
    assert "takes part in every round" in result.output
    assert max(len(line) for line in result.output.splitlines()) <= 80


def test_rows_plans_a_silo_of_that_many_training_rows(fedavg_dp) -> None:
    policy, datasets, _ = fedavg_dp
    first = datasets[0]
    index = torch.arange(50)
    fifty = replace(first, x_train=first.x_train[index], y_train=first.y_train[index])
    (expected, *_) = plans(policy, [fifty, *datasets[1:]])
    result = invoke("privacy", "plan", str(FEDAVG_DP), "--rows", "50")
    assert result.exit_code == 0, result.output
    (row,) = [line.split() for line in result.output.splitlines() if line.startswith(" silo-")]
    assert row[1:3] == ["50", fmt(expected.epsilon)]
    assert "a silo of 50 training rows" in result.output


def test_json_has_every_silos_plan(fedavg_dp) -> None:
    policy, _, planned = fedavg_dp
    result = invoke("privacy", "plan", str(FEDAVG_DP), "--json")
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert document["policy"] == policy.name and document["differentially_private"] is True
    assert document["silos"] == [plan.to_json() for plan in planned]
    assert {"epsilon", "by_purpose", "delta", "accountant", "train_rows"} <= set(
        document["silos"][0]
    )


def test_a_policy_without_dp_accounts_nothing() -> None:
    result = invoke("privacy", "plan", str(HEART_FEDAVG))
    assert result.exit_code == 0, result.output
    assert "asks for no DP" in result.output and "no epsilon" in result.output


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (("--rows", "0"), "--rows: 0 is out of range"),
        (("--rows", "5", "--config", "silo.yaml"), "--config and --rows: give one of them"),
        (("--config", "missing.yaml"), "missing.yaml"),
    ],
)
def test_bad_input_is_one_message(args: tuple[str, ...], expected: str) -> None:
    refused(invoke("privacy", "plan", str(FEDAVG_DP), *args), expected)


def test_a_site_whose_cap_is_below_the_plan_refuses_with_both_numbers(
    tmp_path: Path, fedavg_dp
) -> None:
    _, _, planned = fedavg_dp
    plan = planned[0]  # silo-0's rows, the site below selects them
    cap = round(plan.epsilon / 2, 1)
    consortium = provision(tmp_path)
    data = yaml.safe_load(FEDAVG_DP.read_text())["data"]
    config = consortium.write_silo_config("silo-0", data=data, epsilon_cap=cap)
    result = invoke("privacy", "plan", str(FEDAVG_DP), "--config", str(config))
    assert result.exit_code == 0, result.output
    out = " ".join(result.output.split())
    assert (
        f"this site refuses: privacy budget: this job would spend epsilon {fmt(plan.epsilon)}"
        in out
    )
    assert f"above rules.epsilon_cap {cap:g}" in out
    assert "kit silo-0's peers, 3 silos" in out

    document = json.loads(
        invoke("privacy", "plan", str(FEDAVG_DP), "--config", str(config), "--json").output
    )
    assert document["silos"][0]["epsilon"] == pytest.approx(plan.epsilon)
    assert document["site"]["accepts"] is False
    assert (document["site"]["job_cap"], document["site"]["job_cap_key"]) == (
        cap,
        "rules.epsilon_cap",
    )
    assert document["site"]["spent_elsewhere"] == 0.0

    checked = invoke("silo", "check", "--config", str(config), "--policy", str(FEDAVG_DP))
    assert checked.exit_code == 0, checked.output
    assert f"privacy: this job plans epsilon {fmt(plan.epsilon)} here" in checked.output
    assert f"caps: rules.epsilon_cap {cap:g}" in checked.output
    assert "this site refuses: privacy budget" in checked.output

    roomy = consortium.write_silo_config("silo-0", data=data, epsilon_cap=plan.epsilon + 1)
    checked = invoke("silo", "check", "--config", str(roomy), "--policy", str(FEDAVG_DP))
    assert "this site accepts the job on privacy grounds" in checked.output


def test_simulate_refuses_a_policy_capped_below_its_plan_before_writing(
    tmp_path: Path, fedavg_dp
) -> None:
    _, _, planned = fedavg_dp
    document = yaml.safe_load(FEDAVG_DP.read_text())
    cap = round(min(plan.epsilon for plan in planned) - 0.2, 1)
    document["privacy"]["epsilon_cap"] = cap
    policy = tmp_path / "capped.yaml"
    policy.write_text(yaml.safe_dump(document))
    out = tmp_path / "out"
    result = invoke("simulate", "--policy", str(policy), "--out", str(out))
    message = refused(result, f"above privacy.epsilon_cap {cap:g}", fmt(planned[0].epsilon))
    assert "nothing run, nothing written" in message
    assert "planned epsilon per silo:" in result.output
    assert not out.exists()


def test_validate_prints_the_planned_epsilon_per_silo(fedavg_dp) -> None:
    _, _, planned = fedavg_dp
    result = invoke("policy", "validate", str(FEDAVG_DP))
    assert result.exit_code == 0, result.output
    silos = ", ".join(f"{plan.silo} {fmt(plan.epsilon)}" for plan in planned)
    assert f"planned epsilon per silo: {silos} (delta 1e-05)" in result.output
    plain = invoke("policy", "validate", str(HEART_FEDAVG))
    assert plain.exit_code == 0 and "planned epsilon" not in plain.output
