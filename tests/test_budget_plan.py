"""A job's privacy plan (silo/budget_plan.py) is what its silos book: planned equals spent.

Each silo plans from its own contract and its own task kinds' release functions, before any
task; a run then books, release for release, what was planned (the same mechanisms, so the
same epsilon to the last bit of the accountant) when the silo takes part in every round.
`privacy.job_epsilon` calibrates DP-SGD so that the plan composes to the job's total, and a
total the other releases alone exceed is refused with the plan.
"""

from __future__ import annotations

import math
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner

from fedsilo.ops.cli import main
from fedsilo.ops.plan_cli import consortium_plans
from fedsilo.ops.sim_silos import ConsortiumKeys, build_agent
from fedsilo.ops.simulate import load_silos
from fedsilo.policies.loading import load_policy
from fedsilo.privacy.ledger import PrivacyLedger
from fedsilo.silo.budget_plan import BudgetPlan, plan_job
from fedsilo.silo.config import parse_silo_config
from fedsilo.silo.data import DataError
from fedsilo.silo.errors import DpSgdError
from fedsilo.wire.messages import SIMULATION

EXAMPLES = Path(__file__).parent.parent / "policies" / "examples"
DP_SGD = {"dp_sgd": {"noise_multiplier": 1.1}}
CLIENT_DP = {"client_dp": {"clip": 1.0, "noise_multiplier": 1.0}}
# Algorithms whose every silo takes every position of every round (no client sampling), each
# with the releases it adds: evaluation reports, loss probes, a superfed grid, boosting probes.
FULL_PARTICIPATION = [
    ("heart-fedavg.yaml", DP_SGD, "none"),
    ("heart-fedavg.yaml", DP_SGD, "masking"),
    ("heart-fedavg.yaml", DP_SGD, "ckks"),
    ("heart-fedavg.yaml", CLIENT_DP, "masking"),
    ("heart-aaggff.yaml", DP_SGD, "none"),
    ("heart-qfedavg.yaml", DP_SGD, "none"),
    ("heart-feddc.yaml", DP_SGD, "none"),
    ("heart-cyclic.yaml", DP_SGD, "none"),
    ("heart-scaffold.yaml", DP_SGD, "none"),
    ("heart-superfed.yaml", DP_SGD, "none"),
    ("heart-multiboost.yaml", DP_SGD, "none"),
]


def variant(folder: Path, example: str, privacy: dict[str, Any], method: str = "none") -> Path:
    """`example`, three rounds evaluated after each, with `privacy` and `method`."""
    document = yaml.safe_load((EXAMPLES / example).read_text())
    document |= {"rounds": 3, "eval_every": 1, "privacy": privacy}
    document["secure_aggregation"] = {"method": method}
    if document["data"].get("scaling") == "federated":
        document["data"]["scaling"] = "local"
    path = folder / f"{Path(example).stem}.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


def plans(path: Path) -> dict[str, BudgetPlan]:
    """Each simulated silo's plan, its agent built as `simulate` builds it."""
    policy = load_policy(path)
    return {p.silo: p for p in consortium_plans(policy, load_silos(policy, EXAMPLES))}


def booked(path: Path, out: Path) -> dict[str, PrivacyLedger]:
    ran = CliRunner().invoke(main, ["simulate", "--policy", str(path), "--out", str(out)])
    assert ran.exit_code == 0, ran.output
    return {p.stem: PrivacyLedger(p) for p in sorted((out / "ledgers").glob("*.jsonl"))}


def noised(releases: Any) -> Counter:
    return Counter(m for m in releases if m.kind != "public")


@pytest.mark.parametrize(
    ("example", "privacy", "method"),
    FULL_PARTICIPATION,
    ids=[f"{e.removesuffix('.yaml')}-{next(iter(p))}-{m}" for e, p, m in FULL_PARTICIPATION],
)
def test_every_silo_books_exactly_its_plan(
    tmp_path: Path, example: str, privacy: dict, method: str
) -> None:
    path = variant(tmp_path, example, privacy, method)
    planned = plans(path)
    ledgers = booked(path, tmp_path / "run")
    assert set(ledgers) == set(planned)
    for silo, ledger in ledgers.items():
        assert noised(r.mechanism for r in ledger.records()) == noised(planned[silo].releases)
        assert math.isclose(ledger.spent(SIMULATION), planned[silo].epsilon, rel_tol=1e-12)


