"""FedDC (federated daisy chaining, Kamp et al. ICLR 2023) against FedAvg, daisy chaining alone
and the central reference, on the paper's small-data experiments.

Owns the reproduction runs for the `feddc` strategy: the paper's synthetic experiment
(make_classification, 100 features, 50 silos x 10 training samples, MLP 100-50-20 ReLU,
T = 1000 rounds of one full-batch local step; paper: FedDC 0.89, FedAvg b=1 0.80, FedAvg b=200
0.76, central 0.88), optionally breast_cancer over 50 silos x 8 samples, and the convex case
with Radon points (linear model, silos with 2 samples each). Every method runs on the same
silos, with the same model, optimizer, learning rate and batch; seeds 0.. change the data, the
initialisation and the permutations. A common held-out test set (never trained on) is every
silo's test split, so the aggregate's accuracy is its accuracy on that set and `local_accuracy`
is the mean over the silos' hosted models on it. Features are not standardised (the paper's
notebook fed sklearn's MLP the raw features). Central trains one model on the pooled training
data with the same per-round step (one step on a batch of B samples), so it gets T steps.

Run: `python -m bench.feddc` (`--quick` for a smoke run; `--rounds`, `--seeds`,
`--optimizer`, `--lr`, `--experiments`, `--workers`); writes bench/results/feddc.json and
feddc.png, rewritten after every finished run. The synthetic default (5 methods x 3 seeds,
T = 1000) takes about 25 minutes on 2 CPU cores: a federated run with 50 silos about 3 to 4
minutes (0.2 s a round in-process), central a few seconds.
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch
from sklearn.datasets import load_breast_cancer, make_classification

from bench.common import write
from fedsilo.ops.simulate import simulate
from fedsilo.policies.loading import parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.data import SiloDataset

TEST_SAMPLES = 1000
PAPER = {  # test accuracy reported by the paper, per experiment and method
    "synthetic": {
        "FedDC (d=1, b=200)": 0.89,
        "FedAvg (b=1)": 0.80,
        "FedAvg (b=200)": 0.76,
        "DC only (d=1)": None,
        "central": 0.88,
    },
}


@dataclass(frozen=True)
class Experiment:
    """Silos built from one seed, the model, and the methods to compare (label -> algorithm)."""

    name: str
    silos: Callable[[int], list[SiloDataset]]
    model: dict[str, Any]
    batch_size: int
    methods: dict[str, dict[str, Any]]
    note: str


def silo_split(
    x: np.ndarray, y: np.ndarray, silos: int, per_silo: int, test: tuple[np.ndarray, np.ndarray]
) -> list[SiloDataset]:
    """`silos` silos with `per_silo` consecutive training rows each; every silo's test split is
    the common held-out `test` set; no validation rows."""
    x_test = torch.tensor(test[0], dtype=torch.float32)
    y_test = torch.tensor(test[1], dtype=torch.int64)
    features = x.shape[1]
    datasets = []
    for i in range(silos):
        rows = slice(i * per_silo, (i + 1) * per_silo)
        datasets.append(
            SiloDataset(
                f"silo-{i:03d}",
                torch.tensor(x[rows], dtype=torch.float32),
                torch.tensor(y[rows], dtype=torch.int64),
                torch.zeros((0, features)),
                torch.zeros(0, dtype=torch.int64),
                x_test,
                y_test,
                "classification",
                2,
                tuple(f"f{j}" for j in range(features)),
                (features,),
            )
        )
    return datasets


def synthetic_silos(seed: int) -> list[SiloDataset]:
    """The paper's synthetic data: 50 silos x 10 training rows, 1000 common test rows."""
    train = 50 * 10
    x, y = make_classification(
        n_samples=train + TEST_SAMPLES,
        n_features=100,
        n_informative=20,
        n_redundant=60,
        n_repeated=5,
        n_clusters_per_class=3,
        class_sep=1.0,
        shift=1.0,
        scale=3.0,
        flip_y=0.02,
        random_state=seed,
    )
    return silo_split(x[:train], y[:train], 50, 10, (x[train:], y[train:]))


def breast_cancer_silos(seed: int) -> list[SiloDataset]:
    """breast_cancer shuffled by `seed`: 50 silos x 8 training rows, the other 169 rows the
    common test set; standardised with the training rows' statistics (its raw features span
    five orders of magnitude)."""
    x, y = load_breast_cancer(return_X_y=True)
    order = np.random.default_rng(seed).permutation(len(y))
    x, y = x[order], y[order]
    train = 50 * 8
    mean, std = x[:train].mean(0), x[:train].std(0) + 1e-12
    x = (x - mean) / std
    return silo_split(x[:train], y[:train], 50, 8, (x[train:], y[train:]))


def convex_silos(seed: int) -> list[SiloDataset]:
    """The SUSY stand-in: 18 features, 40 silos x 2 training rows (r = 40 for our 2-output
    linear model, so height 1), 1000 common test rows."""
    train = 40 * 2
    x, y = make_classification(
        n_samples=train + TEST_SAMPLES, n_features=18, n_informative=10, random_state=seed
    )
    return silo_split(x[:train], y[:train], 40, 2, (x[train:], y[train:]))


