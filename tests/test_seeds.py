"""What a policy's seed reproduces (docs/policies.md, "The seed: a simulation and a
deployment"): a site whose silo.yaml holds the policy's data section and selects its silo
loads the simulated silo's rows and splits; a site reading its own file is split as the first
silo; the same silos under other names, or keyed with a secret as a kit keys them under DP,
give other numbers. `tests/test_deployment.py` holds a deployment over real processes to the
simulation, bit for bit."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pandas as pd
import pytest
import torch

from fedsilo.ops import sim_silos
from fedsilo.ops.simulate import load_silos, simulate
from fedsilo.policies.loading import parse_policy
from fedsilo.silo.config import SiloData

DOCS = Path(__file__).resolve().parents[1] / "docs" / "policies.md"
TABLE = Path(__file__).resolve().parents[1] / "silo" / "datasets" / "blood_pressure"
DATA = {
    "source": "csv",
    "path": str(TABLE / "blood_pressure.csv"),
    "target": "systolic",
    "categorical": {"smoker": ["no", "yes"]},
}
POLICY = {
    "version": 1,
    "seed": 5,
    "rounds": 2,
    "model": {"name": "linear"},
    "training": {"epochs": 1, "batch_size": 32, "lr": 0.01},
    "compute": {"device": "cpu"},
    "data": {**DATA, "partition": {"kind": "natural", "column": "clinic"}},
}
SPLITS = ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test")


def final_model(policy_document: dict, rename: dict[str, str] | None = None) -> torch.Tensor:
    policy = parse_policy(policy_document)
    datasets = load_silos(policy, None)
    if rename:
        datasets = [dataclasses.replace(d, name=rename[d.name]) for d in datasets]
    return simulate(policy, datasets).history.state.model


def test_the_docs_say_what_a_seed_reproduces() -> None:
    text = DOCS.read_text()
    assert "## The seed: a simulation and a deployment" in text
    for condition in ("the same rows and splits", "the same silo names", "no DP noise"):
        assert condition in text


def test_a_site_selecting_its_silo_of_the_policys_data_loads_the_simulated_rows() -> None:
    policy = parse_policy(POLICY)
    for simulated in load_silos(policy, None):
        site = SiloData.model_validate({"source": POLICY["data"], "select": simulated.name})
        loaded = site.load(policy.seed, None)
        assert all(torch.equal(getattr(loaded, s), getattr(simulated, s)) for s in SPLITS)


def test_a_site_reading_its_own_file_is_split_as_the_first_silo(tmp_path: Path) -> None:
    policy = parse_policy(POLICY)
    simulated = load_silos(policy, None)
    assert [d.name for d in simulated] == ["north", "river", "hill"]  # as the values appear
    frame = pd.read_csv(DATA["path"])
    same = []
    for data in simulated:
        own = tmp_path / f"{data.name}.csv"
        frame[frame["clinic"] == data.name].drop(columns=["clinic"]).to_csv(own, index=False)
        site = SiloData.model_validate({**DATA, "path": str(own)}).load(policy.seed, None)
        same.append(torch.equal(site.y_test, data.y_test))
    assert same == [True, False, False]


def test_the_same_silos_under_other_names_train_to_other_numbers() -> None:
    assert torch.equal(final_model(POLICY), final_model(POLICY))
    renamed = {"north": "site-c", "river": "site-a", "hill": "site-b"}
    assert not torch.equal(final_model(POLICY), final_model(POLICY, renamed))


def test_dp_noise_follows_each_silos_secret(monkeypatch: pytest.MonkeyPatch) -> None:
    noised = {
        **POLICY,
        "rounds": 1,
        "privacy": {"dp_sgd": {"noise_multiplier": 1.0, "max_grad_norm": 1.0}},
    }
    simulated = final_model(noised)
    assert torch.equal(simulated, final_model(noised))  # a simulation repeats its noise
    agent = sim_silos.SiloAgent
    monkeypatch.setattr(
        sim_silos, "SiloAgent", lambda *a, **k: agent(*a, secret=os.urandom(32), **k)
    )
    assert not torch.equal(simulated, final_model(noised))  # a kit's secret: other noise
