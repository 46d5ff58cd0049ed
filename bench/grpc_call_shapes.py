"""What one gRPC call costs in CPU by its shape: a silo's exchange with the coordinator (a
request out, a reply back) as the streaming call fedsilo makes today, and as the other shapes
gRPC's Python API offers, on the same mutual-TLS channel and bytes.

A silo's `Exchange` (wire/framing.py `exchange_call`) is a stream-stream call: its request is an
envelope frame then the payload's chunks, and so is its reply. gRPC's synchronous Python client
consumes a streamed request on a thread it starts for each call, and wakes its channel's
polling thread when no call is in flight; a unary request needs neither. This bench times, per
call and in each process's CPU (all its threads), four shapes carrying the same two frames
each way (a 300-byte envelope, then a body of `--sizes` bytes):

- `stream_stream`: fedsilo's `Exchange` today;
- `unary_stream`: the request as one message, the reply streamed;
- `unary_stream_single_thread`: the same, on a channel with gRPC's experimental
  `SingleThreadedUnaryStream` option (the reply read on the calling thread);
- `unary_unary`: one message each way (the frames joined).

The server runs in a process of its own, with a thread pool as the coordinator's does, and
reports its CPU between calls; the client is this process. The certificates are a throw-away
consortium's (the coordinator's server certificate, a silo's client certificate). It is a
diagnostic for issue 40 (docs/performance.md): what changing the call shape could save a round,
measured before any protocol change. Each shape runs `--calls` calls after 20 to warm up, three
times, alternating shapes; the JSON holds the medians, and each shape's ratio to
`stream_stream`.

Run: `python -m bench.grpc_call_shapes [--sizes 1e3,4e5,4e6] [--calls 200]`.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import grpc
import grpc.experimental
import matplotlib.pyplot as plt

from bench.common import write
from bench.grpc_floor import REPO, UNLIMITED, client_credentials, server_credentials

SERVICE = "shapes.Shapes"
ENVELOPE = b"e" * 300  # about a signed envelope frame's size
SHAPES = ("stream_stream", "unary_stream", "unary_stream_single_thread", "unary_unary")


def _serve(kits: Path, body: int) -> None:
    """The server's role: answer every shape with the envelope and `body` bytes, print the port,
    then print this process's CPU seconds at every line read from stdin."""
    reply = bytes(body)

    def stream_stream(frames: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        for _ in frames:
            pass
        yield ENVELOPE
        yield reply

    def unary_stream(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        yield ENVELOPE
        yield reply

    def unary_unary(request: bytes, context: grpc.ServicerContext) -> bytes:
        return ENVELOPE + reply

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=8), options=UNLIMITED)
    handlers = {
        "StreamStream": grpc.stream_stream_rpc_method_handler(stream_stream),
        "UnaryStream": grpc.unary_stream_rpc_method_handler(unary_stream),
        "UnaryUnary": grpc.unary_unary_rpc_method_handler(unary_unary),
    }
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler(SERVICE, handlers)])
    port = server.add_secure_port("127.0.0.1:0", server_credentials(kits))
    server.start()
    print(port, flush=True)
    for _ in sys.stdin:
        print(time.process_time(), flush=True)
    server.stop(grace=None)


def _calls(channel: grpc.Channel, single: grpc.Channel, body: bytes) -> dict[str, Callable]:
    stream_stream = channel.stream_stream(f"/{SERVICE}/StreamStream")
    unary_stream = channel.unary_stream(f"/{SERVICE}/UnaryStream")
    single_stream = single.unary_stream(f"/{SERVICE}/UnaryStream")
    unary_unary = channel.unary_unary(f"/{SERVICE}/UnaryUnary")
    return {
        "stream_stream": lambda: list(stream_stream(iter((ENVELOPE, body)), timeout=60)),
        "unary_stream": lambda: list(unary_stream(ENVELOPE + body, timeout=60)),
        "unary_stream_single_thread": lambda: list(single_stream(ENVELOPE + body, timeout=60)),
        "unary_unary": lambda: unary_unary(ENVELOPE + body, timeout=60),
    }


