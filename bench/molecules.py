"""DRFLM's own experiment (DRFLM paper, Table 1 and Fig. 2a; docs/molecules.md): molecular
property regression with graph networks over three silos split by Bemis-Murcko scaffold,
FedAvg against DRFA and DRFLM, average and worst-silo test RMSE beside the paper's numbers.

Settings the paper gives: 3 silos, scaffold split, each silo's own 8:1:1 split, tau = 5 local
steps, local lr 0.01 (SGD), 100 rounds, 3 seeds (each a different split), GCN / GAT / MPNN.
Settings it leaves out, chosen here before running (not tuned): batch 32; readout the mean of
the atoms' last hidden states (a sum readout diverged for the MPNN at lr 0.01 with DRFLM);
GCN hidden [64, 64, 64], GAT hidden [32, 32] with 2 heads, MPNN hidden 32 with 2 steps (kept
small so the grid fits the shared machine); DRFA/DRFLM: M = 3 draws a round from lambda,
constant lambda step 0.1, floor 1e-3, fedsilo's defaults uniform_mix 0.1 and
min_contributors 2, participants.min_silos 1; DRFLM's mixup Beta(1, 1) on g(x) (the graph
embedding), probe on mixed rows; max_atoms 64 (Lipophilicity's 4 larger molecules dropped).
The label-noise curve (Fig. 2a): half of the silos (rounded by silo/partition.py: 1 of 3)
get Gaussian noise of std s on each training label with probability 0.3, s in --noise-stds.

Run: `python -m bench.molecules --part table --cells esol:gcn --out molecules_table_esol_gcn`
(one process per set of cells, as many as the machine takes), then `python -m bench.molecules
--part table --merge molecules_table_esol_gcn,... --note "..."` for bench/results/
molecules_table.json and .png; `python -m bench.molecules --part noise` for
molecules_noise.json and .png. Each process writes its file after every finished cell, so a
cut run keeps what it measured. Timed alone on the 2-core machine, one ESOL run of 100 rounds
takes about 15 s (GCN, FedAvg), 100 s (GAT, DRFLM) and 360 s (MPNN of hidden 64 and 3 steps,
DRFLM); DRFA costs about 1.6 and DRFLM 3.4 times FedAvg.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import matplotlib.pyplot as plt
import numpy as np

from bench.common import RESULTS, write
from fedsilo.ops.simulate import load_silos, simulate
from fedsilo.policies.loading import parse_policy

ROUNDS = 100
MODELS: dict[str, dict[str, Any]] = {
    "gcn": {"name": "gcn", "hidden": [64, 64, 64], "readout": "mean"},
    "gat": {"name": "gat", "hidden": [32, 32], "heads": 2, "readout": "mean"},
    "mpnn": {"name": "mpnn", "hidden": 32, "steps": 2, "readout": "mean"},
}
LAMBDA = {"step": 0.1, "silos_per_round": 3}
METHODS: dict[str, dict[str, Any]] = {
    "FedAvg": {"name": "fedavg"},
    "DRFA": {"name": "drfa", **LAMBDA},
    "DRFLM": {
        "name": "drflm", **LAMBDA, "mixup_alpha": 1.0, "mixup_on": "embedding", "probe": "mixup"
    },
}  # fmt: skip
TRAINING = {"steps": 5, "batch_size": 32, "optimizer": "sgd", "lr": 0.01}
SOURCES = {"esol": "molecules:esol", "freesolv": "molecules:freesolv",
           "lipophilicity": "molecules:lipophilicity"}  # fmt: skip
# The default cells: ESOL with every model, FreeSolv and Lipophilicity with the GCN only.
TABLE_CELLS = "esol:gcn,freesolv:gcn,lipophilicity:gcn,esol:gat,esol:mpnn"
# DRFLM paper Table 1 (mean (std) over 3 seeds): (avg, worst) per (dataset, model, method).
PAPER: dict[str, dict[str, tuple[float, float]]] = {
    "esol:gcn": {"FedAvg": (0.976, 1.232), "DRFA": (1.204, 1.357), "DRFLM": (1.086, 1.121)},
    "esol:gat": {"FedAvg": (1.134, 1.343), "DRFA": (1.346, 1.466), "DRFLM": (1.243, 1.234)},
    "esol:mpnn": {"FedAvg": (0.923, 1.312), "DRFA": (1.233, 1.386), "DRFLM": (0.989, 1.132)},
    "freesolv:gcn": {"FedAvg": (3.011, 3.863), "DRFA": (3.465, 3.928), "DRFLM": (3.123, 3.532)},
    "freesolv:gat": {"FedAvg": (2.641, 3.456), "DRFA": (2.897, 3.699), "DRFLM": (2.801, 3.207)},
    "freesolv:mpnn": {"FedAvg": (2.974, 3.689), "DRFA": (3.211, 3.899), "DRFLM": (3.112, 3.579)},
}


def policy_document(
    dataset: str, model: str, method: str, seed: int, noise_std: float | None
) -> dict[str, Any]:
    data: dict[str, Any] = {
        "source": SOURCES[dataset],
        "molecules": {"max_atoms": 64, "invalid": "drop"},
        "partition": {"kind": "scaffold", "silos": 3},
        "split": {"train": 0.8, "val": 0.1, "test": 0.1},
    }
    if noise_std is not None:
        data["label_noise"] = {"silo_fraction": 0.5, "probability": 0.3, "std": noise_std}
    return {
        "version": 1, "name": f"bench-{dataset}-{model}", "seed": seed, "rounds": ROUNDS,
        "eval_every": ROUNDS, "algorithm": METHODS[method], "model": MODELS[model],
        "training": TRAINING, "participants": {"min_silos": 1}, "data": data,
    }  # fmt: skip


def spread(values: list[float]) -> dict[str, Any]:
    """Mean and (sample) standard deviation over seeds, as the paper reports."""
    std = statistics.stdev(values) if len(values) > 1 else 0.0
    return {"values": values, "mean": statistics.mean(values), "std": std}


def run_cell(
    dataset: str, model: str, method: str, seeds: list[int], noise_std: float | None
) -> dict[str, Any]:
    avg, worst, seconds, skipped = [], [], [], []
    for seed in seeds:
        policy = parse_policy(policy_document(dataset, model, method, seed, noise_std))
        started = time.perf_counter()
        history = simulate(policy, load_silos(policy, None)).history
        seconds.append(time.perf_counter() - started)
        rmse = history.final.summary["rmse"]
        avg.append(rmse["mean"])
        worst.append(rmse["worst"])
        skipped.append(sum("train" not in r.phases for r in history.records))
    row = {
        "dataset": dataset, "model": model, "method": method, "noise_std": noise_std,
        "rmse_avg": spread(avg), "rmse_worst": spread(worst),
        "rounds_without_training": skipped, "seconds_per_run": statistics.mean(seconds),
    }  # fmt: skip
    print(
        f"{dataset}:{model} {method:6s} noise {noise_std} avg {row['rmse_avg']['mean']:.3f} "
        f"({row['rmse_avg']['std']:.3f}) worst {row['rmse_worst']['mean']:.3f} "
        f"({row['rmse_worst']['std']:.3f})  {row['seconds_per_run']:.0f} s/run",
        flush=True,
    )
    return row


def claims(rows: list[dict[str, Any]]) -> dict[str, bool]:
    """The paper's claims, checked per cell on the means over seeds."""
    found: dict[str, bool] = {}
    cells = sorted({f"{r['dataset']}:{r['model']}" for r in rows})
    for cell in cells:
        by = {r["method"]: r for r in rows if f"{r['dataset']}:{r['model']}" == cell}
        if len(by) < len(METHODS):
            continue
        worst = {m: by[m]["rmse_worst"]["mean"] for m in by}
        avg = {m: by[m]["rmse_avg"]["mean"] for m in by}
        found[f"{cell}: DRFLM worst lowest"] = worst["DRFLM"] == min(worst.values())
        found[f"{cell}: DRFA worse than FedAvg on both"] = (
            worst["DRFA"] > worst["FedAvg"] and avg["DRFA"] > avg["FedAvg"]
        )
        found[f"{cell}: FedAvg avg better than DRFLM"] = avg["FedAvg"] < avg["DRFLM"]
    return found


