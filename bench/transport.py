"""The deployment path on loopback: a provisioned consortium of real processes over mutual-TLS
gRPC, FedAvg with one local step, for several model sizes and silo counts, side by side.

Per configuration it reports:
- round overhead beyond local training: a round's wall time minus its slowest silo's training;
- bytes on the wire over payload bytes: loopback traffic (TLS, HTTP/2, protobuf frames,
  envelopes, metrics scrapes) over the safetensors payloads the coordinator counted;
- coordinator peak RSS (VmHWM) over the model's size in bytes, and the same after subtracting
  the coordinator's resident size with a tiny model (the interpreter, torch, gRPC).

Run: `python -m bench.transport [--sizes 1e5,1e6,1e7] [--silos 3,10] [--rounds 3]`.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import psutil
import yaml

from bench.common import write
from fedsilo.ops.demo import LocalConsortium, current_round, free_port

FEATURES, SAMPLES = 32, 64


def hidden_width(parameters: float) -> int:
    """MLP FEATURES -> h -> 2 has 35h + 2 parameters."""
    return max(1, round((parameters - 2) / (FEATURES + 3)))


def run_config(root: Path, parameters: float, silos: int, rounds: int) -> dict:
    names = [f"s{i}" for i in range(silos)]
    consortium, _ = LocalConsortium.provision(root, "bench", names)
    metrics_port = free_port()
    width = hidden_width(parameters)
    policy = root / "policy.yaml"
    policy.write_text(
        yaml.safe_dump(
            {
                "version": 1,
                "name": "transport-bench",
                "rounds": rounds,
                "eval_every": rounds,
                "algorithm": {"name": "fedavg"},
                "model": {"name": "mlp", "hidden": [width]},
                "training": {"steps": 1, "batch_size": SAMPLES, "lr": 0.01},
                "participants": {"min_silos": silos, "phase_timeout_s": 600},
                "compute": {"device": "cpu"},
            }
        )
    )
    consortium.sign_policy(policy)
    for i, name in enumerate(names):
        _write_site(root, name, np.random.default_rng(i))

    net_before = psutil.net_io_counters(pernic=True)["lo"].bytes_recv
    try:
        consortium.start_coordinator(
            metrics_port, 0.5, "--linger-seconds", "600", "--max-payload-mb", "4096"
        )
        for name in names:
            consortium.start_silo(name, root / "sites" / name / "silo.yaml", 0.5)
        while current_round(metrics_port) < rounds:
            consortium.check()
            time.sleep(0.5)
        coordinator = psutil.Process(consortium.processes["coordinator"].pid)
        peak_rss = _peak_rss(coordinator.pid)
        while not (root / "results" / "history.json").exists():
            time.sleep(0.2)
        payload = _payload_bytes(metrics_port)
        net = psutil.net_io_counters(pernic=True)["lo"].bytes_recv - net_before
    finally:
        consortium.stop()
    history = json.loads((root / "results" / "history.json").read_text())
    overheads = [
        r["seconds"] - max(r["compute_seconds"]["train"].values()) for r in history["rounds"]
    ]
    model_bytes = 4 * (FEATURES * width + width + 2 * width + 2)
    return {
        "parameters": FEATURES * width + width + 2 * width + 2,
        "silos": silos,
        "model_bytes": model_bytes,
        "round_seconds": statistics.median(r["seconds"] for r in history["rounds"]),
        "round_overhead_seconds": statistics.median(overheads),
        "payload_bytes": payload,
        "loopback_bytes": net,
        "wire_over_payload": net / payload,
        "coordinator_peak_rss_bytes": peak_rss,
    }


def _write_site(root: Path, name: str, rng: np.random.Generator) -> None:
    site = root / "sites" / name
    site.mkdir(parents=True)
    x = rng.normal(size=(SAMPLES, FEATURES))
    np.savez(site / "data.npz", x=x, y=(x[:, 0] > 0).astype(np.int64))
    (site / "silo.yaml").write_text(
        yaml.safe_dump(
            {
                "version": 1,
                "kit": str(root / "kits" / "silos" / name),
                "data": {
                    "source": {
                        "source": "npz",
                        "path": "data.npz",
                        "partition": {"kind": "iid", "silos": 1},
                    }
                },
            }
        )
    )


def _peak_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc (Linux only)")


def _payload_bytes(port: int) -> float:
    import urllib.request

    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        s.value
        for f in text_string_to_metric_families(text)
        for s in f.samples
        if s.name == "fedsilo_bytes_total"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e5,1e6,1e7")
    parser.add_argument("--silos", default="3,10")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    silo_counts = [int(k) for k in args.silos.split(",")]
    rows = []
    with tempfile.TemporaryDirectory(prefix="fedsilo-bench-") as tmp:
        baseline = run_config(Path(tmp) / "baseline", 1e3, 3, 2)["coordinator_peak_rss_bytes"]
        for k in silo_counts:
            for size in sizes:
                row = run_config(Path(tmp) / f"p{size:.0e}-k{k}", size, k, args.rounds)
                row["peak_rss_over_model"] = row["coordinator_peak_rss_bytes"] / row["model_bytes"]
                row["peak_rss_beyond_baseline_over_model"] = (
                    row["coordinator_peak_rss_bytes"] - baseline
                ) / row["model_bytes"]
                rows.append(row)
                print(
                    {k2: round(v, 3) if isinstance(v, float) else v for k2, v in row.items()},
                    flush=True,
                )

    fig, axes = plt.subplots(1, 3, figsize=(15, 4))
    for k in silo_counts:
        mine = [r for r in rows if r["silos"] == k]
        xs = [r["parameters"] for r in mine]
        axes[0].plot(xs, [r["round_overhead_seconds"] for r in mine], "o-", label=f"{k} silos")
        axes[1].plot(xs, [r["wire_over_payload"] for r in mine], "o-", label=f"{k} silos")
        axes[2].plot(
            xs, [r["peak_rss_beyond_baseline_over_model"] for r in mine], "o-", label=f"{k} silos"
        )
    titles = (
        "round overhead beyond training (s)",
        "loopback bytes / payload bytes",
        "coordinator peak RSS beyond baseline / model bytes",
    )
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("parameters")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].axhline(1.05, color="grey", ls="--")
    axes[2].axhline(3.0, color="grey", ls="--")
    path = write(
        "transport",
        {
            "baseline_coordinator_peak_rss_bytes": baseline,
            "rows": rows,
            "goals": {"wire_over_payload": 1.05, "peak_rss_over_model_at_1e8": 3.0},
            "not_measured": "the same workload under Flower (flwr), for a ratio against the peer",
        },
        fig,
    )
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
