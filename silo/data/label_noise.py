"""Simulated unreliable silos (`data.label_noise`): which silos are noisy, and their training
labels flipped (classification) or perturbed (regression); the maths in silo/partition.py."""

from __future__ import annotations

import numpy as np

from fedsilo.policies.data import DataConfig
from fedsilo.silo.data.encoding import Table
from fedsilo.silo.data.seeds import Purpose, rng_for
from fedsilo.silo.errors import SECTION, DataError
from fedsilo.silo.partition import add_label_noise, flip_labels, noisy_silos


def noisy_labels(
    y: np.ndarray, table: Table, config: DataConfig, rng: np.random.Generator
) -> np.ndarray:
    noise = config.label_noise
    assert noise is not None
    if table.task == "classification":
        assert table.num_classes is not None
        return flip_labels(y, table.num_classes, noise.probability, rng)
    return add_label_noise(y, noise.probability, noise.std, rng)


def noisy_silo_indices(table: Table, config: DataConfig, silos: int, seed: int) -> set[int]:
    if config.label_noise is None:
        return set()
    if table.task not in ("classification", "regression"):
        raise DataError(
            f"{SECTION}.label_noise: flips class labels or perturbs regression targets; task "
            f"plug-in '{table.task}' has neither"
        )
    chosen = noisy_silos(
        silos, config.label_noise.silo_fraction, rng_for(seed, Purpose.NOISY_SILOS)
    )
    return {int(index) for index in chosen}
