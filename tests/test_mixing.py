"""Loss-driven mixing coefficients (coordinator/mixing.py): the simplex projection is the QP it
claims to solve, lambda updates ascend on the losses and stay on the simplex, the floor keeps
lambda from collapsing, the CDF responses reproduce the thesis' worked example, AAggFF-S solves
its QP, AAggFF-D's doubly-robust gradient is the stated closed form, and the unified-table
weights of q-FedAvg, TERM and PropFair are exponentiated-gradient steps from FedAvg's weights."""

import itertools
import json
import math

import numpy as np
import pytest

from fedsilo.coordinator.mixing import (
    RESPONSE_TRANSFORMS,
    AAggFFDState,
    AAggFFSState,
    aaggff_d_step,
    aaggff_d_step_size,
    aaggff_s_step,
    cdf_responses,
    clip_losses,
    decision_gradient,
    default_loss_cap,
    doubly_robust_responses,
    exponentiated_gradient,
    floor_and_renormalise,
    linearised_gradient,
    loss_cap,
    meets_contributor_minimum,
    mix_with_uniform,
    project_simplex,
    projected_loss_ascent,
    propfair_weights,
    proportional_to_counts,
    qfedavg_weights,
    restrict_and_renormalise,
    solve_simplex_qp,
    term_weights,
    unbiased_loss_vector,
)


def scipy_simplex_qp(quadratic: np.ndarray, linear: np.ndarray) -> np.ndarray:
    """min (1/2) p^T Q p + c^T p over the probability simplex, by scipy's SLSQP."""
    optimize = pytest.importorskip("scipy.optimize")
    size = linear.size
    result = optimize.minimize(
        lambda p: 0.5 * p @ quadratic @ p + linear @ p,
        np.full(size, 1.0 / size),
        jac=lambda p: quadratic @ p + linear,
        method="SLSQP",
        bounds=[(0.0, 1.0)] * size,
        constraints=[
            {"type": "eq", "fun": lambda p: p.sum() - 1.0, "jac": lambda p: np.ones(size)}
        ],
        options={"ftol": 1e-12, "maxiter": 1000},
    )
    assert result.success, result.message
    return result.x


def brute_force_projection(v: np.ndarray) -> np.ndarray:
    """argmin ||x - v||^2 over the simplex = the QP with Q = I, c = -v."""
    return scipy_simplex_qp(np.eye(v.size), -v)


def all_draws(size: int, drawn: int) -> list[np.ndarray]:
    """Every uniform draw of `drawn` of `size` silos without replacement, as masks."""
    masks = []
    for subset in itertools.combinations(range(size), drawn):
        mask = np.zeros(size, dtype=bool)
        mask[list(subset)] = True
        masks.append(mask)
    return masks


# --- the simplex projection (docs/algorithms/README.md) -----------------------------------------


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("size", [2, 5, 12])
def test_the_projection_is_the_nearest_point_of_the_simplex(seed: int, size: int) -> None:
    v = np.random.default_rng(seed).normal(scale=2.0, size=size)

    projected = project_simplex(v)

    np.testing.assert_allclose(projected, brute_force_projection(v), atol=1e-8)


@pytest.mark.parametrize("seed", range(6))
def test_the_projection_shifts_every_entry_by_one_threshold_and_clips_at_zero(seed: int) -> None:
    # The exact optimality condition: x = max(v - theta, 0) for one theta, and sum(x) = 1.
    v = np.random.default_rng(seed).normal(size=9)

    projected = project_simplex(v)

    support = projected > 0
    thetas = v[support] - projected[support]
    np.testing.assert_allclose(thetas, thetas[0], atol=1e-14)
    assert np.all(v[~support] <= thetas[0] + 1e-14)
    assert projected.sum() == pytest.approx(1.0, abs=1e-14)


def test_a_point_on_the_simplex_is_its_own_projection() -> None:
    for point in ([0.2, 0.3, 0.5], [1.0, 0.0, 0.0], [0.25, 0.0, 0.75, 0.0]):
        np.testing.assert_allclose(project_simplex(point), point, rtol=0, atol=1e-15)


