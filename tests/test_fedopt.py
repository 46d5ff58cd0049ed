"""FedAdam, FedYogi and FedAdagrad take one server step exactly as Reddi et al. define it."""

import math

import pytest
import torch

from tests.fakes import scripted_silo
from tests.test_engine import engine_for

X0 = [1.0, 2.0, 3.0]
TRAINED = [2.0, 0.0, 3.0]  # so the mean update Delta is [1, -2, 0]
ETA, BETA1, BETA2, TAU = 0.5, 0.9, 0.99, 1e-3


def one_server_step(name: str) -> list[float]:
    silo = scripted_silo("a", lambda t: torch.tensor(X0 if t.kind == "init" else TRAINED))
    engine = engine_for(
        {"a": silo},
        algorithm={"name": name, "server_lr": ETA, "beta1": BETA1, "beta2": BETA2, "tau": TAU},
    )
    return engine.run().state.model.tolist()


def by_hand(second_moment) -> list[float]:
    out = []
    for x, trained in zip(X0, TRAINED, strict=True):
        delta = trained - x
        m = (1 - BETA1) * delta
        v = second_moment(TAU**2, delta**2)
        out.append(x + ETA * m / (math.sqrt(v) + TAU))
    return out


@pytest.mark.parametrize(
    ("name", "second_moment"),
    [
        ("fedadam", lambda v, d2: BETA2 * v + (1 - BETA2) * d2),
        (
            "fedyogi",
            lambda v, d2: v - (1 - BETA2) * d2 * math.copysign(1.0, v - d2) if v != d2 else v,
        ),
        ("fedadagrad", lambda v, d2: v + d2),
    ],
)
def test_one_server_step_matches_the_hand_computation(name, second_moment) -> None:
    assert one_server_step(name) == pytest.approx(by_hand(second_moment), rel=1e-6)


def test_a_coordinate_with_no_update_stays_put() -> None:
    for name in ("fedadam", "fedyogi", "fedadagrad"):
        assert one_server_step(name)[2] == 3.0