def measure(kits: Path, size: int, calls: int) -> dict[str, dict[str, float]]:
    """Per-call wall and CPU milliseconds (client and server) of each shape, `size`-byte bodies
    both ways; the medians of three alternating runs."""
    server = subprocess.Popen(
        [sys.executable, "-m", "bench.grpc_call_shapes", "serve", "--kits", str(kits)]
        + ["--body", str(size)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        cwd=REPO,
    )
    assert server.stdin is not None and server.stdout is not None
    port = int(server.stdout.readline())

    def server_cpu() -> float:
        server.stdin.write("\n")
        server.stdin.flush()
        return float(server.stdout.readline())

    credentials = client_credentials(kits / "silos" / "s0")
    single_thread = [(grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]
    target = f"127.0.0.1:{port}"
    runs: dict[str, list[tuple[float, float, float]]] = {shape: [] for shape in SHAPES}
    try:
        with (
            grpc.secure_channel(target, credentials, options=UNLIMITED) as channel,
            grpc.secure_channel(target, credentials, options=UNLIMITED + single_thread) as single,
        ):
            shapes = _calls(channel, single, bytes(size))
            for shape, call in shapes.items():  # each shape carries the frames both ways
                reply = call()
                got = len(reply) if isinstance(reply, bytes) else sum(len(f) for f in reply)
                if got != len(ENVELOPE) + size:
                    raise RuntimeError(f"{shape} replied {got} bytes, not {len(ENVELOPE) + size}")
            for _ in range(3):
                for shape, call in shapes.items():
                    for _ in range(20):
                        call()
                    server_start, wall, cpu = server_cpu(), time.perf_counter(), time.process_time()
                    for _ in range(calls):
                        call()
                    runs[shape].append(
                        (
                            (time.perf_counter() - wall) / calls * 1e3,
                            (time.process_time() - cpu) / calls * 1e3,
                            (server_cpu() - server_start) / calls * 1e3,
                        )
                    )
    finally:
        server.stdin.close()
        server.wait(timeout=60)
    medians = {
        shape: {
            "wall_ms": statistics.median(r[0] for r in measured),
            "client_cpu_ms": statistics.median(r[1] for r in measured),
            "server_cpu_ms": statistics.median(r[2] for r in measured),
        }
        for shape, measured in runs.items()
    }
    base = dict(medians["stream_stream"])
    for row in medians.values():
        row |= {f"{key}_vs_stream_stream": row[key] / base[key] for key in base}
    return medians


def _figure(rows: list[dict]) -> plt.Figure:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4), sharey=True)
    width = 0.8 / len(SHAPES)
    for ax, side in zip(axes, ("client_cpu_ms", "server_cpu_ms"), strict=True):
        for index, shape in enumerate(SHAPES):
            ax.bar(
                [i + index * width for i in range(len(rows))],
                [row["shapes"][shape][f"{side}_vs_stream_stream"] for row in rows],
                width=width,
                label=shape,
            )
        ax.set_xticks(
            [i + 0.4 - width / 2 for i in range(len(rows))], [f"{r['bytes']:.0e} B" for r in rows]
        )
        ax.set_title(f"{side.split('_')[0]} CPU per call, over stream-stream")
        ax.axhline(1.0, color="black", linewidth=0.8)
        ax.grid(alpha=0.3, axis="y")
    axes[0].legend(fontsize=8)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="role")
    serve = sub.add_parser("serve")
    serve.add_argument("--kits", type=Path, required=True)
    serve.add_argument("--body", type=int, required=True)
    parser.add_argument("--sizes", default="1e3,4e5,4e6")
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--out", default="grpc_call_shapes")
    args = parser.parse_args()
    if args.role == "serve":
        _serve(args.kits, args.body)
        return
    from fedsilo.ops.demo import LocalConsortium

    rows = []
    with tempfile.TemporaryDirectory(prefix="fedsilo-shapes-") as tmp:
        LocalConsortium.provision(Path(tmp), "shapes", ["s0"])
        for size in (int(float(s)) for s in args.sizes.split(",")):
            rows.append({"bytes": size, "shapes": measure(Path(tmp) / "kits", size, args.calls)})
            for shape, row in rows[-1]["shapes"].items():
                print(
                    f"{size:.0e} B {shape}: client {row['client_cpu_ms']:.3f} ms, "
                    f"server {row['server_cpu_ms']:.3f} ms, wall {row['wall_ms']:.3f} ms",
                    flush=True,
                )
    path = write(args.out, {"rows": rows, "calls": args.calls}, _figure(rows))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
