"""The in-process transport: tasks run on at most `max_parallel` worker threads, kept from one
dispatch to the next, and a silo that hangs costs only its own deadline."""

from __future__ import annotations

import threading
import time

from fedsilo.coordinator.transport import Delivery, InProcessTransport
from fedsilo.wire.payload import Payload


def deliveries(*silos: str) -> list[Delivery]:
    return [Delivery(silo, f"task-{silo}", Payload([silo.encode()]), 1) for silo in silos]


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
        replies = transport.dispatch(deliveries("a", "b", "c"), time.monotonic() + 0.5)
        assert sorted(replies) == ["a", "c"]  # b did not answer in time
        assert replies["c"].payload is not None and replies["c"].payload.to_bytes() == b"c"
        for _ in range(3):  # b still hangs on its worker: the other one serves a and c
            replies = transport.dispatch(deliveries("a", "c", "x"), time.monotonic() + 10)
            assert sorted(replies) == ["a", "c", "x"]
            assert replies["x"].failure == "unknown silo"
        assert len(threads) <= 2  # the same two workers, dispatch after dispatch
    finally:
        release.set()
        transport.close()