def fed(daisy: int | None, aggregation: int | None, **extra: Any) -> dict[str, Any]:
    return {"name": "feddc", "daisy_period": daisy, "aggregation_period": aggregation, **extra}


EXPERIMENTS = {
    "synthetic": Experiment(
        "synthetic",
        synthetic_silos,
        {"name": "mlp", "hidden": [100, 50, 20]},
        10,
        {
            "FedDC (d=1, b=200)": fed(1, 200),
            "FedAvg (b=1)": fed(None, 1),
            "FedAvg (b=200)": fed(None, 200),
            "DC only (d=1)": fed(1, None),
            "central": {"name": "central"},
        },
        "make_classification as the paper, 50 silos x 10, 1000 common test rows, raw features",
    ),
    "breast_cancer": Experiment(
        "breast_cancer",
        breast_cancer_silos,
        {"name": "mlp", "hidden": [100, 50, 20]},
        8,
        {
            "FedDC (d=1, b=200)": fed(1, 200),
            "FedAvg (b=1)": fed(None, 1),
            "FedAvg (b=200)": fed(None, 200),
            "DC only (d=1)": fed(1, None),
            "central": {"name": "central"},
        },
        "breast_cancer, 50 silos x 8, 169 common test rows, standardised on the training rows",
    ),
    "convex_radon": Experiment(
        "convex_radon",
        convex_silos,
        {"name": "linear"},
        2,
        {
            "FedDC+Radon (d=1, b=50)": fed(1, 50, aggregator="radon", radon_iterations=1),
            "Radon (b=1)": fed(None, 1, aggregator="radon", radon_iterations=1),
            "Radon (b=50)": fed(None, 50, aggregator="radon", radon_iterations=1),
            "central": {"name": "central"},
        },
        "linear 2-output softmax (P = 38, r = 40): 40 silos x 2, Radon height 1; the paper: "
        "logistic regression, P = 19, r = 21, 441 silos, height 2",
    ),
}


