"""Federated MultiBoost: a boosting round against a worked example (the worst domain, its best
edge, eta_0 / sqrt(t)); a first round in a simulation against the base classifiers' edges
computed here from the silos' rows; loss and edge sums clipped and noised under DP; refused
under secure aggregation; a restarted coordinator resumes the ensemble exactly."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from fedsilo.coordinator.strategies.multiboost import DomainReport, boost_step
from fedsilo.models.zoo import build_model, load_flat
from fedsilo.ops.simulate import simulate
from fedsilo.policies.loading import PolicyError, parse_policy
from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.policies.schema import Policy
from fedsilo.silo.data import load_consortium
from fedsilo.silo.reports import Reports
from tests.resume import resumed_and_uninterrupted


def policy(rounds: int = 1, **extra: object) -> Policy:
    return parse_policy(
        {
            "version": 1,
            "seed": 3,
            "rounds": rounds,
            "eval_every": rounds,
            "algorithm": {"name": "multiboost", "base_learners": 2, "step": 0.5},
            "model": {"name": "logistic"},
            "training": {"steps": 5, "batch_size": 16, "lr": 0.1},
            "data": {
                "source": "sklearn:breast_cancer",
                "partition": {"kind": "dirichlet", "alpha": 1.0, "silos": 3},
            },
            **extra,
        }
    )


def test_a_round_moves_the_best_edge_of_the_worst_domain() -> None:
    # domain a: mean loss 6/4 = 1.5 (the worst), b: 2/2 = 1; a owns classifiers 0 and 2
    reports = {
        "a": DomainReport(loss_sum=6.0, count=4.0, edges={0: 2.0, 2: 3.0}),
        "b": DomainReport(loss_sum=2.0, count=2.0, edges={1: 1.9}),
    }
    moved = boost_step(reports, ["a", "b", "a"], np.zeros(3), t=4, step=1.0)
    # (Z_a / m_a)(1 - 2 eps) = E / m_a: 2/4 for 0, 3/4 for 2; b's 1.9/2 is not a candidate
    assert moved.worst == ("a",) and moved.chosen == 2
    assert moved.alpha.tolist() == [0.0, 0.0, 1.0 / math.sqrt(4)]


def test_tied_worst_domains_compete_and_no_positive_edge_means_no_step() -> None:
    tied = {
        "a": DomainReport(4.0, 4.0, {0: 0.4}),
        "b": DomainReport(2.0, 2.0, {1: 0.3}),  # 0.3 / 2 = 0.15 beats a's 0.4 / 4 = 0.1
    }
    moved = boost_step(tied, ["a", "b"], np.array([0.2, 0.0]), t=1, step=0.5)
    assert moved.worst == ("a", "b") and moved.chosen == 1
    assert moved.alpha.tolist() == [0.2, 0.5]
    negative = {"a": DomainReport(4.0, 4.0, {0: -0.4}), "b": DomainReport(1.0, 2.0, {1: 5.0})}
    still = boost_step(negative, ["a", "b"], np.array([0.2, 0.0]), t=1, step=0.5)
    assert still.chosen is None and still.alpha.tolist() == [0.2, 0.0]


def test_the_first_round_picks_the_largest_edge_over_the_silos_own_rows() -> None:
    p = policy(rounds=1)
    datasets = load_consortium(p.data, seed=p.seed)
    history = simulate(p, datasets).history
    state = history.state
    owners = state.extra["multiboost"]["owners"]
    assert sorted(owners) == sorted(d.name for d in datasets for _ in range(2))
    # alpha = 0: f = 0, every domain's mean loss is 1 (all tie) and E_{k,r} / m_k is the mean
    # of y_i h_r(x_i) over silo k's training rows, h_r = 2 sigmoid(logit) - 1
    by_name = {d.name: d for d in datasets}
    scores = []
    for j, owner in enumerate(owners):
        data = by_name[owner]
        model = build_model(p.model, data.input_shape, data.output_dim, 0)
        load_flat(model, state.tensors["boost/learners"][j])
        with torch.no_grad():
            h = 2 * torch.sigmoid(model(data.x_train)[:, 0].double()) - 1
        scores.append(float(((2.0 * data.y_train.double() - 1) * h).mean()))
    expected = np.zeros(len(owners))
    expected[int(np.argmax(scores))] = 0.5  # eta_0 / sqrt(1)
    assert state.tensors["boost/alpha"].numpy() == pytest.approx(expected)
    assert set(history.final.evaluation) == set(by_name)
    assert all(0.0 <= m["accuracy"] <= 1.0 for m in history.final.evaluation.values())


def test_loss_and_edge_sums_are_clipped_and_noised_under_dp() -> None:
    privacy = PrivacyConfig.model_validate(
        {"dp_sgd": {"noise_multiplier": 1.0}, "reports": {"noise_multiplier": 2.0,
                                                          "loss_bound": 1.0}}
    )  # fmt: skip
    values = torch.tensor([0.5, 3.0, -2.0])
    draw = torch.Generator().manual_seed(7)
    noise = [float(torch.normal(0.0, 2.0, (1,), generator=draw, dtype=torch.float64))
             for _ in range(2)]  # fmt: skip
    reports = Reports(privacy, torch.Generator().manual_seed(7))
    assert reports.clipped_sum(values) == pytest.approx(0.5 + 1.0 + 0.0 + noise[0])
    assert reports.clipped_sum(values, signed=True) == pytest.approx(0.5 + 1.0 - 1.0 + noise[1])
    exact = Reports(PrivacyConfig(), torch.Generator().manual_seed(7))
    assert exact.clipped_sum(values) == pytest.approx(1.5)


def test_secure_aggregation_is_refused() -> None:
    with pytest.raises(PolicyError, match="multiboost"):
        policy(secure_aggregation="masking")


def test_a_restarted_coordinator_resumes_the_ensemble(tmp_path) -> None:
    resumed, uninterrupted = resumed_and_uninterrupted(policy(rounds=4), tmp_path, stop_after=2)
    for name in ("boost/learners", "boost/alpha"):
        assert torch.equal(resumed.state.tensors[name], uninterrupted.state.tensors[name])
    assert resumed.state.extra == uninterrupted.state.extra
    assert len(resumed.state.extra["multiboost"]["chosen"]) == 4
