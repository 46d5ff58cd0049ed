"""AAggFF with a server optimiser (the thesis' plug-and-play pairing): the AAggFF-mixed mean is
the target of FedAdam's, FedYogi's or FedAdagrad's step, computed here by hand for one round;
without `server_optimizer` AAggFF adopts the mean as before; a restarted coordinator resumes
the optimiser's moments with the schedule."""

from __future__ import annotations

import math

import pytest
import torch

from fedsilo.policies.loading import PolicyError
from fedsilo.wire.messages import TaskMessage, TaskResult
from tests.fakes import SPEC
from tests.resume import resumed_and_uninterrupted
from tests.test_engine import engine_for
from tests.test_mixing_strategies import policy

X0 = [1.0, 2.0, 3.0]
TRAINED = {"a": [2.0, 0.0, 3.0], "b": [4.0, 2.0, 3.0]}
SAMPLES = {"a": 1, "b": 3}  # unequal, so a sample-weighted mean would differ from AAggFF's
ETA, BETA1, BETA2, TAU = 0.5, 0.9, 0.99, 1e-3


def silo(name: str, loss: float):
    """Answers init with X0, the loss probe with `loss`, train with TRAINED[name]."""

    def endpoint(payload: bytes) -> bytes:
        task = TaskMessage.decode(payload)
        if task.kind in ("loss", "evaluate"):
            return TaskResult(
                task.task_id, name, task.kind, num_samples=SAMPLES[name],
                metrics={"loss": loss, "accuracy": 0.5},
            ).encode()  # fmt: skip
        model = X0 if task.kind == "init" else TRAINED[name]
        return TaskResult(
            task.task_id, name, task.kind, num_samples=SAMPLES[name],
            tensors={"model": torch.tensor(model)}, spec=SPEC,
        ).encode()  # fmt: skip

    return endpoint


def one_round(optimizer: str | None) -> list[float]:
    algorithm: dict = {"name": "aaggff"}
    if optimizer is not None:
        algorithm["server_optimizer"] = {
            "name": optimizer, "server_lr": ETA, "beta1": BETA1, "beta2": BETA2, "tau": TAU,
        }  # fmt: skip
    # equal losses: equal responses, so AAggFF-S keeps p uniform (the problem is symmetric)
    engine = engine_for({"a": silo("a", 0.7), "b": silo("b", 0.7)}, algorithm=algorithm)
    return engine.run().state.model.tolist()


SECOND_MOMENT = {
    "fedadam": lambda v, d2: BETA2 * v + (1 - BETA2) * d2,
    "fedyogi": lambda v, d2: v - (1 - BETA2) * d2 * math.copysign(1.0, v - d2) if v != d2 else v,
    "fedadagrad": lambda v, d2: v + d2,
}


@pytest.mark.parametrize("optimizer", sorted(SECOND_MOMENT))
def test_one_round_is_the_adaptive_step_towards_the_aaggff_mean(optimizer: str) -> None:
    # p = (1/2, 1/2): the mixed mean is (3, 1, 3), not the sample-weighted (3.5, 1.5, 3)
    mean = [(a + b) / 2 for a, b in zip(TRAINED["a"], TRAINED["b"], strict=True)]
    expected = []
    for x, target in zip(X0, mean, strict=True):
        delta = target - x
        m = (1 - BETA1) * delta
        v = SECOND_MOMENT[optimizer](TAU**2, delta**2)
        expected.append(x + ETA * m / (math.sqrt(v) + TAU))
    assert one_round(optimizer) == pytest.approx(expected, rel=1e-6)
    assert expected[2] == 3.0  # a coordinate nobody moved stays put


def test_without_a_server_optimiser_the_mixed_mean_is_the_model() -> None:
    assert one_round(None) == pytest.approx([3.0, 1.0, 3.0], rel=1e-6)


def test_a_restarted_coordinator_resumes_the_optimiser_and_the_schedule(tmp_path) -> None:
    p = policy("aaggff", rounds=4, noisy=True, settings={"server_optimizer": {"name": "fedyogi"}})
    resumed, uninterrupted = resumed_and_uninterrupted(p, tmp_path, stop_after=2)
    for name in ("model", "m", "v"):
        assert torch.equal(resumed.state.tensors[name], uninterrupted.state.tensors[name])
    assert resumed.state.extra["mixing"] == uninterrupted.state.extra["mixing"]


def test_an_unknown_server_optimiser_is_refused() -> None:
    with pytest.raises(PolicyError, match="server_optimizer"):
        policy("aaggff", settings={"server_optimizer": {"name": "fedsgd"}})