def make_policy(
    algorithm: dict[str, Any], experiment: Experiment, seed: int, args: argparse.Namespace
) -> Policy:
    return parse_policy(
        {
            "version": 1,
            "name": f"feddc-bench-{experiment.name}",
            "seed": seed,
            "rounds": args.rounds,
            "eval_every": max(1, args.rounds // args.evals),
            "algorithm": algorithm,
            "model": experiment.model,
            "training": {
                "steps": 1,
                "batch_size": experiment.batch_size,
                "lr": args.lr,
                "optimizer": args.optimizer,
            },
            "participants": {"phase_timeout_s": 600},
            "compute": {"device": "cpu"},
        }
    )


def curve(history: Any, key: str) -> list[tuple[int, float]]:
    """(round, mean over silos of `key`) at every evaluated round."""
    return [
        (record.round, record.summary[key]["mean"])
        for record in history.records
        if record.summary and key in record.summary
    ]


def run_method(
    algorithm: dict[str, Any], experiment: Experiment, seed: int, args: argparse.Namespace
) -> dict[str, Any]:
    policy = make_policy(algorithm, experiment, seed, args)
    torch.manual_seed(seed)
    started = time.perf_counter()
    history = simulate(policy, experiment.silos(seed)).history
    seconds = time.perf_counter() - started
    final = history.final.summary
    aggregate = "accuracy" if "accuracy" in final else "local_accuracy"
    local = "local_accuracy" if "local_accuracy" in final else "accuracy"
    return {
        "seed": seed,
        "seconds": seconds,
        "accuracy": final[aggregate]["mean"],
        "local_accuracy": final[local]["mean"],
        "train_accuracy": final.get("train_accuracy", final.get("local_train_accuracy", {})).get(
            "mean"
        ),
        "curve_accuracy": curve(history, aggregate),
        "curve_local_accuracy": curve(history, local),
    }


def summarise(runs: Sequence[dict[str, Any]]) -> dict[str, float]:
    values = [run["accuracy"] for run in runs]
    mean = float(np.mean(values))
    return {
        "mean": mean,
        "max_dev": float(max(abs(v - mean) for v in values)),
        "local_mean": float(np.mean([run["local_accuracy"] for run in runs])),
        "seconds_per_run": float(np.mean([run["seconds"] for run in runs])),
    }


def job(
    name: str, label: str, seed: int, args: argparse.Namespace
) -> tuple[str, str, dict[str, Any]]:
    """One (experiment, method, seed) run, in a worker process with one torch thread."""
    torch.set_num_threads(1)
    experiment = EXPERIMENTS[name]
    return name, label, run_method(experiment.methods[label], experiment, seed, args)


def collect(
    done: dict[tuple[str, str], list[dict[str, Any]]], args: argparse.Namespace
) -> dict[str, Any]:
    """Per experiment and method, the runs finished so far and their summary."""
    results: dict[str, Any] = {}
    for name in args.experiments:
        experiment = EXPERIMENTS[name]
        methods = {}
        for label, algorithm in experiment.methods.items():
            runs = sorted(done.get((name, label), []), key=lambda run: run["seed"])
            if runs:
                methods[label] = {"algorithm": algorithm, "runs": runs, **summarise(runs)}
        if methods:
            results[name] = {"note": experiment.note, "methods": methods}
    return results


def save(results: dict[str, Any], args: argparse.Namespace) -> Path:
    parts = [] if args.experiments == ["synthetic"] else list(args.experiments)
    parts += [] if args.optimizer == "sgd" else [args.optimizer]
    name = "_".join(["feddc", *parts])  # feddc.json: the paper's experiment with SGD
    return write(
        name,
        {
            "command": "python -m bench.feddc " + " ".join(args.argv),
            "rounds": args.rounds,
            "seeds": args.seeds,
            "optimizer": args.optimizer,
            "lr": args.lr,
            "eval_every": max(1, args.rounds // args.evals),
            "paper": PAPER,
            "results": results,
        },
        plot(results, args),
    )


def plot(results: dict[str, Any], args: argparse.Namespace) -> plt.Figure:
    names = list(results)
    fig, axes = plt.subplots(len(names), 2, figsize=(12, 4.2 * len(names)), squeeze=False)
    for (curves, bars), name in zip(axes, names, strict=True):
        methods = results[name]["methods"]
        for i, (label, row) in enumerate(methods.items()):
            color = f"C{i}"
            for key, style in (("curve_accuracy", "-"), ("curve_local_accuracy", ":")):
                if key == "curve_local_accuracy" and label == "central":
                    continue
                series = np.array([[v for _, v in run[key]] for run in row["runs"]])
                rounds = [r for r, _ in row["runs"][0][key]]
                curves.plot(
                    rounds,
                    series.mean(0),
                    style,
                    color=color,
                    label=label if style == "-" else None,
                )
        curves.set_title(f"{name}: test accuracy (solid: aggregate, dotted: local models)")
        curves.set_xlabel("round (one local step each)")
        curves.set_ylabel("test accuracy")
        curves.legend(fontsize=8, loc="lower right")
        labels = list(methods)
        ours = [methods[label]["mean"] for label in labels]
        errors = [methods[label]["max_dev"] for label in labels]
        x = np.arange(len(labels))
        bars.bar(x - 0.2, ours, 0.4, yerr=errors, capsize=4, label="ours (mean, max dev)")
        paper = PAPER.get(name, {})
        if paper:
            bars.bar(
                x + 0.2,
                [paper.get(label) or 0.0 for label in labels],
                0.4,
                label="paper",
                color="tab:gray",
            )
        for xi, value in zip(x, ours, strict=True):
            bars.text(xi - 0.2, value + 0.01, f"{value:.2f}", ha="center", fontsize=8)
        bars.set_xticks(x, labels, rotation=20, ha="right", fontsize=8)
        bars.set_ylim(0.4, 1.0)
        bars.set_title(f"{name}: final test accuracy, {len(args.seeds)} seeds")
        bars.legend(fontsize=8)
    fig.suptitle(f"{args.optimizer} lr {args.lr}, {args.rounds} rounds")
    return fig


def table(results: dict[str, Any]) -> None:
    print(f"\n{'experiment':13s} {'method':24s} {'seeds':6s} {'ours (mean ± max dev)':22s} paper")
    for name, result in results.items():
        for label, row in result["methods"].items():
            paper = PAPER.get(name, {}).get(label)
            print(
                f"{name:13s} {label:24s} {len(row['runs']):<6d} "
                f"{row['mean']:.3f} ± {row['max_dev']:.3f}{'':8s} "
                f"{'—' if paper is None else f'{paper:.2f}'}"
            )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="100 rounds, one seed")
    parser.add_argument("--rounds", type=int, default=1000)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--evals", type=int, default=10, help="evaluations over the run")
    parser.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd")
    parser.add_argument("--lr", type=float, default=0.1)
    parser.add_argument("--workers", type=int, default=2, help="runs in parallel processes")
    parser.add_argument(
        "--experiments", nargs="+", choices=tuple(EXPERIMENTS), default=["synthetic"]
    )
    args = parser.parse_args()
    args.argv = sys.argv[1:]
    if args.quick:
        args.rounds, args.seeds = 100, [0]
    # seed-major order: a run cut short still has every method for its first seeds; the
    # results are rewritten after every finished run
    jobs = [
        (name, label, seed)
        for seed in args.seeds
        for name in args.experiments
        for label in EXPERIMENTS[name].methods
    ]
    done: dict[tuple[str, str], list[dict[str, Any]]] = {}
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(args.workers, mp_context=context) as pool:
        futures = [pool.submit(job, name, label, seed, args) for name, label, seed in jobs]
        for future in as_completed(futures):
            name, label, run = future.result()
            done.setdefault((name, label), []).append(run)
            print(
                f"{name:13s} {label:24s} seed {run['seed']}: {run['accuracy']:.3f} "
                f"(local {run['local_accuracy']:.3f}), {run['seconds']:.0f} s",
                flush=True,
            )
            path = save(collect(done, args), args)
    table(collect(done, args))
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
