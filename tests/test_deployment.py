"""The deployment as users run it: a provisioned consortium, a coordinator and three silo agents
as real processes on 127.0.0.1 over mutual TLS, the same answer as the in-process simulation."""

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from rich.console import Console

from fedsilo.ops.cli import main
from fedsilo.ops.job_id import job_id
from fedsilo.ops.report import comparison_table, write_results
from fedsilo.ops.simulate import load_silos, simulate
from fedsilo.policies.loading import parse_policy
from fedsilo.privacy.ledger import PrivacyLedger, verify
from fedsilo.privacy.policy_signing import policy_digest
from fedsilo.wire.tensors import decode_tensors
from tests.deployment import (
    SILOS,
    Consortium,
    fedsilo,
    free_port,
    job_sample,
    policy_document,
    provision,
    sample,
    scrape,
    wait_for,
)


def scrape_at_round(port: int, round_no: int) -> str | None:
    text = scrape(port)
    return text if job_sample(text, "fedsilo_round") == round_no else None


@pytest.fixture
def consortium(tmp_path: Path):
    consortium = provision(tmp_path)
    yield consortium
    consortium.stop_all()


def test_fedavg_over_mtls_processes_equals_the_in_process_simulation(
    consortium: Consortium,
) -> None:
    policy = consortium.write_policy(policy_document())
    metrics_port = free_port()
    consortium.start_coordinator(
        policy, "--metrics-port", str(metrics_port), "--out", "results", "--linger-seconds", "30"
    )
    for silo in SILOS:
        consortium.start_silo(silo)

    text = wait_for(
        lambda: scrape_at_round(metrics_port, 3), 120, "round 3 in /metrics", consortium
    )
    assert job_sample(text, "fedsilo_rounds_total", status="completed") == 3
    assert sample(text, "fedsilo_rejected_messages_total", reason="bad_signature") in (None, 0)
    for silo in SILOS:
        assert sample(text, "fedsilo_bytes_total", direction="from_silo", silo=silo) > 0
        assert 0.5 < job_sample(text, "fedsilo_silo_metric", silo=silo, name="accuracy") <= 1.0
    for silo in SILOS:
        assert consortium.wait(silo, timeout=30) == 0, consortium.log(silo)
    consortium.processes["coordinator"].terminate()  # SIGTERM ends the lingering cleanly
    assert consortium.wait("coordinator", timeout=30) == 0, consortium.log("coordinator")

    tensors, _ = decode_tensors(
        (consortium.root / "results" / "final_model.safetensors").read_bytes()
    )
    expected_policy = parse_policy(policy_document())
    expected = simulate(expected_policy, load_silos(expected_policy, None)).history.state.model
    assert torch.equal(tensors["model"], expected)


