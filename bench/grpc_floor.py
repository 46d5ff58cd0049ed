"""The floor under a deployed round: a bare mutual-TLS gRPC exchange of a round's bytes, with
nothing of fedsilo in it. A server hands N float32 parameters (4N bytes) to each of S client
processes and takes 4N bytes back from each; no framing beyond gRPC's own, no hashing, signing,
disk or training. Its median round time is what any round over this transport pays, so
bench/transport.py reports fedsilo's (and Flower's) round time beyond training over it.

The same shape as fedsilo's task channel (issue 40): clients pull (`Fetch` blocks until the
round's parameters are published) and push (`Return`), over the consortium's own certificates
(its CA, the coordinator's server certificate, each silo's client certificate) and gRPC's
default HTTP/2 settings, with message limits lifted. The server runs in the calling process;
each client is a process of its own, as each silo is.

The floor is measured two ways (`measured_floor` runs each in a fresh process): with the C
allocator as it comes, the issue's floor, and with the allocator setting fedsilo's services
use (ops/memory.py), which makes bare gRPC faster too; fedsilo's overhead is reported over
both, so that its own allocator setting does not count as closing a gap that bare gRPC closes
the same way.

It also reports the server's CPU milliseconds per round (all its threads), to set beside the
coordinator's. Run alone (it provisions a throw-away consortium for the certificates):
`python -m bench.grpc_floor --parameters 1e6 --silos 3 --rounds 5`."""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path

import grpc

from fedsilo.ops.memory import keep_service_buffers

SERVICE = "floor.Floor"
REPO = Path(__file__).resolve().parent.parent
UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]


@dataclass
class FloorRound:
    """The server's side of the exchange: the published round and who returned it."""

    payload: bytes
    silos: int
    published: int = -1
    returned: int = 0

    def __post_init__(self) -> None:
        self.changed = threading.Condition()

    def fetch(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        wanted = int(request)
        with self.changed:
            self.changed.wait_for(lambda: self.published >= wanted)
        return self.payload

    def give_back(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        assert len(request) == len(self.payload)
        with self.changed:
            self.returned += 1
            self.changed.notify_all()
        return b""

    def run(self, number: int) -> float:
        """Publishes round `number` and waits for every client's return; its seconds."""
        start = time.perf_counter()
        with self.changed:
            self.returned, self.published = 0, number
            self.changed.notify_all()
            self.changed.wait_for(lambda: self.returned == self.silos)
        return time.perf_counter() - start


def measured_floor(
    kits: Path, silos: list[str], parameters: int, rounds: int, *, service_allocator: bool
) -> dict:
    """`floor_round_seconds` in a fresh server process, with the C allocator as it comes or set
    as fedsilo's services set it (`service_allocator`), in the server and its clients alike."""
    done = subprocess.run(
        this_module(
            "measure",
            *("--kits", str(kits), "--names", ",".join(silos)),
            *("--parameters", str(parameters), "--rounds", str(rounds)),
            service_allocator=service_allocator,
        ),
        capture_output=True,
        text=True,
        check=True,
        cwd=REPO,
    )
    return json.loads(done.stdout)


def this_module(role: str, *args: str, service_allocator: bool = False) -> list[str]:
    """The command that runs this module in `role` (from the repository's root, `REPO`)."""
    allocator = ["--service-allocator"] if service_allocator else []
    return [sys.executable, "-m", "bench.grpc_floor", role, *args, *allocator]


def floor_round_seconds(
    kits: Path, silos: list[str], parameters: int, rounds: int, *, service_allocator: bool = False
) -> dict:
    """Median and spread of `rounds` exchanges (after one to warm the channels) of 4 *
    `parameters` bytes each way with each of `silos`, over the certificates in `kits` (a
    `fedsilo provision --out` folder). The clients keep freed memory as fedsilo's services do
    when `service_allocator` is set; the server, the calling process, as it was set."""
    exchange = FloorRound(bytes(4 * parameters), len(silos))
    server, port = serve(kits, exchange)
    clients = [
        subprocess.Popen(
            this_module(
                "client",
                *("--kit", str(kits / "silos" / name), "--port", str(port)),
                *("--rounds", str(rounds + 1)),
                service_allocator=service_allocator,
            ),
            cwd=REPO,
        )
        for name in silos
    ]
    try:
        exchange.run(0)  # warms the channels
        cpu = time.process_time()
        seconds = [exchange.run(number) for number in range(1, rounds + 1)]
        cpu = time.process_time() - cpu
        for client in clients:
            assert client.wait(timeout=600) == 0, "a floor client failed"
    finally:
        for client in clients:
            client.kill()
        server.stop(grace=None)
    return {
        "floor_round_seconds": statistics.median(seconds),
        "floor_round_seconds_min": min(seconds),
        "floor_round_seconds_max": max(seconds),
        "floor_server_cpu_ms_per_round": 1e3 * cpu / rounds,
    }


def serve(kits: Path, exchange: FloorRound) -> tuple[grpc.Server, int]:
    """A started server of `exchange` on a free loopback port, with the coordinator's
    certificate from `kits`, requiring a client certificate of the consortium's CA."""
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=2 * exchange.silos + 4), options=UNLIMITED
    )
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                SERVICE,
                {
                    "Fetch": grpc.unary_unary_rpc_method_handler(exchange.fetch),
                    "Return": grpc.unary_unary_rpc_method_handler(exchange.give_back),
                },
            )
        ]
    )
    port = server.add_secure_port("127.0.0.1:0", server_credentials(kits))
    server.start()
    return server, port


