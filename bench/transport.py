"""The deployment path on loopback: a provisioned consortium of real processes over mutual-TLS
gRPC, FedAvg with one local step, for several model sizes and silo counts, side by side.

Per configuration it reports:
- round overhead beyond local training: a round's wall time minus its slowest silo's training;
- bytes on the wire over payload bytes: loopback traffic (TLS, HTTP/2, protobuf frames,
  envelopes, metrics scrapes) over the safetensors payloads the coordinator counted;
- coordinator peak RSS (VmHWM) over the model's size in bytes, and the same after subtracting
  the coordinator's resident size with a tiny model (the interpreter, torch, gRPC).

- CPU milliseconds per round of the coordinator, of the busiest silo and of all parties, between
  rounds (no start-up);
- the floor: the median round of a bare mutual-TLS gRPC exchange of the same bytes with the
  same silo processes' count and the same certificates (bench/grpc_floor.py), and
  `overhead_over_floor`, the round overhead over it (goal: at most 2); and the same floor with
  the allocator setting fedsilo's services use (ops/memory.py), which is faster, and
  `overhead_over_kept_floor` over it (`floor_kept_*`).

Each configuration runs `--repeats` times (default 3), fedsilo, the floor and Flower in turn;
every number is the median over the repeats, and the ratios against the floor and Flower also
keep each repeat's value (`*_runs`), so their spread shows.

Every configuration also runs under Flower (flwr 1.41, legacy `start_server`/`start_client`
over its gRPC transport) when Flower's interpreter exists: bench/flower_peer.py is the same
workload (model, data, FedAvg, one SGD step), run by bench/flower_runner.py and measured the
same way (loopback bytes, the server's own VmHWM, median round seconds, overhead beyond the
slowest client's fit). Flower lives in its own venv, .venv-flwr (`make flower-env`, or point
FEDSILO_FLOWER_PYTHON at another interpreter), because every flwr>=1.20 pins protobuf<7 while
fedsilo's stubs need protobuf 7. Flower's link is server-authenticated TLS with a throw-away
CA (its legacy API takes no client certificates, so not mutual TLS: `flower_tls` says which);
its payload is computed (2 * silos * rounds * model bytes), Flower counting none. Rows then
gain `flower_round_seconds`, `flower_round_overhead_seconds`, `flower_wire_over_payload`,
`flower_server_peak_rss_bytes`, `flower_tls` and the ratios `round_seconds_over_flower` and
`peak_rss_over_flower` (fedsilo over Flower; below 1 is fedsilo ahead) and
`flower_overhead_over_floor`, and the fourth plot
sets the round seconds of both side by side. Without the interpreter, the results say so
under "not_measured".

Run: `python -m bench.transport [--sizes 1e5,1e6,1e7] [--silos 3,10] [--rounds 3] [--repeats 3]
[--out transport]`.
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import psutil
import yaml

from bench.common import write
from bench.flower_peer import SAMPLES, hidden_width, parameter_count, site_data
from bench.flower_runner import REPO, FlowerFailed, flower_python, run_flower
from bench.grpc_floor import measured_floor
from fedsilo.ops.demo import LocalConsortium, free_port


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
        write_site(root, name, i)

    net_before = psutil.net_io_counters(pernic=True)["lo"].bytes_recv
    try:
        consortium.start_coordinator(
            metrics_port, 0.5, "--linger-seconds", "600", "--max-payload-mb", "4096"
        )
        for name in names:
            consortium.start_silo(name, root / "sites" / name / "silo.yaml", 0.5)
        # (round, CPU seconds) as rounds pass, read from the state file, which costs the
        # coordinator nothing (a metrics scrape would cost it CPU and loopback bytes)
        spans: list[tuple[int, dict[str, float]]] = []
        while (now := rounds_saved(root / "state.db")) < rounds:
            consortium.check()
            if now >= 1 and (not spans or spans[-1][0] != now):
                spans.append((now, cpu_seconds(consortium.processes)))
            time.sleep(0.01)
        while not (root / "results" / "history.json").exists():
            time.sleep(0.2)
        peak = peak_rss(consortium.processes["coordinator"].pid)  # the whole run's peak
        payload = _payload_bytes(metrics_port)
        net = psutil.net_io_counters(pernic=True)["lo"].bytes_recv - net_before
    finally:
        consortium.stop()
    count = parameter_count(width)  # the MLP's, near `parameters`
    floor = measured_floor(root / "kits", names, count, rounds, service_allocator=False)
    kept = measured_floor(root / "kits", names, count, rounds, service_allocator=True)
    cpu = cpu_per_round(spans, names)
    history = json.loads((root / "results" / "history.json").read_text())
    overhead = statistics.median(
        r["seconds"] - max(r["compute_seconds"]["train"].values()) for r in history["rounds"]
    )
    model_bytes = 4 * count
    return {
        "parameters": count,
        "silos": silos,
        "model_bytes": model_bytes,
        "round_seconds": statistics.median(r["seconds"] for r in history["rounds"]),
        "round_overhead_seconds": overhead,
        "payload_bytes": payload,
        "loopback_bytes": net,
        "wire_over_payload": net / payload,
        "coordinator_peak_rss_bytes": peak,
        **floor,
        **{key.replace("floor_", "floor_kept_", 1): value for key, value in kept.items()},
        **cpu,
        "overhead_over_floor": overhead / floor["floor_round_seconds"],
        "overhead_over_kept_floor": overhead / kept["floor_round_seconds"],
    }


def write_site(root: Path, name: str, index: int) -> None:
    site = root / "sites" / name
    site.mkdir(parents=True)
    x, y = site_data(index)  # the rows Flower's client `index` trains on too
    np.savez(site / "data.npz", x=x, y=y)
    (site / "silo.yaml").write_text(
        yaml.safe_dump(
            {
                "version": 1,
                "kit": str(root / "kits" / "silos" / name),
                "data": {"source": "npz", "path": "data.npz"},
            }
        )
    )


def rounds_saved(state: Path) -> int:
    """The last round the coordinator saved as completed (0 before any), read-only."""
    if not state.exists():
        return 0
    try:
        with sqlite3.connect(f"file:{state}?mode=ro", uri=True, timeout=1) as db:
            (last,) = db.execute(
                "SELECT MAX(round) FROM rounds WHERE status = 'completed'"
            ).fetchone()
    except sqlite3.OperationalError:  # created, but no table yet
        return 0
    return last or 0


def cpu_seconds(processes: dict) -> dict[str, float]:
    """Each party's CPU seconds so far (user and system, with its child processes)."""
    seconds = {}
    for name, process in processes.items():
        try:
            tree = [psutil.Process(process.pid)]
            tree += tree[0].children(recursive=True)
            seconds[name] = sum(sum(p.cpu_times()[:2]) for p in tree)
        except psutil.NoSuchProcess:
            continue
    return seconds


