"""A service keeps the memory it frees for its next buffers, instead of faulting fresh pages in
at every round, and gives it back when a job ends (ops/memory.py); an operator's own malloc
settings win."""

from __future__ import annotations

import platform
import subprocess
import sys
from collections.abc import Iterator

import pytest

from fedsilo.ops import memory

ROUNDS = 50
ROUND_PAGES = 8 * (1 << 20) // 4096  # each round allocates and frees 8 MiB, as 8 x 1 MiB

CHURN = f"""
import resource, sys, threading
from fedsilo.ops.memory import keep_service_buffers
print(keep_service_buffers())
def rounds():
    for _ in range({ROUNDS}):
        buffers = [bytes(1 << 20) for _ in range(8)]  # zeroed, so every page is touched
        del buffers
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
worker = threading.Thread(target=rounds)  # a thread of its own, as gRPC's handlers are
worker.start()
worker.join()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before)
"""

glibc_only = pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")


def churn(env: dict[str, str] | None = None) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", CHURN], capture_output=True, text=True, check=True, env=env
    ).stdout.split()
    return out[0], int(out[1])


@glibc_only
def test_a_service_faults_in_its_round_buffers_once_not_every_round() -> None:
    applied, faults = churn()
    assert applied == "True"
    assert faults < 2 * ROUND_PAGES  # the first round's pages, not ROUNDS x ROUND_PAGES


@glibc_only
@pytest.mark.parametrize("setting", ["MALLOC_TOP_PAD_", "MALLOC_ARENA_MAX", "GLIBC_TUNABLES"])
def test_an_operators_own_allocator_setting_is_kept(
    setting: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv(setting, "glibc.malloc.arena_max=4" if setting == "GLIBC_TUNABLES" else "4")
    assert memory.keep_service_buffers() is False
    assert memory.keep_freed_memory() is False


@pytest.fixture
def not_glibc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A C library other than glibc (the module looks once, so it is asked afresh here)."""
    monkeypatch.setattr(memory.platform, "libc_ver", lambda: ("", ""))
    memory._glibc.cache_clear()
    yield
    memory._glibc.cache_clear()


@pytest.mark.usefixtures("not_glibc")
def test_elsewhere_than_glibc_nothing_is_set() -> None:
    assert memory.keep_service_buffers() is False
    assert memory.give_back_freed_memory() is False


KEPT = """
import psutil
from fedsilo.ops.memory import SERVICE_PAD_BYTES, keep_service_buffers, make_room_for
keep_service_buffers()
buffers = [bytes(64 << 10) for _ in range(1024)]  # 64 MiB below glibc's mmap threshold: heap
del buffers  # freed, and kept by the margin
kept = psutil.Process().memory_info().rss
for size in (SERVICE_PAD_BYTES, SERVICE_PAD_BYTES + 1):
    print(make_room_for(size), kept - psutil.Process().memory_info().rss)
"""


@glibc_only
def test_memory_kept_for_reuse_is_given_back_before_a_buffer_the_margin_cannot_serve() -> None:
    out = subprocess.run(
        [sys.executable, "-c", KEPT], capture_output=True, text=True, check=True
    ).stdout.split()
    served_by_the_margin, larger = out[:2], out[2:]
    assert served_by_the_margin[0] == "False"
    assert int(served_by_the_margin[1]) < 8 << 20  # kept
    assert larger[0] == "True"
    assert int(larger[1]) > 48 << 20  # most of the 64 MiB given back


@glibc_only
def test_freed_memory_is_given_back_when_asked() -> None:
    assert memory.give_back_freed_memory() is True
