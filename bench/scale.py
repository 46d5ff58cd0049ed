"""Scale: rounds per second of `fedsilo simulate` against the number of silos, for both
backends (in process, Ray actors on a local instance) and two model sizes, with the memory each
silo costs.

Workload (reduced for a 2-core machine shared with other jobs): FedAvg, every silo 32 training
rows of 20 synthetic features (scikit-learn's make_classification, seeded per silo), one local
SGD step of batch 32 per round; an MLP with hidden [32] (738 parameters) or [512, 512]
(274,434 parameters); 4 rounds, evaluated only in the 4th. Rounds 2 and 3 are timed (round 1
pays the workers' first-task imports, round 4 the evaluation): rounds/s = 2 / their wall time.
Memory: the resident size of the processes holding the silos at the end of the run (the
driver in process; the `ray::SiloHost` workers on Ray), per silo as the slope between the
smallest and the largest silo count. Each run is a fresh subprocess, so no run inherits
another's memory or warm workers; repeats use seeds 0, 1, 2.

Every run has OMP_WAIT_POLICY=PASSIVE, as under the `fedsilo` command.

Run: `nice -n 5 python -m bench.scale` (`--silos 10 50 --repeats 1` for a quick look; `--add`
keeps the runs already in bench/results/scale.json, so silo counts can be run one at a time).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import psutil
import torch
from sklearn.datasets import make_classification

from bench.common import RESULTS, write
from fedsilo.coordinator.engine import RoundRecord
from fedsilo.ops.openmp import WAIT_POLICY
from fedsilo.policies.loading import parse_policy
from fedsilo.silo.data import SiloDataset

FEATURES, TRAIN, ROUNDS = 20, 32, 4
MODELS = {"small": [32], "large": [512, 512]}
BACKENDS = ("inprocess", "ray")
# OpenMP threads that sleep at barriers, as the `fedsilo` command sets (ops/openmp.py)
PASSIVE = {**os.environ, "OMP_WAIT_POLICY": WAIT_POLICY}


def silo_data(index: int, seed: int) -> SiloDataset:
    x, y = make_classification(TRAIN + 20, FEATURES, random_state=seed * 100_003 + index)
    x, y = torch.tensor(x, dtype=torch.float32), torch.tensor(y, dtype=torch.int64)
    names = tuple(f"f{i}" for i in range(FEATURES))
    t = TRAIN
    return SiloDataset(
        f"silo{index:04d}", x[:t], y[:t], x[t : t + 10], y[t : t + 10], x[t + 10 :],
        y[t + 10 :], "classification", 2, names, (FEATURES,),
    )  # fmt: skip


class RoundClock:
    """When each round ended, and the silos' resident memory at the last one."""

    def __init__(self, backend: str) -> None:
        self.backend, self.ended, self.rss = backend, {}, 0

    def on_round(self, record: RoundRecord, total_rounds: int) -> None:
        self.ended[record.round] = time.perf_counter()
        if record.round == total_rounds:
            self.rss = silo_memory(self.backend)


def silo_memory(backend: str) -> int:
    if backend == "inprocess":
        return psutil.Process().memory_info().rss
    hosts = [p for p in psutil.process_iter(["name", "cmdline"]) if _is_host(p)]
    return sum(p.memory_info().rss for p in hosts)


def _is_host(process: psutil.Process) -> bool:
    text = " ".join([process.info["name"] or "", *(process.info["cmdline"] or [])])
    return "ray::SiloHost" in text


def one_run(backend: str, silos: int, model: str, seed: int) -> dict[str, Any]:
    from fedsilo.ops.simulate import simulate

    policy = parse_policy(
        {
            "version": 1,
            "rounds": ROUNDS,
            "eval_every": ROUNDS,
            "seed": seed,
            "algorithm": {"name": "fedavg"},
            "model": {"name": "mlp", "hidden": MODELS[model]},
            "training": {"steps": 1, "batch_size": TRAIN, "lr": 0.05},
            "compute": {"device": "cpu"},
            "participants": {"min_silos": 2, "phase_timeout_s": 3600},
        }
    )
    datasets = [silo_data(i, seed) for i in range(silos)]
    clock = RoundClock(backend)
    started = time.perf_counter()
    simulate(policy, datasets, observers=[clock], backend=backend)
    return {
        "backend": backend,
        "silos": silos,
        "model": model,
        "seed": seed,
        "rounds_per_s": 2 / (clock.ended[3] - clock.ended[1]),
        "first_round_s": clock.ended[1] - started,
        "silo_memory_bytes": clock.rss,
    }


def _key(run: dict[str, Any]) -> tuple:
    return run["backend"], run["silos"], run["model"], run["seed"]


