"""`algorithm.robust`: the rules' maths on their own, the preconditions a policy is held to (one
message each, naming the key), the engine's combination in the clear, and a consortium in which
one site's update is scaled by -10."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from bench.robust import run_consortium
from fedsilo.coordinator.engine import RoundEngine
from fedsilo.coordinator.phases import Phase, Task, WeightedMean
from fedsilo.coordinator.robust_aggregation import (
    clipped,
    coordinate_median,
    krum_scores,
    krum_selection,
    norm_bounded_mean,
    trimmed_mean,
    weighted_mean,
)
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.simulate import load_silos
from fedsilo.policies.algorithms.robust import MedianRule
from fedsilo.policies.algorithms.server_step import initial_state, server_step
from fedsilo.policies.loading import PolicyError, parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.wire.tasks.tensor_names import MODEL
from tests.fakes import SPEC, TRAIN, constant_silo
from tests.test_bad_input import assert_refused, invoke

values = st.floats(-1e3, 1e3, allow_nan=False, allow_infinity=False)


@st.composite
def updates(draw: st.DrawFn) -> np.ndarray:
    """An n x d float64 array of updates, one row per silo."""
    n, d = draw(st.integers(1, 9)), draw(st.integers(1, 6))
    return draw(arrays(np.float64, (n, d), elements=values))


def positive_weights(n: int) -> st.SearchStrategy[np.ndarray]:
    return arrays(np.float64, (n,), elements=st.floats(0.5, 100.0))


# -- the maths ------------------------------------------------------------------------------------


@given(updates(), st.randoms(use_true_random=False), st.integers(0, 4))
def test_median_and_trimmed_mean_ignore_the_silos_order_and_stay_within_each_coordinates_range(
    rows: np.ndarray, random: object, trim: int
) -> None:
    trim = min(trim, (len(rows) - 1) // 2)
    order = list(range(len(rows)))
    random.shuffle(order)  # type: ignore[attr-defined]
    rounding = 1e-12 * np.abs(rows).max(axis=0)  # a mean's last bits may round past the range
    for combine in (coordinate_median, lambda u: trimmed_mean(u, trim)):
        combined = combine(rows)
        assert np.array_equal(combined, combine(rows[order]))
        assert np.all(rows.min(axis=0) - rounding <= combined)
        assert np.all(combined <= rows.max(axis=0) + rounding)


@given(updates())
def test_a_trimmed_mean_that_trims_nothing_is_the_mean_and_one_that_keeps_one_is_the_median(
    rows: np.ndarray,
) -> None:
    assert np.allclose(trimmed_mean(rows, 0), rows.mean(axis=0), rtol=1e-12, atol=1e-9)
    if len(rows) % 2 == 1:
        assert np.array_equal(trimmed_mean(rows, len(rows) // 2), coordinate_median(rows))


def test_a_trimmed_mean_that_would_leave_nothing_is_refused() -> None:
    with pytest.raises(ValueError, match="leaves none"):
        trimmed_mean(np.zeros((4, 2)), 2)


@st.composite
def honest_and_far(draw: st.DrawFn) -> tuple[np.ndarray, set[int], int]:
    """n updates, f of them far from the n - f honest ones (in [0, 1]^d), n > 2f + 2, rows
    in a drawn order; the faulty rows' indices; f."""
    f = draw(st.integers(0, 3))
    n = draw(st.integers(2 * f + 3, 2 * f + 7))
    d = draw(st.integers(1, 5))
    unit = st.floats(0, 1)
    honest = draw(arrays(np.float64, (n - f, d), elements=unit))
    far = 10.0 * n * d
    directions = draw(arrays(np.float64, (f, d), elements=st.sampled_from([-1.0, 1.0])))
    offsets = draw(arrays(np.float64, (f, d), elements=unit))
    faulty = far * directions + offsets
    order = draw(st.permutations(range(n)))
    rows = np.concatenate([honest, faulty])[list(order)]
    return rows, {i for i, source in enumerate(order) if source >= n - f}, f


@given(honest_and_far())
def test_krum_and_multi_krum_never_pick_one_of_f_far_away_updates_when_n_exceeds_2f_plus_2(
    case: tuple[np.ndarray, set[int], int],
) -> None:
    rows, faulty, f = case
    for m in range(1, len(rows) - f + 1):
        assert not set(krum_selection(rows, f, m).tolist()) & faulty