def cpu_per_round(spans: list[tuple[int, dict[str, float]]], silos: list[str]) -> dict:
    """CPU milliseconds per round of the coordinator and of the busiest silo, between the first
    and the last round seen passing (so no start-up is counted); on a machine with fewer cores
    than processes their sum, not the slowest party's, bounds the round."""
    if len(spans) < 2 or spans[-1][0] == spans[0][0]:
        return {}
    (first, before), (last, after) = spans[0], spans[-1]
    per_round = {name: 1e3 * (after[name] - before[name]) / (last - first) for name in before}
    return {
        "coordinator_cpu_ms_per_round": per_round["coordinator"],
        "silo_cpu_ms_per_round": max(per_round[name] for name in silos),
        "all_cpu_ms_per_round": sum(per_round.values()),
    }


def peak_rss(pid: int) -> int:
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


def _memory_needed(parameters: float, silos: int) -> float:
    """What one configuration needs on this one machine: each silo process holds its model a
    few times over (parameters, gradients, the received and the sent copy) beside the
    interpreter, and Flower's clients as much again when it runs too."""
    per_silo = 6 * 4 * parameters + 0.5e9
    return 2 * silos * per_silo


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e5,1e6,1e7,1e8")
    parser.add_argument("--silos", default="3,10")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each system, alternated")
    parser.add_argument("--out", default="transport", help="results name: bench/results/OUT.json")
    args = parser.parse_args()
    sizes = [float(s) for s in args.sizes.split(",")]
    silo_counts = [int(k) for k in args.silos.split(",")]
    flower, flwr_version = flower_python(), None
    rows, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="fedsilo-bench-") as tmp:
        baseline = run_config(Path(tmp) / "baseline", 1e3, 3, 2)["coordinator_peak_rss_bytes"]
        for k in silo_counts:
            for size in sizes:
                needed = _memory_needed(size, k)
                if needed > psutil.virtual_memory().available:
                    skipped.append(
                        f"{size:.0e} parameters x {k} silos: needs ~{needed / 1e9:.0f} GB for the"
                        f" silo processes, {psutil.virtual_memory().available / 1e9:.0f} GB free"
                    )
                    continue
                row = _repeated(Path(tmp), size, k, args.rounds, args.repeats, baseline)
                flwr_version = row.pop("flwr", flwr_version)
                rows.append(row)
                print(
                    {k2: round(v, 3) if isinstance(v, float) else v for k2, v in row.items()},
                    flush=True,
                )

    document = {
        "baseline_coordinator_peak_rss_bytes": baseline,
        "rows": rows,
        "goals": {
            "wire_over_payload": 1.05,
            "peak_rss_over_model_at_1e8": 3.0,
            "overhead_over_floor": 2.0,
        },
    }
    if skipped:
        document["skipped_for_memory"] = skipped
    if flower is None:
        document["not_measured"] = (
            "the same workload under Flower (flwr): run `make flower-env` (or set"
            " FEDSILO_FLOWER_PYTHON to an interpreter with flwr 1.41 and torch)"
        )
    else:
        document["flower"] = {
            "python": _portable(flower),
            "flwr": flwr_version,
            "transport": "legacy start_server/start_client gRPC; TLS authenticates the server"
            " only (no client certificates in Flower's legacy API)",
            "payload_bytes": "computed: 2 * silos * rounds * model_bytes",
        }
    path = write(args.out, document, _figure(rows, silo_counts))
    print(f"wrote {path} and {path.with_suffix('.png')}")


