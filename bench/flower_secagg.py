"""Flower's own SecAgg+ beside Flower's own plaintext FedAvg round, at bench/secagg.py's
1e6 parameters x 10 silos: the peer figure for fedsilo's masking ratio (bench/secagg.py).

Runs bench/flower_secagg_peer.py under Flower's interpreter (FEDSILO_FLOWER_PYTHON, default
.venv-flwr/bin/python, made by `make flower-env`; flwr pins protobuf<7 while fedsilo's stubs
need protobuf 7) N times, R rounds each; the peer's docstring says what runs and how a round
is timed: three in-process Flower deployments (plain `DefaultWorkflow`; `SecAggPlusWorkflow`
with num_shares 10, threshold 7, "complete"; num_shares 5, threshold 3, "sparse"; other
SecAgg+ parameters at Flower's defaults) taking turns round by round, clients answering one
at a time. The order of the three within a round rotates from run to run (run k starts with
method k mod 3).

Per run and method: the median over rounds 2..R of the round's wall seconds and process CPU
seconds, of its split (ClientApps, Flower's message encoding at both ends, the server: the
rest) and of the bytes per client each way, and the ratios of each SecAgg+ variant to plain
(of the medians). Over the runs: the median of those figures and their min-max. A check
that SecAgg+ really ran: Flower's log says "Secure aggregation completed." once per secure
round, each secure round sends 4 messages per client (setup, share keys, collect masked
vectors, unmask), and after round 1 the secure global model differs from plain's by no more
than Flower's quantization allows (same initial model, same local step: the difference is
the aggregation's alone; later rounds add its effect on training).

Run: `python -m bench.flower_secagg [--rounds 20] [--runs 3]` (about a minute per 20-round run
on 2 cores); writes bench/results/flower_secagg.json and .png. Without Flower's interpreter it
says so and exits 0.

`--workload trained` runs bench/secagg.py's `--workload trained` instead of the default
"step" workload: 256 samples per client and one local epoch in batches of 64 (the peer's
docstring), so that SecAgg+'s ratio over Flower's plaintext sits beside fedsilo's masking
ratio with real local training; it writes bench/results/flower_secagg_trained.json and .png.
`--out NAME` writes bench/results/NAME.json and .png instead (either workload).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import tempfile
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from bench.common import write
from bench.flower_runner import flower_python

REPO = Path(__file__).resolve().parent.parent
PEER = "bench.flower_secagg_peer"  # run as a module from REPO: it imports bench.turns
METHODS = ("plain", "secaggplus_complete", "secaggplus_sparse")
SECURE = METHODS[1:]
STAGES = 4  # messages per client in a SecAgg+ round: setup, share keys, collect, unmask
COMPLETED = "Secure aggregation completed."
FIGURES = (
    "seconds",
    "cpu_seconds",
    "client_seconds",
    "wire_seconds",
    "server_seconds",
    "bytes_down",
    "bytes_up",
)
PER_CLIENT = ("bytes_down", "bytes_up")
GOAL_RATIO = 2.0  # the masking goal under discussion for fedsilo (bench/secagg.py)
WORKLOADS = ("step", "trained")  # bench/flower_secagg_peer.py's


def run_peer(
    python: Path, rounds: int, order: list[str], timeout_s: float, workload: str = "step"
) -> dict[str, Any]:
    """One peer run: its JSON report, with the count of completed secure aggregations."""
    with tempfile.TemporaryDirectory(prefix="flower-secagg-") as folder:
        out, log = Path(folder) / "peer.json", Path(folder) / "peer.log"
        command = [str(python), "-m", PEER, "--rounds", str(rounds), "--order", ",".join(order)]
        command += ["--workload", workload]
        with log.open("w") as sink:
            done = subprocess.run(
                [*command, "--out", str(out)],
                stdout=sink,
                stderr=subprocess.STDOUT,
                timeout=timeout_s,
                cwd=REPO,
                env={**os.environ, "FLWR_TELEMETRY_ENABLED": "0"},
                check=False,
            )
        text = log.read_text()
        if done.returncode != 0:
            raise RuntimeError(f"Flower peer exited with {done.returncode}:\n{text[-4000:]}")
        report = json.loads(out.read_text())
    report["secure_aggregations_completed"] = text.count(COMPLETED)
    return report


def steady(rounds: list[dict[str, Any]], clients: int) -> dict[str, float]:
    """Medians over rounds 2..R; bytes per client."""
    return {
        key: statistics.median(r[key] for r in rounds[1:]) / (clients if key in PER_CLIENT else 1)
        for key in FIGURES
    }


def summarize_run(report: dict[str, Any], rounds: int) -> dict[str, Any]:
    clients, methods = report["clients"], report["methods"]
    rows = {m: steady(methods[m]["rounds"], clients) for m in METHODS}
    for method in METHODS:
        rows[method]["round1_seconds"] = methods[method]["rounds"][0]["seconds"]
        rows[method]["messages_per_round"] = methods[method]["rounds"][-1]["messages"]
        rows[method]["round1_max_abs_diff_vs_plain"] = methods[method][
            "max_abs_diff_vs_plain_by_round"
        ][0]
        rows[method]["global_model_dtypes"] = methods[method]["global_model_dtypes"]
    for method in SECURE:
        rows[method]["ratio"] = {
            key: rows[method][key] / rows["plain"][key] for key in ("seconds", "cpu_seconds")
        }
    bound = report["quantization_error_bound"]
    checks = {
        "secure_aggregations_completed": report["secure_aggregations_completed"],
        "expected": len(SECURE) * rounds,
        "messages_per_secure_round_ok": all(
            r["messages"] == STAGES * clients for m in SECURE for r in methods[m]["rounds"]
        ),
        "round1_within_quantization_bound": all(
            rows[m]["round1_max_abs_diff_vs_plain"] <= bound for m in SECURE
        ),
    }
    return {
        "order": report["order"],
        "methods": rows,
        "checks": checks,
        "per_round": {m: methods[m]["rounds"] for m in METHODS},
        "max_abs_diff_vs_plain_by_round": {
            m: methods[m]["max_abs_diff_vs_plain_by_round"] for m in SECURE
        },
        "peak_rss_bytes": report["peak_rss_bytes"],
    }


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def over_runs(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Per method, the median and min-max over runs of each run's steady-state figures."""
    summary: dict[str, Any] = {}
    for method in METHODS:
        rows = [run["methods"][method] for run in runs]
        summary[method] = {key: spread([row[key] for row in rows]) for key in FIGURES}
        if method in SECURE:
            summary[method]["ratio"] = {
                key: spread([row["ratio"][key] for row in rows])
                for key in ("seconds", "cpu_seconds")
            }
    return summary


