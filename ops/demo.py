"""`fedsilo demo`: the real deployment path on one machine, with nothing to prepare.

It provisions a throw-away consortium of the four bundled heart-disease hospitals in a fresh
folder, signs the default policy, starts the coordinator and one silo agent per hospital as
separate processes on 127.0.0.1 speaking mutual-TLS gRPC, follows the rounds on the
coordinator's Prometheus endpoint, and prints every hospital's test metrics. Every process is
stopped at the end, also on Ctrl-C or an error.
"""

from __future__ import annotations

import json
import re
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.resources import as_file, files
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from fedsilo.ops.provision import provision
from fedsilo.policies.consortium import parse_consortium
from fedsilo.privacy.identity import read_signing_key
from fedsilo.privacy.policy_signing import sign_policy

DEMO_POLICY = "examples/heart-fedavg.yaml"
HOSPITALS = {  # kit name -> the hospital's value in the data's `dataset` column
    "cleveland": "Cleveland",
    "hungary": "Hungary",
    "switzerland": "Switzerland",
    "va-long-beach": "VA Long Beach",
}


class DemoFailed(RuntimeError):
    """A demo process died or the run did not finish; the message points at its log."""


@dataclass
class LocalConsortium:
    """A consortium's processes on this machine, each logging to logs/<name>.log."""

    folder: Path
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)
    # a command prefix per process name that runs it elsewhere (a network namespace of a
    # shaped-link bench: `ip netns exec NAME`); none by default
    launchers: dict[str, list[str]] = field(default_factory=dict)

    def start(self, name: str, *args: str) -> None:
        log = (self.folder / "logs" / f"{name}.log").open("w")
        self.processes[name] = subprocess.Popen(
            [*self.launchers.get(name, []), sys.executable, "-m", "fedsilo", *args],
            cwd=self.folder,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    @classmethod
    def provision(
        cls, folder: Path, name: str, silos: list[str], host: str = "127.0.0.1"
    ) -> tuple[LocalConsortium, int]:
        """Kits for a consortium whose coordinator listens on a free port (returned) of `host`
        (loopback by default)."""
        grpc_port = free_port()
        config = {
            "consortium": name,
            "coordinator": {"address": f"{host}:{grpc_port}"},
            "silos": [{"name": silo} for silo in silos],
        }
        provision(parse_consortium(config), folder / "kits")
        (folder / "logs").mkdir(parents=True, exist_ok=True)
        return cls(folder), grpc_port

    def sign_policy(self, policy: Path) -> None:
        sign_policy(policy, read_signing_key(self.folder / "kits" / "operator" / "operator.key"))

    def start_coordinator(self, metrics_port: int, poll_seconds: float, *extra: str) -> None:
        self.start(
            "coordinator",
            "coordinator",
            "start",
            "--kit",
            "kits/coordinator",
            "--policy",
            "policy.yaml",
            "--state",
            "state.db",
            "--metrics-port",
            str(metrics_port),
            "--out",
            "results",
            "--poll-seconds",
            str(poll_seconds),
            *extra,
        )

    def start_silo(self, name: str, config: Path, poll_seconds: float) -> None:
        self.start(
            name, "silo", "start", "--config", str(config), "--poll-seconds", str(poll_seconds)
        )

    def check(self) -> None:
        for name, process in self.processes.items():
            code = process.poll()
            if code not in (None, 0):
                raise DemoFailed(f"{name} exited with {code}; see {self.folder}/logs/{name}.log")

    def stop(self, grace_s: float = 10.0) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        for process in self.processes.values():
            try:
                process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def run_demo(
    folder: Path,
    on_round: Callable[[int, int], None],
    rounds: int | None = None,
    timeout_s: float = 600.0,
) -> dict:
    """Provision, run and stop a local consortium; the coordinator's final history.

    `rounds` overrides the default policy's number of rounds (for a quick look)."""
    if folder.exists() and any(folder.iterdir()):
        raise DemoFailed(f"{folder} is not empty; the demo needs a fresh folder")
    consortium, _ = LocalConsortium.provision(folder, "heart-demo", list(HOSPITALS))
    metrics_port = free_port()
    policy = folder / "policy.yaml"
    with as_file(files("fedsilo.policies") / DEMO_POLICY) as source:
        text = source.read_text()
    if rounds is not None:
        text = re.sub(r"^rounds: \d+", f"rounds: {rounds}", text, count=1, flags=re.MULTILINE)
    policy.write_text(text)
    consortium.sign_policy(policy)
    rounds = int(yaml.safe_load(text)["rounds"])
    try:
        consortium.start_coordinator(metrics_port, 1.0, "--join-timeout", "120")
        for name, hospital in HOSPITALS.items():
            consortium.start_silo(name, _write_silo_config(folder, name, hospital), 1.0)
        _follow(consortium, metrics_port, rounds, on_round, timeout_s)
        code = consortium.processes["coordinator"].wait(timeout=60)
        if code != 0:
            raise DemoFailed(
                f"the coordinator exited with {code}; see {folder}/logs/coordinator.log"
            )
    finally:
        consortium.stop()
    return json.loads((folder / "results" / "history.json").read_text())


def _write_silo_config(folder: Path, name: str, hospital: str) -> Path:
    site = folder / "sites" / name
    site.mkdir(parents=True)
    config = site / "silo.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "version": 1,
                "kit": str(folder / "kits" / "silos" / name),
                "data": {"source": "heart", "select": hospital},
            },
            sort_keys=False,
        )
    )
    return config


def _follow(
    consortium: LocalConsortium,
    port: int,
    rounds: int,
    on_round: Callable[[int, int], None],
    timeout_s: float,
) -> None:
    deadline = time.monotonic() + timeout_s
    seen = 0
    while seen < rounds:
        if time.monotonic() > deadline:
            raise DemoFailed(f"no result after {timeout_s:.0f}s; see {consortium.folder}/logs/")
        if consortium.processes["coordinator"].poll() is not None:
            return  # finished (or failed: the caller reads its exit code)
        consortium.check()
        current = current_round(port)
        if current > seen:
            seen = current
            on_round(seen, rounds)
        time.sleep(0.3)


def current_round(port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as response:
            text = response.read().decode()
    except OSError:
        return 0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "fedsilo_round":
                return int(sample.value)
    return 0


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]
