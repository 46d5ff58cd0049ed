"""The transport of a real deployment: tasks wait in the hub for their silo's next long poll
over mTLS gRPC (coordinator/service.py), and results come back through the hub.

Strategies and the engine see the same `Transport` interface as in-process; only the hub and
the network sit in between.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Iterable, Iterator

from fedsilo.coordinator.hub import PostedTask, SiloHub
from fedsilo.coordinator.transport import Delivery, Reply, replies_until


class GrpcTransport:
    def __init__(self, hub: SiloHub) -> None:
        self.hub = hub

    def silos(self) -> list[str]:
        return sorted(self.hub.accepted)

    def dispatch(self, deliveries: Iterable[Delivery], deadline: float) -> Iterator[Reply]:
        replies: queue.Queue[Reply] = queue.Queue()
        task_ids = self._post(deliveries, replies, time.time() + deadline - time.monotonic())
        try:
            yield from replies_until(replies, len(task_ids), deadline)
        finally:
            self.hub.withdraw(task_ids)

    def _post(
        self, deliveries: Iterable[Delivery], replies: queue.Queue[Reply], until: float
    ) -> set[str]:
        """Queue every task in the hub (a revoked or absent silo's task fails at once). Apart so
        that no local variable keeps a posted payload alive once its silo has taken it."""
        task_ids: set[str] = set()
        for delivery in deliveries:
            task_ids.add(delivery.task_id)
            self.hub.post(
                PostedTask(
                    delivery.silo, delivery.task_id, delivery.round, delivery.payload, until
                ),
                replies,
            )
        return task_ids

    def close(self) -> None:
        self.hub.finish()
