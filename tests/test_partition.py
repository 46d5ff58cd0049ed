"""Specifications of the simulation partitioners and the label-noise functions."""

from __future__ import annotations

import numpy as np
import pytest

from fedsilo.silo.partition import (
    add_label_noise,
    by_column,
    dirichlet_label_skew,
    flip_labels,
    iid,
    label_shards,
    noisy_silos,
    quantity_skew,
    quantity_skew_sizes,
)


def rng(seed: int = 0) -> np.random.Generator:
    return np.random.default_rng(seed)


def assert_disjoint_cover(parts: list[np.ndarray], n: int) -> None:
    joined = np.concatenate(parts)
    assert len(joined) == n
    assert np.array_equal(np.sort(joined), np.arange(n))


def label_skew(labels: np.ndarray, parts: list[np.ndarray]) -> float:
    """Mean total-variation distance between each silo's label distribution and the global."""
    classes = np.unique(labels)
    overall = np.array([np.mean(labels == c) for c in classes])
    distances = [
        0.5 * np.abs(np.array([np.mean(labels[p] == c) for c in classes]) - overall).sum()
        for p in parts
    ]
    return float(np.mean(distances))


# iid ------------------------------------------------------------------------------------------


def test_iid_cuts_all_rows_into_near_equal_disjoint_silos() -> None:
    parts = iid(103, 4, rng())
    assert_disjoint_cover(parts, 103)
    assert sorted(len(p) for p in parts) == [25, 26, 26, 26]


def test_iid_is_deterministic_given_the_generator_seed() -> None:
    first, again, other = iid(50, 3, rng(7)), iid(50, 3, rng(7)), iid(50, 3, rng(8))
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))
    assert not all(np.array_equal(a, b) for a, b in zip(first, other, strict=True))


def test_iid_refuses_zero_silos() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        iid(10, 0, rng())


# dirichlet -----------------------------------------------------------------------------------

LABELS = np.repeat(np.arange(5), 400)


def test_dirichlet_cuts_all_rows_into_disjoint_silos_of_at_least_min_size() -> None:
    parts = dirichlet_label_skew(LABELS, 6, 0.3, rng(), min_size=20)
    assert_disjoint_cover(parts, len(LABELS))
    assert min(len(p) for p in parts) >= 20


def test_dirichlet_with_small_alpha_skews_labels_and_large_alpha_does_not() -> None:
    skewed = label_skew(LABELS, dirichlet_label_skew(LABELS, 8, 0.1, rng()))
    balanced = label_skew(LABELS, dirichlet_label_skew(LABELS, 8, 1000.0, rng()))
    assert skewed > 0.4
    assert balanced < 0.05


def test_dirichlet_is_deterministic_given_the_generator_seed() -> None:
    first = dirichlet_label_skew(LABELS, 4, 0.5, rng(3))
    again = dirichlet_label_skew(LABELS, 4, 0.5, rng(3))
    assert all(np.array_equal(a, b) for a, b in zip(first, again, strict=True))


def test_dirichlet_gives_up_with_a_clear_error_when_min_size_is_unreachable() -> None:
    with pytest.raises(ValueError, match="fewer than 50 rows"):
        dirichlet_label_skew(np.repeat([0, 1], 150), 3, 0.001, rng(), min_size=50)
    with pytest.raises(ValueError, match="cannot give each of 5 silos"):
        dirichlet_label_skew(np.zeros(8, dtype=int), 5, 1.0, rng())


def test_dirichlet_leaves_the_labels_untouched() -> None:
    labels = LABELS.copy()
    dirichlet_label_skew(labels, 4, 0.5, rng())
    assert np.array_equal(labels, LABELS)


# quantity skew -------------------------------------------------------------------------------


def test_quantity_skew_small_silos_get_n_min_and_the_others_grow_linearly() -> None:
    sizes = quantity_skew_sizes(1000, 10, 0.3, 10)
    assert sizes[:3] == [10, 10, 10]
    large = sizes[3:]
    assert large[0] == 10
    slope = 2 * (1000 - 10 * 10) / (7 * 6)
    for i, size in enumerate(large[:-1]):
        assert size == int(np.floor(10 + slope * i))
    assert sum(sizes) == 1000


@pytest.mark.parametrize(
    ("n", "silos", "fraction", "n_min"),
    [(1000, 10, 0.3, 10), (997, 7, 0.5, 3), (50, 5, 0.0, 10), (123, 4, 0.6, 1), (12, 3, 0.9, 1)],
)
def test_quantity_skew_sizes_sum_to_exactly_n(
    n: int, silos: int, fraction: float, n_min: int
) -> None:
    sizes = quantity_skew_sizes(n, silos, fraction, n_min)
    assert len(sizes) == silos
    assert sum(sizes) == n
    assert sizes == sorted(sizes)
    assert min(sizes) >= n_min


