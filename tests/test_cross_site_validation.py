"""Cross-site validation (`evaluation.cross_site`, coordinator/cross_site.py): after a job's final
evaluation, every model the coordinator holds in the clear on every site's test split.

A silo answers these evaluations only when its own signed policy asks for them, at most one a
row (the global model's, and one per member's model where the sites' models reach the
coordinator in the clear), each booked and noised like any evaluation; the plan a silo makes
of the job before accepting it counts them.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsilo.coordinator.admin_api import AdminError
from fedsilo.coordinator.cross_site import GLOBAL_ROW, CrossSiteMatrix
from fedsilo.coordinator.engine import RoundRecord
from fedsilo.coordinator.jobs import JobInfo
from fedsilo.coordinator.phases import Phase, PhaseOutcome, Task
from fedsilo.coordinator.strategies.base import ServerState
from fedsilo.coordinator.strategies.references import Local
from fedsilo.ops.cli import main
from fedsilo.ops.cross_site_view import job_cross_site
from fedsilo.ops.simulate import load_silos, simulate
from fedsilo.policies.algorithms.contract import CROSS_SITE, Position, derived_train
from fedsilo.policies.loading import PolicyError, parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.budget_plan import CROSS_SITE_VALIDATION
from fedsilo.silo.data import SiloDataset
from fedsilo.wire.messages import SIMULATION
from fedsilo.wire.tasks import EvaluateTask
from fedsilo.wire.tasks.tensor_names import MODEL
from fedsilo.wire.tensors import ParameterSpec
from tests.adversarial.rewriting import Consortium
from tests.adversarial.rewriting import policy as attack_policy
from tests.deployment import Consortium as Deployment
from tests.silos import agent, run_handler
from tests.test_admin_cli import as_json, ended, submit
from tests.test_budget_plan import DP_SGD, booked, noised, plans, variant

SHUFFLED = "silo-2"  # the broken site: its export's labels are shuffled


def breast_cancer(algorithm: str = "fedavg", **overrides: Any) -> Policy:
    """A short FedAvg-family run over breast-cancer silos that asks for cross-site validation;
    `overrides` replace top-level sections."""
    document: dict[str, Any] = {
        "version": 1,
        "seed": 11,
        "rounds": 2,
        "algorithm": {"name": algorithm},
        "model": {"name": "linear"},
        "training": {"epochs": 3, "batch_size": 16, "lr": 0.1},
        "data": {
            "source": "sklearn:breast_cancer",
            "partition": {"kind": "iid", "silos": 4},
            "split": {"train": 0.6, "val": 0.1, "test": 0.3},
        },
        "evaluation": {"cross_site": True},
    }
    return parse_policy(document | overrides)


def matrix_of(record: RoundRecord) -> CrossSiteMatrix:
    assert record.cross_site is not None, "the final evaluation has no cross-site matrix"
    return CrossSiteMatrix.from_json(record.cross_site)


def with_labels_shuffled(data: SiloDataset, seed: int = 0) -> SiloDataset:
    """`data` with every split's labels permuted: an export whose label column is shuffled."""
    generator = torch.Generator().manual_seed(seed)

    def shuffled(y: torch.Tensor) -> torch.Tensor:
        return y[torch.randperm(len(y), generator=generator)]

    return replace(
        data,
        y_train=shuffled(data.y_train),
        y_val=shuffled(data.y_val),
        y_test=shuffled(data.y_test),
    )


# -- what the matrix shows --------------------------------------------------------------------


