"""Runs bench/flower_peer.py's Flower server and clients from fedsilo's venv and measures them
exactly as bench/transport.py measures fedsilo: median round seconds, round overhead beyond
the slowest client's fit, loopback bytes over payload bytes, and the server's peak RSS.

Flower runs from its own interpreter (FEDSILO_FLOWER_PYTHON, default .venv-flwr/bin/python,
made by `make flower-env`) because flwr pins protobuf<7 and fedsilo's stubs need protobuf 7.
Its legacy transport is server-authenticated TLS here (a throw-away CA made with
`cryptography`); Flower's legacy API has no client certificates, so it is not mutual TLS.
"""

from __future__ import annotations

import datetime
import ipaddress
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import psutil
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from bench.flower_peer import hidden_width, parameter_count

REPO = Path(__file__).resolve().parent.parent
PEER = Path(__file__).resolve().parent / "flower_peer.py"
DEFAULT_PYTHON = REPO / ".venv-flwr" / "bin" / "python"


class FlowerFailed(RuntimeError):
    """A Flower process died or the run did not finish in time; the message names its log."""


def flower_python() -> Path | None:
    """Flower's interpreter, or None when it is not there (`make flower-env` makes it)."""
    path = Path(os.environ.get("FEDSILO_FLOWER_PYTHON", DEFAULT_PYTHON))
    return path if path.is_file() else None


def run_flower(
    root: Path,
    parameters: float,
    silos: int,
    rounds: int,
    tls: bool = True,
    timeout_s: float = 600.0,
    host: str = "127.0.0.1",
    inside: Callable[[str], list[str]] | None = None,
) -> dict | None:
    """One configuration under Flower in folder `root`; None when Flower's interpreter is absent.

    On shaped links (bench/links.py) the server listens on `host` and `inside(name)` is the
    command prefix that runs process `name` ("server", "s0", ...) in its network namespace;
    the loopback byte counts then count nothing of the run."""
    python = flower_python()
    if python is None:
        return None
    root.mkdir(parents=True, exist_ok=True)
    width = hidden_width(parameters)
    port, report = _free_port(), root / "flower.json"
    common = ["--port", str(port), "--parameters", str(parameters), "--host", host]
    server_args = ["--silos", str(silos), "--rounds", str(rounds), "--out", str(report)]
    client_args: list[str] = []
    if tls:
        _write_certificates(root / "certs", host)
        server_args += ["--certs", str(root / "certs")]
        client_args += ["--ca", str(root / "certs" / "ca.pem")]

    deadline = time.monotonic() + timeout_s
    processes: dict[str, subprocess.Popen] = {}
    net_before = psutil.net_io_counters(pernic=True)["lo"].bytes_recv
    try:
        prefix = inside or (lambda name: [])
        processes["server"] = _start(
            python, root, "server", "server", *common, *server_args, prefix=prefix("server")
        )
        _wait_until(lambda: _listening(host, port, prefix("s0")), processes, deadline, root)
        for i in range(silos):
            processes[f"s{i}"] = _start(
                python,
                root,
                f"s{i}",
                "client",
                *common,
                "--silo",
                str(i),
                *client_args,
                prefix=prefix(f"s{i}"),
            )
        _wait_until(lambda: processes["server"].poll() == 0, processes, deadline, root)
        net = psutil.net_io_counters(pernic=True)["lo"].bytes_recv - net_before
    finally:
        _stop(processes)

    measured = json.loads(report.read_text())
    history = measured["rounds"]
    if len(history) != rounds or any(r["failures"] for r in history):
        raise FlowerFailed(f"Flower rounds incomplete or with failures: {history}")
    model_bytes = 4 * parameter_count(width)
    payload = 2 * silos * rounds * model_bytes
    return {
        "parameters": parameter_count(width),
        "silos": silos,
        "model_bytes": model_bytes,
        "round_seconds": statistics.median(r["seconds"] for r in history),
        "round_overhead_seconds": statistics.median(
            r["seconds"] - max(r["fit_seconds"]) for r in history
        ),
        "payload_bytes": payload,
        "loopback_bytes": net,
        "wire_over_payload": net / payload,
        "server_peak_rss_bytes": measured["peak_rss_bytes"],
        "tls": measured["tls"],
        "flwr": measured["flwr"],
    }


def _start(python: Path, root: Path, name: str, *args: str, prefix: list[str]) -> subprocess.Popen:
    with (root / f"flower-{name}.log").open("w") as log:
        return subprocess.Popen(
            [*prefix, str(python), str(PEER), *args],
            cwd=root,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"},
        )


def _wait_until(
    done: Callable[[], bool], processes: dict[str, subprocess.Popen], deadline: float, root: Path
) -> None:
    """Poll `done()` until true; fail on a process exiting with an error, or at the deadline."""
    while not done():
        for name, process in processes.items():
            if process.poll() not in (None, 0):
                raise FlowerFailed(f"Flower {name} exited with {process.returncode}; see {root}")
        if time.monotonic() > deadline:
            raise FlowerFailed(f"Flower run did not finish in time; see the logs in {root}")
        time.sleep(0.1)


def _stop(processes: dict[str, subprocess.Popen], grace_s: float = 5.0) -> None:
    for process in processes.values():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    end = time.monotonic() + grace_s
    for process in processes.values():
        try:
            process.wait(timeout=max(0.1, end - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _listening(host: str, port: int, prefix: list[str]) -> bool:
    """Whether the server accepts connections, tried from where a client runs (`prefix`)."""
    if not prefix:
        with socket.socket() as s:
            return s.connect_ex((host, port)) == 0
    probe = f"import socket; socket.create_connection(({host!r}, {port}), timeout=1).close()"
    return (
        subprocess.run([*prefix, sys.executable, "-c", probe], capture_output=True).returncode == 0
    )


def _write_certificates(folder: Path, host: str = "127.0.0.1") -> None:
    """A throw-away CA (ca.pem) and a server certificate for `host` (server.pem/.key)."""
    folder.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "flower-bench-ca")])
    server_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, host)])

    def certificate(
        subject: x509.Name, public_key: ec.EllipticCurvePublicKey
    ) -> x509.CertificateBuilder:
        return (
            x509.CertificateBuilder()
            .subject_name(subject)
            .issuer_name(ca_name)
            .public_key(public_key)
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
        )

    ca = (
        certificate(ca_name, ca_key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    server = (
        certificate(server_name, key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.SubjectAlternativeName(
                [x509.IPAddress(ipaddress.ip_address(host)), x509.DNSName("localhost")]
            ),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    (folder / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (folder / "server.pem").write_bytes(server.public_bytes(serialization.Encoding.PEM))
    (folder / "server.key").write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