def plot_table(rows: list[dict[str, Any]]) -> plt.Figure:
    cells = list(dict.fromkeys(f"{r['dataset']}:{r['model']}" for r in rows))
    figure, axes = plt.subplots(1, len(cells), figsize=(3.2 * len(cells), 3.6), squeeze=False)
    for axis, cell in zip(axes[0], cells, strict=True):
        by = {r["method"]: r for r in rows if f"{r['dataset']}:{r['model']}" == cell}
        x = np.arange(len(by))
        for offset, key in ((-0.2, "avg"), (0.2, "worst")):
            entries = [by[m][f"rmse_{key}"] for m in by]
            axis.bar(x + offset, [e["mean"] for e in entries], width=0.4, label=key,
                     yerr=[e["std"] for e in entries])  # fmt: skip
            paper = [PAPER.get(cell, {}).get(m, (np.nan, np.nan))[key == "worst"] for m in by]
            axis.scatter(x + offset, paper, marker="x", color="black", zorder=3)
        axis.set_xticks(x, list(by))
        axis.set_title(f"{cell} test RMSE")
    axes[0][0].legend(title="bars: ours, x: paper")
    return figure


def plot_noise(rows: list[dict[str, Any]]) -> plt.Figure:
    figure, axes = plt.subplots(1, 2, figsize=(9, 3.6))
    for axis, key in zip(axes, ("worst", "avg"), strict=True):
        for method in METHODS:
            mine = sorted((r for r in rows if r["method"] == method), key=lambda r: r["noise_std"])
            axis.errorbar(
                [r["noise_std"] for r in mine], [r[f"rmse_{key}"]["mean"] for r in mine],
                yerr=[r[f"rmse_{key}"]["std"] for r in mine], label=method, marker="o",
            )  # fmt: skip
        axis.set_xlabel("label noise std (30 % of labels, 1 of 3 silos)")
        axis.set_title(f"ESOL GCN, {key} test RMSE")
        axis.legend()
    return figure


