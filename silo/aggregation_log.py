"""Which steps of which secure aggregations this silo has taken part in, kept where a restart
does not lose them: a silo advertises keys for, confirms, unmasks and decrypts at most one
aggregation per (job, deployment, round, phase), whatever tasks a coordinator sends later (a
second aggregation of the same round over other silos would reveal one silo's update as the
difference of two sums). The job is the digest of the signed policy the silo accepted: only
the operator's signature makes a new one, never the coordinator.

The log is one JSON file in the silo's state folder for the deployment (`aggregations.json`),
replaced atomically and fsynced (wire/durable.py) when a step is claimed, which is before
the step's answer is made, let alone sent. Without a state folder (simulations) it lives in
memory, as long as the agent.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from fedsilo.wire.durable import make_private_folder, write_atomically

if TYPE_CHECKING:  # the task handlers that claim steps import this module
    from fedsilo.silo.tasks.base import SiloContext

FILE = "aggregations.json"


class StepAlreadyTaken(ValueError):
    """A step of an aggregation this silo already took part in."""


class AggregationLog:
    """The (job, aggregation label, step) triples claimed so far, on disk under `folder` or in
    memory."""

    def __init__(self, folder: Path | None, job: str = "") -> None:
        self.path = None if folder is None else Path(folder) / FILE
        self.job = job
        self._lock = threading.Lock()
        self._claimed: set[str] = set()
        if self.path is not None and self.path.exists():
            try:
                self._claimed = set(json.loads(self.path.read_text())["claimed"])
            except (ValueError, KeyError, TypeError) as exc:
                raise ValueError(
                    f"{self.path} is not this silo's aggregation log ({exc}); it holds which "
                    "secure aggregations the silo took part in: restore it rather than delete it"
                ) from None

    def claim(self, label: bytes, step: str) -> None:
        """Record that this silo takes `step` of aggregation `label`, durably; raise
        `StepAlreadyTaken` when it did so before."""
        entry = f"{self.job}|{label.decode()}|{step}"
        with self._lock:
            if entry in self._claimed:
                raise StepAlreadyTaken(
                    f"this silo already took the {step} step of aggregation {label.decode()!r}; "
                    "a second one for the same job, deployment, round and phase is refused"
                )
            claimed = self._claimed | {entry}
            if self.path is not None:
                make_private_folder(self.path.parent)
                document = json.dumps({"claimed": sorted(claimed)}, indent=0).encode()
                write_atomically(self.path, [document])
            self._claimed = claimed

    def choose(self, label: bytes, choice: str) -> None:
        """Record, durably, that this silo took `choice` (one position of a kind it takes once
        per round, e.g. one cyclic visit) for `label`: the same choice again is no second one;
        another raises `StepAlreadyTaken`."""
        prefix = f"{self.job}|{label.decode()}|"
        with self._lock:
            taken = {e.removeprefix(prefix) for e in self._claimed if e.startswith(prefix)}
        if taken - {choice}:
            raise StepAlreadyTaken(
                f"this silo took {sorted(taken)[0]!r} of {label.decode()!r} already; it takes "
                "one such position a round"
            )
        if not taken:
            self.claim(label, choice)

    def last_round(self, deployment: str, phase: str, step: str) -> int | None:
        """The latest round of `deployment` whose aggregation of `phase` this silo took `step`
        of, in this job; None when it took none."""
        entry = re.compile(
            re.escape(f"{self.job}|{deployment}/r") + r"(\d+)" + re.escape(f"/{phase}|{step}")
        )
        with self._lock:
            rounds = [int(m[1]) for e in self._claimed if (m := entry.fullmatch(e))]
        return max(rounds, default=None)


def aggregation_log(ctx: SiloContext) -> AggregationLog:
    """The silo's log, read from its state folder the first time it is needed."""
    if ctx.store.aggregation_log is None:
        ctx.store.aggregation_log = AggregationLog(ctx.state.folder, ctx.job)
    return ctx.store.aggregation_log
