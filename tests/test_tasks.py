"""Silo task handlers: training, FedProx, evaluation, loss reports (what each computes, run as
the agent runs a handler once a task passed its contract: `run`), and the agent's refusals."""

from dataclasses import replace
from typing import Any

import pytest
import torch

from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import SiloDataset
from fedsilo.silo.model_skeleton import ModelSkeleton
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tasks import (
    EvaluateTask,
    InitTask,
    LocalTraining,
    LossProbe,
    TaskConfig,
    TrainTask,
)
from tests.silos import agent as built
from tests.silos import honest, policy_with, run_handler
from tests.wire_tasks import reworded

LINEAR = {"name": "linear"}


def separable(n: int = 200, seed: int = 0) -> SiloDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 4, generator=g)
    y = (x[:, 0] + 0.5 * x[:, 1] > 0).long()
    return SiloDataset(
        "a",
        x,
        y,
        x[:20],
        y[:20],
        x[:50],
        y[:50],
        "classification",
        2,
        ("f0", "f1", "f2", "f3"),
        (4,),
    )


@pytest.fixture
def agent() -> SiloAgent:
    return built(separable(), policy_with(model=LINEAR))


def message(agent: SiloAgent, config: TaskConfig, model: TaskResult | None = None) -> TaskMessage:
    """A task under an id and position no engine uses (for refusals made before any
    contract is read: a misaddressed task, a config that does not decode)."""
    tensors = dict(model.tensors) if model else {}
    kind = config.KIND
    return TaskMessage(
        f"t-{kind}", 1, kind, agent.name, config, tensors, model.spec if model else None
    )


def run(agent: SiloAgent, config: TaskConfig, model: TaskResult | None = None) -> TaskResult:
    """What `config`'s handler computes on the agent's data from `model` (`run_handler`)."""
    return run_handler(
        agent, config, model.tensors if model else None, model.spec if model else None
    )


def train_config(**overrides: Any) -> TrainTask:
    """5 epochs of SGD at 0.5 in batches of 16 from seed 3, but where `overrides` (local
    training settings, or the task's options) say otherwise."""
    local = {"epochs": 5, "batch_size": 16, "optimizer": "sgd", "lr": 0.5, "seed": 3}
    local |= {k: overrides.pop(k) for k in list(overrides) if k in LocalTraining.json_keys()}
    return TrainTask(local=LocalTraining(**local), **overrides)


def test_init_is_determined_by_the_seed(agent: SiloAgent) -> None:
    a, b, c = (run(agent, InitTask(seed=s)) for s in (1, 1, 2))
    assert a.tensors["model"].equal(b.tensors["model"]) and not a.tensors["model"].equal(
        c.tensors["model"]
    )
    assert a.spec.numel == 4 * 2 + 2


def test_training_learns_and_reports_samples_and_loss(agent: SiloAgent) -> None:
    initial = run(agent, InitTask(seed=0))
    before = run(agent, EvaluateTask(split="test"), initial)
    trained = run(agent, train_config(), initial)
    after = run(agent, EvaluateTask(split="test"), trained)
    assert trained.ok and trained.num_samples == 200 and trained.metrics["steps"] == 5 * 13
    assert after.metrics["accuracy"] > 0.9 and after.metrics["loss"] < before.metrics["loss"]
    assert after.num_samples == 50


def test_training_is_reproducible_for_a_seed(agent: SiloAgent) -> None:
    initial = run(agent, InitTask(seed=0))
    first, second = (run(agent, train_config(optimizer="adam", lr=0.01), initial) for _ in range(2))
    assert first.tensors["model"].equal(second.tensors["model"])


def test_a_silo_that_ran_tasks_before_trains_as_a_fresh_one() -> None:
    """The silo's kept network (silo/model_skeleton.py) is refilled for each task: training,
    evaluating and training again leaves nothing that changes the next task's answer."""
    mlp = policy_with(model={"name": "mlp", "hidden": [8]})
    worn = built(separable(), mlp)
    initial = run(worn, InitTask(seed=0))
    trained = run(worn, train_config(optimizer="adam", lr=0.01), initial)
    run(worn, EvaluateTask(split="test"), trained)
    again = run(worn, train_config(optimizer="adam", lr=0.01, seed=4), trained)
    fresh = built(separable(), mlp)
    alone = run(fresh, train_config(optimizer="adam", lr=0.01, seed=4), trained)
    assert again.tensors["model"].equal(alone.tensors["model"])


