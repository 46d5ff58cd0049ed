"""Domains inside silos (`data.domain`): every row carries the domain of the declared column; the
loss probe reports each domain's loss sum and count (noised and booked as two reports under DP,
refused by a silo without domains); per-domain weights and ApproxFedAvg's soft maximum shape
local training; ApproxFedAvg with one domain is FedAvg; AgnosticFedAvg over domains starts as
FedAvg, moves lambda toward the domain with the larger loss, and resumes after a restart.
What a task computes is its handler run alone (`answer`), as the agent runs it once the task
passed its contract, which lets a coordinator choose domain weights but never all zero."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from sklearn.datasets import load_breast_cancer

from fedsilo.coordinator.engine import RunHistory
from fedsilo.ops.simulate import load_silos, simulate
from fedsilo.policies.loading import PolicyError, parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import DataError, SiloDataset, load_consortium
from fedsilo.silo.domains import DomainObjective
from fedsilo.silo.evaluation import per_sample_loss_function
from fedsilo.silo.reports import reports_mechanism
from fedsilo.silo.tasks.base import parameter_spec
from fedsilo.silo.tasks.evaluate import loss_releases
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tasks import LocalTraining, LossProbe, TaskConfig, TrainTask
from tests.resume import resumed_and_uninterrupted
from tests.silos import agent as built
from tests.silos import honest, policy_with, run_handler

HEART = {"source": "heart", "domain": "sex"}
TRAINING = {"steps": 4, "batch_size": 32, "optimizer": "sgd", "lr": 0.1}
LINEAR = {"name": "linear"}
OVER_DOMAINS = {"name": "agnostic_fedavg", "domains": "data"}


def heart_silo(name: str = "Cleveland") -> SiloDataset:
    p = parse_policy({"version": 1, "data": HEART})
    return next(d for d in load_consortium(p.data, seed=0) if d.name == name)


def grouped_csv(folder: Path, groups: tuple[str, ...], noisy: str | None = None) -> Path:
    """breast_cancer's first four features, a `group` column (rows alternate between `groups`)
    and, with `noisy`, 40% of that group's labels flipped."""
    bunch = load_breast_cancer()
    frame = pd.DataFrame(bunch.data[:, :4], columns=["f0", "f1", "f2", "f3"])
    frame["group"] = [groups[i % len(groups)] for i in range(len(frame))]
    labels = bunch.target.copy()
    if noisy is not None:
        rng = np.random.default_rng(0)
        flip = (frame["group"] == noisy).to_numpy() & (rng.random(len(labels)) < 0.4)
        labels[flip] = 1 - labels[flip]
    frame["label"] = labels
    path = folder / "grouped.csv"
    frame.to_csv(path, index=False)
    return path


def grouped_policy(
    path: Path, groups: tuple[str, ...], name: str, settings: dict | None = None
) -> Policy:
    data = {
        "source": "csv",
        "path": str(path),
        "target": "label",
        "categorical": {"group": list(groups)},
        "domain": "group",
        "partition": {"kind": "iid", "silos": 3},
    }
    return parse_policy(
        {
            "version": 1,
            "seed": 1,
            "rounds": 3,
            "eval_every": 3,
            "algorithm": {"name": name, **(settings or {})},
            "training": TRAINING,
            "data": data,
        }
    )


def run(p: Policy) -> RunHistory:
    return simulate(p, load_consortium(p.data, seed=p.seed)).history


def message(agent: SiloAgent, kind: str, **config: Any) -> TaskMessage:
    """A `train` task (the TRAINING settings, seed 3) or a `loss` probe, from a fresh model
    (its id and position beside the point: `answer` runs its handler alone)."""
    model = agent.context.new_model(seed=0)
    spec = parameter_spec(model)
    typed: TaskConfig = (
        TrainTask(local=LocalTraining(**TRAINING, seed=3), **config)
        if kind == "train"
        else LossProbe(**config)
    )
    return TaskMessage(
        "t", 1, "r", agent.name, typed,
        {"model": spec.flatten(dict(model.named_parameters()))}, spec,
    )  # fmt: skip


def handled(agent: SiloAgent, task: TaskMessage) -> TaskResult:
    """What `task`'s handler computes on the agent's data (`run_handler`)."""
    return run_handler(agent, task.config, task.tensors, task.spec, phase=task.phase)


def answer(agent: SiloAgent, kind: str, **config: object) -> TaskResult:
    result = handled(agent, message(agent, kind, **config))
    assert result.ok, result.error
    return result


def domain_policy(privacy: dict | None = None, data: dict = HEART) -> Policy:
    """AgnosticFedAvg over the data's domains, a linear model and the TRAINING settings."""
    sections = {"privacy": privacy} if privacy is not None else {}
    return policy_with(
        algorithm=OVER_DOMAINS, model=LINEAR, training=TRAINING, data=data, **sections
    )


def heart_agent(privacy: dict | None = None) -> SiloAgent:
    return built(heart_silo(), domain_policy(privacy))


