"""Deployments that take turns, one round each, for benchmarks that run several side by side in
one process (bench/secagg.py, and bench/flower_secagg_peer.py under Flower's interpreter, which
is why this module needs the standard library only)."""

from __future__ import annotations

import threading
from collections.abc import Callable


class Turns:
    """Deployments that take turns, one round each: round r of every method back to back, so
    that load from elsewhere on the machine falls on all of them alike. A deployment runs only
    while it is first in the queue; at the end of a round it goes to the back."""

    def __init__(self, names: list[str]) -> None:
        self._queue = list(names)
        self._changed = threading.Condition()

    def wait(self, name: str) -> None:
        with self._changed:
            self._changed.wait_for(lambda: self._queue[0] == name)

    def pass_on(self, name: str, finished: bool = False) -> None:
        with self._changed:
            self._queue.remove(name)
            if not finished:
                self._queue.append(name)
            self._changed.notify_all()


def take_turns(names: list[str], run: Callable[[str, Turns], None], prefix: str) -> None:
    """`run(name, turns)` for every name, each in its own thread (named `prefix-name`), taking
    turns from its first round: the first error of any of them is raised here."""
    turns = Turns(names)
    errors: list[BaseException] = []

    def go(name: str) -> None:
        try:
            turns.wait(name)
            run(name, turns)
        except BaseException as exc:  # re-raised in the calling thread
            errors.append(exc)
        finally:
            turns.pass_on(name, finished=True)

    threads = [threading.Thread(target=go, args=(n,), name=f"{prefix}-{n}") for n in names]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