def server_credentials(kits: Path) -> grpc.ServerCredentials:
    """The coordinator's certificate from `kits` (a `fedsilo provision --out` folder), asking
    every client for a certificate of the consortium's CA."""
    coordinator = kits / "coordinator"
    return grpc.ssl_server_credentials(
        [((coordinator / "server.key").read_bytes(), (coordinator / "server.crt").read_bytes())],
        root_certificates=(coordinator / "ca.crt").read_bytes(),
        require_client_auth=True,
    )


def client_credentials(kit: Path) -> grpc.ChannelCredentials:
    """A silo's client certificate from its `kit` folder, trusting the consortium's CA."""
    return grpc.ssl_channel_credentials(
        root_certificates=(kit / "ca.crt").read_bytes(),
        private_key=(kit / "client.key").read_bytes(),
        certificate_chain=(kit / "client.crt").read_bytes(),
    )


def _client(kit: Path, port: int, rounds: int) -> None:
    credentials = client_credentials(kit)
    with grpc.secure_channel(f"127.0.0.1:{port}", credentials, options=UNLIMITED) as channel:
        fetch = channel.unary_unary(f"/{SERVICE}/Fetch")
        give_back = channel.unary_unary(f"/{SERVICE}/Return")
        for number in range(rounds):
            give_back(fetch(str(number).encode(), timeout=600), timeout=600)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="role")
    client = sub.add_parser("client")
    client.add_argument("--kit", type=Path, required=True)
    client.add_argument("--port", type=int, required=True)
    client.add_argument("--rounds", type=int, required=True)
    client.add_argument("--service-allocator", action="store_true")
    measure = sub.add_parser("measure")  # one floor in this process, its numbers as JSON
    measure.add_argument("--kits", type=Path, required=True)
    measure.add_argument("--names", required=True)
    measure.add_argument("--service-allocator", action="store_true")
    for command in (parser, measure):
        command.add_argument("--parameters", type=float, default=1e6)
        command.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--silos", type=int, default=3)
    args = parser.parse_args()
    if getattr(args, "service_allocator", False):
        keep_service_buffers()
    if args.role == "client":
        _client(args.kit, args.port, args.rounds)
        return
    if args.role == "measure":
        names, count = args.names.split(","), int(args.parameters)
        keep = args.service_allocator
        measured = floor_round_seconds(args.kits, names, count, args.rounds, service_allocator=keep)
        print(json.dumps(measured))
        return
    from fedsilo.ops.demo import LocalConsortium

    names = [f"s{i}" for i in range(args.silos)]
    with tempfile.TemporaryDirectory(prefix="fedsilo-floor-") as tmp:
        LocalConsortium.provision(Path(tmp), "floor", names)
        kits, count = Path(tmp) / "kits", int(args.parameters)
        for keep in (False, True):
            floor = measured_floor(kits, names, count, args.rounds, service_allocator=keep)
            print(f"service_allocator={keep}: {floor}")


if __name__ == "__main__":
    main()
