"""The random streams of the data pipeline: every use draws from
`np.random.SeedSequence([seed, purpose, ...])`, one purpose per use, so a seed reproduces a
consortium exactly and the uses do not disturb one another."""

from __future__ import annotations

from enum import IntEnum

import numpy as np


class Purpose(IntEnum):
    """The second word of every seed sequence: which use the random numbers are for."""

    PARTITION = 0
    SUBSAMPLE = 1
    SPLIT = 2
    NOISY_SILOS = 3
    LABEL_NOISE = 4


def rng_for(seed: int, purpose: Purpose, *more: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, int(purpose), *more]))