def test_equal_entries_project_to_the_uniform_distribution_whatever_their_value() -> None:
    for value in (-3.0, 0.0, 0.2, 7.0):
        np.testing.assert_allclose(project_simplex([value] * 4), [0.25] * 4, atol=1e-15)


def test_tied_entries_share_the_mass_equally() -> None:
    np.testing.assert_allclose(project_simplex([0.5, 0.5, 0.5, -1.0]), [1 / 3] * 3 + [0.0])
    np.testing.assert_allclose(project_simplex([2.0, 2.0, 0.0]), [0.5, 0.5, 0.0])


def test_one_huge_entry_takes_all_the_mass() -> None:
    np.testing.assert_array_equal(project_simplex([1e6, 0.0, -2.0, 3.0]), [1.0, 0.0, 0.0, 0.0])


def test_the_projection_is_idempotent_and_ignores_a_common_shift() -> None:
    v = np.random.default_rng(1).normal(size=6)

    np.testing.assert_allclose(project_simplex(project_simplex(v)), project_simplex(v))
    np.testing.assert_allclose(project_simplex(v + 5.0), project_simplex(v), atol=1e-14)


def test_the_projection_rejects_non_finite_input() -> None:
    with pytest.raises(ValueError, match="non-finite"):
        project_simplex([0.5, np.nan, 0.5])


# --- loss guards and collapse guards (docs/algorithms/README.md) ---------------------------------


def test_losses_are_clipped_to_zero_and_the_cap_and_non_finite_ones_become_absent() -> None:
    clipped = clip_losses([-1.0, 0.5, 40.0, np.inf, np.nan], loss_cap=10.0)

    np.testing.assert_array_equal(clipped[:3], [0.0, 0.5, 10.0])
    assert np.all(np.isnan(clipped[3:]))


def test_the_default_loss_cap_is_ten_times_the_median_first_round_loss() -> None:
    assert default_loss_cap([0.2, 0.4, 9.0, np.nan]) == pytest.approx(4.0)
    with pytest.raises(ValueError, match="configure"):
        default_loss_cap([0.0, 0.0])


def test_the_loss_cap_is_the_policys_else_the_default_of_the_first_losses() -> None:
    assert loss_cap(2.5, [0.2, 0.4, 9.0]) == 2.5
    assert loss_cap(None, [0.2, 0.4, 9.0, np.nan]) == pytest.approx(4.0)


def test_lambda_from_counts_fills_a_silo_without_a_count_with_the_mean_count() -> None:
    np.testing.assert_allclose(proportional_to_counts([10, 0, 30]), [1 / 6, 1 / 3, 1 / 2])
    np.testing.assert_allclose(proportional_to_counts([0, -3, 0]), [1 / 3] * 3)


def test_the_floor_raises_every_entry_to_it_then_renormalises() -> None:
    np.testing.assert_allclose(
        floor_and_renormalise([1.0, 0.0, 0.0], 1e-3), np.array([1.0, 1e-3, 1e-3]) / 1.002
    )


def test_a_dominant_silo_cannot_absorb_all_of_lambda_under_the_floor() -> None:
    losses = np.array([5.0, 0.1, 0.1, 0.1])
    floored = unfloored = np.full(4, 0.25)
    for _ in range(50):
        floored = projected_loss_ascent(floored, losses, step=0.5, loss_cap=10.0, floor=1e-3)
        unfloored = projected_loss_ascent(unfloored, losses, step=0.5, loss_cap=10.0)

    np.testing.assert_array_equal(unfloored, [1.0, 0.0, 0.0, 0.0])  # collapse without it
    assert floored.min() >= 1e-3 / (1 + 4 * 1e-3) - 1e-15
    assert floored.sum() == pytest.approx(1.0)


def test_mixing_with_uniform_gives_every_silo_at_least_epsilon_over_k() -> None:
    mixed = mix_with_uniform([1.0, 0.0, 0.0, 0.0], epsilon=0.1)

    np.testing.assert_allclose(mixed, [0.925, 0.025, 0.025, 0.025])


