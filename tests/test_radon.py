"""The Radon machine's aggregate: Radon points lie in both hulls of a Radon partition, the
iterated Radon point groups and drops models by a stated rule and resists outliers, and
`RadonAggregator` turns model state dicts into one of the same layout."""

import numpy as np
import pytest
import torch
from scipy.linalg import null_space
from scipy.optimize import linprog

from fedsilo.coordinator.radon import (
    RadonAggregator,
    RadonError,
    iterated_radon_point,
    radon_height,
    radon_number,
    radon_point,
)


def in_convex_hull(point: np.ndarray, vertices: np.ndarray, tol: float = 1e-9) -> bool:
    """Whether some convex combination of the rows of `vertices` is within `tol` of `point`."""
    count, dim = vertices.shape
    # variables: weights w >= 0 (count), slack s >= 0 (dim); minimise the slack.
    a_ub = np.block([[vertices.T, -np.eye(dim)], [-vertices.T, -np.eye(dim)]])
    b_ub = np.concatenate([point, -point])
    a_eq = np.concatenate([np.ones(count), np.zeros(dim)])[None, :]
    objective = np.concatenate([np.zeros(count), np.ones(dim)])
    result = linprog(objective, A_ub=a_ub, b_ub=b_ub, A_eq=a_eq, b_eq=[1.0], method="highs")
    return result.status == 0 and result.fun <= tol * max(1.0, np.abs(vertices).max())


def one_param_models(values: list[float]) -> np.ndarray:
    return np.asarray(values, dtype=np.float64)[:, None]


def test_the_radon_number_of_d_dimensional_points_is_d_plus_2() -> None:
    assert [radon_number(d) for d in (1, 2, 19)] == [3, 4, 21]


def test_the_height_is_the_number_of_full_levels_the_models_fill() -> None:
    assert [radon_height(m, 1) for m in (2, 3, 8, 9, 26, 27)] == [0, 1, 1, 2, 2, 3]


@pytest.mark.parametrize("seed", range(5))
@pytest.mark.parametrize("dim", [1, 2, 5, 19])
def test_the_radon_point_lies_in_the_convex_hulls_of_both_parts_of_the_radon_partition(
    seed: int, dim: int
) -> None:
    points = np.random.default_rng(seed).normal(size=(dim + 2, dim))
    system = np.vstack([points.T, np.ones(dim + 2)])
    coefficients = null_space(system)[:, 0]  # general position: a one-dimensional null space

    point = radon_point(points)

    assert in_convex_hull(point, points[coefficients > 0])
    assert in_convex_hull(point, points[coefficients < 0])


@pytest.mark.parametrize("seed", range(5))
def test_the_radon_point_of_three_reals_is_their_median(seed: int) -> None:
    values = np.random.default_rng(seed).normal(size=3) * 10
    assert radon_point(values[:, None]) == pytest.approx([np.median(values)], abs=1e-12)


def test_the_radon_point_of_three_reals_with_a_repeated_value_is_the_repeated_value() -> None:
    # Every solution has lambda_1 = 0 here, so fixing lambda_1 = 1 would have no solution.
    assert radon_point(one_param_models([7.0, 0.0, 0.0])) == pytest.approx([0.0], abs=1e-12)


def test_the_radon_point_of_a_convex_quadrilateral_is_where_its_diagonals_cross() -> None:
    corners = np.array([[0.0, 0.0], [2.0, 0.0], [2.0, 1.0], [0.0, 3.0]])
    # diagonals (0,0)-(2,1) and (2,0)-(0,3) meet at t (2, 1) with t = 3/4
    np.testing.assert_allclose(radon_point(corners), [1.5, 0.75], atol=1e-12)


def test_the_radon_point_of_a_triangle_and_a_point_inside_it_is_that_point() -> None:
    points = np.array([[0.0, 0.0], [4.0, 0.0], [1.0, 1.0], [0.0, 4.0]])
    np.testing.assert_allclose(radon_point(points), [1.0, 1.0], atol=1e-12)


def test_the_radon_point_moves_with_a_translation_and_ignores_the_order_of_the_points() -> None:
    rng = np.random.default_rng(7)
    points = rng.normal(size=(7, 5))
    shift = rng.normal(size=5) * 1e3

    reference = radon_point(points)

    np.testing.assert_allclose(radon_point(points + shift), reference + shift, atol=1e-9)
    for _ in range(5):
        np.testing.assert_allclose(radon_point(points[rng.permutation(7)]), reference, atol=1e-9)