def test_a_silo_refuses_a_policy_that_breaks_its_local_rules_and_the_others_go_on(
    consortium: Consortium,
) -> None:
    policy = consortium.write_policy(policy_document(rounds=2))
    consortium.start_coordinator(policy, "--out", "results")
    strict = consortium.write_silo_config("silo-2", allowed_algorithms=["fedprox"])
    for silo in SILOS:
        consortium.start_silo(silo, strict if silo == "silo-2" else None)

    assert consortium.wait("silo-2", timeout=60) != 0
    assert "allowed_algorithms: 'fedavg' is not in ['fedprox']" in consortium.log("silo-2")
    assert consortium.wait("coordinator", timeout=120) == 0, consortium.log("coordinator")
    assert "silo silo-2 refused the policy: allowed_algorithms" in consortium.log("coordinator")
    history = (consortium.root / "results" / "history.json").read_text()
    assert '"silo-2"' not in history  # never took part

    status = subprocess.run(
        [
            sys.executable,
            "-m",
            "fedsilo",
            "status",
            "--kit",
            str(consortium.kits / "coordinator"),
            "--state",
            str(consortium.root / "state.db"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "COLUMNS": "250"},
    ).stdout
    assert "refused allowed_algorithms" in status


def test_a_dp_deployment_with_masked_sums_books_every_answer_and_a_site_over_budget_refuses(
    consortium: Consortium,
) -> None:
    """silo-2's cap is below its plan for the job (silo/budget_plan.py): it refuses the policy
    before booking anything, and the others run the job."""
    dp = {
        "delta": 1e-5,
        "dp_sgd": {"noise_multiplier": 1.0},
        "client_dp": {"clip": 1.0, "noise_multiplier": 1.0, "noise": "distributed"},
    }
    policy = consortium.write_policy(
        policy_document(rounds=2, privacy=dp, secure_aggregation="masking")
    )
    metrics_port = free_port()
    consortium.start_coordinator(
        policy, "--metrics-port", str(metrics_port), "--out", "results", "--linger-seconds", "2"
    )
    job = job_id("breast-cancer-deployed", policy_digest(policy.read_bytes()))
    frugal = consortium.write_silo_config("silo-2", epsilon_cap=0.3)  # less than one epoch
    for silo in SILOS:
        if silo != "silo-2":
            consortium.start_silo(silo)
    frugal_silo = consortium.start_silo("silo-2", frugal)
    assert frugal_silo.wait(timeout=120) == 1  # a single-policy agent stops at its refusal
    assert "privacy budget: this job would spend epsilon" in consortium.log("silo-2")
    assert "above rules.epsilon_cap 0.3" in consortium.log("silo-2")
    del consortium.processes["silo-2"]  # its refusal is the outcome, not a failure

    text = wait_for(
        lambda: scrape_at_round(metrics_port, 2), 120, "round 2 in /metrics", consortium
    )
    spent = {
        silo: sample(text, "fedsilo_privacy_epsilon", silo=silo, deployment=job)
        for silo in ("silo-0", "silo-1")
    }
    assert all(0 < e < 20 for e in spent.values()), spent
    published = sample(text, "fedsilo_client_dp_epsilon", deployment=job)
    assert consortium.wait("coordinator", timeout=60) == 0, consortium.log("coordinator")
    assert not (consortium.root / "sites" / "silo-2" / "privacy-ledger.jsonl").exists()

    # The privacy officer's audit of a silo's own ledger, anchored at the head the coordinator
    # recorded with that silo's last answer, recomputes the epsilon it reported.
    history = json.loads((consortium.root / "results" / "history.json").read_text())
    assert history["rounds"][-1]["client_epsilon"] == published > 0
    first = history["rounds"][0]["phases"]["train"]  # the training phase ran masked
    assert sorted(first["answered"]) == ["silo-0", "silo-1"]
    anchor = history["rounds"][-1]["privacy"]["silo-0"]["ledger_head"]
    ledger = consortium.root / "sites" / "silo-0" / "privacy-ledger.jsonl"
    audit = CliRunner().invoke(
        main, ["privacy", "audit", "--ledger", str(ledger), "--anchor", anchor, "--json"]
    )
    assert audit.exit_code == 0, audit.output
    (booked,) = json.loads(audit.output)["deployments"]
    assert booked["deployment"] == job  # the job, not the consortium: a ledger spans jobs
    assert booked["recomputed"] == booked["booked"] >= spent["silo-0"]

    # The coordinator kept silo-0's signed receipts: its ledger books every release it received,
    # including the last one (the final evaluation), and one record deleted is named.
    receipts = consortium.root / "receipts.json"
    fedsilo("privacy", "receipts", "--state", str(consortium.root / "state.db"),
            "--silo", "silo-0", "--out", str(receipts))  # fmt: skip
    kit = str(consortium.kits / "silos" / "silo-0")
    audited = ["privacy", "audit", "--receipts", str(receipts), "--verify-key", kit]
    whole = CliRunner().invoke(main, [*audited, "--ledger", str(ledger)])
    assert whole.exit_code == 0, whole.output
    cut = consortium.root / "cut-ledger.jsonl"
    cut.write_bytes(b"".join(ledger.read_bytes().splitlines(keepends=True)[:-1]))
    deleted = CliRunner().invoke(main, [*audited, "--ledger", str(cut)])
    assert deleted.exit_code == 1, deleted.output
    assert "deleted" in deleted.output


def test_a_dp_simulation_shows_the_epsilon_each_silo_of_the_deployment_books(
    consortium: Consortium, tmp_path: Path
) -> None:
    document = policy_document(
        rounds=2, privacy={"delta": 1e-5, "epsilon_cap": 50, "dp_sgd": {"noise_multiplier": 1.0}}
    )
    policy = consortium.write_policy(document)
    consortium.start_coordinator(policy, "--out", "results", "--linger-seconds", "1")
    for silo in SILOS:
        consortium.start_silo(silo)
    assert consortium.wait("coordinator", timeout=120) == 0, consortium.log("coordinator")
    job = job_id("breast-cancer-deployed", policy_digest(policy.read_bytes()))
    booked = {
        silo: PrivacyLedger(consortium.root / "sites" / silo / "privacy-ledger.jsonl").spent(job)
        for silo in SILOS
    }
    assert all(0 < e < 50 for e in booked.values()), booked

    parsed = parse_policy(document)
    result = simulate(parsed, load_silos(parsed, None))
    write_results(tmp_path / "sim", {"fedavg": result})
    simulated = json.loads((tmp_path / "sim" / "results.json").read_text())["privacy"]
    assert simulated["epsilon"] == booked
    assert simulated["epsilon_cap"] == 50
    for silo in SILOS:  # the simulation's own ledgers, audited like a site's
        (audited,) = verify(tmp_path / "sim" / "ledgers" / f"{silo}.jsonl", cap=50).deployments
        assert (audited.deployment, audited.booked) == ("simulation", booked[silo])
        assert audited.recomputed == audited.booked
    console = Console(width=120, record=True)
    console.print(comparison_table({"fedavg": result}))
    table = console.export_text()
    assert "ε: booked at δ=1e-05, cap 50" in table
    (row,) = [line for line in table.splitlines() if line.startswith("│ silo-0 ")]
    assert row.rstrip(" │").endswith(f"{booked['silo-0']:.3g}")
    deployed = json.loads((consortium.root / "results" / "results.json").read_text())["privacy"]
    assert deployed["epsilon_per_round"] == simulated["epsilon_per_round"]

    # the coordinator ends the job with each silo's audit anchor, the head history.json keeps
    history = json.loads((consortium.root / "results" / "history.json").read_text())
    for silo in SILOS:
        head = history["rounds"][-1]["privacy"][silo]["ledger_head"]
        assert f"silo {silo}'s audit anchor (its ledger head at round 2): {head}" in (
            consortium.log("coordinator")
        )


def test_feddc_with_sealed_hand_offs_and_ckks_sums_over_processes_equals_the_simulation(
    consortium: Consortium,
) -> None:
    document = policy_document(
        rounds=4,
        algorithm={
            "name": "feddc",
            "daisy_period": 1,
            "aggregation_period": 2,
            "permutation": "derangement",
        },
        training={"steps": 1, "batch_size": 16, "lr": 0.05},
        channel={"sealed_handoffs": True},
        secure_aggregation="ckks",
    )
    policy = consortium.write_policy(document)
    consortium.start_coordinator(policy, "--out", "results", "--linger-seconds", "2")
    for silo in SILOS:
        consortium.start_silo(silo)
    assert consortium.wait("coordinator", timeout=120) == 0, consortium.log("coordinator")

    history = json.loads((consortium.root / "results" / "history.json").read_text())
    assert [r["status"] for r in history["rounds"]] == ["completed"] * 4
    assert "daisy" in history["rounds"][0]["phases"]  # round 1 hands models on
    assert "aggregate" in history["rounds"][1]["phases"]  # round 2 sums them under CKKS
    tensors, _ = decode_tensors(
        (consortium.root / "results" / "final_model.safetensors").read_bytes()
    )
    expected_policy = parse_policy(document)
    expected = simulate(expected_policy, load_silos(expected_policy, None)).history.state.model
    # CKKS decrypts approximately (rounded to 2^-22): the same model within that precision
    assert torch.allclose(tensors["model"], expected, atol=1e-5)


def test_fedevg_over_processes_sends_no_model_and_writes_the_simulations_synthetic_set(
    consortium: Consortium,
) -> None:
    data = {"source": "sklearn:digits", "scaling": "none", "partition": {"kind": "iid", "silos": 3}}
    document = policy_document(
        rounds=2,
        algorithm={"name": "fedevg", "samples_per_class": 2, "classifier_epochs": 5},
        model={"name": "cnn", "channels": [4], "hidden": 0, "activation": "silu", "norm": "group"},
        training={"epochs": 1, "batch_size": 32, "optimizer": "adam", "lr": 1e-3},
        data=data,
        secure_aggregation="masking",
    )
    document["algorithm"]["image_every"] = 1
    policy = consortium.write_policy(document)
    consortium.start_coordinator(policy, "--out", "results", "--linger-seconds", "2")
    for silo in SILOS:
        consortium.start_silo(silo, consortium.write_silo_config(silo, data=data))
    assert consortium.wait("coordinator", timeout=120) == 0, consortium.log("coordinator")

    results = consortium.root / "results"
    history = json.loads((results / "history.json").read_text())
    assert [r["status"] for r in history["rounds"]] == ["completed"] * 2
    assert sorted(p.name for p in (results / "synthetic").iterdir()) == [
        "round-0000.png",
        "round-0001.png",
        "round-0002.png",
    ]
    synthetic, _ = decode_tensors((results / "synthetic.safetensors").read_bytes())
    expected_policy = parse_policy(document)
    expected = simulate(expected_policy, load_silos(expected_policy, None)).history.state
    assert torch.allclose(synthetic["x"], expected.tensors["synthetic"], atol=1e-5)
    assert torch.equal(synthetic["y"], expected.tensors["synthetic_labels"])


def test_drflm_on_molecular_graphs_over_processes_equals_the_simulation(
    consortium: Consortium,
) -> None:
    """The molecular policy as deployed: each silo featurises its own scaffold share of the
    bundled FreeSolv with RDKit, trains a small GCN with mixup of g(x), and the final model is
    the simulation's."""
    data = {
        "source": "molecules:freesolv",
        "molecules": {"max_atoms": 24},
        "partition": {"kind": "scaffold", "silos": 3},
    }
    document = policy_document(
        rounds=2,
        algorithm={"name": "drflm", "step": 0.1, "mixup_on": "embedding"},
        model={"name": "gcn", "hidden": [8], "readout": "mean"},
        training={"steps": 2, "batch_size": 16, "lr": 0.01},
        participants={"min_silos": 1, "phase_timeout_s": 20},
        data=data,
    )
    policy = consortium.write_policy(document)
    consortium.start_coordinator(policy, "--out", "results", "--linger-seconds", "2")
    for silo in SILOS:
        consortium.start_silo(silo, consortium.write_silo_config(silo, data=data))
    assert consortium.wait("coordinator", timeout=120) == 0, consortium.log("coordinator")

    history = json.loads((consortium.root / "results" / "history.json").read_text())
    assert [r["status"] for r in history["rounds"]] == ["completed"] * 2
    assert set(history["final"]["evaluation"]) == set(SILOS)
    tensors, _ = decode_tensors(
        (consortium.root / "results" / "final_model.safetensors").read_bytes()
    )
    expected_policy = parse_policy(document)
    expected = simulate(expected_policy, load_silos(expected_policy, None)).history.state.model
    assert torch.equal(tensors["model"], expected)


@pytest.mark.parametrize("method", ["masking", "ckks"])
def test_a_coordinator_killed_mid_secure_round_and_restarted_ends_with_the_uninterrupted_model(
    consortium: Consortium, method: str
) -> None:
    # silo-2 is frozen once round 2 ends, so the coordinator is stuck inside round 3's secure
    # aggregation when SIGKILL reaches it; restarted with the same command, it finishes the
    # aggregation the silos began (tests/test_restart_mid_aggregation.py: at every step)
    document = policy_document(rounds=4, secure_aggregation=method)
    policy = consortium.write_policy(document)
    consortium.start_coordinator(policy, "--out", "results")
    for silo in SILOS:
        consortium.start_silo(silo)
    consortium.wait_for_log("coordinator", "round 2/4 completed", timeout=120, interval=0.02)
    consortium.send_signal("silo-2", signal.SIGSTOP)
    consortium.kill("coordinator")
    consortium.send_signal("silo-2", signal.SIGCONT)
    assert "round 3/4" not in consortium.log("coordinator")
    consortium.start_coordinator(policy, "--out", "results", name="restarted")
    assert consortium.wait("restarted", timeout=120) == 0, consortium.log("restarted")
    resumed = consortium.log("restarted")
    assert "round 3/4 completed" in resumed and "failed" not in resumed

    tensors, _ = decode_tensors(
        (consortium.root / "results" / "final_model.safetensors").read_bytes()
    )
    expected_policy = parse_policy(document)
    expected = simulate(expected_policy, load_silos(expected_policy, None)).history.state.model
    if method == "masking":  # exact fixed-point sums: the same bits
        assert torch.equal(tensors["model"], expected)
    else:  # CKKS decrypts approximately (rounded to 2^-22): the same model within that
        assert torch.allclose(tensors["model"], expected, atol=1e-5)
