"""Every random choice derives from (experiment seed, round, phase, purpose, silo), so a run
can be replayed exactly and one choice never shifts another's stream."""

from __future__ import annotations

import hashlib

import numpy as np


def derive_seed(seed: int, *parts: int | str) -> int:
    """A 63-bit seed determined by `seed` and the labelled `parts`."""
    text = "/".join([str(seed), *(str(p) for p in parts)])
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(), "little") >> 1


def derive_rng(seed: int, *parts: int | str) -> np.random.Generator:
    return np.random.default_rng(derive_seed(seed, *parts))