def setting(seeds: list[int]) -> dict[str, Any]:
    return {
        "rounds": ROUNDS, "seeds": seeds, "training": TRAINING, "models": MODELS,
        "methods": METHODS, "silos": 3, "partition": "scaffold", "split": "8:1:1",
        "participants.min_silos": 1, "max_atoms": 64, "invalid": "drop",
        "paper": "DRFLM Table 1; FreeSolv/ESOL GAT and MPNN only where listed in cells",
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--part", choices=("table", "noise"), required=True)
    parser.add_argument("--cells", default=TABLE_CELLS)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--noise-stds", default="0.5,1,2")
    parser.add_argument("--out", help="results name (default molecules_<part>)")
    parser.add_argument(
        "--merge", help="table results names (comma-separated) to merge into molecules_table"
    )
    parser.add_argument("--note", default="", help="what the merged table leaves out, and why")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    rows: list[dict[str, Any]] = []
    if args.merge:
        documents = [json.loads((RESULTS / f"{n}.json").read_text()) for n in args.merge.split(",")]
        rows = [row for document in documents for row in document["rows"]]
        cells = list(dict.fromkeys(f"{r['dataset']}:{r['model']}" for r in rows))
        document = {"setting": {**setting(seeds), "cells": cells, "note": args.note},
                    "rows": rows, "paper": PAPER, "claims": claims(rows)}  # fmt: skip
        print(write("molecules_table", document, plot_table(rows)))
    elif args.part == "table":
        cells = args.cells.split(",")
        for cell in cells:
            dataset, model = cell.split(":")
            for method in METHODS:
                rows.append(run_cell(dataset, model, method, seeds, None))
                document = {"setting": {**setting(seeds), "cells": cells}, "rows": rows,
                            "paper": PAPER, "claims": claims(rows)}  # fmt: skip
                write(args.out or "molecules_table", document, plot_table(rows))
    else:
        stds = [float(s) for s in args.noise_stds.split(",")]
        for std in stds:
            for method in METHODS:
                rows.append(run_cell("esol", "gcn", method, seeds, std))
                document = {"setting": {**setting(seeds), "noise_stds": stds,
                                        "label_noise": {"silo_fraction": 0.5,
                                                        "probability": 0.3}},
                            "rows": rows}  # fmt: skip
                write(args.out or "molecules_noise", document, plot_noise(rows))


if __name__ == "__main__":
    main()