def test_a_site_whose_labels_are_shuffled_stands_out_in_its_row_and_its_column() -> None:
    """Its own model is the worst on every healthy site's data, and every model (the global
    one included) is worst on its data, each by a wide margin below every healthy cell."""
    policy = breast_cancer()
    datasets = [
        with_labels_shuffled(d) if d.name == SHUFFLED else d for d in load_silos(policy, None)
    ]
    rows = matrix_of(simulate(policy, datasets).history.final).rows
    sites = sorted(d.name for d in datasets)
    assert list(rows) == [GLOBAL_ROW, *sites]
    accuracy = {(row, site): rows[row][site]["accuracy"] for row in rows for site in sites}
    healthy = [v for (row, site), v in accuracy.items() if SHUFFLED not in (row, site)]
    for row in rows:
        assert min(sites, key=lambda site: accuracy[row, site]) == SHUFFLED, row
        assert accuracy[row, SHUFFLED] < min(healthy) - 0.2
    for site in sites:
        if site != SHUFFLED:
            assert min(rows, key=lambda row: accuracy[row, site]) == SHUFFLED, site
            assert accuracy[SHUFFLED, site] < min(healthy) - 0.1


class KeptStates:
    """An engine observer that keeps the state after every round (0: the setup)."""

    def __init__(self) -> None:
        self.states: dict[int, ServerState] = {}

    def on_round(self, record: RoundRecord, total_rounds: int) -> None:
        pass

    def on_state(self, round_no: int, state: ServerState) -> None:
        self.states[round_no] = state


def models_of_the_last_round(
    policy: Policy, datasets: list[SiloDataset], states: dict[int, ServerState]
) -> dict[str, torch.Tensor]:
    """Every row's model, recomputed apart from the run: the final global model, then each
    site's: `local` keeps them in its state; a FedAvg site's is its own training, at a silo
    of its own, of the last round's task from the state before that round."""
    last, before = states[policy.rounds], states[policy.rounds - 1]
    if policy.algorithm.name == "local":
        return {d.name: last.tensors[Local.key(d.name)] for d in datasets}
    sites = {}
    for data in datasets:
        config = derived_train(policy, Position(policy.rounds, "train", data.name))
        trained = run_handler(
            agent(data, policy), config, {MODEL: before.model}, before.spec, policy.rounds
        )
        sites[data.name] = trained.tensors[MODEL]
    return {GLOBAL_ROW: last.model, **sites}


@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 2**16),
    algorithm=st.sampled_from(["fedavg", "local"]),
    silos=st.integers(2, 4),
    rounds=st.integers(1, 2),
)
def test_every_cell_is_its_models_evaluation_on_its_sites_test_split_run_apart(
    seed: int, algorithm: str, silos: int, rounds: int
) -> None:
    """Property: for any seed, algorithm with site rows, consortium and length, each cell
    equals, bit for bit, the plain evaluation of that row's model (recomputed apart from the
    run) on that site's test split at a fresh silo."""
    data = {"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": silos}}
    policy = breast_cancer(algorithm, seed=seed, rounds=rounds, data=data)
    datasets = load_silos(policy, None)
    kept = KeptStates()
    matrix = matrix_of(simulate(policy, datasets, observers=[kept]).history.final)
    models = models_of_the_last_round(policy, datasets, kept.states)
    assert list(matrix.rows) == list(models)
    assert matrix.note is None and not matrix.dropped
    spec = kept.states[rounds].spec
    for row, model in models.items():
        for data_of_site in datasets:
            apart = run_handler(
                agent(data_of_site, policy), EvaluateTask(split="test"), {MODEL: model}, spec
            )
            assert matrix.rows[row][data_of_site.name] == dict(apart.metrics), (row, data_of_site)


def test_under_secure_aggregation_simulate_shows_the_global_row_only_and_says_why(
    tmp_path: Path,
) -> None:
    """Masking (with model lineage, which each silo holds the global model to): the
    coordinator never held a site's model; the table, results.json and cross_site.csv have
    the global model's row, and the output says why in one line."""
    policy = tmp_path / "masked.yaml"
    document = breast_cancer().model_dump(mode="json")
    document["secure_aggregation"] = {"method": "masking"}
    policy.write_text(yaml.safe_dump(document))
    out = tmp_path / "out"
    ran = CliRunner().invoke(main, ["simulate", "--policy", str(policy), "--out", str(out)])
    assert ran.exit_code == 0, ran.output
    why = "under secure_aggregation masking the coordinator holds only the sum"
    assert "cross-site validation: test accuracy" in ran.output
    assert why in " ".join(ran.output.split())
    results = json.loads((out / "results.json").read_text())
    matrix = CrossSiteMatrix.from_json(results["cross_site"])
    assert list(matrix.rows) == [GLOBAL_ROW] and why in (matrix.note or "")
    assert matrix.rows[GLOBAL_ROW] == results["final"]["per_silo"]  # the same model and data
    lines = (out / "cross_site.csv").read_text().splitlines()
    assert lines[0].startswith("model,site,accuracy") and len(lines) == 1 + len(matrix.sites)