def test_quantity_skew_with_one_large_silo_gives_it_all_the_rest() -> None:
    assert quantity_skew_sizes(100, 2, 0.5, 5) == [5, 95]


def test_quantity_skew_refuses_too_few_rows_for_n_min() -> None:
    with pytest.raises(ValueError, match="too few"):
        quantity_skew_sizes(29, 3, 0.3, 10)


def test_quantity_skew_cuts_shuffled_rows_into_those_sizes_deterministically() -> None:
    parts = quantity_skew(500, 5, 0.4, 20, rng(1))
    assert_disjoint_cover(parts, 500)
    assert [len(p) for p in parts] == quantity_skew_sizes(500, 5, 0.4, 20)
    again = quantity_skew(500, 5, 0.4, 20, rng(1))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


# by column -----------------------------------------------------------------------------------


def test_by_column_makes_one_silo_per_value_in_order_of_first_appearance() -> None:
    silos = by_column(np.array(["b", "a", "b", "c", "a"], dtype=object))
    assert list(silos) == ["b", "a", "c"]
    assert [s.tolist() for s in silos.values()] == [[0, 2], [1, 4], [3]]


def test_by_column_names_silos_by_the_value_as_a_string() -> None:
    assert list(by_column(np.array([3, 1, 3]))) == ["3", "1"]


# label noise ---------------------------------------------------------------------------------


def test_flip_labels_flips_about_the_given_fraction_to_another_class() -> None:
    y = rng(0).integers(0, 4, size=20_000)
    flipped = flip_labels(y, 4, 0.3, rng(1))
    changed = flipped != y
    assert abs(changed.mean() - 0.3) < 0.02
    assert set(np.unique(flipped)) <= {0, 1, 2, 3}


def test_flip_labels_never_keeps_the_class_and_spreads_evenly_over_the_others() -> None:
    y = np.zeros(30_000, dtype=np.int64)
    flipped = flip_labels(y, 4, 1.0, rng())
    assert not (flipped == 0).any()
    shares = np.bincount(flipped, minlength=4)[1:] / len(y)
    assert np.allclose(shares, 1 / 3, atol=0.02)


def test_flip_labels_returns_a_new_array_and_keeps_the_dtype() -> None:
    y = np.array([0, 1, 2, 1], dtype=np.int64)
    flipped = flip_labels(y, 3, 1.0, rng())
    assert np.array_equal(y, [0, 1, 2, 1])
    assert flipped.dtype == np.int64


def test_add_label_noise_perturbs_about_the_given_fraction_with_the_given_std() -> None:
    y = np.linspace(0, 1, 20_000)
    noisy = add_label_noise(y, 0.25, 2.0, rng())
    changed = noisy != y
    assert abs(changed.mean() - 0.25) < 0.02
    assert abs((noisy - y)[changed].std() - 2.0) < 0.1
    assert np.array_equal(y, np.linspace(0, 1, 20_000))


def test_add_label_noise_with_zero_probability_changes_nothing() -> None:
    y = np.arange(10.0)
    assert np.array_equal(add_label_noise(y, 0.0, 1.0, rng()), y)


@pytest.mark.parametrize(
    ("silos", "fraction", "count"),
    [(10, 0.3, 3), (4, 0.5, 2), (5, 0.5, 3), (8, 0.01, 1), (3, 1.0, 3)],
)
def test_noisy_silos_picks_round_fraction_of_silos_at_least_one(
    silos: int, fraction: float, count: int
) -> None:
    chosen = noisy_silos(silos, fraction, rng())
    assert len(chosen) == count
    assert list(chosen) == sorted(set(chosen.tolist()))
    assert all(0 <= index < silos for index in chosen)


def test_noisy_silos_is_deterministic_given_the_generator_seed() -> None:
    assert np.array_equal(noisy_silos(20, 0.3, rng(5)), noisy_silos(20, 0.3, rng(5)))


def test_shards_give_each_silo_its_shards_of_distinct_labels() -> None:
    labels = np.repeat(np.arange(10), 40)  # 400 rows: shards of 10 rows never straddle labels
    parts = label_shards(labels, silos=20, shards_per_silo=2, rng=rng(3))
    assert_disjoint_cover(parts, 400)
    assert [len(p) for p in parts] == [20] * 20
    assert all(len(np.unique(labels[p])) == 2 for p in parts)
    again = label_shards(labels, silos=20, shards_per_silo=2, rng=rng(3))
    assert all(np.array_equal(a, b) for a, b in zip(parts, again, strict=True))


def test_more_shards_than_rows_are_refused() -> None:
    with pytest.raises(ValueError, match="40 shards need at least 40 rows"):
        label_shards(np.zeros(30, dtype=int), silos=20, shards_per_silo=2, rng=rng())