def test_krum_needs_more_than_2f_plus_2_updates() -> None:
    with pytest.raises(ValueError, match="n > 4"):
        krum_scores(np.zeros((4, 3)), 1)


def test_krum_breaks_ties_towards_the_earlier_silo() -> None:
    rows = np.array([[2.0], [0.0], [0.0], [0.0], [0.0]])  # rows 1 to 4 score 0 alike
    assert krum_selection(rows, 1, 2).tolist() == [1, 2]


@given(updates().flatmap(lambda rows: st.tuples(st.just(rows), positive_weights(len(rows)))))
def test_norm_bounded_with_a_bound_above_every_update_is_the_weighted_mean(
    case: tuple[np.ndarray, np.ndarray],
) -> None:
    rows, weights = case
    bound = float(np.linalg.norm(rows, axis=1).max()) + 1.0
    expected = np.average(rows, axis=0, weights=weights)
    assert np.allclose(norm_bounded_mean(rows, weights, bound), expected, rtol=1e-12, atol=1e-9)


@given(
    updates().flatmap(lambda rows: st.tuples(st.just(rows), positive_weights(len(rows)))),
    st.floats(1e-3, 1e3),
)
def test_norm_bounded_moves_the_model_by_at_most_the_bound(
    case: tuple[np.ndarray, np.ndarray], bound: float
) -> None:
    rows, weights = case
    assert np.all(np.linalg.norm(clipped(rows, bound), axis=1) <= bound * (1 + 1e-12))
    assert np.linalg.norm(norm_bounded_mean(rows, weights, bound)) <= bound * (1 + 1e-12)
    assert np.allclose(weighted_mean(rows, weights), np.average(rows, axis=0, weights=weights))


# -- the policy ------------------------------------------------------------------------------------


def policy(robust: object, name: str = "fedavg", **sections: object) -> Policy:
    document: dict[str, object] = {
        "version": 1,
        "rounds": 2,
        "algorithm": {"name": name, "robust": robust},
        "participants": {"min_silos": 5},
        "data": {"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": 5}},
    }
    return parse_policy({**document, **sections})


REFUSED = {
    "krum among too few silos": (
        {"name": "krum", "f": 2},
        {},
        "algorithm.robust.f: krum withstands f faulty silos only among n > 2f + 2 = 6",
    ),
    "multi_krum among too few silos": (
        {"name": "multi_krum", "f": 2},
        {},
        "algorithm.robust.f: multi_krum",
    ),
    "multi_krum averaging more than n - f": (
        {"name": "multi_krum", "f": 1, "m": 5},
        {},
        "algorithm.robust.m: multi_krum averages m of the n - f",
    ),
    "a trimmed mean that leaves nothing": (
        {"name": "trimmed_mean", "count": 3},
        {},
        "algorithm.robust.count: trimming 3 updates from each end",
    ),
    "a trimmed mean given both beta and count": (
        {"name": "trimmed_mean", "beta": 0.1, "count": 1},
        {},
        "algorithm.robust: beta and count both say how many updates to trim",
    ),
    "norm_bounded without its bound": (
        {"name": "norm_bounded"},
        {},
        "algorithm.robust.max_norm",
    ),
    "masking": (
        {"name": "median"},
        {"secure_aggregation": "masking"},
        "algorithm.robust: median ranks, trims or clips each silo's own update, and under "
        "secure_aggregation masking the coordinator sees only the sum of the masked updates",
    ),
    "ckks": (
        {"name": "krum", "f": 1},
        {"secure_aggregation": "ckks"},
        "under secure_aggregation ckks the coordinator sees only the sum of the encrypted",
    ),
    "client-level DP": (
        {"name": "norm_bounded", "max_norm": 1.0},
        {"privacy": {"client_dp": {"clip": 1.0, "noise_multiplier": 1.0}}},
        "algorithm.robust: under privacy.client_dp the released model is the noised mean",
    ),
}


