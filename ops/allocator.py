"""How a service process's C allocator gives memory back: kept for reuse, not returned at once.

A round allocates and frees the same few megabytes again and again: gRPC's message buffers, the
frames of each message, the received payload, the running mean. glibc's malloc serves them from
its arenas, and at each free it returns the memory above a small margin to the kernel (a
thread's arena gives back whole heaps), so the next round's buffers are fresh pages, each one
faulted in and zeroed by the kernel again. Measured on 2 cores at 1e6 parameters x 3 silos
(bench/transport.py's workload): 18,700 page faults a round at the coordinator, 73 MB of fresh
pages, and half its CPU (68 of 147 ms a round across all processes); with a 256 MiB margin
(`M_TOP_PAD`) the faults fall to about 50 a round and the coordinator's CPU to 33 ms. The cost
is memory kept for reuse: the coordinator's resident size was 313 MiB, and 399 MiB with the
margin and two arenas (`M_ARENA_MAX`, which bounds how many arenas keep a margin; one more
arena than the main one serves gRPC's threads as fast as the default eight per core did).
A buffer larger than the margin still comes from, and goes back to, the kernel directly, so a
model of 1e8 parameters is not held twice.

The `fedsilo` services (`coordinator start`, `coordinator serve`, `silo start`) call
`keep_freed_memory` once at start. glibc only (`mallopt`); elsewhere nothing changes. An
operator's own `MALLOC_*` environment or `GLIBC_TUNABLES` is kept.
"""

from __future__ import annotations

import ctypes
import os
import platform

M_TOP_PAD = -2  # glibc's <malloc.h>
M_ARENA_MAX = -8
TOP_PAD_BYTES = 256 << 20
ARENA_MAX = 2


def keep_freed_memory() -> bool:
    """Set the margin and the arena count; whether they were set."""
    if platform.libc_ver()[0] != "glibc" or _operator_tuned():
        return False
    mallopt = ctypes.CDLL(None).mallopt
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(M_TOP_PAD, TOP_PAD_BYTES)) and bool(mallopt(M_ARENA_MAX, ARENA_MAX))


def _operator_tuned() -> bool:
    return "GLIBC_TUNABLES" in os.environ or any(name.startswith("MALLOC_") for name in os.environ)
