"""glibc's malloc policy for fedsilo's processes: keep the memory a round frees for the next one.

A round allocates and frees the same buffers again and again. In a service: gRPC's message
buffers, each message's frames, the received payload, the running mean. In a simulation: every
silo's task, answer and the running sum, in one process. glibc's malloc returns freed memory to
the kernel at each free beyond small margins (it unmaps large buffers, trims its heap's top,
and deletes a thread arena's whole heaps), so the next round's buffers are fresh pages, each
faulted in and zeroed by the kernel again.

- `keep_service_buffers`, for `coordinator start`, `coordinator serve` and `silo start`
  (ops/cli_support.py `start_service`): a margin of `SERVICE_PAD_BYTES` kept at the top of each
  arena (`M_TOP_PAD`), which serves a round's buffers from memory already faulted in, and two
  arenas (`M_ARENA_MAX`) so that at most two keep one. Measured at 1e6 parameters x 3 silos on
  2 cores (bench/transport.py's workload): the coordinator's page faults fell from 18,700 a
  round (73 MB of fresh pages) to about 50, its CPU from 68 to 34 ms a round (it was 114-119 ms
  before its frames stopped going through protobuf objects, wire/framing.py), and the round from
  94 to 75 ms; its resident size rose from 313 to 390 MiB. At 1e7 x 3 its CPU fell from 691 to
  414 ms a round and its peak resident size rose from 478 to 578 MiB: the margin is
  memory kept for reuse, bounded by the margin, not by the model. A buffer larger than what the
  margin holds is still mapped and unmapped directly. `give_back_freed_memory` returns it all
  between jobs (`coordinator serve`).
- `make_room_for`, the coordinator's round engine's hook before it allocates a round's mean: a
  mean larger than the margin is mapped directly, not served from what the arenas keep, so what
  they keep would only add to the round's peak, and it is given back first. At 1e8 parameters
  x 3 silos (400 MB means) the coordinator's peak fell from 3.04-3.07x the model to 2.81x (3
  runs each, alternating), with no change in its CPU a round that the runs resolve. It is cheap
  because the mean reads and sums its slices in buffers kept from slice to slice
  (coordinator/running_mean.py): once the heap's top is given back, glibc maps afresh every
  buffer of 128 KiB or more that the top cannot serve (the margin's `mallopt` fixes that
  threshold), so a fresh buffer per slice was fresh pages per slice, five times a run's faults.
- `keep_freed_memory`, for `fedsilo simulate`: buffers up to `KEPT_BUFFER_BYTES` from the heap
  and up to `KEPT_FREE_BYTES` of freed memory kept: with a 1M-parameter model and 10 silos
  (bench/engine_overhead.py, alternating runs) the engine's time per round fell from 21-33 ms to
  14-20 ms.

All are no-ops where the C library is not glibc, and where the operator set glibc's malloc
themselves (`MALLOC_*` or `GLIBC_TUNABLES` in the environment, which glibc has already read).
They change how memory is laid out, never what is computed.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

log = logging.getLogger("fedsilo")

M_TRIM_THRESHOLD = -1  # glibc's mallopt parameter numbers (<malloc.h>)
M_TOP_PAD = -2
M_MMAP_THRESHOLD = -3
M_ARENA_MAX = -8
SERVICE_PAD_BYTES = 256 << 20
SERVICE_ARENAS = 2
KEPT_BUFFER_BYTES = 32 << 20
KEPT_FREE_BYTES = 128 << 20


def keep_service_buffers() -> bool:
    """A service's margin and arenas (see the module docstring); True when they took effect."""
    return _mallopt({M_TOP_PAD: SERVICE_PAD_BYTES, M_ARENA_MAX: SERVICE_ARENAS})


def give_back_freed_memory() -> bool:
    """Return every arena's free memory to the kernel now (a job ended); True when glibc did."""
    libc = _glibc()
    return libc is not None and bool(libc.malloc_trim(0))


def make_room_for(nbytes: int) -> bool:
    """Before allocating `nbytes`: give back the arenas' free memory when the margin could not
    serve them anyway (see the module docstring); True when it was given back."""
    return nbytes > SERVICE_PAD_BYTES and give_back_freed_memory()


def keep_freed_memory() -> bool:
    """Keep freed buffers of a simulation's round for the next one; True when it took effect."""
    return _mallopt({M_MMAP_THRESHOLD: KEPT_BUFFER_BYTES, M_TRIM_THRESHOLD: KEPT_FREE_BYTES})


def _mallopt(settings: dict[int, int]) -> bool:
    libc = _glibc()
    if libc is None or _set_by_the_operator():
        return False
    done = all(bool(libc.mallopt(parameter, value)) for parameter, value in settings.items())
    log.debug("malloc options %s set: %s", settings, done)
    return done


@functools.cache
def _glibc() -> ctypes.CDLL | None:
    """This process's C library where it is glibc (`libc_ver` scans the interpreter's binary:
    once is enough)."""
    return ctypes.CDLL(None) if platform.libc_ver()[0] == "glibc" else None


def _set_by_the_operator() -> bool:
    return "GLIBC_TUNABLES" in os.environ or any(name.startswith("MALLOC_") for name in os.environ)