def test_an_algorithm_with_no_model_to_evaluate_is_refused_naming_the_key() -> None:
    with pytest.raises(PolicyError, match=r"evaluation\.cross_site: multiboost evaluates no model"):
        breast_cancer("multiboost")


# -- privacy: booked, noised, planned ---------------------------------------------------------


def test_under_dp_every_cell_is_booked_and_noised_and_the_plan_a_silo_makes_covers_them(
    tmp_path: Path,
) -> None:
    """DP-SGD with noised reports, cross-site validation on: each silo plans the global row
    and one row per hospital as cross-site validation's own purpose, and books exactly its
    plan; the global row is a fresh noised release, not the final evaluation's."""
    path = variant(tmp_path, "heart-fedavg.yaml", DP_SGD)
    document = yaml.safe_load(path.read_text())
    path.write_text(yaml.safe_dump({**document, "evaluation": {"cross_site": True}}))
    planned = plans(path)
    ledgers = booked(path, tmp_path / "run")
    assert set(ledgers) == set(planned)
    for silo, ledger in ledgers.items():
        records = list(ledger.records())
        assert noised(r.mechanism for r in records) == noised(planned[silo].releases)
        assert math.isclose(ledger.spent(SIMULATION), planned[silo].epsilon, rel_tol=1e-12)
        crossed = [r for r in records if f"/{CROSS_SITE.format('')}" in r.task_id]
        assert len(crossed) == 1 + len(ledgers)
        assert all(r.mechanism.kind != "public" for r in crossed)
        assert planned[silo].by_purpose()[CROSS_SITE_VALIDATION] > 0
    results = json.loads((tmp_path / "run" / "results.json").read_text())
    assert results["metrics_noised"]
    global_row = results["cross_site"]["rows"][GLOBAL_ROW]
    assert global_row != results["final"]["per_silo"]  # the same model, noised afresh


# -- the silo contract: a deviating coordinator, the real engine and protocol, unmodified silos --


def cross_site_row(
    c: Consortium, row: int, model: torch.Tensor, spec: ParameterSpec
) -> PhaseOutcome:
    """Row `row` of a cross-site validation, as the honest engine sends it (the plain
    `evaluate` of the test split, in the last round), whatever the silos' policy says."""
    tasks = tuple(Task(s, EvaluateTask(split="test"), {MODEL: model}, spec) for s in c.silos)
    phase = Phase(CROSS_SITE.format(row), tasks, quorum=0)
    return c.engine().execute(phase, c.policy.rounds)


def test_silos_whose_policy_asks_no_cross_site_validation_refuse_its_evaluations() -> None:
    """The coordinator asks for every row a cross-site matrix could have; the silos' signed
    policy does not ask for one, so not one extra evaluation is answered or booked."""
    c = Consortium(attack_policy("none"))
    model, spec = c.initial_model()
    for row in range(1 + len(c.silos)):
        assert not cross_site_row(c, row, model, spec).reports, f"row {row} was answered"
    refusals = c.refusals("evaluate")
    assert set(refusals) == set(c.silos)
    assert all("cross_site" in why for why in refusals.values()), refusals


def test_silos_answer_no_more_cross_site_rows_than_their_policy_implies() -> None:
    """Under a policy that asks, FedAvg in the clear: the global model's row and one per member
    (four rows for three silos) are answered; a fifth row is refused by every silo."""
    c = Consortium(attack_policy("none", evaluation={"cross_site": True}))
    model, spec = c.initial_model()
    for row in range(1 + len(c.silos)):
        assert set(cross_site_row(c, row, model, spec).reports) == set(c.silos)
    beyond = cross_site_row(c, 1 + len(c.silos), model, spec)
    assert not beyond.reports and set(beyond.dropped) == set(c.silos)