def table(summary: dict[str, Any]) -> str:
    lines = [
        f"{'method':<20}{'wall s':>8}{'cpu s':>8}{'x plain (wall)':>22}{'x plain (cpu)':>22}"
        f"{'up MB/client':>14}"
    ]
    for method in METHODS:
        row = summary[method]
        cells = f"{row['seconds']['median']:>8.3f}{row['cpu_seconds']['median']:>8.3f}"
        for key in ("seconds", "cpu_seconds"):
            if method in SECURE:
                r = row["ratio"][key]
                cells += f"{r['median']:>10.2f} ({r['min']:.2f}-{r['max']:.2f})"
            else:
                cells += f"{'1':>22}"
        lines.append(f"{method:<20}{cells}{row['bytes_up']['median'] / 1e6:>14.1f}")
    return "\n".join(lines)


def plot(summary: dict[str, Any], workload: str = "step") -> plt.Figure:
    figure, (seconds, ratios) = plt.subplots(1, 2, figsize=(11, 4))
    xs = range(len(METHODS))
    for offset, key, label in ((-0.2, "seconds", "wall"), (0.2, "cpu_seconds", "CPU")):
        cells = [summary[m][key] for m in METHODS]
        seconds.bar(
            [x + offset for x in xs],
            [c["median"] for c in cells],
            width=0.4,
            yerr=[[c["median"] - c["min"] for c in cells], [c["max"] - c["median"] for c in cells]],
            label=label,
        )
    seconds.set_xticks(list(xs), METHODS, fontsize=8)
    seconds.set_ylabel("round seconds (median of rounds 2..R)")
    seconds.set_title(f"Flower 1.41, 1e6 parameters x 10 clients, {workload} workload")
    seconds.legend()
    for offset, key, label in ((-0.2, "seconds", "wall"), (0.2, "cpu_seconds", "CPU")):
        cells = [summary[m]["ratio"][key] for m in SECURE]
        ratios.bar(
            [x + offset for x in range(len(SECURE))],
            [c["median"] for c in cells],
            width=0.4,
            yerr=[[c["median"] - c["min"] for c in cells], [c["max"] - c["median"] for c in cells]],
            label=label,
        )
    ratios.axhline(GOAL_RATIO, color="grey", linestyle="--", label=f"{GOAL_RATIO:g}x")
    ratios.set_xticks(list(range(len(SECURE))), SECURE, fontsize=8)
    ratios.set_ylabel("x plain round (median of runs, min-max)")
    ratios.set_title("SecAgg+ over plaintext FedAvg")
    ratios.legend()
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds per run (>= 2)")
    parser.add_argument("--runs", type=int, default=3, help="peer runs")
    parser.add_argument("--timeout", type=float, default=1200.0, help="seconds per peer run")
    parser.add_argument(
        "--workload",
        choices=WORKLOADS,
        default="step",
        help="step: 32 samples, 1 SGD step on 8 (default); trained: 256 samples, 1 epoch of 64s",
    )
    parser.add_argument(
        "--out",
        help="write bench/results/OUT.json and .png (default: flower_secagg, or "
        "flower_secagg_WORKLOAD for another workload)",
    )
    args = parser.parse_args()
    if args.rounds < 2 or args.runs < 1:
        parser.error("at least 2 rounds (round 1 is the warm-up) and 1 run")
    python = flower_python()
    if python is None:
        print(
            "Flower's interpreter is not there (set FEDSILO_FLOWER_PYTHON or run "
            "`make flower-env`); skipping the Flower SecAgg+ bench."
        )
        return
    load_before = os.getloadavg()
    runs, reports = [], []
    for k in range(args.runs):
        order = list(METHODS[k % len(METHODS) :] + METHODS[: k % len(METHODS)])
        report = run_peer(python, args.rounds, order, args.timeout, args.workload)
        reports.append(report)
        runs.append(summarize_run(report, args.rounds))
        plain = runs[-1]["methods"]["plain"]["seconds"]
        print(
            f"run {k + 1}/{args.runs} ({', '.join(order)}): plain {plain:.3f} s, "
            + ", ".join(f"{m} x{runs[-1]['methods'][m]['ratio']['seconds']:.2f}" for m in SECURE),
            flush=True,
        )
    summary = over_runs(runs)
    print(table(summary))
    checks = [run["checks"] for run in runs]
    print(f"checks per run: {checks}")
    first = reports[0]
    name = args.out or (
        "flower_secagg" if args.workload == "step" else f"flower_secagg_{args.workload}"
    )
    path = write(
        name,
        {
            "settings": {
                "rounds": args.rounds,
                "runs": args.runs,
                "steady_state": "median of rounds 2..R per run; then median (min-max) of runs",
                "parameters": first["parameters"],
                "clients": first["clients"],
                "workload": first["workload"],
                "strategy": "FedAvg, all clients every round, no evaluation",
                "secaggplus": {m: first["methods"][m]["num_shares_threshold"] for m in SECURE},
                "secaggplus_defaults": first["secaggplus_defaults"],
                "quantization_error_bound": first["quantization_error_bound"],
                "clients_answer": "one at a time, in process (hand-written Grid)",
                "order": "rotates by run; methods take turns round by round",
            },
            "flwr": first["flwr"],
            "peer_torch_threads": first["torch_threads"],
            "load_average_before": load_before,
            "load_average_after": os.getloadavg(),
            "summary": summary,
            "runs": runs,
        },
        plot(summary, args.workload),
    )
    print(f"wrote bench/results/{path.name} and {path.with_suffix('.png').name}")


if __name__ == "__main__":
    main()