def test_every_row_carries_the_domain_of_the_declared_column() -> None:
    data = heart_silo("Hungary")
    assert data.domains == ("Male", "Female")
    male = data.feature_names.index("sex=Male")
    for split in ("train", "val", "test"):
        x = getattr(data, f"x_{split}")
        assert torch.equal(data.domain_codes[split] == 0, x[:, male] == 1.0)


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"source": "sklearn:digits", "domain": "x0"}, "domain names a categorical column"),
        (
            {"source": "csv", "path": "t.csv", "target": "y", "domain": "site"},
            "must be declared in categorical",
        ),
    ],
)
def test_a_domain_must_be_a_declared_categorical_column(data: dict, message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        parse_policy({"version": 1, "data": data})


def test_the_domain_probe_reports_each_domains_loss_sum_and_count() -> None:
    agent = heart_agent()
    result = answer(agent, "loss", split="train", by_domain=True)
    model = agent.context.new_model(seed=0)
    x, y = agent.context.split("train")
    codes = agent.context.data.domain_codes["train"]
    with torch.no_grad():
        losses = per_sample_loss_function("classification")(model(x), y).double()
    for code, domain in enumerate(("Male", "Female")):
        rows = codes == code
        assert result.metrics[f"count[{domain}]"] == int(rows.sum())
        assert result.metrics[f"loss_sum[{domain}]"] == pytest.approx(float(losses[rows].sum()))
    assert "loss" not in result.metrics


def test_under_dp_the_domain_reports_are_noised_and_booked_as_two_reports() -> None:
    agent = heart_agent({"dp_sgd": {"noise_multiplier": 1.0}})
    privacy = agent.context.privacy
    exact = answer(heart_agent(), "loss", split="train", by_domain=True)
    noisy = answer(agent, "loss", split="train", by_domain=True)
    assert noisy.metrics.keys() == exact.metrics.keys()
    assert all(noisy.metrics[k] != exact.metrics[k] for k in exact.metrics)
    task = message(agent, "loss", split="train", by_domain=True)
    assert loss_releases(task, agent.context) == reports_mechanism(privacy, 2)


def test_a_silo_without_domains_refuses_a_domain_task() -> None:
    p = parse_policy({"version": 1, "data": {"source": "sklearn:breast_cancer"}})
    data = load_consortium(p.data, seed=0)[0]
    agent = built(data, policy_with(model=LINEAR))
    for kind, config in (("loss", {"by_domain": True}), ("train", {"domain_temperature": 1.0})):
        with pytest.raises(ValueError, match=r"declares no domain column \(data.domain\)"):
            handled(agent, message(agent, kind, **config))
    # the tasks a domain policy's contract asks of such a silo (AgnosticFedAvg's probe over
    # domains, ApproxFedAvg's training) are refused the same way, with nothing else sent
    model = message(agent, "train")
    for algorithm, phase in ((OVER_DOMAINS, "loss"), ({"name": "approx_fedavg"}, "train")):
        silo = built(data, policy_with(algorithm=algorithm, model=LINEAR))
        result = silo.handle(honest(silo, phase, 1, model.tensors, model.spec))
        assert not result.ok and not result.tensors
        assert "declares no domain column (data.domain)" in result.error


def test_a_simulation_needing_domains_on_data_without_them_is_refused() -> None:
    p = parse_policy(
        {"version": 1, "algorithm": {"name": "approx_fedavg"}, "data": {"source": "heart"}}
    )
    with pytest.raises(DataError, match="silo 'Cleveland' declares no domain column"):
        load_silos(p, base_dir=None)


def test_equal_domain_weights_train_like_plain_training() -> None:
    plain = answer(heart_agent(), "train")
    weighted = answer(heart_agent(), "train", domain_weights={"Male": 1.0, "Female": 1.0})
    assert torch.allclose(plain.tensors["model"], weighted.tensors["model"], atol=1e-6)


def test_zero_domain_weights_leave_the_model_where_it_was() -> None:
    agent = heart_agent()
    received = message(agent, "train").tensors["model"]
    trained = answer(agent, "train", domain_weights={"Male": 0.0, "Female": 0.0})
    assert torch.equal(trained.tensors["model"], received)
    with pytest.raises(ValueError, match=r"unknown domains \['Other'\]"):
        handled(agent, message(agent, "train", domain_weights={"Other": 1.0}))
    # a silo's contract lets the coordinator choose the domain weights, but never all zero (a
    # task that releases the model received), and the handler still refuses unknown domains
    zeros = {"Male": 0.0, "Female": 0.0}
    for weights, error in (
        (zeros, "gives every domain weight 0"),
        ({"Other": 1.0}, "unknown domains ['Other']"),
    ):
        fresh = heart_agent()  # a refused task is that position's answer: one silo per case
        model = message(fresh, "train")
        task = honest(fresh, "train", 1, model.tensors, model.spec, domain_weights=weights)
        refused = fresh.handle(task)
        assert not refused.ok and not refused.tensors and error in refused.error


def soft_maximum_gradient(temperature: float, reduction: str) -> tuple[torch.Tensor, ...]:
    """The gradient of ApproxFedAvg's batch loss with respect to four rows' losses, rows 0-1 of
    domain 0 (losses 1, 2) and rows 2-3 of domain 1 (losses 4, 6)."""
    losses = torch.tensor([1.0, 2.0, 4.0, 6.0], requires_grad=True)
    codes = torch.tensor([0, 0, 1, 1])
    objective = DomainObjective(
        lambda index: losses[index], codes, 2, temperature=temperature, reduction=reduction
    )
    value = objective.batch_loss(torch.arange(4))
    (gradient,) = torch.autograd.grad(value, losses)
    return value.detach(), gradient


def test_the_soft_maximum_spans_the_mean_and_the_worst_domain() -> None:
    value, gradient = soft_maximum_gradient(1e-6, "sum")  # mu -> 0: each domain counts alike
    assert torch.allclose(gradient, torch.full((4,), 0.5 / 4), atol=1e-6)
    value, gradient = soft_maximum_gradient(1e3, "sum")  # mu large: the worse domain alone
    assert value.item() == pytest.approx(10.0 / 4)
    assert torch.allclose(gradient, torch.tensor([0.0, 0.0, 0.25, 0.25]), atol=1e-6)
    value, gradient = soft_maximum_gradient(1e3, "mean")
    assert value.item() == pytest.approx(5.0)
    assert torch.allclose(gradient, torch.tensor([0.0, 0.0, 0.5, 0.5]), atol=1e-6)


def test_the_soft_maximum_of_one_domain_is_the_mean_loss() -> None:
    losses = torch.tensor([1.0, 2.0, 6.0])
    for reduction in ("sum", "mean"):
        objective = DomainObjective(
            lambda index: losses[index], torch.zeros(3, dtype=torch.long), 1, None, 7.0, reduction
        )
        assert objective.batch_loss(torch.arange(3)).item() == pytest.approx(3.0)


def test_approx_fedavg_with_one_domain_is_fedavg(tmp_path: Path) -> None:
    path = grouped_csv(tmp_path, ("a",))
    approx = run(grouped_policy(path, ("a",), "approx_fedavg", {"temperature": 5.0}))
    fedavg = run(grouped_policy(path, ("a",), "fedavg"))
    assert torch.allclose(approx.state.model, fedavg.state.model, atol=1e-5)


def test_approx_fedavg_with_two_domains_is_not_fedavg(tmp_path: Path) -> None:
    path = grouped_csv(tmp_path, ("a", "b"), noisy="b")
    approx = run(grouped_policy(path, ("a", "b"), "approx_fedavg", {"temperature": 5.0}))
    fedavg = run(grouped_policy(path, ("a", "b"), "fedavg"))
    assert [r.status for r in approx.records] == ["completed"] * 3
    assert not torch.allclose(approx.state.model, fedavg.state.model, atol=1e-3)


def test_agnostic_fedavg_over_domains_starts_as_fedavg(tmp_path: Path) -> None:
    path = grouped_csv(tmp_path, ("a", "b"), noisy="b")
    settings = {"domains": "data", "step": 1e-12}
    agnostic = run(grouped_policy(path, ("a", "b"), "agnostic_fedavg", settings))
    fedavg = run(grouped_policy(path, ("a", "b"), "fedavg"))
    assert torch.allclose(agnostic.state.model, fedavg.state.model, atol=1e-5)
    mixing_state = agnostic.state.extra["mixing"]
    assert mixing_state["domains"] == ["a", "b"]
    assert mixing_state["omega"] == pytest.approx({"a": 1.0, "b": 1.0}, rel=1e-6)


def test_agnostic_fedavg_moves_lambda_toward_the_domain_with_the_larger_loss(
    tmp_path: Path,
) -> None:
    path = grouped_csv(tmp_path, ("a", "b"), noisy="b")
    p = grouped_policy(path, ("a", "b"), "agnostic_fedavg", {"domains": "data", "step": 1.0})
    state = run(p).state.extra["mixing"]
    lam = dict(zip(state["domains"], state["lam"], strict=True))
    assert lam["b"] > lam["a"]
    assert state["omega"]["b"] > state["omega"]["a"]


def test_a_restarted_coordinator_resumes_agnostic_fedavg_over_domains(tmp_path: Path) -> None:
    p = parse_policy(
        {
            "version": 1,
            "rounds": 4,
            "algorithm": {"name": "agnostic_fedavg", "domains": "data", "step": 1.0},
            "training": TRAINING,
            "data": HEART,
        }
    )
    resumed, uninterrupted = resumed_and_uninterrupted(p, tmp_path, stop_after=2)
    assert torch.equal(resumed.state.model, uninterrupted.state.model)
    assert resumed.state.extra["mixing"] == uninterrupted.state.extra["mixing"]
