"""The transport of a real deployment: tasks wait in the hub for their silo's next long poll
over mTLS gRPC (coordinator/service.py), and results come back through the hub.

Strategies and the engine see the same `Transport` interface as in-process; only the hub and
the network sit in between.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Sequence

from fedsilo.coordinator.hub import PostedTask, SiloHub
from fedsilo.coordinator.transport import Delivery, Reply


class GrpcTransport:
    def __init__(self, hub: SiloHub) -> None:
        self.hub = hub

    def silos(self) -> list[str]:
        return sorted(self.hub.accepted)

    def dispatch(self, deliveries: Sequence[Delivery], deadline: float) -> dict[str, Reply]:
        replies: queue.Queue[Reply] = queue.Queue()
        received: dict[str, Reply] = {}
        for delivery in deliveries:  # a revoked or absent silo's task fails at once
            posted = PostedTask(delivery.silo, delivery.task_id, delivery.round, delivery.payload)
            self.hub.post(posted, replies)
        try:
            while len(received) < len(deliveries):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                try:
                    reply = replies.get(timeout=remaining)
                except queue.Empty:
                    break
                received[reply.silo] = reply
        finally:
            self.hub.withdraw({d.task_id for d in deliveries})
        return received

    def close(self) -> None:
        self.hub.finish()