def test_a_silo_that_sits_out_rounds_books_less_than_its_plan_never_more(tmp_path: Path) -> None:
    """Client sampling: each round trains a fraction of the silos; the plan is the most."""
    document = yaml.safe_load((EXAMPLES / "heart-fedavg.yaml").read_text())
    document["algorithm"]["client_fraction"] = 0.5
    document["participants"] = {**document.get("participants", {}), "min_silos": 2}
    (tmp_path / "base.yaml").write_text(yaml.safe_dump(document))
    path = variant(tmp_path, "heart-fedavg.yaml", DP_SGD)
    document = yaml.safe_load(path.read_text())
    document["algorithm"]["client_fraction"] = 0.5
    document["participants"] = {**document.get("participants", {}), "min_silos": 2}
    path.write_text(yaml.safe_dump(document))
    planned = plans(path)
    ledgers = booked(path, tmp_path / "run")
    short = 0
    for silo, ledger in ledgers.items():
        spent = noised(r.mechanism for r in ledger.records())
        assert spent <= noised(planned[silo].releases)
        short += spent != noised(planned[silo].releases)
        assert ledger.spent(SIMULATION) <= planned[silo].epsilon
    assert short > 0  # some silo sat out a round


def test_a_job_epsilon_is_the_total_every_silo_books(tmp_path: Path) -> None:
    """job_epsilon 4 with evaluation every round: DP-SGD gets what the reports leave, and
    each silo books 4 (to the calibration's tolerance) where training_epsilon 4 books more."""
    total = variant(tmp_path, "heart-fedavg.yaml", {"job_epsilon": 4.0, "dp_sgd": {}})
    planned = plans(total)
    for silo, ledger in booked(total, tmp_path / "total").items():
        assert ledger.spent(SIMULATION) == planned[silo].epsilon
        assert 4.0 * (1 - 1e-6) <= ledger.spent(SIMULATION) <= 4.0
        assert planned[silo].by_purpose()["evaluation"] > 0
    training_only = tmp_path / "training-only"
    training_only.mkdir()
    path = variant(training_only, "heart-fedavg.yaml", {"dp_sgd": {"training_epsilon": 4.0}})
    assert all(p.epsilon > 4.5 for p in plans(path).values())


def test_a_job_epsilon_the_reports_alone_exceed_is_refused_with_the_plan(tmp_path: Path) -> None:
    path = variant(tmp_path, "heart-fedavg.yaml", {"job_epsilon": 0.5, "dp_sgd": {}})
    policy = load_policy(path)
    data = load_silos(policy, EXAMPLES)[0]
    keys = ConsortiumKeys.generate([data.name])
    agent = build_agent(policy, data.name, data, torch.device("cpu"), keys)
    with pytest.raises(DpSgdError, match=r"privacy\.job_epsilon 0\.5 cannot be met .*evaluation"):
        plan_job(agent.context)


def test_the_former_name_target_epsilon_is_read_as_training_epsilon(tmp_path: Path) -> None:
    former = variant(tmp_path, "heart-fedavg.yaml", {"dp_sgd": {"target_epsilon": 3.0}})
    assert load_policy(former).privacy.dp_sgd.training_epsilon == 3.0


def agent_with_ledger(path: Path, ledger: Path):
    ledger.mkdir()
    policy = load_policy(path)
    data = load_silos(policy, EXAMPLES)[0]
    keys = ConsortiumKeys.generate([data.name])
    return build_agent(policy, data.name, data, torch.device("cpu"), keys, ledgers=ledger)