def test_a_cross_site_task_is_answered_only_on_the_test_split() -> None:
    """The split is the silo's contract's, not the coordinator's: a row asked on the training
    split (the data the site's own model was fitted to) is refused."""
    c = Consortium(attack_policy("none", evaluation={"cross_site": True}))
    model, spec = c.initial_model()
    tasks = tuple(Task(s, EvaluateTask(split="train"), {MODEL: model}, spec) for s in c.silos)
    out = c.engine().execute(Phase(CROSS_SITE.format(0), tasks, quorum=0), c.policy.rounds)
    assert not out.reports
    assert all("split" in why for why in c.refusals("evaluate").values()), c.refusals()


def test_under_secure_aggregation_a_silo_answers_the_global_models_row_only() -> None:
    """Masking: the coordinator never held a site's model, so a silo answers one row."""
    secure = {"method": "masking", "lineage": False}
    c = Consortium(
        attack_policy("masking", evaluation={"cross_site": True}, secure_aggregation=secure)
    )
    model, spec = c.initial_model()
    assert set(cross_site_row(c, 0, model, spec).reports) == set(c.silos)
    assert not cross_site_row(c, 1, model, spec).reports


# -- a deployment: `fedsilo job validate` -----------------------------------------------------


def job_info(status: str) -> JobInfo:
    return JobInfo("crosssite-0123abcd", "crosssite", "0123abcd" * 8, status, "operator", 1.0,
                   2.0, None, False, "")  # fmt: skip


def test_job_validate_says_a_running_job_has_no_matrix_yet_and_a_job_that_asked_none_why() -> None:
    asked, plain = breast_cancer(), breast_cancer(evaluation={"cross_site": False})
    with pytest.raises(AdminError, match="is running: its cross-site validation runs after"):
        job_cross_site(job_info("running"), asked, None)
    with pytest.raises(AdminError, match=r"evaluation\.cross_site is false"):
        job_cross_site(job_info("completed"), plain, {"round": 2, "summary": {}})


def test_job_validate_shows_a_deployed_jobs_matrix_and_names_the_key_for_a_job_that_asked_none(
    consortium: Deployment,
) -> None:
    """A real `coordinator serve` and three silo agents (processes, mTLS): a one-round job
    that asks for cross-site validation has the global row and one per site, read from the
    coordinator's state file by a short job id; a job whose policy asks for none gets one
    message naming `evaluation.cross_site` and exit status 1."""
    consortium.serve_with_silos()
    job = submit(consortium, "crosssite", rounds=1, evaluation={"cross_site": True})
    plain = submit(consortium, "plain", rounds=1)
    operator = ["--kit", str(consortium.kits / "operator")]
    refused = CliRunner().invoke(main, ["job", "validate", plain, *operator])
    assert refused.exit_code == 1
    assert "evaluation.cross_site" in refused.output and "Traceback" not in refused.output
    assert ended(consortium, job)["status"] == "completed"

    short = job.rsplit("-", 1)[0]  # the policy's name: a start of the job's id
    document = as_json(consortium, "job", "validate", short)
    assert (document["job"], document["status"], document["round"]) == (job, "completed", 1)
    assert document["metric"] == "accuracy" and not document["metrics_noised"]
    rows = document["cross_site"]["rows"]
    silos = ["silo-0", "silo-1", "silo-2"]
    assert list(rows) == [GLOBAL_ROW, *silos]
    assert all(sorted(cells) == silos for cells in rows.values())
    shown = CliRunner().invoke(main, ["job", "validate", short, *operator])
    assert shown.exit_code == 0, shown.output
    assert "cross-site validation: test accuracy" in shown.output
    assert all(name in shown.output for name in [GLOBAL_ROW, *silos])
