"""The transport benchmark's workload under Flower (flwr), for a side-by-side with fedsilo.

Runs under Flower's own interpreter (`make flower-env` builds .venv-flwr): every flwr>=1.20
pins protobuf<7 while fedsilo's stubs need protobuf 7, so this file imports neither fedsilo nor
bench.common. Its module level needs numpy only, so bench/transport.py and
bench/flower_runner.py share the workload definition below (widths, data) from fedsilo's venv.

Two roles on 127.0.0.1 (or on `--host`, the server's address on a shaped link), with Flower's
legacy API (`flwr.server.start_server` and `flwr.client.start_client`, both living in
flwr.compat; deprecated since 1.13 but present):

    python bench/flower_peer.py server --port P --parameters N --silos K --rounds R --out F.json
        [--certs DIR]      # DIR/ca.pem, server.pem, server.key: TLS (server-authenticated)
    python bench/flower_peer.py client --port P --parameters N --silo I [--ca DIR/ca.pem]

FedAvg over every silo each round, no federated evaluation, one local SGD step (batch 64,
lr 0.01) on the MLP FEATURES -> hidden -> 2 with SAMPLES normal rows per silo (seeded by the
silo's index, label x[:, 0] > 0). The server sends its own initial model (no extra fetch from
a client) and, at the end, writes F.json: per round the seconds from the sampled clients being
configured to the aggregate being ready, every client's fit seconds (reported in its fit
metrics), its own peak RSS (VmHWM), and whether TLS was on.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from torch import nn

FEATURES, SAMPLES = 32, 64
LR = 0.01
MAX_MESSAGE_BYTES = 2**31 - 1


def hidden_width(parameters: float) -> int:
    """MLP FEATURES -> h -> 2 has 35h + 2 parameters."""
    return max(1, round((parameters - 2) / (FEATURES + 3)))


def parameter_count(width: int) -> int:
    return FEATURES * width + width + 2 * width + 2


def site_data(silo: int) -> tuple[np.ndarray, np.ndarray]:
    """Silo `silo`'s SAMPLES x FEATURES rows and 0/1 labels, the same on both sides."""
    x = np.random.default_rng(silo).normal(size=(SAMPLES, FEATURES))
    return x, (x[:, 0] > 0).astype(np.int64)


def mlp(width: int) -> nn.Sequential:
    import torch
    from torch import nn

    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(FEATURES, width), nn.ReLU(), nn.Linear(width, 2))


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc (Linux only)")


def serve(args: argparse.Namespace) -> None:
    import flwr
    from flwr.common import FitIns, FitRes, Parameters, Scalar, ndarrays_to_parameters
    from flwr.server import ServerConfig, start_server
    from flwr.server.client_manager import ClientManager
    from flwr.server.client_proxy import ClientProxy
    from flwr.server.strategy import FedAvg

    class TimedFedAvg(FedAvg):
        """FedAvg that times each round from dispatch to the aggregate being ready."""

        def __init__(self, **kwargs: Any) -> None:
            super().__init__(**kwargs)
            self.started: dict[int, float] = {}
            self.rounds: list[dict[str, Any]] = []

        def configure_fit(
            self, server_round: int, parameters: Parameters, client_manager: ClientManager
        ) -> list[tuple[ClientProxy, FitIns]]:
            instructions = super().configure_fit(server_round, parameters, client_manager)
            self.started[server_round] = time.perf_counter()  # after waiting for the clients
            return instructions

        def aggregate_fit(
            self,
            server_round: int,
            results: list[tuple[ClientProxy, FitRes]],
            failures: list[tuple[ClientProxy, FitRes] | BaseException],
        ) -> tuple[Parameters | None, dict[str, Scalar]]:
            aggregated = super().aggregate_fit(server_round, results, failures)
            self.rounds.append(
                {
                    "round": server_round,
                    "seconds": time.perf_counter() - self.started[server_round],
                    "fit_seconds": [float(r.metrics["fit_seconds"]) for _, r in results],
                    "failures": len(failures),
                }
            )
            return aggregated

    model = mlp(hidden_width(args.parameters))
    initial = [p.detach().numpy() for p in model.parameters()]
    strategy = TimedFedAvg(
        fraction_fit=1.0,
        fraction_evaluate=0.0,
        min_fit_clients=args.silos,
        min_evaluate_clients=0,
        min_available_clients=args.silos,
        initial_parameters=ndarrays_to_parameters(initial),
    )
    del model, initial
    certificates = None
    if args.certs is not None:
        certificates = tuple(
            (args.certs / name).read_bytes() for name in ("ca.pem", "server.pem", "server.key")
        )
    start_server(
        server_address=f"{args.host}:{args.port}",
        config=ServerConfig(num_rounds=args.rounds),
        strategy=strategy,
        grpc_max_message_length=MAX_MESSAGE_BYTES,
        certificates=certificates,
    )
    report = {
        "flwr": flwr.__version__,
        "tls": certificates is not None,
        "rounds": strategy.rounds,
        "peak_rss_bytes": peak_rss_bytes(),
    }
    args.out.write_text(json.dumps(report, indent=2))


def join(args: argparse.Namespace) -> None:
    import torch
    from flwr.client import NumPyClient, start_client
    from flwr.common import NDArrays, Scalar

    model = mlp(hidden_width(args.parameters))
    x, y = (torch.from_numpy(a) for a in site_data(args.silo))
    x = x.float()

    class Silo(NumPyClient):
        def get_parameters(self, config: dict[str, Scalar]) -> NDArrays:
            return [p.detach().numpy() for p in model.parameters()]

        def fit(
            self, parameters: NDArrays, config: dict[str, Scalar]
        ) -> tuple[NDArrays, int, dict[str, Scalar]]:
            started = time.perf_counter()
            with torch.no_grad():
                for p, received in zip(model.parameters(), parameters, strict=True):
                    p.copy_(torch.from_numpy(received))
            optimizer = torch.optim.SGD(model.parameters(), lr=LR)
            optimizer.zero_grad(set_to_none=True)
            torch.nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
            trained = [p.detach().numpy().copy() for p in model.parameters()]
            return trained, SAMPLES, {"fit_seconds": time.perf_counter() - started}

    ca = args.ca.read_bytes() if args.ca is not None else None
    start_client(
        server_address=f"{args.host}:{args.port}",
        client=Silo().to_client(),
        grpc_max_message_length=MAX_MESSAGE_BYTES,
        root_certificates=ca,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    roles = parser.add_subparsers(dest="role", required=True)
    server = roles.add_parser("server")
    server.add_argument("--silos", type=int, required=True)
    server.add_argument("--rounds", type=int, required=True)
    server.add_argument("--out", type=Path, required=True)
    server.add_argument("--certs", type=Path)
    client = roles.add_parser("client")
    client.add_argument("--silo", type=int, required=True)
    client.add_argument("--ca", type=Path)
    for role in (server, client):
        role.add_argument("--port", type=int, required=True)
        role.add_argument("--parameters", type=float, required=True)
        role.add_argument("--host", default="127.0.0.1", help="the server's address")
    args = parser.parse_args()
    if args.role == "server":
        serve(args)
    else:
        join(args)


if __name__ == "__main__":
    main()