def test_identical_points_give_that_point_without_nan() -> None:
    point = np.array([0.5, -2.0, 3.0])
    assert np.array_equal(radon_point(np.tile(point, (5, 1))), point)
    assert np.array_equal(iterated_radon_point(np.tile(point, (25, 1)), 2), point)


def test_collinear_points_in_the_plane_give_a_finite_point_on_their_segment() -> None:
    points = np.array([[0.0, 0.0], [1.0, 1.0], [2.0, 2.0], [3.0, 3.0]])
    point = radon_point(points)
    assert np.all(np.isfinite(point))
    assert in_convex_hull(point, points)


def test_a_radon_point_takes_exactly_d_plus_2_points_and_only_finite_ones() -> None:
    with pytest.raises(RadonError, match=r"exactly r = d \+ 2 = 4 points; got 5"):
        radon_point(np.zeros((5, 2)))
    with pytest.raises(RadonError, match="finite"):
        radon_point(np.array([[0.0], [1.0], [np.nan]]))


def test_the_iterated_radon_point_of_r_squared_reals_is_the_median_of_consecutive_medians() -> None:
    values = [4, 7, 6, 8, 2, 9, 3, 1, 5]
    # consecutive triples: medians 6, 8, 3 -> 6 (strided triples would give 4; the median 5)
    assert iterated_radon_point(one_param_models(values), 2) == pytest.approx([6.0], abs=1e-12)


def test_the_iterated_radon_point_ignores_the_order_within_and_of_the_groups() -> None:
    rng = np.random.default_rng(3)
    models = rng.normal(size=(16, 2))  # r = 4, h = 2
    reference = iterated_radon_point(models, 2)

    groups = models.reshape(4, 4, 2)
    shuffled = np.stack([group[rng.permutation(4)] for group in groups[rng.permutation(4)]])

    np.testing.assert_allclose(
        iterated_radon_point(shuffled.reshape(16, 2), 2), reference, atol=1e-9
    )


def test_only_the_first_r_to_the_h_models_are_used_and_the_rest_are_dropped() -> None:
    values = [4, 7, 6, 8, 2, 9, 3, 1, 5]
    expected = iterated_radon_point(one_param_models(values), 2)

    for extra in ([1e9], [-1e9, 0.0, 1e9, 2.0, 3.0]):
        models = one_param_models(values + extra)
        assert iterated_radon_point(models, 2) == pytest.approx(expected, abs=1e-12)


def test_a_height_the_models_cannot_fill_is_lowered_to_the_largest_that_they_can() -> None:
    values = [4, 7, 6, 8, 2, 9, 3, 1]  # 8 < 3^2: one level, over the first three models
    assert iterated_radon_point(one_param_models(values), 2) == pytest.approx([6.0], abs=1e-12)
    assert iterated_radon_point(one_param_models(values), 1) == pytest.approx([6.0], abs=1e-12)


def test_a_height_lower_than_the_models_could_fill_uses_only_r_to_that_height_models() -> None:
    values = [8, 2, 9, 4, 7, 6, 3, 1, 5]  # height 2: medians 8, 6, 3 -> 6
    assert iterated_radon_point(one_param_models(values), 1) == pytest.approx([8.0], abs=1e-12)


def test_fewer_models_than_the_radon_number_are_refused_with_both_counts() -> None:
    with pytest.raises(RadonError, match=r"4 models given.*d = 3 parameters.*r = d \+ 2 = 5"):
        iterated_radon_point(np.zeros((4, 3)), 1)


def test_at_least_one_iteration_is_required() -> None:
    with pytest.raises(RadonError, match="at least 1 iteration"):
        iterated_radon_point(np.zeros((9, 1)), 0)


