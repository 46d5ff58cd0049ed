"""The in-process transport: tasks run on at most `max_parallel` worker threads, kept from one
dispatch to the next, and a silo that hangs costs only its own deadline."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from fedsilo.coordinator.transport import Delivery, InProcessTransport, Reply
from fedsilo.wire.payload import Payload


def deliveries(*silos: str) -> list[Delivery]:
    return [Delivery(silo, f"task-{silo}", Payload([silo.encode()]), 1) for silo in silos]


def replies_by_silo(replies: Iterable[Reply]) -> dict[str, Reply]:
    return {reply.silo: reply for reply in replies}


def test_each_reply_comes_as_it_arrives_not_when_the_last_silo_answers() -> None:
    release = threading.Event()

    def slow(payload: bytes) -> bytes:
        release.wait(timeout=10)
        return payload

    transport = InProcessTransport({"quick": lambda payload: payload, "slow": slow})
    try:
        replies = transport.dispatch(deliveries("slow", "quick"), time.monotonic() + 10)
        assert next(replies).silo == "quick"  # while "slow" still works
        release.set()
        assert [reply.silo for reply in replies] == ["slow"]
    finally:
        release.set()
        transport.close()


def test_tasks_run_on_kept_workers_and_a_hung_silo_misses_only_its_own_deadline() -> None:
    release = threading.Event()
    threads: set[threading.Thread] = set()

    def echo(payload: bytes) -> bytes:
        threads.add(threading.current_thread())
        return payload

    def hung(payload: bytes) -> bytes:
        release.wait()
        return payload

    transport = InProcessTransport({"a": echo, "b": hung, "c": echo}, max_parallel=2)
    try:
        replies = replies_by_silo(
            transport.dispatch(deliveries("a", "b", "c"), time.monotonic() + 0.5)
        )
        assert sorted(replies) == ["a", "c"]  # b did not answer in time
        assert replies["c"].payload is not None and replies["c"].payload.to_bytes() == b"c"
        for _ in range(3):  # b still hangs on its worker: the other one serves a and c
            replies = replies_by_silo(
                transport.dispatch(deliveries("a", "c", "x"), time.monotonic() + 10)
            )
            assert sorted(replies) == ["a", "c", "x"]
            assert replies["x"].failure == "unknown silo"
        assert len(threads) <= 2  # the same two workers, dispatch after dispatch
    finally:
        release.set()
        transport.close()
