"""Torch's global random generator, which a network's own randomness draws from (nn.Dropout, a
plug-in's torch.rand in forward, the vectors spectral_norm starts from, a factory's default
initialisation): one user at a time in a process, seeded for the use and restored after it.

The silos of a simulation share one process, so without this their draws would interleave in
whatever order their threads ran, and two identical runs would differ. Each use seeds the
generator (and every CUDA device's) from what it is for alone (a training task's seed, a
build's seed) and holds the lock while it draws. The zoo's networks draw nothing from it
(models/zoo.py), so only a plug-in's training waits for it (silo/local_loop.py).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

_LOCK = threading.Lock()


@contextmanager
def seeded_global_rng(seed: int) -> Iterator[None]:
    """Torch's global generators (CPU, and each CUDA device) seeded with `seed` and held for
    the block; their states are restored after it."""
    devices = list(range(torch.cuda.device_count())) if torch.cuda.is_initialized() else []
    with _LOCK, torch.random.fork_rng(devices=devices):
        torch.manual_seed(seed)
        yield
