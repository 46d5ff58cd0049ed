"""Shaped links on one machine: a star of Linux network namespaces for bench/links.py.

The coordinator and each silo get a namespace of their own, each joined by a veth pair to a
bridge in a hub namespace, and every link is shaped with a token bucket (`tc qdisc ... tbf`) on
both of its ends, so each direction of each link carries at most `rate_mbit`. The coordinator's
link is the busiest, as a hospital consortium's is: it carries every silo's model down and every
update up. No delay is added (the kernel's netem module is not on every machine); round trips
on veth are tens of microseconds, and bench/links.py accounts them from the protocol's message
count instead.

Clean-up never depends on the bench ending well:
- `shaped_star` deletes its namespaces (and kills what still runs in them) on the way out;
- a reaper process, started before the first namespace, holds a pipe from the bench and deletes
  them when that pipe closes, which is also when the bench is killed (SIGKILL included);
- every start first deletes the namespaces of earlier runs whose process is gone.

Namespaces are named `fsl<pid>-<role>`, the pid being the bench's. Requires root, `ip` and `tc`
(iproute2); `link_problem` says why a machine cannot run it, in one sentence.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager, suppress
from dataclasses import dataclass

PREFIX = "fsl"
SUBNET = "10.77.0"
COORDINATOR_HOST = 1
# A token bucket holds at least one full-size segment of a veth's offloads (64 KiB) and a
# timer tick's worth of bytes at its rate (HZ is 100 to 1000), so it never throttles below it.
MIN_BURST_BYTES = 256 << 10
QUEUE_LATENCY_MS = 100


class LinkSetupFailed(RuntimeError):
    """A namespace, veth or qdisc could not be made; the message has the command and its error."""


def link_problem() -> str | None:
    """Why this machine cannot make shaped links (not root, no iproute2); None: it can."""
    if os.geteuid() != 0:
        return (
            "the link bench makes network namespaces and shapes their links with tc, which "
            "needs root: run it as root (sudo python -m bench.links ...)"
        )
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        return f"the link bench needs iproute2's {' and '.join(missing)} on the PATH"
    return None


@dataclass(frozen=True)
class Star:
    """A shaped star: where each party runs and how the others reach the coordinator."""

    tag: str
    silos: int
    rate_mbit: float

    @property
    def hub(self) -> str:
        return f"{self.tag}-hub"

    @property
    def coordinator(self) -> str:
        return f"{self.tag}-c"

    def silo(self, index: int) -> str:
        return f"{self.tag}-s{index}"

    @property
    def coordinator_ip(self) -> str:
        return f"{SUBNET}.{COORDINATOR_HOST}"

    def silo_ip(self, index: int) -> str:
        return f"{SUBNET}.{10 + index}"

    @property
    def namespaces(self) -> list[str]:
        return [self.hub, self.coordinator, *(self.silo(i) for i in range(self.silos))]

    def run_in(self, namespace: str, command: Sequence[str]) -> list[str]:
        """`command` as it runs inside `namespace`."""
        return ["ip", "netns", "exec", namespace, *command]

    def coordinator_link_bytes(self) -> tuple[int, int]:
        """Bytes the coordinator's end of its link has sent and received so far (every byte
        on the wire: Ethernet, IP, TCP, TLS, HTTP/2 and the payload)."""
        sent = _read_in(self.coordinator, "/sys/class/net/eth0/statistics/tx_bytes")
        received = _read_in(self.coordinator, "/sys/class/net/eth0/statistics/rx_bytes")
        return sent, received


@contextmanager
def shaped_star(silos: int, rate_mbit: float) -> Iterator[Star]:
    """A star of `silos` silos and a coordinator, every link at `rate_mbit` each way; all of
    it gone on the way out, and when the process that made it is killed."""
    problem = link_problem()
    if problem is not None:
        raise LinkSetupFailed(problem)
    remove_stale()
    star = Star(f"{PREFIX}{os.getpid()}", silos, rate_mbit)
    reaper = subprocess.Popen(
        [sys.executable, "-m", "bench.netns", "--reap", *star.namespaces],
        stdin=subprocess.PIPE,
        start_new_session=True,  # a signal to the bench's group does not stop it first
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    try:
        _build(star)
        yield star
    finally:
        remove(star.namespaces)
        assert reaper.stdin is not None
        reaper.stdin.close()
        reaper.wait()


def _build(star: Star) -> None:
    for namespace in star.namespaces:
        _ip("netns", "add", namespace)
        _ip("-n", namespace, "link", "set", "lo", "up")
    _ip("-n", star.hub, "link", "add", "br0", "type", "bridge")
    _ip("-n", star.hub, "link", "set", "br0", "up")
    ends = [(star.coordinator, star.coordinator_ip, "c")]
    ends += [(star.silo(i), star.silo_ip(i), f"s{i}") for i in range(star.silos)]
    for namespace, address, port in ends:
        _ip(
            "link", "add", "eth0", "netns", namespace, "type", "veth",
            "peer", "name", port, "netns", star.hub,
        )  # fmt: skip
        _ip("-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
        _ip("-n", namespace, "link", "set", "eth0", "up")
        _ip("-n", star.hub, "link", "set", port, "master", "br0")
        _ip("-n", star.hub, "link", "set", port, "up")
        _shape(namespace, "eth0", star.rate_mbit)  # what this party sends
        _shape(star.hub, port, star.rate_mbit)  # what it receives


def _shape(namespace: str, device: str, rate_mbit: float) -> None:
    burst = max(MIN_BURST_BYTES, int(rate_mbit * 1e6 / 8 / 100))
    _run(
        "tc", "-n", namespace, "qdisc", "add", "dev", device, "root", "tbf",
        "rate", f"{rate_mbit}mbit", "burst", str(burst), "latency", f"{QUEUE_LATENCY_MS}ms",
    )  # fmt: skip


def remove(namespaces: Sequence[str]) -> None:
    """Kill what runs in each namespace and delete it (its veth ends go with it); namespaces
    already gone are skipped."""
    existing = set(list_namespaces())
    for namespace in namespaces:
        if namespace not in existing:
            continue
        pids = subprocess.run(
            ["ip", "netns", "pids", namespace], capture_output=True, text=True, check=False
        ).stdout.split()
        for pid in pids:
            with suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        subprocess.run(["ip", "netns", "del", namespace], capture_output=True, check=False)


def remove_stale() -> list[str]:
    """Delete the namespaces of earlier runs whose bench process is gone; returns their names."""
    stale = [
        name
        for name in list_namespaces()
        if (pid := _owner(name)) is not None and not os.path.exists(f"/proc/{pid}")
    ]
    remove(stale)
    return stale


def list_namespaces() -> list[str]:
    """Every named network namespace on this machine."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [line.split()[0] for line in listed.stdout.splitlines() if line.strip()]


def _owner(namespace: str) -> int | None:
    head, _, _ = namespace.partition("-")
    digits = head.removeprefix(PREFIX)
    return int(digits) if head.startswith(PREFIX) and digits.isdigit() else None


def _read_in(namespace: str, path: str) -> int:
    out = subprocess.run(
        ["ip", "netns", "exec", namespace, "cat", path], capture_output=True, text=True
    )
    return int(out.stdout.strip())


def _ip(*args: str) -> None:
    _run("ip", *args)


def _run(*command: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise LinkSetupFailed(f"{' '.join(command)}: {done.stderr.strip()}")


def _reap(namespaces: Sequence[str]) -> None:
    """The reaper: wait for the bench's pipe to close (it exited or was killed), then delete
    its namespaces."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sys.stdin.buffer.read()
    remove(namespaces)


if __name__ == "__main__" and sys.argv[1:2] == ["--reap"]:
    _reap(sys.argv[2:])