def test_an_aggregate_needs_the_minimum_number_of_distinct_contributors() -> None:
    assert not meets_contributor_minimum([5, 0, 0, 0])  # M draws of one silo: its own model
    assert not meets_contributor_minimum([3, 2, 0, 0])
    assert meets_contributor_minimum([3, 1, 1, 0])
    assert meets_contributor_minimum([0.5, 0.5, 0.0], t_min=2)
    with pytest.raises(ValueError, match="at least 2"):
        meets_contributor_minimum([1, 1], t_min=1)


def test_weights_restricted_to_the_responders_are_renormalised_over_them() -> None:
    mask = [True, False, True, False]

    np.testing.assert_allclose(
        restrict_and_renormalise([0.1, 0.4, 0.3, 0.2], mask), [0.25, 0, 0.75, 0]
    )
    np.testing.assert_allclose(
        restrict_and_renormalise([0.0, 1.0, 0.0, 0.0], mask), [0.5, 0, 0.5, 0]
    )


# --- lambda updates: projected ascent (AFL, DRFA) and EG (AgnosticFedAvg) ------------------------


def test_the_drfa_step_is_the_projection_of_lambda_plus_the_scaled_loss_vector() -> None:
    # K = 3, U' = {0, 1}: v = (3/2)(1, 2, 0) = (1.5, 3, 0); lambda + 0.1 v is shifted by 0.15.
    stepped = projected_loss_ascent([1 / 3] * 3, [1.0, 2.0, np.nan], step=0.1, loss_cap=10.0)

    np.testing.assert_allclose(stepped, [1 / 3, 1 / 3 + 0.15, 1 / 3 - 0.15])


def test_the_loss_vector_over_a_uniform_probe_set_is_unbiased() -> None:
    # E over U of v_k = f_k, exactly, for |U'| = M drawn uniformly.
    losses = np.array([0.3, 1.2, 0.7, 2.0, 0.1])

    mean = np.mean(
        [unbiased_loss_vector(np.where(u, losses, np.nan), 10.0) for u in all_draws(5, 2)],
        axis=0,
    )

    np.testing.assert_allclose(mean, losses, atol=1e-14)


def test_lambda_ascends_toward_the_larger_losses_and_ignores_a_loss_above_the_cap() -> None:
    capped = projected_loss_ascent([0.5, 0.5], [1.0, 1e9], step=0.1, loss_cap=2.0)

    np.testing.assert_allclose(capped, [0.45, 0.55])  # v = (1, 2) after clipping


def test_lambda_stays_put_when_no_silo_reported_a_loss() -> None:
    lam = np.array([0.7, 0.2, 0.1])

    np.testing.assert_array_equal(
        projected_loss_ascent(lam, [np.nan] * 3, step=1.0, loss_cap=1.0, floor=1e-3), lam
    )


def test_eg_is_the_normalised_multiplicative_update() -> None:
    lam, losses = np.array([0.5, 0.3, 0.2]), np.array([1.0, 0.5, 2.0])

    stepped = exponentiated_gradient(lam, losses, 0.7)

    expected = lam * np.exp(0.7 * losses)
    np.testing.assert_allclose(stepped, expected / expected.sum())


def test_eg_moves_mass_toward_the_higher_losses_and_stays_on_the_simplex() -> None:
    lam = np.full(4, 0.25)
    losses = np.array([0.2, 3.0, 1.0, 0.5])

    stepped = exponentiated_gradient(lam, losses, 0.5)

    assert np.argmax(stepped) == 1 and np.argmin(stepped) == 0
    assert np.all(np.diff(stepped[np.argsort(losses)]) > 0)
    assert stepped.min() > 0 and stepped.sum() == pytest.approx(1.0)


