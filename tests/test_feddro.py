"""FedDRO (docs/algorithms/feddro.md): the interpolating measure and the barycenter against hand
computations and POT itself, the point clouds' opt-in, booking and sensitivity, the site rule
that refuses them, the adversary, and a run resumed from its state."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import ot
import pytest
import torch

from fedsilo.coordinator.feddro import barycenter
from fedsilo.policies.loading import load_policy, parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.privacy.accounting import Mechanism
from fedsilo.silo.config import LocalRules
from fedsilo.silo.data import load_consortium
from fedsilo.silo.feddro import (
    WassersteinAdversary,
    interpolate,
    mapped_records,
    point_cloud_sensitivity,
    support_step,
)
from fedsilo.silo.tasks.base import SiloContext
from fedsilo.silo.tasks.feddro import feddro_support, feddro_support_releases
from fedsilo.wire.messages import TaskMessage
from fedsilo.wire.tasks import FedDroSupport
from fedsilo.wire.tasks.tensor_names import BARYCENTER, PRESENT, SUPPORT
from tests.resume import resumed_and_uninterrupted
from tests.silos import agent as built
from tests.silos import honest

EXAMPLE = Path(__file__).resolve().parents[1] / "policies" / "examples" / "digits-feddro.yaml"


def small_policy(**algorithm: object) -> Policy:
    document = load_policy(EXAMPLE).model_dump(mode="json", exclude_none=True)
    document["algorithm"] |= {"barycenter_rounds": 2, "support_points": 4, **algorithm}
    document |= {"rounds": 3, "eval_every": 3}
    document["training"] = {"steps": 2, "batch_size": 16, "optimizer": "adam", "lr": 0.01}
    return parse_policy(document)


def test_the_interpolating_measure_by_hand() -> None:
    # two points each, far apart: the plan matches 0 -> 10 and 1 -> 11 (1/2 each)
    x, y = np.array([[0.0], [1.0]]), np.array([[11.0], [10.0]])
    assert interpolate(x, y, 0.5) == pytest.approx(np.array([[5.0], [6.0]]))
    assert interpolate(x, y, 0.0) == pytest.approx(x)
    assert interpolate(x, y, 1.0) == pytest.approx(np.array([[10.0], [11.0]]))


def test_the_interpolating_measure_is_the_barycentric_projection_of_pots_exact_plan() -> None:
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(6, 3)), rng.normal(size=(9, 3)) + 2.0
    cost = ot.dist(x, y)
    plan = ot.emd(np.full(6, 1 / 6), np.full(9, 1 / 9), cost / cost.max())
    expected = 0.7 * x + 0.3 * 6 * plan @ y
    assert interpolate(x, y, 0.3) == pytest.approx(expected)


def test_the_barycenter_of_two_clouds_by_hand_and_against_pot() -> None:
    a, b = np.array([[[0.0], [2.0]]]), np.array([[[4.0], [6.0]]])
    start = np.array([[[1.0], [5.0]]])
    both = {"a": np.ones(1), "b": np.ones(1)}
    assert barycenter({"a": a, "b": b}, both, start) == pytest.approx(np.array([[[2.0], [4.0]]]))

    rng = np.random.default_rng(1)
    x, y, init = rng.normal(size=(5, 2)), rng.normal(size=(5, 2)) + 3, rng.normal(size=(5, 2))
    pot = ot.lp.free_support_barycenter(
        [x, y], [np.full(5, 0.2)] * 2, init, weights=np.array([0.5, 0.5])
    )
    ours = barycenter({"a": x[None], "b": y[None]}, both, init[None])
    assert ours[0] == pytest.approx(pot)


def test_a_group_a_silo_lacks_is_left_out_of_that_groups_barycenter() -> None:
    clouds = {s: np.full((2, 1, 1), v) for s, v in (("a", 0.0), ("b", 4.0), ("c", 100.0))}
    present = {"a": np.ones(2), "b": np.ones(2), "c": np.array([1.0, 0.0])}
    previous = np.full((2, 1, 1), -1.0)
    result = barycenter(clouds, present, previous)
    assert result[0, 0, 0] == pytest.approx(104 / 3)  # all three hold group 0
    assert result[1, 0, 0] == pytest.approx(2.0)  # c lacks group 1: the mean of a and b


def test_a_support_step_is_the_midpoint_of_the_two_interpolations() -> None:
    support = np.array([[0.0], [1.0]])
    records = np.array([[10.0], [11.0], [10.0], [11.0]])
    bary = np.array([[-10.0], [-9.0]])
    # eta_P = [5, 6], eta_Q = [-5, -4]: the midpoint of the geodesic between them is [0, 1]
    assert support_step(support, records, bary, 0.5) == pytest.approx(np.array([[0.0], [1.0]]))


def test_one_record_moves_eta_p_by_at_most_the_stated_sensitivity() -> None:
    rng = np.random.default_rng(2)
    support = rng.normal(size=(4, 3))
    records = rng.normal(size=(8, 3))
    records /= np.maximum(1.0, np.linalg.norm(records, axis=1, keepdims=True))  # clip 1
    other = records.copy()
    other[0] = [-1.0, 0.0, 0.0]
    moved = interpolate(support, records, 0.5) - interpolate(support, other, 0.5)
    assert np.linalg.norm(moved) <= point_cloud_sensitivity(4, 0.5, 1.0) == pytest.approx(2.0)


def test_records_map_onto_their_class_cloud() -> None:
    x = np.array([[0.0], [1.0], [5.0]])
    y = np.array([0, 0, 1])
    clouds = np.array([[[10.0], [11.0]], [[-3.0], [-3.0]]])
    mapped, labels = mapped_records(x, y, clouds, "classwise")
    assert mapped == pytest.approx(np.array([[10.0], [11.0], [-3.0]]))
    assert list(labels) == [0, 0, 1]


def test_a_huge_penalty_leaves_the_adversary_where_it_started() -> None:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 2)
    x, y = torch.randn(5, 3), torch.tensor([0, 1, 0, 1, 0])
    index = torch.arange(5)
    strong = WassersteinAdversary("classification", model, x, y, 1e9, 5, 1e-10)
    assert torch.allclose(strong.perturbed(index), x)
    weak = WassersteinAdversary("classification", model, x, y, 0.1, 5, 0.5)
    plain = torch.nn.functional.cross_entropy(model(x), y)
    assert float(weak.batch_loss(index).detach()) > float(
        plain.detach()
    )  # the ascent found a worse neighbour


def test_a_policy_must_opt_into_point_clouds() -> None:
    with pytest.raises(ValueError, match="release_point_clouds"):
        small_policy(release_point_clouds=False)
    with pytest.raises(ValueError, match="set both"):
        small_policy(point_cloud_clip=1.0)


def test_a_site_that_forbids_data_releases_refuses_feddro_naming_the_rule() -> None:
    rules = LocalRules(forbid_data_releases=True)
    (problem,) = rules.violations(small_policy())
    assert problem.startswith("forbid_data_releases: feddro sends point clouds")
    fedavg = parse_policy(
        load_policy(EXAMPLE).model_dump(mode="json", exclude_none=True)
        | {"algorithm": {"name": "fedavg"}}
    )
    assert rules.violations(fedavg) == []
    assert LocalRules().violations(small_policy()) == []


def support_task(ctx: SiloContext, groups: int, dim: int) -> TaskMessage:
    clouds = torch.zeros(groups, 4, dim, dtype=torch.float64)
    return TaskMessage(
        task_id="t-1",
        round=1,
        phase="support",
        silo=ctx.name,
        config=FedDroSupport(),
        tensors={SUPPORT: clouds, BARYCENTER: clouds},
    )


def silo_context(policy: Policy) -> SiloContext:
    """The first silo's context under its own copy of `policy`."""
    (data, *_) = load_consortium(policy.data, seed=policy.seed)
    return SiloContext("silo-0", data, policy, torch.device("cpu"), secret=b"s" * 32)


