"""A job that fails or is aborted after some rounds completed keeps what they cost: its silos
spent privacy budget that never comes back, so the coordinator writes the results of its last
completed round (the model of that round, and the history rebuilt from the state file with
each silo's epsilon as it reported it), marked partial in results.json under `ended`, and
`fedsilo job results` hands them back, saying whose round they are and what each silo spent.
A job that fails before any round completed has no results, as before.

With real processes (`coordinator serve` and three silo agents, started once for both jobs,
mTLS on 127.0.0.1): a DP job that needs every silo fails once one site can no longer pay (its
agent in another consortium, which books in the same ledger, released without noise, so the
site's total over all jobs is above its `rules.total_epsilon_cap`: it answers
`budget_exhausted`, is retired, and the rounds after miss their quorum); another job is aborted
by the operator. In process: the state file alone rebuilds the partial results.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner, Result

from fedsilo.coordinator.engine import RoundRecord
from fedsilo.coordinator.state import StateStore
from fedsilo.coordinator.strategies.base import ServerState
from fedsilo.ops.cli import main
from fedsilo.ops.coordinator_process import saved_history, write_partial_results
from fedsilo.ops.job_id import job_id
from fedsilo.policies.loading import load_policy
from fedsilo.privacy.accounting import Mechanism
from fedsilo.privacy.ledger import PrivacyLedger
from fedsilo.privacy.policy_signing import policy_digest
from fedsilo.wire.messages import task_id
from fedsilo.wire.tensors import ParameterSpec, decode_tensors
from tests.deployment import SILOS, Consortium, policy_document, provision, wait_until_ended

DP = {"delta": 1e-5, "dp_sgd": {"noise_multiplier": 1.0}}
ROUNDS = 6
BROKE = "silo-2"  # the site whose budget over all jobs runs out in the middle of the job


@pytest.fixture(scope="module")
def consortium(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Consortium]:
    """A serving coordinator and an agent per silo, for every job of this module (each silo's
    silo.yaml, read again per job, is written by the test whose job it is)."""
    running = provision(tmp_path_factory.mktemp("consortium"))
    try:
        running.serve_with_silos()
        yield running
    finally:
        running.stop_all()


def operator(consortium: Consortium, *args: str) -> Result:
    return CliRunner().invoke(main, [*args, "--kit", str(consortium.kits / "operator")])


def ledger(consortium: Consortium, silo: str) -> PrivacyLedger:
    return PrivacyLedger(consortium.root / "sites" / silo / "privacy-ledger.jsonl")


def spend_the_rest_elsewhere(consortium: Consortium, silo: str) -> None:
    """`silo`'s agent in another consortium books a release without noise in the site's ledger:
    its epsilon over all jobs is now infinite."""
    ledger(consortium, silo).append(
        deployment="another-consortium-job",
        round=1,
        task_id="another-consortium-job/1/train/local",
        mechanism=Mechanism.none(),
        payload_digest="0" * 64,
        delta=1e-5,
    )


def last_completed_round(consortium: Consortium, job: str) -> int:
    with StateStore(consortium.root / "state.db") as store:
        saved = store.last_round(job)
    assert saved is not None
    return max(r["round"] for r in saved.records if r["status"] == "completed")


def test_a_job_that_fails_midway_hands_back_its_last_completed_round_and_what_each_silo_spent(
    consortium: Consortium,
) -> None:
    consortium.write_silo_config(BROKE, total_epsilon_cap=1000.0)
    policy = consortium.write_policy(
        policy_document(
            rounds=ROUNDS,
            name="partial",
            privacy=DP,
            participants={
                "min_silos": len(SILOS),
                "phase_timeout_s": 20,
                "max_consecutive_failed_rounds": 2,
            },
        )
    )
    job = job_id(load_policy(policy).name, policy_digest(policy.read_bytes()))
    assert consortium.submit(policy) == job
    consortium.wait_for_log("coordinator", f"round 2/{ROUNDS} completed", interval=0.05)
    spend_the_rest_elsewhere(consortium, BROKE)

    info = wait_until_ended(consortium, job, timeout=60)
    assert info.status == "failed", consortium.log("coordinator")
    assert "rounds in a row missed their quorum" in info.error
    model_round = last_completed_round(consortium, job)
    assert 2 <= model_round < ROUNDS

    out = consortium.root / "fetched" / job
    fetched = operator(consortium, "job", "results", job, "--out", str(out))
    assert fetched.exit_code == 0, fetched.output
    assert (
        f"partial results: job {job} ended failed ({info.error}); these are the results of its "
        f"last completed round {model_round} of {ROUNDS}"
    ) in " ".join(fetched.output.split())

    results = json.loads((out / "results.json").read_text())
    assert results["ended"] == {
        "status": "failed",
        "reason": info.error,
        "partial": True,
        "model_round": model_round,
        "last_round": results["history"][-1]["round"],
        "rounds": ROUNDS,
    }
    assert results["history"][-1]["round"] > model_round  # the failed rounds are there too
    assert {r["round"] for r in results["failed_rounds"]} == {
        r["round"] for r in results["history"] if r["status"] == "failed"
    }
    tensors, _ = decode_tensors((out / "final_model.safetensors").read_bytes())
    assert tensors  # the model of round `model_round`
    assert (out / "history.json").is_file()

    # what each silo's own ledger booked for the job, to the last bit, and so the CLI says
    spent = {silo: ledger(consortium, silo).spent(job) for silo in SILOS}
    assert all(epsilon is not None and 0 < epsilon < 1000 for epsilon in spent.values())
    assert results["privacy"]["epsilon"] == spent
    for silo in SILOS:
        said = re.search(rf"{silo} spent epsilon (\S+) on this job", fetched.output)
        assert said is not None and float(said.group(1)) == pytest.approx(spent[silo], rel=1e-2)

    # `fedsilo status` shows the job that ended last with each silo's epsilon
    status = operator(consortium, "status", "--json")
    assert status.exit_code == 0, status.output
    progress = json.loads(status.output)["progress"]
    assert progress["deployment"] == job
    assert {s: v["epsilon"] for s, v in progress["silos"].items()} == spent


def test_an_aborted_job_hands_back_its_last_completed_round_with_each_silos_reported_epsilon(
    consortium: Consortium,
) -> None:
    consortium.write_silo_config(BROKE)  # no cap over all jobs at this site
    rounds = 30  # more than run before the abort lands (within a second)
    policy = consortium.write_policy(
        policy_document(
            rounds=rounds,
            name="aborted",
            privacy=DP,
            participants={"min_silos": len(SILOS), "phase_timeout_s": 20},
        )
    )
    job = consortium.submit(policy)
    consortium.wait_for_log("coordinator", f"round 2/{rounds} completed", interval=0.05)
    aborted = operator(consortium, "job", "abort", job)
    assert aborted.exit_code == 0, aborted.output

    info = wait_until_ended(consortium, job, timeout=60)
    assert (info.status, info.error) == ("aborted", "aborted by the operator")
    model_round = last_completed_round(consortium, job)
    assert 2 <= model_round < rounds

    out = consortium.root / "fetched" / job
    fetched = operator(consortium, "job", "results", job, "--out", str(out))
    assert fetched.exit_code == 0, fetched.output
    assert (
        f"partial results: job {job} ended aborted (aborted by the operator); these are the "
        f"results of its last completed round {model_round} of {rounds}"
    ) in " ".join(fetched.output.split())
    results = json.loads((out / "results.json").read_text())
    assert results["ended"]["status"] == "aborted"
    assert (results["ended"]["model_round"], results["ended"]["rounds"]) == (model_round, rounds)

    # each silo's epsilon is what its ledger booked for the tasks whose answers reached the
    # coordinator; a task the abort cut short may have booked more, but its answer never came
    answered: dict[str, set[str]] = {silo: set() for silo in SILOS}
    for record in results["history"]:
        for phase, outcome in record["phases"].items():
            for silo in outcome["answered"]:
                answered[silo].add(task_id(job, record["round"], phase, None, silo))
    for silo in SILOS:
        booked = [r for r in ledger(consortium, silo).records() if r.task_id in answered[silo]]
        assert results["privacy"]["epsilon"][silo] == booked[-1].epsilon_cumulative


# -- in process: the state file alone ------------------------------------------------------


def server_state(value: float) -> ServerState:
    weights = {"model/w": torch.full((2, 1), value)}
    return ServerState(weights, ParameterSpec.of({"w": weights["model/w"]}))


def round_record(round_no: int, status: str, epsilon: float | None = None) -> dict:
    privacy = {"silo-0": {"epsilon": epsilon, "ledger_head": f"{round_no:064x}"}}
    record = RoundRecord(round_no, status, 0.1, privacy=privacy if epsilon else None)
    return record.to_json()


def test_the_partial_results_hold_the_last_completed_rounds_model_and_every_reported_epsilon(
    tmp_path: Path,
) -> None:
    policy = load_policy(
        _written(tmp_path, policy_document(rounds=ROUNDS, privacy=DP, name="state-only"))
    )
    with StateStore(tmp_path / "state.db") as store:
        store.open_deployment("job", "digest", policy.model_dump_json())
        store.save_round("job", 0, "setup", server_state(0.0), {"round": 0, "silos": ["silo-0"]})
        store.save_round(
            "job", 1, "completed", server_state(1.0), round_record(1, "completed", 1.0)
        )
        store.save_round(
            "job", 2, "completed", server_state(2.0), round_record(2, "completed", 2.0)
        )
        # a failed round keeps the state before it; its answers' epsilon still counts
        store.save_round("job", 3, "failed", server_state(2.0), round_record(3, "failed", 2.5))
        model_round = write_partial_results(
            tmp_path / "results", policy, store, "job", "aborted", "aborted by the operator"
        )
    assert model_round == 2
    results = json.loads((tmp_path / "results" / "results.json").read_text())
    assert results["ended"] == {
        "status": "aborted",
        "reason": "aborted by the operator",
        "partial": True,
        "model_round": 2,
        "last_round": 3,
        "rounds": ROUNDS,
    }
    assert results["privacy"]["epsilon"] == {"silo-0": 2.5}
    assert [r["round"] for r in results["history"]] == [1, 2, 3]
    tensors, _ = decode_tensors((tmp_path / "results" / "final_model.safetensors").read_bytes())
    assert torch.equal(tensors["model/w"], torch.full((2, 1), 2.0))


def test_a_job_with_no_completed_round_gets_no_results(tmp_path: Path) -> None:
    policy = load_policy(_written(tmp_path, policy_document(rounds=ROUNDS, name="none-done")))
    with StateStore(tmp_path / "state.db") as store:
        store.open_deployment("job", "digest", policy.model_dump_json())
        assert saved_history(store, "job") is None  # not even set up
        store.save_round("job", 0, "setup", server_state(0.0), {"round": 0, "silos": ["silo-0"]})
        store.save_round("job", 1, "failed", server_state(0.0), round_record(1, "failed"))
        assert (
            write_partial_results(tmp_path / "results", policy, store, "job", "failed", "why")
            is None
        )
    assert not (tmp_path / "results").exists()


def _written(folder: Path, document: dict) -> Path:
    path = folder / "policy.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path