# the ratios whose spread over repeats a row reports beside their median
SPREAD = (
    "overhead_over_floor",
    "overhead_over_kept_floor",
    "flower_overhead_over_floor",
    "round_seconds_over_flower",
)


def _repeated(tmp: Path, size: float, silos: int, rounds: int, repeats: int, baseline: int) -> dict:
    """One configuration `repeats` times, fedsilo (then the gRPC floor on its certificates) and
    Flower in turn; each number is the median over the repeats, and the ratios of `SPREAD`
    also keep every repeat's value, so the spread of a noisy shared machine shows."""
    runs = []
    for repeat in range(repeats):
        folder = tmp / f"p{size:.0e}-k{silos}-r{repeat}"
        row = run_config(folder, size, silos, rounds)
        row["peak_rss_over_model"] = row["coordinator_peak_rss_bytes"] / row["model_bytes"]
        row["peak_rss_beyond_baseline_over_model"] = (
            row["coordinator_peak_rss_bytes"] - baseline
        ) / row["model_bytes"]
        try:
            peer = run_flower(tmp / f"flower-p{size:.0e}-k{silos}-r{repeat}", size, silos, rounds)
        except FlowerFailed as failed:  # a result too: the peer could not run it
            row["flower_failed"] = str(failed).split(";")[0]
            peer = None
        if peer is not None:
            row |= _versus_flower(row, peer) | {"flwr": peer["flwr"]}
        runs.append(row)
    merged = {
        key: statistics.median(run[key] for run in runs)
        if isinstance(value, int | float) and not isinstance(value, bool)
        else value
        for key, value in runs[0].items()
        if all(key in run for run in runs)
    }
    for key in SPREAD:
        if key in merged:
            merged[f"{key}_runs"] = [run[key] for run in runs]
    merged["repeats"] = repeats
    return merged


