"""Data plug-ins (entry point group `fedsilo.datasets`) and task plug-ins (`fedsilo.tasks`): a
registered loader's arrays or torch Dataset become silos like any source; an unregistered one is
refused naming the key as the reader's file spells it; bad rows are refused; a Cox survival task
trains with FedAvg and reports its concordance index, and is refused under DP-SGD without a
per-row loss."""

from __future__ import annotations

import math
from importlib.metadata import EntryPoint
from typing import Any

import pytest
import torch

from fedsilo.ops.simulate import load_silos, simulate
from fedsilo.policies.loading import PolicyError, parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.config import SiloData
from fedsilo.silo.data import DataError, load_consortium
from fedsilo.silo.data import plugins as plugin_registry
from fedsilo.silo.data.plugins import DATASETS_GROUP, TASKS_GROUP
from tests.plugin_data_fixtures import COX_TASK

FIXTURES = "tests.plugin_data_fixtures"
LOADERS = ("breast_cancer", "breast_cancer_dataset", "flat_x", "nan_x", "survival")
TRAINING = {"epochs": 1, "batch_size": 32, "optimizer": "adam", "lr": 0.05}


@pytest.fixture(autouse=True)
def installed_plugins(monkeypatch: pytest.MonkeyPatch) -> None:
    """The fixtures' loaders and the Cox task registered as a site's installed entry points."""
    points = {
        DATASETS_GROUP: tuple(
            EntryPoint(name, f"{FIXTURES}:{name}", DATASETS_GROUP) for name in LOADERS
        ),
        TASKS_GROUP: (EntryPoint("cox", COX_TASK, TASKS_GROUP),),
    }
    monkeypatch.setattr(plugin_registry, "installed", lambda group: points.get(group, ()))


def plugin_data(loader: str, **extra: Any) -> dict[str, Any]:
    return {"source": "plugin", "loader": f"{FIXTURES}:{loader}", **extra}


def policy(data: dict[str, Any], **overrides: Any) -> Policy:
    return parse_policy(
        {
            "version": 1,
            "seed": 2,
            "rounds": 4,
            "algorithm": {"name": "fedavg"},
            "model": {"name": "linear"},
            "training": TRAINING,
            "data": {"partition": {"kind": "iid", "silos": 3}, **data},
            **overrides,
        }
    )


@pytest.mark.parametrize("loader", ["breast_cancer", "breast_cancer_dataset"])
def test_a_plugin_loader_of_arrays_or_of_a_dataset_trains_with_fedavg(loader: str) -> None:
    p = policy(plugin_data(loader, args={"rows": 300}))
    silos = load_silos(p, None)
    assert [len(s.y_train) + len(s.y_val) + len(s.y_test) for s in silos] == [100, 100, 100]
    assert silos[0].task == "classification" and silos[0].num_classes == 2
    final = simulate(p, silos).history.final
    assert final.summary is not None
    assert final.summary["accuracy"]["mean"] > 0.85


def test_a_dataset_and_its_arrays_make_the_same_silos() -> None:
    arrays = load_consortium(policy(plugin_data("breast_cancer")).data, seed=2)
    dataset = load_consortium(policy(plugin_data("breast_cancer_dataset")).data, seed=2)
    for a, b in zip(arrays, dataset, strict=True):
        assert a.x_train.equal(b.x_train) and a.y_test.equal(b.y_test)


def test_a_loader_that_is_not_installed_is_refused_naming_the_policy_key() -> None:
    p = policy(plugin_data("not_registered"))
    with pytest.raises(DataError) as refused:
        load_silos(p, None)
    message = str(refused.value)
    assert message.startswith(f"data.loader: '{FIXTURES}:not_registered' is not an installed")
    assert f"{FIXTURES}:breast_cancer" in message  # what is installed


def test_a_loader_that_is_not_installed_is_refused_naming_the_silo_yaml_key() -> None:
    site = SiloData.model_validate({"source": plugin_data("not_registered")})
    with pytest.raises(DataError, match=r"^data\.source\.loader: "):
        site.load(seed=0, base_dir=None)


