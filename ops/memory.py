"""Handing freed memory back to the operating system in long-running services.

glibc's malloc serves allocations below its mmap threshold from per-thread arenas and raises
that threshold dynamically after large frees; a coordinator that streams models as 1 MiB frames
on many gRPC threads then keeps every arena's high-water mark resident, round after round.
Fixing the threshold (so chunk-sized buffers are mapped and unmapped) keeps resident memory at
what the round needs. A no-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging

log = logging.getLogger("fedsilo")

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD_BYTES = 256 << 10


def return_freed_memory() -> bool:
    """Fix glibc's mmap threshold; True when it took effect."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc
        return False
    done = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    log.debug("malloc mmap threshold fixed at %d bytes: %s", MMAP_THRESHOLD_BYTES, done)
    return done