def _versus_flower(row: dict, peer: dict) -> dict:
    """Flower's numbers for `row`'s configuration, and fedsilo's over Flower's."""
    return {
        "flower_round_seconds": peer["round_seconds"],
        "flower_round_overhead_seconds": peer["round_overhead_seconds"],
        "flower_wire_over_payload": peer["wire_over_payload"],
        "flower_server_peak_rss_bytes": peer["server_peak_rss_bytes"],
        "flower_tls": peer["tls"],
        "round_seconds_over_flower": row["round_seconds"] / peer["round_seconds"],
        "flower_overhead_over_floor": peer["round_overhead_seconds"] / row["floor_round_seconds"],
        "peak_rss_over_flower": row["coordinator_peak_rss_bytes"] / peer["server_peak_rss_bytes"],
    }


def _figure(rows: list[dict], silo_counts: list[int]) -> plt.Figure:
    fig, axes = plt.subplots(1, 5, figsize=(25, 4))
    for k in silo_counts:
        mine = [r for r in rows if r["silos"] == k]
        xs = [r["parameters"] for r in mine]
        axes[0].plot(xs, [r["round_overhead_seconds"] for r in mine], "o-", label=f"{k} silos")
        axes[1].plot(xs, [r["wire_over_payload"] for r in mine], "o-", label=f"{k} silos")
        axes[2].plot(
            xs, [r["peak_rss_beyond_baseline_over_model"] for r in mine], "o-", label=f"{k} silos"
        )
        ours = axes[3].plot(
            xs, [r["round_seconds"] for r in mine], "o-", label=f"fedsilo, {k} silos"
        )
        if all("flower_round_seconds" in r for r in mine):
            theirs = [r["flower_round_seconds"] for r in mine]
            color = ours[0].get_color()
            axes[3].plot(xs, theirs, "s--", color=color, label=f"Flower, {k} silos")
        floor = axes[4].plot(
            xs, [r["overhead_over_floor"] for r in mine], "o-", label=f"fedsilo, {k} silos"
        )
        color = floor[0].get_color()
        kept = [r["overhead_over_kept_floor"] for r in mine]
        axes[4].plot(xs, kept, "o:", color=color, label=f"fedsilo over the kept floor, {k} silos")
        if all("flower_overhead_over_floor" in r for r in mine):
            theirs = [r["flower_overhead_over_floor"] for r in mine]
            axes[4].plot(xs, theirs, "s--", color=color, label=f"Flower, {k} silos")
    flower_measured = any("flower_round_seconds" in r for r in rows)
    titles = (
        "round overhead beyond training (s)",
        "loopback bytes / payload bytes",
        "coordinator peak RSS beyond baseline / model bytes",
        "round seconds, fedsilo vs Flower"
        if flower_measured
        else "round seconds (Flower not measured: make flower-env)",
        "round time beyond training / bare mTLS gRPC round",
    )
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("parameters")
        ax.set_title(title, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[1].axhline(1.05, color="grey", ls="--")
    axes[2].axhline(3.0, color="grey", ls="--")
    axes[3].set_yscale("log")
    axes[4].axhline(2.0, color="grey", ls="--")
    return fig


def _portable(interpreter: Path) -> str:
    """The interpreter as a path inside the repository when it lives there (results carry no
    absolute paths of the machine that wrote them), else its file name."""
    try:
        return str(interpreter.absolute().relative_to(REPO))
    except ValueError:
        return interpreter.name


if __name__ == "__main__":
    main()
