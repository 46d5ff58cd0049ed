"""SuPerFed (Hahn et al. KDD 2022) against FedAvg, FedProx and local-only training: the thesis'
digits set-up (ch. II) on sklearn digits, and the four heart-disease hospitals.

What it measures: the mean over silos of the personalised model's test accuracy (SuPerFed: the
global model mixed with the silo's local model at the lambda* its own selection split chooses
from the 11-point grid), against the one model FedAvg/FedProx publish and each silo's model
trained alone; and SuPerFed's accuracy-vs-lambda curve, with and without the orthogonality term.

1. Digits, seeds 0, 1, 2 (the seed changes the shards, the splits and the training).
   `sklearn:digits` (1,797 rows of 8x8 pixels, raw values 0..16) dealt into 20 silos by
   `partition: {kind: shards, silos: 20, shards_per_silo: 2}` (40 label-sorted shards, 2 per
   silo at random; a shard that straddles two labels gives its silo a third label: 3 to 7 of
   the 20 silos per seed), each silo's rows split 70/10/20 into train/val/test (63/9/18 rows).
   Scaling: [0,1] pixels, one feature space for every silo: `scaling: none` (the
   loader reads digits' intensities 0..16 as 0..1). The loader's default, `local` (each silo
   standardises with its own two or three classes' statistics), gives every silo a different
   input space; a sensitivity block reruns FedAvg, SuPerFed-MM/LM and local-only under it.
   MLP 64-128-128-10 (every weight and bias mixable), T = 100 rounds, 5 of the 20 silos per
   round (client_fraction 0.25), E = 5 epochs, B = 10, SGD lr 0.05, momentum 0.9, weight
   decay 1e-4, lr x 0.99 per round; one evaluation, after the last round. Methods:
   SuPerFed-MM (model mixing, L = 0.4, nu = 1, mu = 0.01), SuPerFed-LM (layer mixing, L = 0.6,
   nu = 2, mu = 0.01), both again with nu = 0; FedProx with SuPerFed's prox (SuPerFed with
   L = 1: mixing never starts, so it is FedAvg plus mu = 0.01 times the sum of per-layer L2
   norms); the library's `fedprox` (squared prox at its default mu) for contrast; FedAvg (its
   global model on each silo's test split); local-only (every silo, every round, the same
   epochs). lambda* is chosen on each silo's validation split (`min_validation: 1`: the ~9
   validation rows are always used), and the same runs report the oracle (the best test
   lambda), lambda = 0 (global) and lambda = 1 (local). The lambda curve is the mean over silos
   of the test accuracy at each lambda; flatness: accuracy at 0.5 minus the better endpoint
   (lambda 0 or 1), the largest dip of an interior point below the better endpoint, and, as a
   second barrier measure, the largest dip below the straight line between the endpoints (a
   monotone slope is a dip below the better endpoint but no barrier); each also per silo,
   averaged. cos^2(w_f, w_l) is each trained silo's report after its local training
   (`orthogonality`), averaged over the 5 silos of the last round.
2. Heart (the bundled UCI table, the four hospitals as silos), seeds 0-4 (the seed changes each
   hospital's split and the training): policies/examples/heart-superfed.yaml as it stands (its
   model, training, split, participants and SuPerFed settings, lambda* chosen by its rule with
   its min_validation) with 40 rounds and one evaluation at the end; local-only and FedAvg with
   the same model, training and data.

Claims (computed from the means over seeds, never asserted, with the number of seeds in which
each holds): (a) SuPerFed-MM and -LM at lambda* beat FedAvg by >= 10 points; (b) they are >=
local-only; (c) with nu > 0 the curve is flat (accuracy at 0.5 within 2 points of the better
endpoint) and with nu = 0 it has a barrier (an interior dip of more than 2 points below the
better endpoint); (d) cos^2 < 1e-3 with nu > 0. Heart: SuPerFed >= max(local-only, FedAvg).
Cells are the mean over seeds and the largest deviation of a seed from it.

Run: `python -m bench.superfed` (both experiments: 51 runs in 2 worker processes of one torch
thread each, 9 to 10 minutes on 2 CPU cores; a digits run takes 13 s (FedAvg), about 27 s
(SuPerFed, FedProx) or 52 s (local-only), a heart run 2-4 s); `--experiment digits` (about 8.5
minutes) or `--experiment heart` (about 30 s) for one; `--quick` for a smoke run (one seed, 10
rounds, about 40 s; it overwrites the same files); `--workers N`. Writes
bench/results/superfed.json, superfed.png and superfed_lambda.png (digits) and
superfed_heart.json and superfed_heart.png (heart).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
from collections.abc import Iterable, Mapping
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch
import yaml

from bench.common import RESULTS, write
from bench.mixing import cell, spread
from fedsilo.coordinator.engine import RunHistory
from fedsilo.ops.report import lambda_curves
from fedsilo.ops.simulate import simulate
from fedsilo.policies.algorithms import FedProxConfig, SuperFedConfig
from fedsilo.policies.loading import parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.data import load_consortium

DIGITS_SEEDS = (0, 1, 2)
HEART_SEEDS = (0, 1, 2, 3, 4)
DIGITS_ROUNDS = 100
HEART_ROUNDS = 40
QUICK_ROUNDS = 10
DIGITS_DATA = {
    "source": "sklearn:digits",
    "partition": {"kind": "shards", "silos": 20, "shards_per_silo": 2},
    "split": {"train": 0.7, "val": 0.1, "test": 0.2},
    "scaling": "none",
}
DIGITS_MODEL = {"name": "mlp", "hidden": [128, 128]}
DIGITS_TRAINING = {
    "epochs": 5,
    "batch_size": 10,
    "optimizer": "sgd",
    "lr": 0.05,
    "momentum": 0.9,
    "weight_decay": 1e-4,
    "lr_schedule": {"kind": "exponential", "gamma": 0.99},
}
SAMPLED = {"client_fraction": 0.25}
PROX_MU = 0.01
HEART_EXAMPLE = Path(__file__).resolve().parents[1] / "policies/examples/heart-superfed.yaml"
LIBRARY_FEDPROX_MU = FedProxConfig.model_fields["prox_mu"].default
POINTS = 100.0  # accuracies are fractions; tables and claims speak in points
FLAT_TOLERANCE = 2.0  # points: "within about 2 points" of the best lambda
FEDAVG_MARGIN = 10.0  # points: claim (a)
ORTHOGONAL = 1e-3  # claim (d)


def superfed(mixing: str, start: float, nu: float) -> dict[str, Any]:
    """SuPerFed at the digits settings: lambda* on validation whatever its size."""
    return {
        "name": "superfed",
        "mixing": mixing,
        "start_fraction": start,
        "ortho_nu": nu,
        "prox_mu": PROX_MU,
        "min_validation": 1,
        **SAMPLED,
    }


MM, LM, MM0, LM0 = "SuPerFed-MM", "SuPerFed-LM", "SuPerFed-MM nu=0", "SuPerFed-LM nu=0"
FEDPROX_SAME = f"FedProx (L2 prox mu {PROX_MU:g}, SuPerFed L=1)"
FEDPROX_LIBRARY = f"FedProx (library, squared, mu {LIBRARY_FEDPROX_MU:g})"
FEDAVG, LOCAL = "FedAvg", "local-only"
DIGITS_METHODS: dict[str, dict[str, Any]] = {
    MM: superfed("model", 0.4, 1.0),
    LM: superfed("layer", 0.6, 2.0),
    MM0: superfed("model", 0.4, 0.0),
    LM0: superfed("layer", 0.6, 0.0),
    FEDPROX_SAME: superfed("model", 1.0, 0.0),
    FEDPROX_LIBRARY: {"name": "fedprox", **SAMPLED},
    FEDAVG: {"name": "fedavg", **SAMPLED},
    LOCAL: {"name": "local"},
}
PERSONALISED = (MM, LM)
CURVE_PAIRS = ((MM, MM0), (LM, LM0))  # (nu > 0, nu = 0)
SCALING_CHECK = (FEDAVG, MM, LM, LOCAL)  # rerun under the loader's default `local` scaling
SUPERFED_METRICS = ("global_accuracy", "local_accuracy", "oracle_accuracy", "lambda_star")
HEART_SUPERFED, HEART_METHODS = "SuPerFed", ("SuPerFed", LOCAL, FEDAVG)
# relative run times, to start the long runs first
COST = {LOCAL: 3.0, MM: 2.0, LM: 2.0, MM0: 2.0, LM0: 2.0}


# ---------------------------------------------------------------------------------------------
# Policies


def heart_example() -> dict[str, Any]:
    return yaml.safe_load(HEART_EXAMPLE.read_text())


def heart_algorithm(label: str) -> dict[str, Any]:
    if label == HEART_SUPERFED:
        return heart_example()["algorithm"]
    return {"name": "fedavg"} if label == FEDAVG else {"name": "local"}


def policy_for(experiment: str, label: str, seed: int, rounds: int) -> Policy:
    """`digits`, `digits-local-scaling` (the loader's default scaling) or `heart`."""
    if experiment == "heart":
        document = {**heart_example(), "algorithm": heart_algorithm(label)}
    else:
        scaling = "local" if experiment == "digits-local-scaling" else DIGITS_DATA["scaling"]
        document = {
            "version": 1,
            "algorithm": DIGITS_METHODS[label],
            "model": DIGITS_MODEL,
            "training": DIGITS_TRAINING,
            "data": {**DIGITS_DATA, "scaling": scaling},
        }
    return parse_policy({**document, "seed": seed, "rounds": rounds, "eval_every": rounds})


# ---------------------------------------------------------------------------------------------
# One run


def silo_metrics(metrics: Mapping[str, float]) -> dict[str, Any]:
    """What a run keeps of a silo's final evaluation: accuracy, and SuPerFed's lambda* and its
    neighbours, the split lambda* was chosen on, and the test-accuracy curve."""
    kept: dict[str, Any] = {"accuracy": metrics["accuracy"]}
    if "lambda_star" not in metrics:
        return kept
    kept["local_trained"] = bool(metrics["local_trained"])
    if not kept["local_trained"]:  # only the global model was evaluated (lambda* = 0)
        only = metrics["global_accuracy"]
        return kept | {
            "global_accuracy": only,
            "oracle_accuracy": only,
            "local_accuracy": float("nan"),
            "lambda_star": 0.0,
        }
    kept |= {name: metrics[name] for name in SUPERFED_METRICS}
    kept["selection"] = "val" if metrics["selection_on_validation"] else "train"
    kept["curve"] = lambda_curves({"silo": metrics})["silo"]["accuracy"]
    return kept


def orthogonality(history: RunHistory, policy: Policy) -> dict[str, Any] | None:
    """SuPerFed's cos^2(w_f, w_l) as the silos report it after training: the mean over the
    last round's silos, and the mean over silos of each one's last report while mixing."""
    config = policy.algorithm
    if not isinstance(config, SuperFedConfig):
        return None
    start = config.mixing_from(policy.rounds)
    last: dict[str, float] = {}
    final: list[float] = []
    for record in history.records:
        answered = record.phases.get("train", {}).get("answered", {})
        found = {silo: m["orthogonality"] for silo, m in answered.items() if "orthogonality" in m}
        if record.round >= start:
            last |= found
        if found:
            final = list(found.values())
    return {
        "final_round_mean": statistics.mean(final) if final else None,
        "last_while_mixing_mean": statistics.mean(last.values()) if last else None,
        "silos_mixed": len(last),
    }


def run(experiment: str, label: str, seed: int, rounds: int) -> dict[str, Any]:
    """One simulation: each silo's final metrics, and SuPerFed's curves and cos^2."""
    torch.set_num_threads(1)
    policy = policy_for(experiment, label, seed, rounds)
    started = time.perf_counter()
    history = simulate(policy, load_consortium(policy.data, seed)).history
    seconds = time.perf_counter() - started
    evaluation = history.final.evaluation or {}
    silos = {silo: silo_metrics(metrics) for silo, metrics in sorted(evaluation.items())}
    curves = lambda_curves(evaluation)
    return {
        "experiment": experiment,
        "method": label,
        "seed": seed,
        "seconds": seconds,
        "silos": silos,
        "lambdas": next(iter(curves.values()))["lambda"] if curves else None,
        "orthogonality": orthogonality(history, policy),
    }


# ---------------------------------------------------------------------------------------------
# Tables, curves and claims


def silo_mean(run: Mapping[str, Any], metric: str) -> float:
    return statistics.mean(silo[metric] for silo in run["silos"].values())


def trains_local(runs: list[dict[str, Any]]) -> bool:
    """SuPerFed whose mixing started (not the L = 1 FedProx), so lambda has a local end."""
    return any(s.get("local_trained") for r in runs for s in r["silos"].values())


def method_table(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean over silos per seed, summarised over seeds: accuracy at lambda* (or the method's
    one model), SuPerFed's global/local/oracle accuracy and lambda*, cos^2, seconds per run."""
    metrics = ("accuracy", *SUPERFED_METRICS) if trains_local(runs) else ("accuracy",)
    table: dict[str, Any] = {m: spread([silo_mean(r, m) for r in runs]) for m in metrics}
    if runs[0]["orthogonality"] is not None and trains_local(runs):
        for key in ("final_round_mean", "last_while_mixing_mean"):
            table[f"orthogonality_{key}"] = spread([r["orthogonality"][key] for r in runs])
    selection = [s["selection"] for r in runs for s in r["silos"].values() if "selection" in s]
    if selection:
        table["lambda_chosen_on_validation"] = selection.count("val") / len(selection)
    table["seconds_per_run"] = statistics.mean(r["seconds"] for r in runs)
    return table


def flatness(curve: list[float], lambdas: list[float]) -> dict[str, float]:
    """In points: accuracy at lambda 0.5 minus the better endpoint; the largest dip of an
    interior point below the better endpoint (0 when none is below: a monotone slope from the
    better endpoint to the worse one counts as a dip too); and the barrier in the sense of
    Frankle et al. 2020, the largest dip of an interior point below the straight line between
    the endpoints' accuracies (a slope alone gives none)."""
    grid, values = np.array(lambdas), np.array(curve)
    best_end = max(values[0], values[-1])
    half = values[int(np.argmin(np.abs(grid - 0.5)))]
    line = (1 - grid) * values[0] + grid * values[-1]
    return {
        "half_minus_best_endpoint": POINTS * float(half - best_end),
        "interior_dip": POINTS * max(0.0, float(best_end - values[1:-1].min())),
        "barrier_below_line": POINTS * max(0.0, float((line - values)[1:-1].max())),
    }


def curve_summary(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The mean over silos of the test accuracy at each lambda, per seed and over seeds, and
    its flatness (of the seed-mean curve, per seed, and each silo's own, averaged)."""
    lambdas = runs[0]["lambdas"]
    per_seed = [
        np.mean([s["curve"] for s in r["silos"].values() if "curve" in s], axis=0).tolist()
        for r in runs
    ]
    mean = np.mean(per_seed, axis=0).tolist()
    per_silo = [
        [flatness(s["curve"], lambdas) for s in r["silos"].values() if "curve" in s] for r in runs
    ]
    return {
        "lambda": lambdas,
        "accuracy": [spread(list(column)) for column in zip(*per_seed, strict=True)],
        "per_seed": per_seed,
        "flatness_of_mean": flatness(mean, lambdas),
        "flatness_per_seed": [flatness(curve, lambdas) for curve in per_seed],
        "silo_mean": {
            key: spread([statistics.mean(f[key] for f in silos) for silos in per_silo])
            for key in ("interior_dip", "barrier_below_line")
        },
    }


def method_rows(
    runs: Mapping[str, list[dict[str, Any]]], methods: Iterable[str]
) -> dict[str, dict[str, Any]]:
    rows = {}
    for label in methods:
        mine = runs[label]
        rows[label] = {"table": method_table(mine), "runs": mine}
        if trains_local(mine):
            rows[label]["lambda_curve"] = curve_summary(mine)
    return rows


def compared(
    rows: Mapping[str, dict[str, Any]], method: str, other: str, margin: float
) -> dict[str, Any]:
    """`method`'s accuracy minus `other`'s in points, on the means and paired by seed, and
    whether it is at least `margin`."""
    ours, theirs = (rows[m]["table"]["accuracy"] for m in (method, other))
    per_seed = [POINTS * (a - b) for a, b in zip(ours["values"], theirs["values"], strict=True)]
    difference = POINTS * (ours["mean"] - theirs["mean"])
    return {
        "difference_points": difference,
        "per_seed_points": per_seed,
        "holds": difference >= margin,
        "seeds_holding": sum(d >= margin for d in per_seed),
    }


def curve_claims(rows: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """(c): flat with nu > 0, a barrier with nu = 0."""
    found = {}
    for with_nu, without in CURVE_PAIRS:
        flat, barrier = rows[with_nu]["lambda_curve"], rows[without]["lambda_curve"]
        half = flat["flatness_of_mean"]["half_minus_best_endpoint"]
        dip = barrier["flatness_of_mean"]["interior_dip"]
        found[with_nu] = {
            "flat_half_minus_best_endpoint_points": half,
            "flat_interior_dip_points": flat["flatness_of_mean"]["interior_dip"],
            "flat_holds": half >= -FLAT_TOLERANCE,
            "flat_seeds_holding": sum(
                f["half_minus_best_endpoint"] >= -FLAT_TOLERANCE for f in flat["flatness_per_seed"]
            ),
            "nu0_interior_dip_points": dip,
            "nu0_half_minus_best_endpoint_points": barrier["flatness_of_mean"][
                "half_minus_best_endpoint"
            ],
            "barrier_holds": dip > FLAT_TOLERANCE,
            "barrier_seeds_holding": sum(
                f["interior_dip"] > FLAT_TOLERANCE for f in barrier["flatness_per_seed"]
            ),
            "barrier_below_line_points": {
                "nu": flat["flatness_of_mean"]["barrier_below_line"],
                "nu0": barrier["flatness_of_mean"]["barrier_below_line"],
            },
            "barrier_below_line_holds": barrier["flatness_of_mean"]["barrier_below_line"]
            > FLAT_TOLERANCE,
        }
    return found


def orthogonality_claims(rows: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """(d): cos^2 of the last round's silos below 1e-3 with nu > 0; beside it nu = 0's."""
    found = {}
    for with_nu, without in CURVE_PAIRS:
        ours = rows[with_nu]["table"]["orthogonality_final_round_mean"]
        theirs = rows[without]["table"]["orthogonality_final_round_mean"]
        found[with_nu] = {
            "cos2": ours["mean"],
            "cos2_nu0": theirs["mean"],
            "holds": ours["mean"] < ORTHOGONAL,
            "seeds_holding": sum(v < ORTHOGONAL for v in ours["values"]),
            "nu0_over_nu": theirs["mean"] / ours["mean"] if ours["mean"] > 0 else None,
        }
    return found


def digits_claims(rows: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {
        "a_beats_fedavg_by_10_points": {
            m: compared(rows, m, FEDAVG, FEDAVG_MARGIN) for m in PERSONALISED
        },
        "b_at_least_local_only": {m: compared(rows, m, LOCAL, 0.0) for m in PERSONALISED},
    }
    if all(m in rows for pair in CURVE_PAIRS for m in pair):
        found["c_lambda_curve"] = curve_claims(rows)
        found["d_orthogonality"] = orthogonality_claims(rows)
    return found


def heart_claims(rows: Mapping[str, dict[str, Any]]) -> dict[str, Any]:
    """SuPerFed >= max(local-only, FedAvg), on the means and per seed."""
    ours = rows[HEART_SUPERFED]["table"]["accuracy"]
    best = [
        max(a, b)
        for a, b in zip(
            *(rows[m]["table"]["accuracy"]["values"] for m in (LOCAL, FEDAVG)), strict=True
        )
    ]
    best_mean = max(rows[m]["table"]["accuracy"]["mean"] for m in (LOCAL, FEDAVG))
    return {
        "superfed_at_least_best_baseline": {
            "difference_points": POINTS * (ours["mean"] - best_mean),
            "per_seed_points": [
                POINTS * (a - b) for a, b in zip(ours["values"], best, strict=True)
            ],
            "holds": ours["mean"] >= best_mean,
            "seeds_holding": sum(a >= b for a, b in zip(ours["values"], best, strict=True)),
        },
        "versus": {m: compared(rows, HEART_SUPERFED, m, 0.0) for m in (LOCAL, FEDAVG)},
    }


def per_hospital(rows: Mapping[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Each method's test accuracy per hospital over seeds; SuPerFed's lambda* and selection."""
    table: dict[str, dict[str, Any]] = {}
    for label, row in rows.items():
        for silo in row["runs"][0]["silos"]:
            entry = table.setdefault(silo, {})
            entry[label] = spread([r["silos"][silo]["accuracy"] for r in row["runs"]])
            if label == HEART_SUPERFED:
                entry["lambda_star"] = [r["silos"][silo]["lambda_star"] for r in row["runs"]]
                entry["selection"] = row["runs"][0]["silos"][silo]["selection"]
    return table


# ---------------------------------------------------------------------------------------------
# Plots


def accuracy_bars(axis: plt.Axes, rows: Mapping[str, dict[str, Any]], title: str) -> None:
    """Mean personalised test accuracy per method (error bars: max deviation over seeds); for
    SuPerFed also the oracle lambda, lambda = 0 and lambda = 1 as markers."""
    labels = list(rows)
    positions = np.arange(len(labels))
    tables = [rows[m]["table"] for m in labels]
    axis.bar(
        positions,
        [POINTS * t["accuracy"]["mean"] for t in tables],
        yerr=[POINTS * t["accuracy"]["max_dev"] for t in tables],
        capsize=3,
        color="tab:blue",
        label="personalised (SuPerFed: lambda* on its selection split)",
    )
    markers = {
        "oracle_accuracy": ("k^", "oracle lambda (test)"),
        "global_accuracy": ("wv", "lambda = 0 (global)"),
        "local_accuracy": ("ws", "lambda = 1 (local)"),
    }
    for key, (style, name) in markers.items():
        found = [(i, POINTS * t[key]["mean"]) for i, t in enumerate(tables) if key in t]
        if found:
            x, y = zip(*found, strict=True)
            axis.plot(x, y, style, mec="k", ms=6, label=name, linestyle="none")
    axis.set_xticks(positions, labels, rotation=30, ha="right", fontsize=8)
    axis.set_ylabel("mean test accuracy over silos (%)")
    axis.set_ylim(max(0.0, min(POINTS * t["accuracy"]["mean"] for t in tables) - 15), 100.5)
    axis.set_title(title, fontsize=10)
    axis.legend(fontsize=7, loc="lower left")


def scaling_bars(
    axis: plt.Axes, rows: Mapping[str, dict[str, Any]], local: Mapping[str, dict[str, Any]]
) -> None:
    """The sensitivity block: each method on [0,1] pixels and under local standardisation."""
    positions = np.arange(len(SCALING_CHECK))
    for offset, (name, found) in ((-0.2, ("none", rows)), (0.2, ("local", local))):
        accuracy = [found[m]["table"]["accuracy"] for m in SCALING_CHECK]
        axis.bar(
            positions + offset,
            [POINTS * a["mean"] for a in accuracy],
            0.4,
            yerr=[POINTS * a["max_dev"] for a in accuracy],
            capsize=3,
            label=f"scaling: {name}",
        )
    axis.set_xticks(positions, SCALING_CHECK, rotation=30, ha="right", fontsize=8)
    means = [
        found[m]["table"]["accuracy"]["mean"] for found in (rows, local) for m in SCALING_CHECK
    ]
    lowest = POINTS * min(means)
    axis.set_ylim(max(0.0, lowest - 10), 100.5)
    axis.set_title("digits: data.scaling none ([0,1] pixels, main) or local", fontsize=10)
    axis.legend(fontsize=7, loc="lower left")


def digits_plot(
    rows: Mapping[str, dict[str, Any]], local: Mapping[str, dict[str, Any]]
) -> plt.Figure:
    fig, axes = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [2, 1]})
    accuracy_bars(axes[0], rows, "digits, 20 shard silos (2 labels each), 5 per round, T = 100")
    scaling_bars(axes[1], rows, local)
    return fig


def lambda_plot(rows: Mapping[str, dict[str, Any]]) -> plt.Figure:
    """Mean test accuracy over silos against lambda, nu > 0 against nu = 0 (error bars: max
    deviation over seeds)."""
    fig, axes = plt.subplots(1, len(CURVE_PAIRS), figsize=(11, 4), sharey=True)
    for axis, pair in zip(axes, CURVE_PAIRS, strict=True):
        for label in pair:
            curve = rows[label]["lambda_curve"]
            nu = DIGITS_METHODS[label]["ortho_nu"]
            axis.errorbar(
                curve["lambda"],
                [POINTS * c["mean"] for c in curve["accuracy"]],
                yerr=[POINTS * c["max_dev"] for c in curve["accuracy"]],
                marker="o",
                capsize=3,
                label=f"nu = {nu:g}",
            )
        axis.set_xlabel("lambda (0: global model, 1: local model)")
        axis.set_title(pair[0], fontsize=10)
        axis.legend(fontsize=8)
    axes[0].set_ylabel("mean test accuracy over the 20 silos (%)")
    return fig


def heart_plot(rows: Mapping[str, dict[str, Any]]) -> plt.Figure:
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    accuracy_bars(axes[0], rows, "heart: 4 hospitals, 40 rounds")
    hospitals = per_hospital(rows)
    positions = np.arange(len(hospitals))
    width = 0.8 / len(rows)
    for j, label in enumerate(rows):
        cells = [hospitals[h][label] for h in hospitals]
        axes[1].bar(
            positions + (j - (len(rows) - 1) / 2) * width,
            [POINTS * c["mean"] for c in cells],
            width,
            yerr=[POINTS * c["max_dev"] for c in cells],
            capsize=2,
            label=label,
        )
    axes[1].set_xticks(positions, list(hospitals), fontsize=8)
    axes[1].set_ylabel("test accuracy (%)")
    axes[1].set_ylim(50, 100.5)
    axes[1].set_title("per hospital", fontsize=10)
    axes[1].legend(fontsize=7)
    return fig


# ---------------------------------------------------------------------------------------------
# Running


Job = tuple[str, str, int, int]  # experiment, method, seed, rounds
Runs = dict[tuple[str, str], list[dict[str, Any]]]


def jobs_for(experiment: str, quick: bool) -> list[Job]:
    """Every run of `digits` (with its scaling check) or `heart`."""
    if experiment == "heart":
        seeds, rounds = HEART_SEEDS, HEART_ROUNDS
        grid = [("heart", m) for m in HEART_METHODS]
    else:
        seeds, rounds = DIGITS_SEEDS, DIGITS_ROUNDS
        grid = [("digits", m) for m in DIGITS_METHODS]
        grid += [("digits-local-scaling", m) for m in SCALING_CHECK]
    if quick:
        seeds, rounds = seeds[:1], QUICK_ROUNDS
    return [(name, label, seed, rounds) for name, label in grid for seed in seeds]


def run_all(jobs: list[Job], workers: int) -> Runs:
    """The jobs in `workers` processes (spawned, one torch thread each), longest first."""
    done: Runs = {}
    ordered = sorted(jobs, key=lambda job: -COST.get(job[1], 1.0) * job[3])
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        futures = [pool.submit(run, *job) for job in ordered]
        for future in as_completed(futures):
            found = future.result()
            done.setdefault((found["experiment"], found["method"]), []).append(found)
            accuracy = POINTS * statistics.mean(s["accuracy"] for s in found["silos"].values())
            print(
                f"{found['experiment']:20s} {found['method']:40s} seed {found['seed']}: "
                f"{accuracy:.2f}%  ({found['seconds']:.0f} s)",
                flush=True,
            )
    return {key: sorted(runs, key=lambda r: r["seed"]) for key, runs in done.items()}


def print_table(title: str, rows: Mapping[str, dict[str, Any]]) -> None:
    print(title)
    for label, row in rows.items():
        table = row["table"]
        extra = "  ".join(
            f"{key.removesuffix('_accuracy')} {cell(table[key], POINTS)}"
            for key in ("oracle_accuracy", "global_accuracy", "local_accuracy")
            if key in table
        )
        print(f"  {label:40s} {cell(table['accuracy'], POINTS)}  {extra}", flush=True)


def settings(experiment: str, quick: bool) -> dict[str, Any]:
    jobs = jobs_for(experiment, quick)
    common = {"seeds": sorted({j[2] for j in jobs}), "rounds": jobs[0][3], "quick": quick}
    if experiment == "heart":
        return {
            **common,
            "example": HEART_EXAMPLE.name,
            "policy": heart_example(),
            "methods": {m: heart_algorithm(m) for m in HEART_METHODS},
        }
    return {
        **common,
        "data": DIGITS_DATA,
        "model": DIGITS_MODEL,
        "training": DIGITS_TRAINING,
        "methods": DIGITS_METHODS,
        "scaling_check": {"data.scaling": "local", "methods": list(SCALING_CHECK)},
    }


def write_digits(runs: Runs, quick: bool, seconds: float) -> None:
    rows = method_rows({m: runs[("digits", m)] for m in DIGITS_METHODS}, DIGITS_METHODS)
    local = method_rows(
        {m: runs[("digits-local-scaling", m)] for m in SCALING_CHECK}, SCALING_CHECK
    )
    found = {"main": digits_claims(rows), "local_scaling": digits_claims(local)}
    print_table("digits (data.scaling none: [0,1] pixels)", rows)
    print_table("digits, sensitivity: data.scaling local", local)
    for label, row in rows.items():
        if "lambda_curve" in row:
            curve = row["lambda_curve"]
            values = " ".join(f"{POINTS * c['mean']:.1f}" for c in curve["accuracy"])
            print(f"  curve {label:20s} {values}  {curve['flatness_of_mean']}")
    print(found, flush=True)
    path = write(
        "superfed",
        {
            "settings": settings("digits", quick),
            "wall_seconds_all_experiments": seconds,
            "claims": found,
            "rows": rows,
            "local_scaling_rows": local,
        },
        digits_plot(rows, local),
    )
    figure = lambda_plot(rows)
    figure.tight_layout()
    figure.savefig(RESULTS / "superfed_lambda.png", dpi=120)
    plt.close(figure)
    print(f"wrote {path}, {path.with_suffix('.png')} and superfed_lambda.png")


def write_heart(runs: Runs, quick: bool, seconds: float) -> None:
    rows = method_rows({m: runs[("heart", m)] for m in HEART_METHODS}, HEART_METHODS)
    found = heart_claims(rows)
    print_table("heart", rows)
    print(found, flush=True)
    path = write(
        "superfed_heart",
        {
            "settings": settings("heart", quick),
            "wall_seconds_all_experiments": seconds,
            "claims": found,
            "per_hospital": per_hospital(rows),
            "rows": rows,
        },
        heart_plot(rows),
    )
    print(f"wrote {path} and {path.with_suffix('.png')}")


WRITERS = {"digits": write_digits, "heart": write_heart}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, 10 rounds (smoke test)")
    parser.add_argument(
        "--experiment", choices=("digits", "heart", "all"), default="all", help="which to run"
    )
    parser.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    args = parser.parse_args()
    experiments = list(WRITERS) if args.experiment == "all" else [args.experiment]
    started = time.perf_counter()
    runs = run_all([job for e in experiments for job in jobs_for(e, args.quick)], args.workers)
    seconds = time.perf_counter() - started
    for experiment in experiments:
        WRITERS[experiment](runs, args.quick, seconds)
    print(f"total {seconds:.0f} s")


if __name__ == "__main__":
    main()
