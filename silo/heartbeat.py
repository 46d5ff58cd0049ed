"""The silo agent's heartbeat: a thread that tells the coordinator, every few seconds, that the
agent is alive, also while it trains or prepares a job, so that a coordinator takes a silo gone
silent for its heartbeat window for a dropout at once instead of waiting for a phase deadline
(coordinator/hub.py).

Each heartbeat is one signed request over the agent's channel (`CoordinatorConnection.
exchange_once`), answered at once with how often the coordinator wants to hear from the silo
(`every_s`, a quarter of its window), which the thread follows from then on. A heartbeat that
fails (the coordinator is restarting, the network is down) is not retried: the next one is due
soon, and the agent's own requests carry the retries and the refusals.
"""

from __future__ import annotations

import logging
import threading
import time

import grpc

from fedsilo.silo.client import CoordinatorConnection
from fedsilo.wire.control import ACK, HEARTBEAT, decode_control
from fedsilo.wire.framing import MessageRejected

log = logging.getLogger("fedsilo.silo")

FIRST_INTERVAL_S = 1.0  # until the coordinator says how often it wants to hear
MIN_INTERVAL_S, MAX_INTERVAL_S = 0.25, 900.0
TIMEOUT_S = 10.0


class Heartbeat:
    """Beats on `connection` until `stop()` or the connection's stop event."""

    def __init__(self, connection: CoordinatorConnection) -> None:
        self.connection = connection
        self.interval_s = FIRST_INTERVAL_S
        self.answered_at: float | None = None  # when the coordinator last answered (time.time)
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="heartbeat")

    def start(self) -> Heartbeat:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=TIMEOUT_S + 1)

    def beat(self) -> None:
        """One heartbeat; adopt the interval the coordinator asks for."""
        reply = decode_control(
            self.connection.exchange_once(
                self.connection.control(HEARTBEAT), HEARTBEAT, 0, timeout_s=TIMEOUT_S
            )
        )
        self.answered_at = time.time()
        every_s = reply.get("every_s") if reply.type == ACK else None
        if isinstance(every_s, int | float):
            self.interval_s = min(max(float(every_s), MIN_INTERVAL_S), MAX_INTERVAL_S)

    def _run(self) -> None:
        while not (self._stopped.is_set() or self.connection.stop.is_set()):
            try:
                self.beat()
            except (grpc.RpcError, MessageRejected, ValueError) as exc:  # ValueError: WireError
                log.debug("heartbeat not answered: %s", exc)
            self._stopped.wait(self.interval_s)
