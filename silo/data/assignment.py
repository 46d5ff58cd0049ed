"""Which rows go to which silo: the policy's partition (natural by a column, or simulated:
iid, Dirichlet label skew, label shards, quantity skew, molecular scaffolds; the maths in
silo/partition.py), seeded from the consortium's seed."""

from __future__ import annotations

import numpy as np

from fedsilo.policies.data import (
    DirichletPartition,
    IidPartition,
    NaturalPartition,
    Partition,
    QuantitySkewPartition,
    ScaffoldPartition,
    ShardsPartition,
)
from fedsilo.silo.data.encoding import Table
from fedsilo.silo.data.seeds import Purpose, rng_for
from fedsilo.silo.errors import SECTION, DataError
from fedsilo.silo.partition import (
    by_column,
    by_group,
    dirichlet_label_skew,
    iid,
    label_shards,
    quantity_skew,
)


def _partition_rows(table: Table, partition: Partition, seed: int) -> list[np.ndarray]:
    rng = rng_for(seed, Purpose.PARTITION)
    n = len(table.y)
    if isinstance(partition, IidPartition):
        return iid(n, partition.silos, rng)
    if isinstance(partition, DirichletPartition):
        if table.task != "classification":
            raise DataError(
                f"{SECTION}.partition: a dirichlet partition skews class labels; this task is "
                "regression"
            )
        return dirichlet_label_skew(
            table.y, partition.silos, partition.alpha, rng, partition.min_size
        )
    if isinstance(partition, ShardsPartition):
        if table.task != "classification":
            raise DataError(
                f"{SECTION}.partition: a shards partition deals label-sorted shards; this task "
                "is regression"
            )
        return label_shards(table.y, partition.silos, partition.shards_per_silo, rng)
    if isinstance(partition, ScaffoldPartition):
        assert table.groups is not None  # a molecular source's scaffolds
        return by_group(table.groups, partition.silos, rng)
    assert isinstance(partition, QuantitySkewPartition)
    total = n if partition.total is None else partition.total
    if total > n:
        raise DataError(
            f"{SECTION}.partition.total: quantity_skew total={total} exceeds the source's {n} rows"
        )
    rows = np.sort(rng_for(seed, Purpose.SUBSAMPLE).choice(n, size=total, replace=False))
    parts = quantity_skew(total, partition.silos, partition.small_fraction, partition.n_min, rng)
    return [rows[part] for part in parts]


def assign_silos(table: Table, partition: Partition, seed: int) -> list[tuple[str, np.ndarray]]:
    if isinstance(partition, NaturalPartition):
        assert table.groups is not None
        return list(by_column(table.groups).items())
    try:
        parts = _partition_rows(table, partition, seed)
    except DataError:
        raise
    except ValueError as error:
        raise DataError(f"{SECTION}.partition: cannot partition the data: {error}") from error
    return [(f"silo-{index}", rows) for index, rows in enumerate(parts)]