@pytest.mark.parametrize(
    "outliers",
    [[0, 1, 2], [0, 4, 8], [3, 9, 14], [15, 10, 5]],
    ids=["one-group", "three-groups", "spread", "last-of-each"],
)
def test_fewer_than_2_to_the_h_huge_outliers_cannot_pull_the_point_out_of_the_inliers_hull(
    outliers: list[int],
) -> None:
    rng = np.random.default_rng(11)
    models = rng.uniform(-1.0, 1.0, size=(16, 2))  # r = 4, h = 2: tolerates 3 bad models
    inliers = np.delete(models, outliers, axis=0)
    models[outliers] = rng.choice([-1.0, 1.0], size=(3, 2)) * 1e6

    point = iterated_radon_point(models, 2)

    assert np.all(point >= inliers.min(axis=0) - 1e-9)
    assert np.all(point <= inliers.max(axis=0) + 1e-9)
    assert in_convex_hull(point, inliers, tol=1e-6)
    assert not in_convex_hull(models.mean(axis=0), inliers, tol=1e-6)


def state(weight: torch.Tensor, bias: torch.Tensor, steps: int = 3) -> dict[str, torch.Tensor]:
    return {
        "layer.weight": weight,
        "layer.bias": bias,
        "norm.num_batches_tracked": torch.tensor(steps),
    }


def random_states(count: int, seed: int = 0) -> list[dict[str, torch.Tensor]]:
    generator = torch.Generator().manual_seed(seed)
    return [
        state(
            torch.randn(2, 3, generator=generator),
            torch.randn(3, generator=generator, dtype=torch.float64),
        )
        for _ in range(count)
    ]


def test_aggregating_three_one_parameter_models_gives_their_median() -> None:
    models = [{"w": torch.tensor(v)} for v in (3.0, -1.0, 10.0)]
    out = RadonAggregator().aggregate(models, iterations=1)
    assert out["w"].item() == pytest.approx(3.0)


def test_the_aggregate_has_the_models_names_shapes_and_dtypes_and_their_buffers() -> None:
    models = random_states(11)  # 6 + 3 float parameters: r = 11

    out = RadonAggregator().aggregate(models, iterations=1)

    assert list(out) == list(models[0])
    for name, tensor in models[0].items():
        assert out[name].shape == tensor.shape
        assert out[name].dtype == tensor.dtype
    assert out["norm.num_batches_tracked"].item() == 3


def test_the_aggregate_is_the_iterated_radon_point_of_the_models_float_parameters() -> None:
    models = random_states(11)
    vectors = np.stack(
        [
            np.concatenate([m["layer.bias"].numpy(), m["layer.weight"].double().numpy().ravel()])
            for m in models
        ]
    )
    expected = iterated_radon_point(vectors, 1)

    out = RadonAggregator().aggregate(models, iterations=1)

    np.testing.assert_allclose(out["layer.bias"].numpy(), expected[:3], atol=1e-12)
    np.testing.assert_allclose(
        out["layer.weight"].numpy(), expected[3:].reshape(2, 3).astype(np.float32), atol=1e-6
    )


def test_models_without_float_tensors_aggregate_to_their_shared_buffers() -> None:
    models = [{"steps": torch.tensor([1, 2])}, {"steps": torch.tensor([1, 2])}]
    out = RadonAggregator().aggregate(models, iterations=1)
    assert torch.equal(out["steps"], torch.tensor([1, 2]))


def test_models_whose_integer_buffers_differ_are_refused_naming_the_buffer() -> None:
    models = random_states(11)
    models[4]["norm.num_batches_tracked"] = torch.tensor(4)
    with pytest.raises(RadonError, match="norm.num_batches_tracked"):
        RadonAggregator().aggregate(models, iterations=1)


def test_models_with_different_tensors_shapes_or_dtypes_are_refused_naming_the_tensor() -> None:
    models = random_states(11)
    models[2] = {**models[2], "extra": torch.zeros(1)}
    with pytest.raises(RadonError, match="extra"):
        RadonAggregator().aggregate(models, iterations=1)

    models = random_states(11)
    models[5] = {**models[5], "layer.bias": torch.zeros(3)}  # float32 where others are float64
    with pytest.raises(RadonError, match="layer.bias"):
        RadonAggregator().aggregate(models, iterations=1)


def test_too_few_models_for_their_parameter_count_are_refused() -> None:
    with pytest.raises(RadonError, match=r"10 models given.*d = 9 parameters"):
        RadonAggregator().aggregate(random_states(10), iterations=1)
    with pytest.raises(RadonError, match="no models"):
        RadonAggregator().aggregate([], iterations=1)
