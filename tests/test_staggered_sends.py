"""Staggered sends (coordinator/staggered_sends.py): a large message leaves only once the one
before it has, a small one never waits, and neither a stalled nor a cancelled send holds the
others back."""

from __future__ import annotations

import threading
from collections.abc import Iterator

from fedsilo.coordinator.staggered_sends import StaggeredSends

LARGE = 1 << 20


def _frames(name: str, log: list[str], count: int = 3) -> Iterator[bytes]:
    for i in range(count):
        log.append(f"{name}{i}")
        yield b"x"


def _send(sends: StaggeredSends, name: str, log: list[str], size: int = LARGE) -> threading.Thread:
    thread = threading.Thread(target=lambda: list(sends.frames(_frames(name, log), size)))
    thread.start()
    return thread


def test_a_large_message_leaves_only_after_the_large_one_holding_the_slot() -> None:
    sends, log = StaggeredSends(), []
    first = sends.frames(_frames("a", log), LARGE)
    next(first)  # a holds the slot, one frame out
    second = _send(sends, "b", log)
    second.join(timeout=0.3)
    assert second.is_alive() and log == ["a0"]  # b waits while a moves
    list(first)
    second.join()
    assert log == ["a0", "a1", "a2", "b0", "b1", "b2"]


def test_a_small_message_never_waits_for_the_slot() -> None:
    sends, log = StaggeredSends(), []
    first = sends.frames(_frames("a", log), LARGE)
    next(first)
    _send(sends, "c", log, size=100).join()
    assert log == ["a0", "c0", "c1", "c2"]
    list(first)


def test_a_send_that_stalls_lets_the_others_go_side_by_side() -> None:
    sends, log = StaggeredSends(stall_s=0.2), []
    stalled = sends.frames(_frames("a", log), LARGE)
    next(stalled)  # its silo stops reading: no next frame is asked for
    _send(sends, "b", log).join()
    assert log == ["a0", "b0", "b1", "b2"]
    list(stalled)


def test_a_cancelled_send_gives_the_slot_back() -> None:
    sends, log = StaggeredSends(), []
    cancelled = sends.frames(_frames("a", log), LARGE)
    next(cancelled)
    cancelled.close()  # what gRPC does to the generator of a call the silo cancelled
    _send(sends, "b", log).join()
    assert log == ["a0", "b0", "b1", "b2"]