def test_eg_with_a_zero_step_changes_nothing_and_a_huge_step_does_not_overflow() -> None:
    lam = np.array([0.2, 0.5, 0.3])

    np.testing.assert_allclose(exponentiated_gradient(lam, [9.0, 1.0, 5.0], 0.0), lam)
    np.testing.assert_allclose(exponentiated_gradient(lam, [9.0, 1.0, 5.0], 1e4), [1.0, 0, 0])


def test_eg_moves_only_the_observed_domains_and_keeps_their_total_mass() -> None:
    # Absent domains keep their lambda; the observed ones share their old mass.
    lam = np.array([0.4, 0.1, 0.3, 0.2])
    observed = np.array([True, False, True, False])

    stepped = exponentiated_gradient(lam, [1.0, np.nan, 2.0, np.nan], 1.0, observed=observed)

    np.testing.assert_array_equal(stepped[~observed], lam[~observed])
    moved = lam[observed] * np.exp([1.0, 2.0])
    np.testing.assert_allclose(stepped[observed], 0.7 * moved / moved.sum())


# --- the unified table: q-FedAvg, TERM, PropFair (docs/algorithms/aaggff.md) --------------------

LOSSES = np.array([0.3, 1.5, 0.8, 0.05])
SIZES = np.array([100.0, 20.0, 50.0, 30.0])
FEDAVG = SIZES / SIZES.sum()


def test_q_fedavg_weighs_each_silo_by_its_share_times_its_loss_to_the_q() -> None:
    expected = FEDAVG * LOSSES**1.5

    np.testing.assert_allclose(qfedavg_weights(LOSSES, SIZES, 1.5), expected / expected.sum())


def test_term_weighs_each_silo_by_its_share_times_the_exponentially_tilted_loss() -> None:
    expected = FEDAVG * np.exp(2.0 * LOSSES)

    np.testing.assert_allclose(term_weights(LOSSES, SIZES, 2.0), expected / expected.sum())


def test_propfair_weighs_each_silo_by_its_share_over_the_distance_to_the_baseline() -> None:
    expected = FEDAVG / (3.0 - LOSSES)

    np.testing.assert_allclose(propfair_weights(LOSSES, SIZES, 3.0), expected / expected.sum())


def test_q_fedavg_and_term_reduce_to_fedavg_at_zero_and_propfair_as_the_baseline_grows() -> None:
    np.testing.assert_array_equal(qfedavg_weights(LOSSES, SIZES, 0.0), FEDAVG)
    np.testing.assert_allclose(term_weights(LOSSES, SIZES, 0.0), FEDAVG, rtol=1e-15)
    np.testing.assert_allclose(propfair_weights(LOSSES, SIZES, 1e9), FEDAVG, rtol=1e-8)


def test_equal_losses_give_fedavg_weights_for_every_rule() -> None:
    equal = np.full(4, 0.7)

    for weights in (
        qfedavg_weights(equal, SIZES, 5.0),
        term_weights(equal, SIZES, 10.0),
        propfair_weights(equal, SIZES, 2.0),
    ):
        np.testing.assert_allclose(weights, FEDAVG, rtol=1e-14)


def test_q_fedavg_tends_to_afl_all_mass_on_the_worst_silo_as_q_grows() -> None:
    np.testing.assert_allclose(qfedavg_weights(LOSSES, SIZES, 500.0), [0, 1, 0, 0], atol=1e-12)


def test_q_fedavg_gives_a_zero_loss_no_weight_and_all_zero_losses_fedavg() -> None:
    assert qfedavg_weights([0.0, 1.0, 1.0, 1.0], SIZES, 1.0)[0] == 0.0
    np.testing.assert_array_equal(qfedavg_weights(np.zeros(4), SIZES, 2.0), FEDAVG)


def test_propfair_needs_every_loss_below_the_baseline() -> None:
    with pytest.raises(ValueError, match="baseline"):
        propfair_weights(LOSSES, SIZES, 1.5)


# --- AAggFF responses and decision loss (docs/algorithms/aaggff.md) -----------------------------

