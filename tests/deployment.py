"""A real consortium for tests: provisioned with the CLI in a temporary folder, each party a
separate OS process on 127.0.0.1 speaking mTLS gRPC, everything bounded in time and killed at
the end."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path

import yaml

SILOS = ("silo-0", "silo-1", "silo-2")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def fedsilo(*args: str, cwd: Path, timeout: float = 60) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedsilo", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def policy_document(rounds: int = 3, **overrides: object) -> dict:
    return {
        "version": 1,
        "name": "breast-cancer-deployed",
        "seed": 7,
        "rounds": rounds,
        "algorithm": {"name": "fedavg"},
        "model": {"name": "linear"},
        "training": {"epochs": 1, "batch_size": 16, "lr": 0.05},
        "participants": {"min_silos": 2, "phase_timeout_s": 20},
        "data": {"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": 3}},
        **overrides,
    }


@dataclass
class Consortium:
    root: Path
    port: int
    processes: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def kits(self) -> Path:
        return self.root / "kits"

    def write_policy(self, document: dict, name: str = "policy.yaml") -> Path:
        path = self.root / name
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        signed = fedsilo(
            "policy",
            "sign",
            str(path),
            "--key",
            str(self.kits / "operator" / "operator.key"),
            cwd=self.root,
        )
        assert signed.returncode == 0, signed.stdout + signed.stderr
        return path

    def write_silo_config(
        self, silo: str, metrics_port: int | None = None, **rules: object
    ) -> Path:
        folder = self.root / "sites" / silo
        folder.mkdir(parents=True, exist_ok=True)
        document: dict = {
            "version": 1,
            "kit": str(self.kits / "silos" / silo),
            "data": {"source": policy_document()["data"], "select": silo},
        }
        if metrics_port is not None:
            document["metrics_port"] = metrics_port
        if rules:
            document["rules"] = rules
        path = folder / "silo.yaml"
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        return path

    def start(self, name: str, *args: str) -> subprocess.Popen:
        log = (self.root / f"{name}.log").open("w")
        process = subprocess.Popen(
            [sys.executable, "-m", "fedsilo", *args],
            cwd=self.root,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.processes[name] = process
        return process

    def start_coordinator(
        self, policy: Path, *extra: str, state: str = "state.db"
    ) -> subprocess.Popen:
        return self.start(
            "coordinator",
            "coordinator",
            "start",
            "--kit",
            str(self.kits / "coordinator"),
            "--policy",
            str(policy),
            "--state",
            str(self.root / state),
            "--poll-seconds",
            "0.5",
            "--join-timeout",
            "60",
            *extra,
        )

    def start_silo(self, silo: str, config: Path | None = None) -> subprocess.Popen:
        config = config or self.write_silo_config(silo)
        return self.start(silo, "silo", "start", "--config", str(config), "--poll-seconds", "0.5")

    def wait(self, name: str, timeout: float = 120) -> int:
        try:
            return self.processes[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{name} still running after {timeout}s:\n{self.log(name)}"
            ) from None

    def check_running(self) -> None:
        for name, process in self.processes.items():
            if process.poll() is not None:
                raise AssertionError(f"{name} exited with {process.returncode}:\n{self.log(name)}")

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


def provision(root: Path, silos: tuple[str, ...] = SILOS) -> Consortium:
    port = free_port()
    (root / "consortium.yaml").write_text(
        yaml.safe_dump(
            {
                "consortium": "test-consortium",
                "coordinator": {"address": f"127.0.0.1:{port}"},
                "silos": [{"name": s} for s in silos],
            }
        )
    )
    result = fedsilo("provision", "--consortium", "consortium.yaml", "--out", "kits", cwd=root)
    assert result.returncode == 0, result.stdout + result.stderr
    return Consortium(root, port)


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def sample(text: str, metric: str, **labels: str) -> float | None:
    """The value of `metric` with exactly these labels in a Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == metric and s.labels == labels:
                return s.value
    return None


def wait_for(
    predicate, timeout: float, what: str, alive: Consortium | None = None, interval: float = 0.2
):
    """Poll `predicate` until it is truthy; fail at once if a process of `alive` has died."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if alive is not None:
            alive.check_running()
        try:
            value = predicate()
        except OSError:
            value = None
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")
