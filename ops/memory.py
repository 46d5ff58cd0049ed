"""glibc's malloc policy for fedsilo's processes: give freed memory back, or keep it.

glibc's malloc serves allocations below its mmap threshold from per-thread arenas and raises
that threshold dynamically after large frees; a coordinator that streams models as 1 MiB frames
on many gRPC threads then keeps every arena's high-water mark resident, round after round.
`return_freed_memory` fixes the threshold low (so chunk-sized buffers are mapped and unmapped)
and keeps the coordinator service's resident memory at what the round needs.

A simulation is the other way round: every silo lives in the one process and each round
allocates and frees the same model-sized buffers (tasks, answers, the running sum), which glibc
unmaps or trims off its heap's top, so the next round faults the same pages in again, zeroed.
`keep_freed_memory` serves buffers up to `KEPT_BUFFER_BYTES` from the heap and keeps up to
`KEPT_FREE_BYTES` of freed memory for reuse: with a 1M-parameter model and 10 silos
(bench/engine_overhead.py, alternating runs) the engine's time per round fell from 21-33 ms to
14-20 ms.
Larger buffers (a model of 8M parameters and more) are still mapped and given back.

Both are no-ops where the C library is not glibc, and change how memory is laid out, never
what is computed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("fedsilo")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD_BYTES = 256 << 10
KEPT_BUFFER_BYTES = 32 << 20
KEPT_FREE_BYTES = 128 << 20


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold low; True when it took effect."""
    return _mallopt({M_MMAP_THRESHOLD: MMAP_THRESHOLD_BYTES})


def keep_freed_memory() -> bool:
    """Keep freed buffers of a simulation's round for the next one; True when it took effect."""
    return _mallopt({M_MMAP_THRESHOLD: KEPT_BUFFER_BYTES, M_TRIM_THRESHOLD: KEPT_FREE_BYTES})


def _mallopt(settings: dict[int, int]) -> bool:
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        mallopt = ctypes.CDLL(name).mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    done = all(bool(mallopt(parameter, value)) for parameter, value in settings.items())
    log.debug("malloc options %s set: %s", settings, done)
    return done