def test_at_a_jobs_end_a_silo_names_every_release_that_differs_from_its_plan(
    tmp_path: Path,
) -> None:
    agent = agent_with_ledger(variant(tmp_path, "heart-fedavg.yaml", DP_SGD), tmp_path / "l")
    plan = agent.budget_plan()
    said = agent.spent_against_plan(plan)  # nothing booked yet: a job that ended at once
    assert said is not None
    assert "planned and not booked" in said and "3 x dp_sgd (noise 1.1" in said
    assert "booked beyond the plan" not in said
    assert agent.ledger is not None
    for release in plan.releases:
        agent.ledger.append(
            deployment=SIMULATION, round=1, task_id="t", mechanism=release,
            payload_digest="0" * 64, delta=plan.delta, accountant=plan.accountant,
        )  # fmt: skip
    assert agent.spent_against_plan(plan) is None  # planned equals spent
    extra = plan.releases[1]
    agent.ledger.append(
        deployment=SIMULATION, round=4, task_id="u", mechanism=extra,
        payload_digest="0" * 64, delta=plan.delta, accountant=plan.accountant,
    )  # fmt: skip
    said = agent.spent_against_plan(plan)
    assert said is not None and "booked beyond the plan: 1 x" in said


def silo_yaml(**keys: Any):
    document = {"kit": "kit", "data": {"source": "sklearn:breast_cancer", "select": "silo-0"}}
    document |= keys
    return parse_silo_config(document, "silo.yaml")


def test_a_site_can_keep_its_training_set_size_coarse(tmp_path: Path) -> None:
    """DP-SGD's sample rate (batch / n) and epsilon reveal a silo's training rows; with
    `train_rows_multiple` a site trains on a multiple of it, the rows left out drawn by the
    job's seed, so only that multiple is revealed."""
    whole = silo_yaml().load_data(tmp_path / "silo.yaml", seed=3)
    coarse = silo_yaml(train_rows_multiple=50)
    first = coarse.load_data(tmp_path / "silo.yaml", seed=3)
    assert len(first.y_train) == len(whole.y_train) // 50 * 50 < len(whole.y_train)
    assert torch.equal(first.x_test, whole.x_test)  # evaluation keeps every row
    again = coarse.load_data(tmp_path / "silo.yaml", seed=3)
    assert torch.equal(first.x_train, again.x_train)  # a job's rows, the same at every load
    other = coarse.load_data(tmp_path / "silo.yaml", seed=4)
    assert not torch.equal(first.x_train, other.x_train)
    too_coarse = silo_yaml(train_rows_multiple=len(whole.y_train) + 1)
    with pytest.raises(DataError, match="train_rows_multiple: the training split has"):
        too_coarse.load_data(tmp_path / "silo.yaml", seed=3)


def test_a_dp_sgd_answer_tells_the_training_set_size_only_to_the_sites_multiple(
    tmp_path: Path,
) -> None:
    """Two sites of 190 and 170 training rows, both keeping them to a multiple of 50 (150): the
    same DP-SGD train task gets the same scalars from both, the sample rate (batch / kept
    rows), the steps, the noise multiplier, the noised count and the epsilon the answer
    brings; none derives from the rows a site holds beyond the multiple."""
    from fedsilo.silo.agent import SiloAgent
    from tests.adversarial.helpers import DEPLOYMENT, JOB, SiloSite, dp_policy, initial_model, train
    from tests.test_tasks import separable

    scalars = []
    for rows in (190, 170):
        data = separable().with_train_rows(torch.arange(rows)).with_train_rows_multiple_of(50, 3)
        assert len(data.y_train) == 150
        site = SiloSite(tmp_path / str(rows))  # the same silo name and secret: the same noise
        site.folder.mkdir()
        agent = SiloAgent(
            site.name,
            data,
            dp_policy(),
            policy_digest=JOB,
            secret=bytes(site.identity),
            ledger=PrivacyLedger(site.ledger_path),
            deployment=DEPLOYMENT,
        )
        result, _ = train(agent, initial_model(agent))
        assert result.ok, result.error
        assert result.metrics["dp_sample_rate"] == 16 / 150  # helpers.TRAINING's batch
        scalars.append((result.num_samples, dict(result.metrics), result.epsilon))
    assert scalars[0] == scalars[1]
