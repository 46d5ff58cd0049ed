"""A silo's rows into train, validation and test: proportional sizes with at least one row in
each split asked for, shuffled, and stratified by label when every class allows it."""

from __future__ import annotations

import numpy as np

from fedsilo.policies.data import SplitConfig
from fedsilo.silo.data.dataset import DataError


def split_sizes(n: int, split: SplitConfig, silo: str) -> list[int]:
    """Rows for train, val and test: proportional, at least one in each split asked for."""
    needed = 3 if split.val > 0 else 2
    if n < needed:
        raise DataError(
            f"silo '{silo}' has {n} rows; splitting it into train/val/test needs at least {needed}"
        )
    val = max(1, int(n * split.val + 0.5)) if split.val > 0 else 0  # rounded half up
    test = max(1, int(n * split.test + 0.5))
    while n - val - test < 1:
        if val >= test:
            val -= 1
        else:
            test -= 1
    return [n - val - test, val, test]


def _interleave(sizes: list[int]) -> np.ndarray:
    """A sequence of split indices (0, 1, 2) holding sizes[j] of each j, spread evenly so that
    any run of the sequence is close to proportional."""
    slots = np.concatenate([(np.arange(size) + 0.5) / size for size in sizes if size])
    splits = np.repeat(np.arange(len(sizes)), sizes)
    return splits[np.argsort(slots, kind="stable")]


def _can_stratify(labels: np.ndarray, sizes: list[int]) -> bool:
    """Every class present has enough rows to expect one in the smallest split."""
    _, counts = np.unique(labels, return_counts=True)
    smallest = min(size for size in sizes if size)
    return bool(counts.min() * smallest >= sum(sizes))


def split_positions(
    labels: np.ndarray | None, sizes: list[int], rng: np.random.Generator
) -> list[np.ndarray]:
    """Positions (within the silo) of its train, val and test rows: shuffled, and stratified
    by label (rows grouped by class before the even interleave) when every class allows it."""
    order = rng.permutation(sum(sizes))
    if labels is not None and _can_stratify(labels, sizes):
        order = order[np.argsort(labels[order], kind="stable")]
    assignment = _interleave(sizes)
    return [np.sort(order[assignment == split]) for split in range(len(sizes))]
