"""A real consortium for tests: provisioned with the CLI in a temporary folder, each party a
separate OS process on 127.0.0.1 speaking mTLS gRPC, everything bounded in time and killed at
the end. Short operator commands (provision, policy sign, coordinator revoke) run the same CLI
in this process, which saves a Python start-up per command."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import yaml
from click.testing import CliRunner

from fedsilo.coordinator.jobs import JobInfo, JobQueue
from fedsilo.ops.cli import main
from fedsilo.ops.coordinator_serve import submit_local
from fedsilo.ops.demo import free_port
from fedsilo.ops.provision import SiloKit, load_silo_kit
from fedsilo.wire.envelope import Envelope, EnvelopeVerifier
from fedsilo.wire.framing import (
    exchange_call,
    exchange_one_call,
    one_message,
    read_message,
    to_frames,
)

SILOS = ("silo-0", "silo-1", "silo-2")


def fedsilo(*args: str) -> None:
    """Run a short `fedsilo` command in this process and require it to succeed."""
    result = CliRunner().invoke(main, list(args), catch_exceptions=False)
    assert result.exit_code == 0, result.output


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

    def sharing_kits(self, root: Path) -> Consortium:
        """The same consortium (kits, address) with its own folder for policies, state and logs."""
        (root / "kits").symlink_to(self.kits)
        return Consortium(root, self.port)

    def write_policy(self, document: dict, name: str = "policy.yaml") -> Path:
        path = self.root / name
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        fedsilo("policy", "sign", str(path), "--key", str(self.kits / "operator" / "operator.key"))
        return path

    def revoke(self, silo: str, state: str = "state.db") -> None:
        """`fedsilo coordinator revoke SILO`: a running coordinator refuses it within a second."""
        fedsilo(
            "coordinator",
            "revoke",
            silo,
            "--kit",
            str(self.kits / "coordinator"),
            "--state",
            str(self.root / state),
        )

    def add_silo(self, silo: str) -> None:
        """`fedsilo consortium add-silo SILO`: one more kit from the consortium's CA, enrolled in
        the coordinator kit's roster (no other kit touched)."""
        fedsilo(
            "consortium",
            "add-silo",
            silo,
            "--ca-kit",
            str(self.kits / "operator"),
            "--coordinator-kit",
            str(self.kits / "coordinator"),
            "--consortium",
            str(self.root / "consortium.yaml"),
            "--out",
            str(self.kits),
        )

    def write_silo_config(
        self,
        silo: str,
        metrics_port: int | None = None,
        data: dict | None = None,
        proxy: str | None = None,
        **rules: object,
    ) -> Path:
        """`data`: the data section (the default policy's when None), this silo selected;
        `proxy`: silo.yaml's coordinator.proxy."""
        folder = self.root / "sites" / silo
        folder.mkdir(parents=True, exist_ok=True)
        document: dict = {
            "version": 1,
            "kit": str(self.kits / "silos" / silo),
            "data": {"source": data or policy_document()["data"], "select": silo},
        }
        if metrics_port is not None:
            document["metrics_port"] = metrics_port
        if proxy is not None:
            document["coordinator"] = {"proxy": proxy}
        if rules:
            document["rules"] = rules
        path = folder / "silo.yaml"
        path.write_text(yaml.safe_dump(document, sort_keys=False))
        return path

    def start(
        self, name: str, *args: str, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen:
        """`fedsilo ARGS` as process `name`; `env`: its whole environment (default: ours)."""
        return self.spawn(name, [sys.executable, "-m", "fedsilo", *args], env)

    def spawn(
        self, name: str, argv: Sequence[str], env: Mapping[str, str] | None = None
    ) -> subprocess.Popen:
        """Any program as process `name`, logging to `name`.log, killed by `stop_all`."""
        with (self.root / f"{name}.log").open("w") as log:
            process = subprocess.Popen(
                list(argv),
                cwd=self.root,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
                env=None if env is None else dict(env),
            )
        self.processes[name] = process
        return process

    def start_coordinator(
        self,
        policy: Path,
        *extra: str,
        state: str = "state.db",
        name: str = "coordinator",
        join_timeout_s: float = 60,
    ) -> subprocess.Popen:
        return self.start(
            name,
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
            str(join_timeout_s),
            *extra,
        )

    def start_serve(
        self, *extra: str, state: str = "state.db", name: str = "coordinator"
    ) -> subprocess.Popen:
        """`fedsilo coordinator serve`: jobs come later (`submit`)."""
        return self.start(
            name,
            "coordinator",
            "serve",
            "--kit",
            str(self.kits / "coordinator"),
            "--state",
            str(self.root / state),
            "--poll-seconds",
            "0.5",
            "--join-timeout",
            "60",
            *extra,
        )

    def serve_with_silos(self, configs: Mapping[str, Path] | None = None) -> None:
        """`coordinator serve` once it is up, and an agent for each of SILOS (`configs`: the
        silo.yaml of those not started with the default one)."""
        self.start_serve()
        self.wait_for_log("coordinator", "serving mTLS gRPC")
        for silo in SILOS:
            self.start_silo(silo, (configs or {}).get(silo))

    def submit(self, policy: Path, state: str = "state.db") -> str:
        """Queue the signed `policy` on a serving coordinator's state file; its job id."""
        return submit_local(self.root / state, self.kits / "coordinator", policy).job_id

    def start_silo(
        self, silo: str, config: Path | None = None, env: Mapping[str, str] | None = None
    ) -> subprocess.Popen:
        config = config or self.write_silo_config(silo)
        return self.start(
            silo, "silo", "start", "--config", str(config), "--poll-seconds", "0.5", env=env
        )

    def start_silo_again(self, silo: str, name: str) -> subprocess.Popen:
        """Another agent of `silo` as process `name`, with the command its unit runs (`silo
        start` on the silo.yaml `start_silo` wrote): a restart, or a second agent."""
        config = self.root / "sites" / silo / "silo.yaml"
        return self.start(name, "silo", "start", "--config", str(config), "--poll-seconds", "0.5")

    def wait(self, name: str, timeout: float = 120) -> int:
        try:
            return self.processes[name].wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            raise AssertionError(
                f"{name} still running after {timeout}s:\n{self.log(name)}"
            ) from None

    def check_running(self) -> None:
        """Fail if a process failed; one that finished its work (exit 0) is fine."""
        for name, process in self.processes.items():
            if process.poll() not in (None, 0):
                raise AssertionError(f"{name} exited with {process.returncode}:\n{self.log(name)}")

    def log(self, name: str) -> str:
        path = self.root / f"{name}.log"
        return path.read_text() if path.exists() else ""

    def wait_for_log(
        self, name: str, text: str, timeout: float = 60, interval: float = 0.2
    ) -> None:
        """Wait until `name`'s log contains `text`, failing at once if a process failed."""
        wait_for(lambda: text in self.log(name), timeout, f"{text!r} in {name}.log", self, interval)

    def send_signal(self, name: str, signum: signal.Signals) -> None:
        """Send `signum` to `name`'s process group (SIGSTOP freezes it, SIGCONT resumes it)."""
        os.killpg(self.processes[name].pid, signum)

    def kill(self, name: str) -> None:
        """SIGKILL `name` and forget it: the processes left are the ones expected to run."""
        self.send_signal(name, signal.SIGKILL)
        self.processes.pop(name).wait(timeout=10)

    def stop_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(timeout=10)


def provision(root: Path, silos: tuple[str, ...] = SILOS, host: str = "127.0.0.1") -> Consortium:
    """A new consortium (its own CA and keys) in `root`, its coordinator on a free port of
    `host` (the name its certificate is issued for)."""
    port = free_port()
    (root / "consortium.yaml").write_text(
        yaml.safe_dump(
            {
                "consortium": "test-consortium",
                "coordinator": {"address": f"{host}:{port}"},
                "silos": [{"name": s} for s in silos],
            }
        )
    )
    fedsilo("provision", "--consortium", str(root / "consortium.yaml"), "--out", str(root / "kits"))
    return Consortium(root, port)


def silo_credentials(kit: SiloKit) -> grpc.ChannelCredentials:
    """The silo's mutual-TLS identity, from its kit."""
    return grpc.ssl_channel_credentials(
        kit.tls.ca_certificate.read_bytes(),
        kit.tls.private_key.read_bytes(),
        kit.tls.certificate.read_bytes(),
    )


def send_as_silo(
    consortium: Consortium, silo: str, envelope: Envelope, payload: bytes, *, whole: bool = False
) -> bytes:
    """One message to the coordinator over `silo`'s TLS identity, in frames (`Exchange`) or whole
    (`ExchangeOne`); the verified reply's payload."""
    kit = load_silo_kit(consortium.kits / "silos" / silo)
    verifier = EnvelopeVerifier(kit.consortium, {"coordinator": kit.coordinator_verify_key})
    address = kit.coordinator_address
    with grpc.secure_channel(address, silo_credentials(kit)) as channel:
        if whole:
            replies = exchange_one_call(channel)(one_message(envelope, payload), timeout=30)
        else:
            replies = exchange_call(channel)(to_frames(envelope, payload), timeout=30)
        return read_message(replies, verifier, 1 << 20)[1].to_bytes()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return response.read().decode()


def metric(port: int, name: str, **labels: str) -> float:
    """One sample of the /metrics at `port`; 0 for a sample not (yet) exported."""
    return sample(scrape(port), name, **labels) or 0.0


def sample(text: str, metric: str, **labels: str) -> float | None:
    """The value of `metric` with exactly these labels in a Prometheus exposition."""
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == metric and s.labels == labels:
                return s.value
    return None


def job_sample(text: str, metric: str, **labels: str) -> float | None:
    """The value of `metric` with these labels and a job's `deployment` label, whichever job
    (a run of `coordinator start` has one); the sum when several jobs have one."""
    from prometheus_client.parser import text_string_to_metric_families

    values = [
        s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == metric
        and "deployment" in s.labels
        and {k: v for k, v in s.labels.items() if k != "deployment"} == labels
    ]
    return sum(values) if values else None


def job_metric(port: int, name: str, **labels: str) -> float:
    """`job_sample` of the /metrics at `port`; 0 for a sample not (yet) exported."""
    return job_sample(scrape(port), name, **labels) or 0.0


def wait_for(
    predicate, timeout: float, what: str, alive: Consortium | None = None, interval: float = 0.2
):
    """Poll `predicate` until it is truthy; fail at once if a process of `alive` has failed."""
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


def job_info(consortium: Consortium, job: str, state: str = "state.db") -> JobInfo:
    """Job `job` as the coordinator's state file records it now."""
    jobs = JobQueue(consortium.root / state)
    try:
        return jobs.job(job)
    finally:
        jobs.close()


def wait_until_ended(consortium: Consortium, job: str, timeout: float = 60) -> JobInfo:
    """Job `job` once it ended (whichever way), failing at once if a process failed."""
    return wait_for(
        lambda: (info := job_info(consortium, job)).finished_at is not None and info,
        timeout,
        f"job {job} to end",
        consortium,
    )
