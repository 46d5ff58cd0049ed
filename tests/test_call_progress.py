"""A silo's exchange ends when it stops moving (silo/call_progress.py): a large reply that keeps
arriving is read to its end however long it takes, one whose frames stop is cancelled and
raised as a deadline the agent retries, and a call that fails for another reason fails as it
did."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import grpc
import pytest

from fedsilo.silo import call_progress
from fedsilo.silo.call_progress import StalledCall, watched_reply


class FakeCall:
    """A reply stream: `frames` frames, `every_s` apart, then (with `stall`) nothing until
    cancelled."""

    def __init__(self, frames: int, every_s: float, stall: bool = False) -> None:
        self.frames, self.every_s, self.stall = frames, every_s, stall
        self.cancelled = threading.Event()

    def cancel(self) -> bool:
        self.cancelled.set()
        return True

    def __iter__(self) -> Iterator[bytes]:
        for _ in range(self.frames):
            time.sleep(self.every_s)
            yield b"frame"
        if self.stall:
            self.cancelled.wait(timeout=30)
            raise Cancelled()


class Cancelled(grpc.RpcError):
    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.CANCELLED


@pytest.fixture(autouse=True)
def _quick_checks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(call_progress, "CHECK_EVERY_S", 0.05)


def test_a_reply_that_keeps_moving_is_read_to_its_end_past_the_idle_time() -> None:
    call = FakeCall(frames=12, every_s=0.05)  # 0.6 s in all, never 0.3 s without a frame
    assert len(list(watched_reply(lambda _: call, idle_s=0.3))) == 12
    assert not call.cancelled.is_set()


def test_a_reply_whose_frames_stop_is_cancelled_and_retried_as_a_deadline() -> None:
    call = FakeCall(frames=2, every_s=0.01, stall=True)
    with pytest.raises(StalledCall) as stalled:
        list(watched_reply(lambda _: call, idle_s=0.2))
    assert call.cancelled.is_set()
    assert stalled.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED


def test_the_request_frames_count_as_progress() -> None:
    seen = []

    def start(progress: call_progress.CallProgress) -> FakeCall:
        for _ in progress.moving(iter([b"a"] * 3)):
            seen.append(progress.moved_at)
        return FakeCall(frames=1, every_s=0.0)

    assert list(watched_reply(start, idle_s=1.0)) == [b"frame"]
    assert seen == sorted(seen) and len(seen) == 3


def test_a_call_that_fails_otherwise_fails_as_before() -> None:
    class Refused(grpc.RpcError):
        def code(self) -> grpc.StatusCode:
            return grpc.StatusCode.PERMISSION_DENIED

    def refused() -> Iterator[bytes]:
        raise Refused()
        yield b""  # a generator

    class Call:
        def cancel(self) -> bool:
            return True

        def __iter__(self) -> Iterator[bytes]:
            return refused()

    with pytest.raises(Refused):
        list(watched_reply(lambda _: Call(), idle_s=1.0))