EXAMPLE_LOSSES = [0.01, 0.10, 0.02]
# thesis Table 3.3 (two decimals); the third Normal response is printed as 0.29-0.30.
EXAMPLE_RESPONSES = {
    "weibull": [[0.05], [1.00], [0.19]],
    "frechet": [[0.01], [0.65], [0.11]],
    "gumbel": [[0.12], [0.76], [0.18]],
    "exponential": [[0.21], [0.90], [0.37]],
    "logistic": [[0.32], [0.79], [0.37]],
    "normal": [[0.22], [0.90], [0.29, 0.30]],
}


@pytest.mark.parametrize("transform", sorted(EXAMPLE_RESPONSES))
def test_each_transform_reproduces_the_thesis_worked_example(transform: str) -> None:
    responses = cdf_responses(EXAMPLE_LOSSES, transform, upper=1.0)

    rounded = np.round(responses, 2)
    for value, allowed in zip(rounded, EXAMPLE_RESPONSES[transform], strict=True):
        assert any(value == pytest.approx(a, abs=1e-9) for a in allowed), (value, allowed)


def test_the_registry_holds_the_six_cdfs() -> None:
    assert set(RESPONSE_TRANSFORMS) == set(EXAMPLE_RESPONSES)


@pytest.mark.parametrize("transform", sorted(RESPONSE_TRANSFORMS))
def test_each_cdf_maps_larger_relative_losses_to_larger_responses_in_the_range(
    transform: str,
) -> None:
    losses = np.linspace(0.0, 5.0, 40)

    responses = cdf_responses(losses, transform, upper=0.25, lower=0.05)

    assert np.all(np.diff(responses) >= 0) and responses[-1] > responses[0]
    assert np.all((responses >= 0.05) & (responses <= 0.25))


def test_responses_depend_only_on_losses_relative_to_their_mean() -> None:
    scaled = cdf_responses(np.array(EXAMPLE_LOSSES) * 37.0, "gumbel", upper=1.0)

    np.testing.assert_allclose(scaled, cdf_responses(EXAMPLE_LOSSES, "gumbel", upper=1.0))


def test_all_zero_losses_put_every_input_at_one() -> None:
    responses = cdf_responses([0.0, 0.0, 0.0], "frechet", upper=1.0)

    np.testing.assert_allclose(responses, math.exp(-1.0))


def test_an_unknown_transform_is_rejected() -> None:
    with pytest.raises(ValueError, match="unknown transform"):
        cdf_responses(EXAMPLE_LOSSES, "cauchy", upper=1.0)


def decision_loss(p: np.ndarray, responses: np.ndarray) -> float:
    """AAggFF's decision loss -log(1 + <p, r>), the function `decision_gradient` differentiates."""
    return -math.log1p(float(np.dot(p, responses)))


def test_the_decision_gradient_is_the_gradient_of_the_decision_loss() -> None:
    p, r = np.array([0.2, 0.5, 0.3]), np.array([0.1, 0.3, 0.05])
    h = 1e-6
    numeric = [
        (decision_loss(p + h * e, r) - decision_loss(p - h * e, r)) / (2 * h) for e in np.eye(3)
    ]

    assert decision_loss(p, r) == pytest.approx(-math.log(1.0 + 0.2 * 0.1 + 0.15 + 0.015))
    np.testing.assert_allclose(decision_gradient(p, r), numeric, atol=1e-9)


# --- the simplex QP and AAggFF-S (docs/algorithms/aaggff.md) ------------------------------------