def as_fedavg(policy: Policy) -> Policy:
    return parse_policy(
        policy.model_dump(mode="json", exclude_none=True) | {"algorithm": {"name": "fedavg"}}
    )


def test_a_silo_answers_feddro_support_only_under_its_own_feddro_policy() -> None:
    policy = small_policy()
    refusing = silo_context(as_fedavg(policy))
    with pytest.raises(ValueError, match="release_point_clouds: true"):
        feddro_support(support_task(refusing, 10, 64), refusing)
    ctx = silo_context(policy)
    result = feddro_support(support_task(ctx, 10, 64), ctx)
    assert result.tensors[SUPPORT].shape == (10, 4, 64)
    assert result.tensors[PRESENT].tolist() == [1.0] * 10
    assert feddro_support_releases(support_task(ctx, 10, 64), ctx) == [Mechanism.none()]
    # Sent to agents: the task a FedDRO silo's contract asks for in round 1 is answered under
    # that policy, and refused unrun under FedAvg's, whose contract has no such phase.
    (data, *_) = load_consortium(policy.data, seed=policy.seed)
    clouds = support_task(ctx, 10, 64).tensors
    feddro = built(data, policy)
    assert feddro.handle(honest(feddro, "support", 1, clouds)).ok
    fedavg = built(data, as_fedavg(policy))
    refused = fedavg.handle(honest(feddro, "support", 1, clouds))
    assert not refused.ok and not refused.tensors
    assert "phase 'support' is not one of fedavg's phases" in refused.error


def test_noised_point_clouds_are_booked_as_a_gaussian_mechanism() -> None:
    policy = small_policy(point_cloud_clip=2.0, point_cloud_noise=3.0)
    ctx = silo_context(policy)
    (mechanism,) = feddro_support_releases(support_task(ctx, 10, 64), ctx)
    sensitivity = 2 * 0.5 * 2.0 * 2.0  # 2 t clip sqrt(4 points)
    assert mechanism == Mechanism.gaussian(sensitivity=sensitivity, noise_std=3 * sensitivity)
    noisy = feddro_support(support_task(ctx, 10, 64), ctx).tensors[SUPPORT]
    exact_ctx = silo_context(small_policy())
    exact = feddro_support(support_task(exact_ctx, 10, 64), exact_ctx).tensors[SUPPORT]
    assert not torch.allclose(noisy, exact)


def test_a_run_resumed_in_stage_a_ends_as_an_uninterrupted_one(tmp_path: Path) -> None:
    policy = small_policy()
    resumed, uninterrupted = resumed_and_uninterrupted(policy, tmp_path, stop_after=1)
    assert torch.equal(resumed.state.model, uninterrupted.state.model)
    assert torch.equal(resumed.state.tensors[BARYCENTER], uninterrupted.state.tensors[BARYCENTER])