@pytest.mark.parametrize("case", sorted(REFUSED))
def test_a_rule_that_cannot_run_is_refused_in_one_message_naming_its_key(case: str) -> None:
    robust, sections, message = REFUSED[case]
    with pytest.raises(PolicyError) as refused:
        policy(robust, **sections)
    assert message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_an_algorithm_outside_fedavgs_round_is_told_which_algorithms_read_robust() -> None:
    with pytest.raises(PolicyError, match="scaffold does not read 'robust' .read by approx_fedavg"):
        policy({"name": "median"}, name="scaffold")


def test_the_command_line_refuses_a_robust_rule_under_masking_with_exit_status_1(
    tmp_path: Path,
) -> None:
    path = tmp_path / "p.yaml"
    path.write_text(
        "version: 1\nalgorithm: {name: fedavg, robust: {name: median}}\n"
        "secure_aggregation: masking\n"
    )
    assert_refused(invoke("policy", "validate", str(path)), "algorithm.robust", "masking")


@given(
    st.integers(1, 12),
    st.integers(0, 5),
    st.floats(0.05, 1.0),
    st.integers(0, 20),
    st.sampled_from(["krum", "multi_krum"]),
)
@settings(max_examples=60, deadline=None)
def test_krum_accepted_at_min_silos_has_more_than_2f_plus_2_answers_in_every_sampled_round(
    min_silos: int, f: int, fraction: float, extra: int, name: str
) -> None:
    document = {
        "version": 1,
        "algorithm": {
            "name": "fedavg",
            "client_fraction": fraction,
            "robust": {"name": name, "f": f},
        },
        "participants": {"min_silos": min_silos},
    }
    try:
        accepted = parse_policy(document)
    except PolicyError as refused:
        assert min_silos <= 2 * f + 2 and "algorithm.robust.f" in str(refused)
        return
    assert min_silos > 2 * f + 2
    assert accepted.cohort_size(min_silos + extra) > 2 * f + 2


@pytest.mark.parametrize(
    "robust",
    [
        None,
        {"name": "median"},
        {"name": "trimmed_mean"},
        {"name": "trimmed_mean", "count": 2},
        {"name": "krum", "f": 1},
        {"name": "multi_krum", "f": 1, "m": 3},
        {"name": "norm_bounded", "max_norm": 0.5},
    ],
)
def test_every_rule_reads_back_from_the_policy_it_dumps(robust: object) -> None:
    """What the signed copy a silo reads, and every re-validation of a policy, relies on."""
    written = policy(robust)
    assert Policy.model_validate(written.model_dump()) == written


# -- the engine ------------------------------------------------------------------------------------

HONEST = {"a": [1.0, 2.0, 3.0], "b": [1.5, 2.5, 2.0], "c": [0.5, 1.0, 4.0], "d": [1.2, 1.8, 3.5]}
FAR = [1e4, -1e4, 1e4]


def engine_for(robust: object, name: str = "fedavg", **sections: object) -> RoundEngine:
    document: dict[str, object] = {
        "version": 1,
        "rounds": 1,
        "algorithm": {"name": name, **({"robust": robust} if robust else {})},
        "participants": {"min_silos": 5, "phase_timeout_s": 5.0},
        **sections,
    }
    written = parse_policy(document)
    endpoints: dict[str, Callable[[bytes], bytes]] = {
        silo: constant_silo(silo, values) for silo, values in HONEST.items()
    }
    endpoints["e"] = constant_silo("e", FAR)
    return RoundEngine(
        make_strategy(written), InProcessTransport(endpoints), written, sorted(endpoints)
    )


def test_krum_moves_the_model_to_one_honest_silos_model_exactly() -> None:
    model = engine_for({"name": "krum", "f": 1}).run().state.model
    assert any(torch.equal(model, torch.tensor(values)) for values in HONEST.values()), model


def test_the_median_of_the_models_is_the_new_model_and_fedavg_is_pulled_away() -> None:
    rows = np.array([*HONEST.values(), FAR])
    median = engine_for({"name": "median"}).run().state.model
    assert torch.equal(median, torch.from_numpy(np.median(rows, axis=0)).float())
    assert engine_for(None).run().state.model.abs().max() > 1000