def test_a_site_reads_a_plugin_source_as_one_silo() -> None:
    site = SiloData.model_validate({"source": plugin_data("breast_cancer")})
    assert len(site.load(seed=0, base_dir=None).y_train) == 320


def test_a_loader_that_is_not_an_entry_point_value_is_refused_by_the_policy() -> None:
    with pytest.raises(PolicyError, match="loader 'os.system' is not an entry point value"):
        policy({"source": "plugin", "loader": "os.system"})


@pytest.mark.parametrize(
    ("loader", "complaint"),
    [
        ("flat_x", r"'x' must have shape \(n, \.\.\.\)"),
        ("nan_x", "'x' holds 1 non-finite values"),
    ],
)
def test_bad_rows_from_a_loader_are_refused_naming_the_key(loader: str, complaint: str) -> None:
    with pytest.raises(DataError, match=rf"^data\.loader: data plug-in .*{complaint}"):
        load_silos(policy(plugin_data(loader)), None)


def test_a_survival_task_plugin_trains_with_fedavg_and_reports_its_c_index() -> None:
    p = policy(plugin_data("survival"), rounds=6)
    silos = load_silos(p, None)
    assert silos[0].task == COX_TASK and silos[0].output_dim == 1
    assert silos[0].y_train.shape[1] == 2  # (time, event)
    result = simulate(p, silos)
    assert result.headline_metric == "c_index"
    evaluation = result.history.final.evaluation
    assert evaluation is not None
    assert all(set(metrics) >= {"c_index", "loss"} for metrics in evaluation.values())
    summary = result.history.final.summary
    assert summary is not None
    assert summary["c_index"]["mean"] > 0.7  # a random risk scores 0.5
    assert summary["c_index"]["worst"] == min(m["c_index"] for m in evaluation.values())


def test_a_task_plugin_without_a_per_row_loss_is_refused_under_dp_sgd(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    dp = {"delta": 1e-5, "dp_sgd": {"noise_multiplier": 1.0}}
    p = policy(plugin_data("survival"), rounds=1, privacy=dp)
    silos = load_silos(p, None)
    message = rf"^privacy\.dp_sgd: .*task plug-in '{COX_TASK}' defines no per_sample_loss"
    with pytest.raises(PolicyError, match=message):  # refused before the run, once data is read
        simulate(p, silos)
    # and each silo refuses on its own when a coordinator sends the round regardless
    monkeypatch.setattr("fedsilo.ops.simulate.check_consortium", lambda *_, **__: None)
    record = simulate(p, silos).history.records[-1]
    assert record.status == "failed"
    assert record.error is not None
    assert f"task plug-in '{COX_TASK}' defines no per_sample_loss" in record.error
    assert "privacy.dp_sgd" in record.error


def test_label_noise_is_refused_for_a_task_plugin() -> None:
    data = plugin_data("survival", label_noise={"silo_fraction": 0.5, "probability": 0.2})
    with pytest.raises(DataError, match=rf"^data\.label_noise: .*'{COX_TASK}'"):
        load_silos(policy(data), None)


def test_a_task_that_is_not_an_installed_plugin_is_refused_naming_the_key() -> None:
    data = plugin_data("breast_cancer", task="tests.plugin_data_fixtures:NoSuchTask")
    with pytest.raises(DataError, match=r"^data\.task: "):
        load_silos(policy(data), None)


def test_the_cox_loss_is_breslows_partial_likelihood() -> None:
    from tests.plugin_data_fixtures import CoxTask

    risk = torch.tensor([[0.5], [-1.0], [2.0], [0.0]])
    y = torch.tensor([[2.0, 1.0], [1.0, 1.0], [1.0, 0.0], [3.0, 1.0]])
    # risk sets: t=2 -> {0, 3}; t=1 -> all four (Breslow: the tied row 2 is in it); t=3 -> {3}
    e = [math.exp(r) for r in (0.5, -1.0, 2.0, 0.0)]
    expected = -((0.5 - math.log(e[0] + e[3])) + (-1.0 - math.log(sum(e))) + (0.0 - 0.0)) / 4
    assert CoxTask().loss(risk, y).item() == pytest.approx(expected)
