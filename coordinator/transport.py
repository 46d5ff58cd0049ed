"""How tasks reach silos. The engine hands a transport encoded task messages and a deadline and
gets back each encoded result as it arrives, until all came or the deadline passed, so it checks
and sums one reply while the other silos still work; strategies never see the transport.

`InProcessTransport` calls the silos' endpoints (bytes in, bytes out) on at most `max_parallel`
daemon worker threads, kept from one dispatch to the next, so a silo that hangs costs only its
own deadline (and, for as long as it hangs, its worker) and never blocks the process from
exiting. The workers live as long as the transport: a thread started per task would also start
its own OpenMP team in torch, whose threads, busy-waiting after each call, took the CPU from the
engine's aggregation (bench/engine_overhead.py). Messages are encoded exactly as on the
network, so the in-process path exercises the same contract as the gRPC one; a task reaches
its endpoint as the payload's parts (the silo reads the model in place), not joined into one
more copy of the model per silo, and an answer comes back as its parts too (the header, then
the memory of the answer's own tensors, which the engine reads in place).
"""

from __future__ import annotations

import queue
import threading
import time
import weakref
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Protocol

from fedsilo.wire.messages import SiloEndpoint
from fedsilo.wire.payload import AnyPayload, as_payload


@dataclass(frozen=True)
class Delivery:
    """A task for one silo, already encoded."""

    silo: str
    task_id: str
    payload: AnyPayload
    round: int


@dataclass(frozen=True)
class Reply:
    """What came back for one task: the encoded result, or why nothing usable came back."""

    silo: str
    task_id: str
    payload: AnyPayload | None
    failure: str | None = None


class Transport(Protocol):
    def silos(self) -> list[str]: ...

    def dispatch(self, deliveries: Iterable[Delivery], deadline: float) -> Iterator[Reply]:
        """Deliver every task; yield each reply as it arrives, until every task has one or
        `deadline` (time.monotonic) passed. A silo that yields nothing did not reply in time.

        `deliveries` is consumed once and not kept: the engine encodes each task as it is
        handed over, so no transport holds a phase's encoded tasks longer than it must."""
        ...

    def close(self) -> None: ...


def replies_until(replies: queue.Queue[Reply], expected: int, deadline: float) -> Iterator[Reply]:
    """The replies that arrive on `replies`, as they arrive, until `expected` came or
    `deadline` passed."""
    for _ in range(expected):
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return
        try:
            yield replies.get(timeout=remaining)
        except queue.Empty:
            return


class InProcessTransport:
    def __init__(self, endpoints: Mapping[str, SiloEndpoint], max_parallel: int = 4) -> None:
        if max_parallel < 1:
            raise ValueError("max_parallel must be >= 1")
        self._endpoints = dict(endpoints)
        self._max_parallel = max_parallel
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._workers: list[threading.Thread] = []
        # workers hold the job queue, not the transport: one dropped unclosed still stops them
        weakref.finalize(self, _stop, self._jobs, self._workers)

    def silos(self) -> list[str]:
        return list(self._endpoints)

    def dispatch(self, deliveries: Iterable[Delivery], deadline: float) -> Iterator[Reply]:
        replies: queue.Queue[Reply] = queue.Queue()
        expected = 0
        for delivery in deliveries:
            expected += 1
            endpoint = self._endpoints.get(delivery.silo)
            if endpoint is None:
                replies.put(Reply(delivery.silo, delivery.task_id, None, "unknown silo"))
                continue
            if len(self._workers) < self._max_parallel:
                worker = threading.Thread(
                    target=_work, args=(self._jobs,), name="silo-worker", daemon=True
                )
                worker.start()
                self._workers.append(worker)
            self._jobs.put((endpoint, delivery, replies))
        yield from replies_until(replies, expected, deadline)

    def close(self) -> None:
        self._endpoints.clear()
        _stop(self._jobs, self._workers)


_Job = tuple[SiloEndpoint, Delivery, "queue.Queue[Reply]"]


def _work(jobs: queue.SimpleQueue[_Job | None]) -> None:
    """A worker: call each job's endpoint and queue its reply, until told to stop (None)."""
    while (job := jobs.get()) is not None:
        endpoint, delivery, replies = job
        try:
            payload = endpoint(delivery.payload)  # parts in, parts out: nothing joined
        except Exception as exc:  # a silo's crash is that silo's dropout, not ours
            replies.put(Reply(delivery.silo, delivery.task_id, None, f"silo crashed: {exc!r}"))
            continue
        replies.put(Reply(delivery.silo, delivery.task_id, as_payload(payload)))


def _stop(jobs: queue.SimpleQueue[_Job | None], workers: list[threading.Thread]) -> None:
    """Tell every worker to stop once the jobs queued before are done."""
    for _ in workers:
        jobs.put(None)
    workers.clear()