def random_problem(seed: int, size: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    factor = rng.normal(size=(size, size))
    return factor @ factor.T + 0.5 * np.eye(size), rng.normal(size=size)


@pytest.mark.parametrize("seed", range(5))
def test_the_qp_solver_finds_scipys_minimiser_and_satisfies_the_kkt_conditions(seed: int) -> None:
    quadratic, linear = random_problem(seed, 6)

    solution = solve_simplex_qp(quadratic, linear)

    assert solution.converged
    # SLSQP stops on the objective, so on these ill-conditioned Q (condition ~30) it is only
    # about 1e-7 from the minimiser; the KKT check below holds the solver to 1e-9.
    np.testing.assert_allclose(solution.weights, scipy_simplex_qp(quadratic, linear), atol=1e-6)
    gradient = quadratic @ solution.weights + linear
    support = solution.weights > 1e-10
    nu = gradient[support].mean()
    np.testing.assert_allclose(gradient[support], nu, atol=1e-9)
    assert np.all(gradient[~support] >= nu - 1e-9)


def test_the_qp_solver_reports_when_it_ran_out_of_iterations() -> None:
    quadratic, linear = random_problem(0, 6)

    solution = solve_simplex_qp(quadratic, linear, max_iterations=2)

    assert not solution.converged and solution.iterations == 2
    assert solution.weights.sum() == pytest.approx(1.0)


def test_the_initial_aaggff_s_state_uses_the_reference_constants() -> None:
    state = AAggFFSState.initial(8)

    assert (state.alpha, state.beta) == (4.0, 2.0)  # alpha = 4 K L = 4, beta = 1/(4L) = K/4
    np.testing.assert_array_equal(state.hessian, 4.0 * np.eye(8))
    np.testing.assert_array_equal(state.weights, np.full(8, 0.125))


def test_aaggff_s_solves_the_ftrl_qp_of_its_accumulated_gradients() -> None:
    # Rebuild AAggFF-S's problem independently and solve it with scipy; round 3 has a
    # dropout, whose response is the responders' mean.
    rounds = [[0.4, 0.9, 0.2, 0.5], [0.6, 1.1, 0.1, 0.3], [0.5, np.nan, 0.3, 0.2]]
    state = AAggFFSState.initial(4)
    p, gradients = np.full(4, 0.25), []
    for losses in rounds:
        state, _ = aaggff_s_step(state, losses, "logistic")
        losses = np.array(losses)
        seen = np.isfinite(losses)
        x = losses[seen] / losses[seen].mean()
        r = np.full(4, np.mean(1 / (1 + np.exp(-(x - 1)))) / 4)
        r[seen] = 1 / (1 + np.exp(-(x - 1))) / 4
        gradients.append(-r / (1 + p @ r))
        total = np.sum(gradients, axis=0)
        hessian = 4.0 * np.eye(4) + sum(np.outer(g, g) for g in gradients)
        p = scipy_simplex_qp(4.0 * np.eye(4) + 1.0 * hessian, total)  # alpha 4, beta K/4 = 1

        np.testing.assert_allclose(state.weights, p, atol=1e-8)
        np.testing.assert_allclose(state.cumulative_gradient, total, atol=1e-12)


def test_aaggff_s_keeps_uniform_weights_while_every_silo_has_the_same_loss() -> None:
    state = AAggFFSState.initial(5)
    for loss in (0.9, 0.4, 2.0, 0.4):
        state, weights = aaggff_s_step(state, np.full(5, loss), "normal")

        np.testing.assert_allclose(weights, np.full(5, 0.2), atol=1e-12)


def test_aaggff_s_raises_the_weight_of_a_silo_whose_loss_stays_twice_the_others() -> None:
    state, history = AAggFFSState.initial(4), []
    for _ in range(30):
        state, weights = aaggff_s_step(state, [2.0, 1.0, 1.0, 1.0], "normal")
        history.append(weights[0])

    assert np.all(np.diff(history) > 0)
    assert history[-1] > 0.25


def test_aaggff_s_keeps_its_decision_with_fewer_than_two_responders() -> None:
    state, _ = aaggff_s_step(AAggFFSState.initial(3), [1.0, 2.0, 0.5], "weibull")

    kept, weights = aaggff_s_step(state, [np.nan, 4.0, np.inf], "weibull")

    assert kept is state
    np.testing.assert_array_equal(weights, [0.0, 1.0, 0.0])
    with pytest.raises(ValueError, match="no silo"):
        aaggff_s_step(state, [np.nan] * 3, "weibull")


def test_aaggff_s_aggregates_only_the_responders_with_renormalised_weights() -> None:
    state = AAggFFSState.initial(3)

    new_state, weights = aaggff_s_step(state, [1.0, np.nan, 3.0], "normal")

    np.testing.assert_allclose(weights, restrict_and_renormalise(new_state.weights, [1, 0, 1]))


def test_a_single_silo_takes_all_the_weight() -> None:
    s_state, s_weights = aaggff_s_step(AAggFFSState.initial(1), [0.3], "normal")
    d_state, d_weights = aaggff_d_step(AAggFFDState.initial(1, 1.0), [0.3], "normal")

    np.testing.assert_array_equal(s_weights, [1.0])
    np.testing.assert_array_equal(d_weights, [1.0])


def test_aaggff_states_survive_a_json_round_trip_and_steps_leave_their_input_alone() -> None:
    losses = [0.5, 1.5, 1.0]
    s_state, _ = aaggff_s_step(AAggFFSState.initial(3), losses, "gumbel")
    d_state, _ = aaggff_d_step(AAggFFDState.initial(3, 1.0), losses, "gumbel")
    for state, step in ((s_state, aaggff_s_step), (d_state, aaggff_d_step)):
        restored = type(state).from_json(json.loads(json.dumps(state.to_json())))
        before = state.to_json()

        assert restored.to_json() == before
        assert (
            step(restored, losses, "gumbel")[0].to_json()
            == step(state, losses, "gumbel")[0].to_json()
        )
        assert state.to_json() == before
        with pytest.raises(ValueError, match="read-only"):
            state.weights[0] = 1.0


# --- AAggFF-D (docs/algorithms/aaggff.md) -------------------------------------------------------


def test_the_doubly_robust_estimate_adds_the_inverse_probability_weighted_residual() -> None:
    # K = 4, q = 1/2, silos 0 and 1 observed with responses 0.3 and 0.1, imputation 0.2.
    observed = np.array([True, True, False, False])
    responses = np.array([0.3, 0.1, np.nan, np.nan])

    standard = doubly_robust_responses(responses, observed, 0.5, 0.2)

    np.testing.assert_allclose(standard, [0.4, 0.0, 0.2, 0.2], atol=1e-15)


def test_the_linearised_gradient_is_the_thesis_closed_form() -> None:
    # p = (0.1, 0.2, 0.3, 0.4), r_hat = (0.4, 0, 0.2, 0.2), r0 = 0.2 1: a = 1.2,
    # <p, r_hat - r0> = 0.02 - 0.04 = -0.02, correction 0.2 (-0.02) / 1.44 = -1/360.
    gradient = linearised_gradient([0.1, 0.2, 0.3, 0.4], [0.4, 0.0, 0.2, 0.2], np.full(4, 0.2))

    np.testing.assert_allclose(
        gradient, np.array([-1 / 3, 0.0, -1 / 6, -1 / 6]) - 1 / 360, atol=1e-15
    )


def test_the_linearised_gradient_is_the_first_order_expansion_of_the_true_one() -> None:
    p = np.array([0.1, 0.2, 0.3, 0.4])
    reference = np.full(4, 0.2)
    direction = np.array([0.3, -0.1, 0.05, 0.2])
    errors = []
    for size in (1e-1, 1e-2):
        r = reference + size * direction
        errors.append(np.abs(linearised_gradient(p, r, reference) - decision_gradient(p, r)).max())

    np.testing.assert_allclose(
        linearised_gradient(p, reference, reference), decision_gradient(p, reference)
    )
    assert errors[1] < errors[0] / 50  # the error is second order: 100x smaller, up to slack


@pytest.mark.parametrize(("size", "drawn"), [(5, 2), (6, 3), (8, 1)])
def test_the_doubly_robust_estimate_is_unbiased_for_an_imputation_fixed_before_the_draw(
    size: int, drawn: int
) -> None:
    # The expectation over uniform draws without replacement, computed exactly by enumerating
    # every draw (no Monte Carlo tolerance); P(j drawn) = drawn / size.
    r = np.random.default_rng(size).uniform(0.0, 0.5, size)
    reference = np.full(size, 0.17)
    p = np.random.default_rng(0).dirichlet(np.ones(size))
    estimates, gradients = [], []
    for mask in all_draws(size, drawn):
        estimate = doubly_robust_responses(np.where(mask, r, np.nan), mask, drawn / size, 0.17)
        estimates.append(estimate)
        gradients.append(linearised_gradient(p, estimate, reference))

    np.testing.assert_allclose(np.mean(estimates, axis=0), r, atol=1e-14)
    np.testing.assert_allclose(
        np.mean(gradients, axis=0), linearised_gradient(p, r, reference), atol=1e-14
    )


@pytest.mark.parametrize(("size", "drawn"), [(5, 2), (6, 3)])
def test_imputing_with_the_observed_mean_as_aaggff_d_does_biases_the_estimate(
    size: int, drawn: int
) -> None:
    # Lemma 3.2's unbiasedness needs an imputation independent of the draw; the observed mean
    # is not, and shrinks each estimate toward mean(r) by (K - m)/(m (K - 1)) of the gap.
    r = np.random.default_rng(size).uniform(0.0, 0.5, size)

    mean = np.mean(
        [
            doubly_robust_responses(np.where(m, r, np.nan), m, drawn / size, r[m].mean())
            for m in all_draws(size, drawn)
        ],
        axis=0,
    )

    shrinkage = (size - drawn) / (drawn * (size - 1))
    np.testing.assert_allclose(mean, r + shrinkage * (r.mean() - r), atol=1e-14)


def test_the_aaggff_d_step_size_follows_the_reference_schedule() -> None:
    assert aaggff_d_step_size(3, 50, 0.2) == pytest.approx(math.sqrt(math.log(50)) / (2.2 * 2.0))


def test_an_aaggff_d_round_is_softmax_of_minus_eta_times_the_accumulated_gradient() -> None:
    # K = 4, q = 1/2, silos 0 and 1 sampled with losses 3 and 1 (mean 2: x = 1.5, 0.5).
    state = AAggFFDState.initial(4, 0.5)
    r = 0.5 * (1 - np.exp(-(np.array([1.5, 0.5]) ** 2)))  # Weibull responses in [0, q]
    r_bar = r.mean()
    r_hat = np.array([r_bar + (r[0] - r_bar) / 0.5, r_bar + (r[1] - r_bar) / 0.5, r_bar, r_bar])
    a = 1 + r_bar
    gradient = -r_hat / a + r_bar * np.mean(r_hat - r_bar) / a**2  # p uniform
    eta = math.sqrt(math.log(4)) / (2.5 * math.sqrt(2))
    expected = np.exp(-eta * gradient) / np.exp(-eta * gradient).sum()

    new_state, weights = aaggff_d_step(state, [3.0, 1.0, np.nan, np.nan], "weibull")

    np.testing.assert_allclose(new_state.cumulative_gradient, gradient, atol=1e-15)
    np.testing.assert_allclose(new_state.weights, expected, atol=1e-15)
    assert new_state.rounds == 1
    np.testing.assert_allclose(weights, [*expected[:2] / expected[:2].sum(), 0, 0], atol=1e-15)


def test_aaggff_d_keeps_uniform_weights_while_every_client_has_the_same_loss() -> None:
    state = AAggFFDState.initial(6, 0.5)
    for sampled in ([0, 1, 2], [3, 4, 5], [0, 2, 4]):
        losses = np.full(6, np.nan)
        losses[sampled] = 0.8
        state, _ = aaggff_d_step(state, losses, "exponential")

        np.testing.assert_allclose(state.weights, np.full(6, 1 / 6), atol=1e-15)


def test_aaggff_d_raises_the_weight_of_a_client_whose_loss_stays_twice_the_others() -> None:
    state, history = AAggFFDState.initial(4, 1.0), []
    for _ in range(30):
        state, _ = aaggff_d_step(state, [2.0, 1.0, 1.0, 1.0], "normal")
        history.append(state.weights[0])

    assert np.all(np.diff(history) > 0)
    assert history[-1] > 0.25
