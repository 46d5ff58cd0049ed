"""A silo's rows into train, validation and test: proportional sizes with at least one row in
each split asked for, shuffled, and stratified by label when every class allows it; or, with a
split column, as each row's value says."""

from __future__ import annotations

import numpy as np

from fedsilo.policies.data import SPLIT_VALUES, DataConfig, SplitConfig
from fedsilo.silo.errors import SECTION, DataError


def split_sizes(n: int, split: SplitConfig, silo: str) -> list[int]:
    """Rows for train, val and test: proportional, at least one in each split asked for."""
    needed = 3 if split.val > 0 else 2
    if n < needed:
        raise DataError(
            f"{SECTION}.partition: silo '{silo}' has {n} rows; splitting it into train/val/test "
            f"needs at least {needed} (fewer silos, or a partition that gives each more rows)"
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


def predefined_splits(
    silo: str, rows: np.ndarray, codes: np.ndarray, config: DataConfig
) -> list[np.ndarray]:
    """The rows of `silo` whose split column says train, val and test (codes index
    SPLIT_VALUES), in table order; a silo without training or test rows is refused."""
    parts = [rows[codes == code] for code in range(len(SPLIT_VALUES))]
    for code in (0, 2):
        if len(parts[code]) == 0:
            raise DataError(
                f"{SECTION}.split.column: silo '{silo}' has no row whose column "
                f"'{config.split.column}' says {SPLIT_VALUES[code]}"
            )
    return parts