def summarise(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    rows = []
    for backend in BACKENDS:
        for model in MODELS:
            counts = sorted({r["silos"] for r in runs if r["model"] == model})
            memory = {}
            for silos in counts:
                same = [
                    r
                    for r in runs
                    if (r["backend"], r["model"], r["silos"]) == (backend, model, silos)
                ]
                if not same:
                    continue
                speeds = [r["rounds_per_s"] for r in same]
                memory[silos] = float(np.median([r["silo_memory_bytes"] for r in same]))
                rows.append(
                    {
                        "backend": backend,
                        "model": model,
                        "silos": silos,
                        "runs": len(same),
                        "rounds_per_s_median": float(np.median(speeds)),
                        "rounds_per_s_min": min(speeds),
                        "rounds_per_s_max": max(speeds),
                        "first_round_s_median": float(
                            np.median([r["first_round_s"] for r in same])
                        ),
                        "memory_bytes_median": memory[silos],
                    }
                )
            if len(memory) >= 2:
                low, high = min(memory), max(memory)
                rows.append(
                    {
                        "backend": backend,
                        "model": model,
                        "memory_per_silo_bytes": (memory[high] - memory[low]) / (high - low),
                    }
                )
    return rows


def crossover(rows: list[dict[str, Any]], model: str) -> int | None:
    """The smallest silo count from which Ray's median rounds/s beats the in-process one at
    that count and every larger one measured (None: no such count)."""
    speed = {
        (r["backend"], r["silos"]): r["rounds_per_s_median"]
        for r in rows
        if r.get("model") == model and "silos" in r
    }
    counts = sorted({s for _, s in speed})
    ahead = [speed.get(("ray", s), 0) > speed.get(("inprocess", s), float("inf")) for s in counts]
    start = next((i for i in range(len(counts)) if all(ahead[i:])), None)
    return None if start is None else counts[start]


def plot(rows: list[dict[str, Any]]) -> plt.Figure:
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    for backend in BACKENDS:
        for model, style in zip(MODELS, ("-o", "--s"), strict=True):
            points = [
                r for r in rows if (r["backend"], r["model"]) == (backend, model) and "silos" in r
            ]
            if not points:
                continue
            x = [r["silos"] for r in points]
            axes[0].plot(
                x, [r["rounds_per_s_median"] for r in points], style, label=f"{backend}, {model}"
            )
            memory = [r["memory_bytes_median"] / 2**20 for r in points]
            axes[1].plot(x, memory, style, label=f"{backend}, {model}")
    for axis, label in zip(
        axes, ("rounds / s (median)", "silos' resident memory (MiB)"), strict=True
    ):
        axis.set_xscale("log")
        axis.set_yscale("log")
        axis.set_xlabel("silos")
        axis.set_ylabel(label)
        axis.legend(fontsize=8)
    axes[0].set_title("FedAvg, 1 local step: rounds/s")
    axes[1].set_title("memory of the processes holding the silos")
    return figure


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--silos", type=int, nargs="*", default=[10, 50, 200, 1000], help="none: re-summarise"
    )
    parser.add_argument("--models", nargs="+", choices=list(MODELS), default=list(MODELS))
    parser.add_argument("--repeats", type=int, default=3, help="seeds 0.. per silo count")
    parser.add_argument("--max-repeat-silos", type=int, default=200, help="larger: one seed")
    parser.add_argument(
        "--add", action="store_true", help="keep the runs already in bench/results/scale.json"
    )
    parser.add_argument("--one", nargs=4, metavar=("BACKEND", "SILOS", "MODEL", "SEED"))
    args = parser.parse_args()
    if args.one:
        backend, silos, model, seed = args.one
        print(json.dumps(one_run(backend, int(silos), model, int(seed))))
        return
    runs = json.loads((RESULTS / "scale.json").read_text())["runs"] if args.add else []
    for silos in args.silos:
        repeats = args.repeats if silos <= args.max_repeat_silos else 1
        for model in args.models:
            for seed in range(repeats):
                for backend in BACKENDS:
                    command = [
                        sys.executable,
                        "-m",
                        "bench.scale",
                        "--one",
                        backend,
                        str(silos),
                        model,
                        str(seed),
                    ]
                    out = subprocess.run(
                        command, check=True, capture_output=True, text=True, env=PASSIVE
                    ).stdout
                    run = json.loads(out.strip().splitlines()[-1])
                    runs = [r for r in runs if _key(r) != _key(run)] + [run]
                    print(run, flush=True)
    rows = summarise(runs)
    document = {
        "settings": {
            "algorithm": "fedavg",
            "features": FEATURES,
            "train_rows_per_silo": TRAIN,
            "local_steps": 1,
            "rounds": ROUNDS,
            "timed_rounds": [2, 3],
            "models": {name: {"hidden": hidden} for name, hidden in MODELS.items()},
            "ray": "local instance, num_cpus = this machine's CPUs, 1 CPU per silo actor",
            "torch_threads_per_actor": "the driver's (see ops/ray_backend.py)",
        },
        "runs": runs,
        "summary": rows,
        "crossover_silos": {model: crossover(rows, model) for model in MODELS},
    }
    path = write("scale", document, plot(rows))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
