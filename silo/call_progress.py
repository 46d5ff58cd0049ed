"""A silo's exchange ends when it stops moving, not at a fixed time.

A fixed deadline on one exchange (the silo's result up, the coordinator's next task down) fails
every time where the task is a large model and the link is narrow: a 1e8-parameter model takes
32 s to cross a 100 Mbit/s link alone, and three times that while two other silos download
theirs. The reply, and the task in it, would be lost at each retry. Here an exchange has no
deadline of its own; it is cancelled once no frame has moved either way for `idle_s` (the long
poll and a margin, `ChannelSettings.call_timeout_s`), which still ends a call to a coordinator
that hangs or a connection that died without a word. The cancelled call raises `StalledCall`,
which the agent retries as it does a deadline.

One daemon thread per process (`WATCHDOG`) looks at the exchanges in flight twice a second.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Protocol, TypeVar

import grpc

T = TypeVar("T")
CHECK_EVERY_S = 0.5


class Cancellable(Protocol):
    def cancel(self) -> bool: ...


class StalledCall(grpc.RpcError):
    """An exchange in which nothing moved for `idle_s`: retried like a deadline."""

    def __init__(self, idle_s: float) -> None:
        super().__init__(f"no frame moved for {idle_s:.0f}s")
        self.idle_s = idle_s

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.DEADLINE_EXCEEDED

    def details(self) -> str:
        return f"no frame moved either way for {self.idle_s:.0f}s"


class CallProgress:
    """One exchange's progress: pass its request and reply frames through `moving`."""

    def __init__(self, idle_s: float) -> None:
        self.idle_s = idle_s
        self.moved_at = time.monotonic()
        self.stalled = False
        self.call: Cancellable | None = None

    def moving(self, frames: Iterable[T]) -> Iterator[T]:
        for frame in frames:
            self.moved_at = time.monotonic()
            yield frame
            self.moved_at = time.monotonic()

    def check(self, now: float) -> None:
        if self.call is not None and not self.stalled and now - self.moved_at > self.idle_s:
            self.stalled = True
            self.call.cancel()


class Watchdog:
    """Cancels each watched exchange that stalls."""

    def __init__(self) -> None:
        self._watched: set[CallProgress] = set()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def watch(self, progress: CallProgress) -> None:
        with self._lock:
            self._watched.add(progress)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="call-watchdog", daemon=True)
                self._thread.start()

    def forget(self, progress: CallProgress) -> None:
        with self._lock:
            self._watched.discard(progress)

    def _run(self) -> None:
        while True:
            time.sleep(CHECK_EVERY_S)
            with self._lock:
                watched = list(self._watched)
            now = time.monotonic()
            for progress in watched:
                progress.check(now)


WATCHDOG = Watchdog()


def watched_reply(start: Callable[[CallProgress], Iterable[T]], idle_s: float) -> Iterator[T]:
    """The reply frames of the call `start(progress)` makes (its request passed through
    `progress.moving`), cancelled once nothing moves for `idle_s` (`StalledCall`)."""
    progress = CallProgress(idle_s)
    call = start(progress)
    progress.call = call  # type: ignore[assignment]
    WATCHDOG.watch(progress)
    try:
        yield from progress.moving(call)
    except grpc.RpcError as exc:
        if progress.stalled and exc.code() == grpc.StatusCode.CANCELLED:
            raise StalledCall(idle_s) from None
        raise
    finally:
        WATCHDOG.forget(progress)
