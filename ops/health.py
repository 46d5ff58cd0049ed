"""Liveness and readiness of a running service, for container health checks and Kubernetes
probes, without opening a port: a silo agent connects out only.

A running coordinator (`coordinator serve`) or silo agent (`silo start`) given a health file
(`--health-file`, or the environment's FEDSILO_HEALTH_FILE, which the container image sets)
rewrites it every `EVERY_S` seconds from a thread of its own, atomically: its role, its process
id, when it wrote, and when it was last ready. Ready means, for the coordinator, its gRPC server
is serving; for a silo agent, the coordinator answered its last heartbeat. `fedsilo-health`
reads the file: alive when it was written within `--max-age` seconds (the process runs), ready
(`--ready`) when it was also ready within that time.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import click

from fedsilo.wire.durable import write_atomically

ENVIRONMENT = "FEDSILO_HEALTH_FILE"
EVERY_S = 5.0
DEFAULT_MAX_AGE_S = 60.0


class HealthError(ValueError):
    """The service is not alive, or not ready: the message says which and since when."""


@dataclass(frozen=True)
class Health:
    role: str
    pid: int
    written_at: float
    ready_at: float | None

    def check(self, now: float, max_age_s: float, ready: bool) -> str:
        """One line saying the service is alive (and ready, if asked); HealthError otherwise."""
        age = now - self.written_at
        if age > max_age_s:
            raise HealthError(
                f"{self.role} (pid {self.pid}) last wrote its health {age:.0f} s ago "
                f"(more than {max_age_s:.0f} s): it is stopped or stuck"
            )
        line = f"{self.role} alive (pid {self.pid}, written {age:.0f} s ago)"
        if not ready:
            return line
        if self.ready_at is None or now - self.ready_at > max_age_s:
            since = "never" if self.ready_at is None else f"{now - self.ready_at:.0f} s ago"
            raise HealthError(f"{line}, but not ready: {_READY[self.role]} (last: {since})")
        return line + ", ready"


_READY = {
    "coordinator": "its gRPC server is not serving",
    "silo": "the coordinator has not answered its heartbeats",
}


def read_health(path: Path) -> Health:
    """The health file at `path`; HealthError when there is none or it is not one."""
    try:
        document = json.loads(path.read_text())
        return Health(
            role=str(document["role"]),
            pid=int(document["pid"]),
            written_at=float(document["written_at"]),
            ready_at=None if document["ready_at"] is None else float(document["ready_at"]),
        )
    except FileNotFoundError:
        raise HealthError(
            f"no health file at {path}: the service has not started yet, or it writes its "
            f"health elsewhere (--health-file, {ENVIRONMENT})"
        ) from None
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise HealthError(f"{path}: not a fedsilo health file ({exc})") from None


class HealthFile:
    """Rewrites `path` every EVERY_S seconds until `stop()`; `ready_at()` says when the service
    was last ready (None: not yet)."""

    def __init__(self, path: Path, role: str, ready_at: Callable[[], float | None]) -> None:
        if role not in _READY:
            raise ValueError(f"role {role!r} is not one of {sorted(_READY)}")
        self.path = path
        self.role = role
        self.ready_at = ready_at
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True, name="health")

    def start(self) -> HealthFile:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write()  # at once: a health check made right after the start reads it
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        self._thread.join(timeout=EVERY_S + 1)

    def write(self) -> None:
        document = {
            "role": self.role,
            "pid": os.getpid(),
            "written_at": time.time(),
            "ready_at": self.ready_at(),
        }
        write_atomically(self.path, [json.dumps(document).encode()], power_loss=False)

    def _run(self) -> None:
        while not self._stopped.wait(EVERY_S):
            try:
                self.write()
            except OSError:  # a full or vanished volume: the health check then says stale
                continue


@click.command("fedsilo-health")
@click.option(
    "--file",
    "path",
    type=click.Path(path_type=Path),
    envvar=ENVIRONMENT,
    required=True,
    help=f"The service's health file (default: ${ENVIRONMENT}, set in the container image).",
)
@click.option(
    "--max-age",
    "max_age_s",
    type=click.FloatRange(min=1),
    default=DEFAULT_MAX_AGE_S,
    show_default=True,
    help="Seconds within which the service must have written (and, with --ready, been ready).",
)
@click.option(
    "--ready",
    is_flag=True,
    help="Also require readiness: the coordinator serving, or a silo heard by its coordinator.",
)
def main(path: Path, max_age_s: float, ready: bool) -> None:
    """Exit 0 when the coordinator or silo agent writing FILE is alive (and ready, with
    --ready); otherwise say why and exit 1. A command of its own, so that a health check every
    few seconds does not load the whole fedsilo CLI (torch)."""
    try:
        click.echo(read_health(path).check(time.time(), max_age_s, ready))
    except HealthError as exc:
        raise click.ClickException(str(exc)) from None