def test_fedadams_server_step_takes_the_robust_combination_as_its_mean() -> None:
    engine = engine_for({"name": "median"}, name="fedadam")
    history, algorithm = engine.run(), engine.policy.algorithm
    median = torch.from_numpy(np.median(np.array([*HONEST.values(), FAR]), axis=0)).float()
    start = initial_state(algorithm, torch.zeros(3))
    expected = server_step(algorithm, start, {MODEL: median})
    assert torch.equal(history.state.model, expected[MODEL])


def test_the_outcome_of_a_robust_phase_carries_no_single_silos_model() -> None:
    engine = engine_for({"name": "median"})
    phase = Phase(
        "train",
        tuple(Task(s, TRAIN, {MODEL: torch.zeros(3)}, SPEC) for s in "abcde"),
        aggregate=WeightedMean((MODEL,), robust=MedianRule(name="median")),
    )
    outcome = engine.execute(phase, round_no=1)
    assert outcome.tensors == {} and set(outcome.mean) == {MODEL}


def test_a_robust_phase_whose_silos_were_sent_different_models_is_refused() -> None:
    engine = engine_for({"name": "median"})
    phase = Phase(
        "train",
        tuple(
            Task(s, TRAIN, {MODEL: torch.full((3,), float(i))}, SPEC) for i, s in enumerate("abcde")
        ),
        aggregate=WeightedMean((MODEL,), robust=MedianRule(name="median")),
    )
    with pytest.raises(ValueError, match="one reference 'model' for every silo"):
        engine.execute(phase, round_no=1)


def test_the_engine_refuses_a_robust_phase_under_secure_aggregation() -> None:
    engine = engine_for(None, secure_aggregation="masking")
    phase = Phase(
        "train",
        tuple(Task(s, TRAIN, {MODEL: torch.zeros(3)}, SPEC) for s in "abcde"),
        aggregate=WeightedMean((MODEL,), robust=MedianRule(name="median")),
    )
    with pytest.raises(ValueError, match="needs each silo's update in the clear"):
        engine.execute(phase, round_no=1)


# -- a consortium with a faulty site ---------------------------------------------------------------


def consortium_policy(robust: object) -> Policy:
    document = {
        "version": 1,
        "seed": 3,
        "rounds": 5,
        "algorithm": {"name": "fedavg", **({"robust": robust} if robust else {})},
        "training": {"lr": 0.05, "batch_size": 16},
        "participants": {"min_silos": 5},
        "data": {"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": 5}},
    }
    return parse_policy(document)


def accuracy(robust: object, faulty_scale: float | None) -> float:
    written = consortium_policy(robust)
    datasets = load_silos(written, None)
    scales = {} if faulty_scale is None else {datasets[0].name: faulty_scale}
    history, _ = run_consortium(written, datasets, scales)
    return history.final.summary["accuracy"]["weighted_mean"]  # type: ignore[index]


@pytest.fixture(scope="module")
def clean_accuracy() -> float:
    return accuracy(None, None)


def test_one_site_scaling_its_update_by_minus_10_wrecks_fedavg(clean_accuracy: float) -> None:
    assert accuracy(None, -10.0) < clean_accuracy / 2


@pytest.mark.parametrize(
    "robust",
    [
        {"name": "median"},
        {"name": "trimmed_mean", "count": 1},
        {"name": "krum", "f": 1},
        {"name": "multi_krum", "f": 1},
        {"name": "norm_bounded", "max_norm": 0.5},
    ],
    ids=lambda robust: robust["name"],
)
def test_a_robust_rule_keeps_the_clean_accuracy_when_one_site_scales_its_update_by_minus_10(
    robust: dict[str, object], clean_accuracy: float
) -> None:
    assert accuracy(robust, -10.0) > clean_accuracy - 0.1


def test_silos_train_the_same_under_a_robust_rule_only_the_combination_differs() -> None:
    plain, robust = consortium_policy(None), consortium_policy({"name": "median"})
    datasets = load_silos(plain, None)
    runs = [run_consortium(written, datasets)[0] for written in (plain, robust)]
    first = [next(r for r in run.records if r.round == 1).phases["train"] for run in runs]
    assert first[0]["answered"] == first[1]["answered"]  # the same training from the same model
    assert not torch.equal(runs[0].state.model, runs[1].state.model)