def test_the_kept_network_is_reset_to_a_fresh_builds_state() -> None:
    skeleton = ModelSkeleton()
    built = skeleton.take(
        lambda: torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
    )
    built(torch.randn(4, 2)).sum().backward()  # statistics move, gradients appear
    built[0].weight.requires_grad_(False)
    built.eval()
    again = skeleton.take(lambda: pytest.fail("built twice"))
    assert again is built and again.training
    assert all(p.grad is None and p.requires_grad for p in again.parameters())
    assert again[1].running_mean.equal(torch.zeros(2)) and again[1].running_var.equal(torch.ones(2))


def test_steps_mode_runs_exactly_that_many_steps(agent: SiloAgent) -> None:
    trained = run(agent, train_config(epochs=None, steps=7), run(agent, InitTask(seed=0)))
    assert trained.metrics["steps"] == 7


def test_a_strong_proximal_term_keeps_the_model_near_the_one_received(agent: SiloAgent) -> None:
    initial = run(agent, InitTask(seed=0))
    free = run(agent, train_config(lr=0.05), initial)
    held = run(agent, train_config(lr=0.05, prox_mu=10.0), initial)
    drift = {
        name: (r.tensors["model"] - initial.tensors["model"]).norm()
        for name, r in (("free", free), ("held", held))
    }
    assert drift["held"] < 0.5 * drift["free"]


def test_loss_report_is_the_mean_training_loss(agent: SiloAgent) -> None:
    report = run(agent, LossProbe(), run(agent, InitTask(seed=0)))
    assert set(report.metrics) == {"loss"} and report.num_samples == 200


def test_agent_refuses_tasks_for_another_silo_or_of_unknown_kind(agent: SiloAgent) -> None:
    stranger = TaskMessage("t", 1, "x", "b", train_config())
    assert "addressed to 'b'" in agent.handle(stranger).error
    transmogrify = reworded(message(agent, InitTask(seed=0)), {}, kind="transmogrify")
    unknown = TaskResult.decode(agent.handle_bytes(transmogrify))
    assert unknown.status == "error" and "unknown task kind" in unknown.error


def test_agent_refuses_a_task_whose_config_is_not_its_kinds(agent: SiloAgent) -> None:
    """A coordinator can send any JSON: an unknown or mistyped key is refused unrun, naming
    the kind and the key."""
    init = message(agent, InitTask(seed=0))
    colour = TaskResult.decode(agent.handle_bytes(reworded(init, {"seed": 0, "colour": "red"})))
    assert colour.status == "error" and colour.task_id == "t-init"
    assert "init task: unknown config key(s) ['colour']" in colour.error
    typed = TaskResult.decode(agent.handle_bytes(reworded(init, {"seed": "0"})))
    assert "init task: config key 'seed' must be int" in typed.error


def test_a_model_of_another_shape_is_refused_not_half_applied(agent: SiloAgent) -> None:
    other = built(
        SiloDataset(
            "a",
            *([torch.zeros(4, 3), torch.zeros(4).long()] * 3),
            "classification",
            2,
            ("x", "y", "z"),
            (3,),
        ),
        policy_with(model=LINEAR),
    )
    foreign = run(other, InitTask(seed=0))
    result = agent.handle(honest(agent, "train", 1, foreign.tensors, foreign.spec))
    assert result.status == "error" and "spec is not this silo's model's" in result.error
    with pytest.raises(ValueError, match="does not fit"):  # the handler refuses it too
        run(agent, train_config(), foreign)


def test_a_malformed_payload_gets_an_error_result() -> None:
    reply = TaskResult.decode(built(separable()).handle_bytes(b"junk"))
    assert reply.status == "error"


def test_a_pinned_silo_refuses_tasks_under_another_policy() -> None:
    pinned = built(separable(), policy_digest="ab" * 32)
    same = honest(pinned, "init", 0)
    foreign = replace(same, policy_digest="cd" * 32)
    refused = pinned.handle(foreign)
    assert refused.status == "error" and "this silo accepted 'abababababab' only" in refused.error
    assert pinned.handle(same).ok
