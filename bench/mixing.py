"""The loss-driven mixing schedules against FedAvg, on the set-ups their claims come from.

1. DRFLM's label-noise regression (sklearn diabetes, 442 rows, 10 features): 3 silos, balanced
   (rows dealt at random) or 7:2:1. Features and targets are standardised with the pooled
   statistics (a benchmark convenience: the targets' unit is then one standard deviation,
   77.1 in disease-progression units). Each silo keeps 80% of its rows for training, 20% for
   test (no validation rows). Label noise follows the data config's rule: silo_fraction 0.5 of
   3 silos rounds half up to 2 noisy silos, drawn at random per seed (silo.partition
   `noisy_silos`); in them each training target gets N(0, std^2) noise with probability 0.3,
   std in 0, 0.5, 1, 2 target standard deviations; test targets stay clean. Linear regression,
   tau = 5 local SGD steps per round, batch 32, lr 0.01, 100 rounds; FedAvg, DRFA, DRFLM
   (mixup alpha 1.0), every mixing setting at its default. Reported: worst-silo and mean test
   RMSE of the final model.
2. AAggFF-S (docs/algorithms/aaggff.md): sklearn breast_cancer standardised, k-means (k = 7)
   on the standardised features gives 7 silos of unequal size (4 to 33 test rows) and shifted
   covariates; run twice: with 15% of the training labels of one silo (drawn per seed)
   flipped, and without; 80/20 stratified split per silo (plain where a silo has fewer than 2
   rows of a class). Logistic regression, T = 100
   rounds, E = 1 epoch, B = 20, SGD lr 0.1, weight decay 1e-3; AAggFF (Normal CDF) against
   FedAvg, q-FedAvg (q = 1), TERM (tilt 1), PropFair (M = 3), AFL (step 0.1). Reported: mean,
   worst-10% (with 7 silos: the worst silo) and Gini of per-silo test accuracy, and the mean,
   worst and Gini of per-silo test loss.
3. DRFLM's Table 2 (`--label-flip`), classification with flipped labels. Its FMNIST row
   ("following Mohri et al.": three classes, each silo holding one) on sklearn digits: the
   three classes are fixed by a rule, not chosen by outcome: the triple that a pooled softmax
   regression confuses most (5-fold unshuffled cross-validation on all ten digits, summed
   confusions of the triple's three pairs), {1, 8, 9} with scikit-learn 1.9; a silo's test
   accuracy is then the accuracy on its class (about 36 test rows: one row is 2.8 points).
   Features standardised with the pooled statistics of those rows. Its Adult row (silos split
   by a covariate) on breast_cancer, standardised, k-means (k = 3) silos: 359, 100 and 110
   rows, 89%, 36% and 0% benign. Each silo's rows split 80/20 into train and test (stratified
   where the silo has 2 rows of each class); run clean, and with "flip": every training label
   of every silo replaced with probability 0.3 by a uniformly random other class
   (silo.partition `flip_labels`, seeded by the seed); test labels stay clean. Softmax
   (linear) model; FedAvg, DRFA, DRFLM (mixup alpha 1.0) at the settings of 1 (tau = 5,
   batch 32, lr 0.01, mixing defaults), 400 rounds (the seed runs 1000; 400 is what fits the
   5-minute budget on 2 CPU cores). Reported: worst-silo and mean test accuracy of the final
   model; beside them the seed's Table 2 and which of its claims hold, on the means over
   seeds and per seed (a tie does not hold).

Seeds 0, 1, 2 (data, noise and training); cells are the mean over seeds and the largest
deviation of a seed from it; DRFA/DRFLM rows also count the rounds DRFA skipped (fewer than
min_contributors distinct silos drawn). Run: `python -m bench.mixing` for 1 and 2, about 5
minutes on 2 CPU cores (bench/results/mixing.json and mixing.png); `--cross-device` for
AAggFF-D (mixing_cross_device.*); `--label-flip` for 3, about 6 minutes
(mixing_label_flip.*). With --quick: one seed, 30 rounds, a smoke test.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import statistics
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch
from sklearn.cluster import KMeans
from sklearn.datasets import load_breast_cancer, load_diabetes, load_digits
from sklearn.linear_model import LogisticRegression
from sklearn.metrics import confusion_matrix
from sklearn.model_selection import cross_val_predict, train_test_split
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler

from bench.common import write
from fedsilo.ops.simulate import simulate
from fedsilo.policies.loading import parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.data import SiloDataset, load_consortium
from fedsilo.silo.partition import add_label_noise, flip_labels, noisy_silos

SEEDS = (0, 1, 2)
NOISE_STDS = (0.0, 0.5, 1.0, 2.0)  # in target standard deviations
NOISE_PROBABILITY = 0.3
NOISY_SILO_FRACTION = 0.5
SPLITS: dict[str, tuple[float, ...]] = {"balanced": (1, 1, 1), "7:2:1": (0.7, 0.2, 0.1)}
REGRESSION_ROUNDS = 100
DRFLM_TRAINING = {"steps": 5, "batch_size": 32, "optimizer": "sgd", "lr": 0.01}
DRFLM_METHODS: dict[str, dict[str, Any]] = {
    "FedAvg": {"algorithm": {"name": "fedavg"}},
    "DRFA": {"algorithm": {"name": "drfa"}},
    "DRFLM": {"algorithm": {"name": "drflm", "mixup_alpha": 1.0}},
}
LABEL_FLIP_PROBABILITY = 0.3
LABEL_FLIP_ROUNDS = 400
LABEL_FLIP_CLUSTERS = 3
# DRFLM Table 2 (Wu et al. 2022), worst-silo accuracy (%)
PAPER_TABLE_2: dict[str, dict[str, dict[str, float]]] = {
    "FMNIST": {
        "clean": {"FedAvg": 70.64, "DRFA": 71.04, "DRFLM": 70.89},
        "flip": {"FedAvg": 67.21, "DRFA": 66.28, "DRFLM": 69.78},
    },
    "Adult": {
        "clean": {"FedAvg": 68.21, "DRFA": 67.31, "DRFLM": 69.87},
        "flip": {"FedAvg": 66.23, "DRFA": 64.86, "DRFLM": 68.66},
    },
}
# the seed's Table 2 claims as predicates on the methods' worst-silo accuracies (a tie fails)
TABLE_2_CLAIMS: dict[str, dict[str, Callable[[dict[str, float]], bool]]] = {
    "clean": {"drfa_best": lambda w: w["DRFA"] > max(w["FedAvg"], w["DRFLM"])},
    "flip": {
        "drfa_below_fedavg": lambda w: w["DRFA"] < w["FedAvg"],
        "drflm_best": lambda w: w["DRFLM"] > max(w["FedAvg"], w["DRFA"]),
    },
}
CLUSTERS = 7
FLIP_FRACTION = 0.15
FAIRNESS_ROUNDS = 100
CROSS_DEVICE_ROUNDS = 300
CROSS_DEVICE_TRAINING = {"epochs": 1, "batch_size": 20, "optimizer": "sgd", "lr": 0.1}
FAIRNESS_METHODS: dict[str, dict[str, Any]] = {
    "FedAvg": {"algorithm": {"name": "fedavg"}},
    "q-FedAvg": {"algorithm": {"name": "qfedavg", "q": 1.0}},
    "TERM": {"algorithm": {"name": "term", "tilt": 1.0}},
    "PropFair": {"algorithm": {"name": "propfair", "baseline": 3.0}},
    "AFL": {"algorithm": {"name": "afl", "step": 0.1}},
    "AAggFF": {"algorithm": {"name": "aaggff", "transform": "normal"}},
}


Split = tuple[np.ndarray, np.ndarray, list[tuple[np.ndarray, np.ndarray]]]  # x, y, silo rows


def silo(name: str, x: tuple[np.ndarray, np.ndarray], y: tuple[np.ndarray, np.ndarray],
         task: str, classes: int = 2) -> SiloDataset:  # fmt: skip
    """A silo from its (train, test) features and labels; no validation rows."""
    label = torch.int64 if task == "classification" else torch.float32
    features = x[0].shape[1]
    return SiloDataset(
        name,
        torch.tensor(x[0], dtype=torch.float32),
        torch.tensor(y[0], dtype=label),
        torch.zeros((0, features)),
        torch.zeros(0, dtype=label),
        torch.tensor(x[1], dtype=torch.float32),
        torch.tensor(y[1], dtype=label),
        task,
        classes if task == "classification" else None,
        tuple(f"f{j}" for j in range(features)),
        (features,),
    )


def diabetes_silos(seed: int, shares: tuple[float, ...], noise_std: float) -> list[SiloDataset]:
    """3 diabetes silos with the given row shares; label noise at `noise_std` (0: none)."""
    x, y = load_diabetes(return_X_y=True)
    x, y = (x - x.mean(0)) / x.std(0), (y - y.mean()) / y.std()
    rng = np.random.default_rng(seed)
    order = rng.permutation(len(y))
    cuts = np.round(np.cumsum(shares)[:-1] / sum(shares) * len(y)).astype(int)
    noisy = set(noisy_silos(len(shares), NOISY_SILO_FRACTION, rng).tolist()) if noise_std else set()
    datasets = []
    for i, rows in enumerate(np.split(order, cuts)):
        train, test = rows[: int(0.8 * len(rows))], rows[int(0.8 * len(rows)) :]
        y_train = y[train]
        if i in noisy:
            y_train = add_label_noise(y_train, NOISE_PROBABILITY, noise_std, rng)
        datasets.append(silo(f"silo-{i}", (x[train], x[test]), (y_train, y[test]), "regression"))
    return datasets


def flipped_silo(seed: int) -> int:
    """The silo whose training labels are flipped (with `flip`) at this seed."""
    return int(np.random.default_rng(seed).integers(CLUSTERS))


def breast_cancer_rows(seed: int, clusters: int) -> Split:
    """Standardised breast_cancer, k-means silos on it, each silo's rows split 80/20 into
    (train, test), stratified where the silo has at least 2 rows of each class."""
    x, y = load_breast_cancer(return_X_y=True)
    x = (x - x.mean(0)) / x.std(0)
    found = KMeans(clusters, n_init=10, random_state=seed).fit_predict(x)
    splits = []
    for k in range(clusters):
        rows = np.flatnonzero(found == k)
        stratify = y[rows] if np.bincount(y[rows], minlength=2).min() >= 2 else None
        train, test = train_test_split(rows, test_size=0.2, stratify=stratify, random_state=seed)
        splits.append((train, test))
    return x, y, splits


def breast_cancer_silos(seed: int, flip: bool) -> list[SiloDataset]:
    """The AAggFF-S comparison: k-means silos on standardised breast_cancer; with `flip`, 15% of
    one silo's training labels flipped."""
    x, y, splits = breast_cancer_rows(seed, CLUSTERS)
    rng = np.random.default_rng(seed + 1)
    flipped = flipped_silo(seed) if flip else None
    datasets = []
    for k, (train, test) in enumerate(splits):
        y_train = y[train].copy()
        if k == flipped:
            hit = rng.choice(len(train), size=round(FLIP_FRACTION * len(train)), replace=False)
            y_train[hit] = 1 - y_train[hit]
        datasets.append(
            silo(f"silo-{k}", (x[train], x[test]), (y_train, y[test]), "classification")
        )
    return datasets


def confusable_digits() -> tuple[tuple[int, ...], dict[str, int]]:
    """The three digit classes a pooled softmax regression confuses most: 5-fold (unshuffled,
    stratified) cross-validated predictions on all of sklearn's digits, the triple with the
    most off-diagonal confusions among its three pairs (both directions; ties to the lowest
    digits). Returns the triple and the five highest counts."""
    x, y = load_digits(return_X_y=True)
    model = make_pipeline(StandardScaler(), LogisticRegression(max_iter=2000))
    confusion = confusion_matrix(y, cross_val_predict(model, x, y, cv=5))
    pairs = confusion + confusion.T
    counts = {
        triple: int(sum(pairs[a, b] for a, b in itertools.combinations(triple, 2)))
        for triple in itertools.combinations(range(10), 3)
    }
    ranked = sorted(counts, key=counts.__getitem__, reverse=True)
    return ranked[0], {str(t): counts[t] for t in ranked[:5]}


def digit_rows(seed: int, classes: tuple[int, ...]) -> Split:
    """Mohri et al.'s split on digits: one silo per class in `classes`, labels renumbered
    0..len-1 in that order; features standardised with the pooled statistics of those rows
    (constant pixels left at 0); each silo's rows split 80/20 into (train, test)."""
    x, y = load_digits(return_X_y=True)
    keep = np.isin(y, classes)
    x, y = x[keep], np.array([classes.index(label) for label in y[keep]])
    std = x.std(0)
    x = (x - x.mean(0)) / np.where(std > 0, std, 1.0)
    silos = (np.flatnonzero(y == c) for c in range(len(classes)))
    return x, y, [tuple(train_test_split(r, test_size=0.2, random_state=seed)) for r in silos]


def flip_silos(rows_of: Callable[[int], Split], flip: bool, seed: int) -> list[SiloDataset]:
    """Silos of `rows_of(seed)`; with `flip`, each training label flipped with probability 0.3
    to a uniformly random other class (test labels stay clean)."""
    x, y, splits = rows_of(seed)
    classes = int(y.max()) + 1
    rng = np.random.default_rng(seed)
    datasets = []
    for k, (train, test) in enumerate(splits):
        y_train = flip_labels(y[train], classes, LABEL_FLIP_PROBABILITY, rng) if flip else y[train]
        datasets.append(
            silo(f"silo-{k}", (x[train], x[test]), (y_train, y[test]), "classification", classes)
        )
    return datasets


def policy(method: dict[str, Any], seed: int, rounds: int, training: dict[str, Any]) -> Policy:
    return parse_policy(
        {
            "version": 1,
            "seed": seed,
            "rounds": rounds,
            "eval_every": rounds,
            "model": {"name": "linear"},
            "training": training,
            **method,
        }
    )


def spread(values: list[float]) -> dict[str, Any]:
    """Mean over seeds and the largest deviation of a seed from it."""
    mean = statistics.mean(values)
    return {"values": values, "mean": mean, "max_dev": max(abs(v - mean) for v in values)}


def drfa_runs(
    method: dict[str, Any],
    seeds: tuple[int, ...],
    rounds: int,
    silos_of: Callable[[int], list[SiloDataset]],
    metric: str,
) -> dict[str, Any]:
    """`method` at the DRFLM paper's training settings, once per seed on `silos_of(seed)`: the
    final model's worst-silo and mean `metric`, per seed its per-silo values and final mixing
    weights, the rounds DRFA skipped, the time per run."""
    worst, mean, seconds, skipped, per_silo, weights = [], [], [], [], [], []
    for seed in seeds:
        started = time.perf_counter()
        history = simulate(policy(method, seed, rounds, DRFLM_TRAINING), silos_of(seed)).history
        seconds.append(time.perf_counter() - started)
        skipped.append(sum("train" not in r.phases for r in history.records))
        summary = history.final.summary[metric]
        worst.append(summary["worst"])
        mean.append(summary["mean"])
        per_silo.append({s: m[metric] for s, m in history.final.evaluation.items()})
        weights.append(history.records[-1].mixing)
    return {
        f"worst_{metric}": spread(worst),
        f"mean_{metric}": spread(mean),
        f"per_silo_{metric}": per_silo,
        "final_mixing_weights": weights,
        "skipped_rounds": skipped,
        "seconds_per_run": statistics.mean(seconds),
    }


def regression(seeds: tuple[int, ...], rounds: int) -> list[dict[str, Any]]:
    rows = []
    for split, shares in SPLITS.items():
        for std in NOISE_STDS:
            for label, method in DRFLM_METHODS.items():
                silos_of = partial(diabetes_silos, shares=shares, noise_std=std)
                runs = drfa_runs(method, seeds, rounds, silos_of, "rmse")
                rows.append({"split": split, "noise_std": std, "method": label, **runs})
                print(
                    f"{split:8s} std {std:3.1f} {label:6s} worst {cell(runs['worst_rmse'])}  "
                    f"mean {cell(runs['mean_rmse'])}  skipped rounds {runs['skipped_rounds']}",
                    flush=True,
                )
    return rows


def fairness(seeds: tuple[int, ...], rounds: int, flip: bool) -> list[dict[str, Any]]:
    training = {
        "epochs": 1, "batch_size": 20, "optimizer": "sgd", "lr": 0.1, "weight_decay": 1e-3
    }  # fmt: skip
    rows = []
    for label, method in FAIRNESS_METHODS.items():
        found: dict[str, list[float]] = {}
        seconds, per_silo, weights = [], [], []
        for seed in seeds:
            started = time.perf_counter()
            history = simulate(
                policy(method, seed, rounds, training), breast_cancer_silos(seed, flip)
            ).history
            seconds.append(time.perf_counter() - started)
            per_silo.append({s: m["accuracy"] for s, m in history.final.evaluation.items()})
            weights.append(history.records[-1].mixing)
            summary = history.final.summary
            for metric, key in [
                ("accuracy", "mean"), ("accuracy", "worst_10"), ("accuracy", "gini"),
                ("loss", "mean"), ("loss", "worst"), ("loss", "gini"),
            ]:  # fmt: skip
                found.setdefault(f"{metric}_{key}", []).append(summary[metric][key])
        rows.append(
            {
                "method": label,
                "flip": flip,
                **{name: spread(values) for name, values in found.items()},
                "per_silo_accuracy": per_silo,
                "final_mixing_weights": weights,
                "seconds_per_run": statistics.mean(seconds),
            }
        )
        print(
            f"{'flip' if flip else 'clean':5s} {label:9s} acc mean "
            f"{cell(rows[-1]['accuracy_mean'], 100)}  worst-10% "
            f"{cell(rows[-1]['accuracy_worst_10'], 100)}  Gini "
            f"{cell(rows[-1]['accuracy_gini'])}  loss Gini {cell(rows[-1]['loss_gini'])}",
            flush=True,
        )
    return rows


def cross_device(seeds: tuple[int, ...], rounds: int) -> list[dict[str, Any]]:
    """The AAggFF-D comparison: AAggFF-D on digits over 50 Dirichlet(0.3) silos, 20% sampled
    per round, softmax regression, against the same baselines with the same sampling."""
    rows = []
    for label, method in FAIRNESS_METHODS.items():
        found: dict[str, list[float]] = {}
        seconds = []
        for seed in seeds:
            document = {
                **policy(method, seed, rounds, CROSS_DEVICE_TRAINING).model_dump(),
                "algorithm": {**method["algorithm"], "client_fraction": 0.2},
                "data": {
                    "source": "sklearn:digits",
                    "partition": {"kind": "dirichlet", "silos": 50, "alpha": 0.3},
                },
            }
            p = parse_policy(document)
            started = time.perf_counter()
            history = simulate(p, load_consortium(p.data, seed=seed)).history
            seconds.append(time.perf_counter() - started)
            summary = history.final.summary
            for key in ("mean", "worst_10", "gini"):
                found.setdefault(f"accuracy_{key}", []).append(summary["accuracy"][key])
        rows.append(
            {
                "method": label,
                **{name: spread(values) for name, values in found.items()},
                "seconds_per_run": statistics.mean(seconds),
            }
        )
        print(
            f"digits-50 {label:9s} acc mean {cell(rows[-1]['accuracy_mean'], 100)}  worst-10% "
            f"{cell(rows[-1]['accuracy_worst_10'], 100)}  Gini {cell(rows[-1]['accuracy_gini'])}",
            flush=True,
        )
    return rows


def cross_device_plot(rows: list[dict[str, Any]]) -> plt.Figure:
    """Mean, worst-10% and Gini of test accuracy per method (error bars: max deviation)."""
    fig, axes = plt.subplots(1, 3, figsize=(12, 3.5))
    names = [row["method"] for row in rows]
    for ax, key in zip(axes, ("accuracy_mean", "accuracy_worst_10", "accuracy_gini"), strict=True):
        ax.bar(names, [r[key]["mean"] for r in rows], yerr=[r[key]["max_dev"] for r in rows])
        ax.set_title(key.replace("_", " "))
        ax.tick_params(axis="x", rotation=30)
    fig.suptitle("AAggFF-D setting: digits, 50 silos, 20% sampled per round")
    return fig


def label_flip_sources(digits: tuple[int, ...]) -> dict[str, Callable[[int], Split]]:
    """The two Table 2 stand-ins: digits split by class (FMNIST's) and breast_cancer split by
    covariates (Adult's)."""
    return {
        "digits": partial(digit_rows, classes=digits),
        "breast_cancer": partial(breast_cancer_rows, clusters=LABEL_FLIP_CLUSTERS),
    }


def label_flip(
    seeds: tuple[int, ...], rounds: int, digits: tuple[int, ...]
) -> list[dict[str, Any]]:
    """DRFLM's Table 2: FedAvg, DRFA and DRFLM on each source, clean and with flipped labels."""
    rows = []
    for data, rows_of in label_flip_sources(digits).items():
        for flip in (False, True):
            for label, method in DRFLM_METHODS.items():
                runs = drfa_runs(
                    method, seeds, rounds, partial(flip_silos, rows_of, flip), "accuracy"
                )
                rows.append({"data": data, "flip": flip, "method": label, **runs})
                print(
                    f"{data:13s} {'flip' if flip else 'clean':5s} {label:6s} worst "
                    f"{cell(runs['worst_accuracy'], 100)}  mean {cell(runs['mean_accuracy'], 100)}"
                    f"  skipped rounds {runs['skipped_rounds']}",
                    flush=True,
                )
    return rows


def worst_table(
    rows: list[dict[str, Any]], data: str, seed: int | None
) -> dict[str, dict[str, float]]:
    """Worst-silo accuracy (%) by condition (clean, flip) and method: the mean over seeds, or
    the seed at index `seed`."""
    table: dict[str, dict[str, float]] = {}
    for row in rows:
        if row["data"] == data:
            worst = row["worst_accuracy"]
            value = worst["mean"] if seed is None else worst["values"][seed]
            table.setdefault("flip" if row["flip"] else "clean", {})[row["method"]] = 100 * value
    return table


def table_2_claims(worst: dict[str, dict[str, float]]) -> dict[str, bool]:
    return {
        f"{condition}_{name}": holds(worst[condition])
        for condition, found in TABLE_2_CLAIMS.items()
        for name, holds in found.items()
    }


def label_flip_claims(rows: list[dict[str, Any]], seeds: int) -> dict[str, Any]:
    """The seed's Table 2 claims on our means over seeds, the seeds in which they hold, and on
    the paper's own numbers."""
    found: dict[str, Any] = {
        "paper": {data: table_2_claims(table) for data, table in PAPER_TABLE_2.items()}
    }
    for data in dict.fromkeys(row["data"] for row in rows):
        per_seed = [table_2_claims(worst_table(rows, data, i)) for i in range(seeds)]
        found[data] = {
            claim: {"holds": held, "seeds_holding": sum(s[claim] for s in per_seed)}
            for claim, held in table_2_claims(worst_table(rows, data, None)).items()
        }
    return found


def label_flip_plot(rows: list[dict[str, Any]], digits: tuple[int, ...]) -> plt.Figure:
    """Worst-silo test accuracy per method, clean against flipped (error bars: max deviation over
    seeds; diamonds: mean accuracy over silos)."""
    titles = {
        "digits": f"digits {{{', '.join(map(str, digits))}}}, one class per silo",
        "breast_cancer": f"breast_cancer, {LABEL_FLIP_CLUSTERS} k-means silos",
    }
    fig, axes = plt.subplots(1, len(titles), figsize=(11, 4))
    positions = np.arange(len(DRFLM_METHODS))
    for axis, (data, title) in zip(axes, titles.items(), strict=True):
        for offset, flip in ((-0.2, False), (0.2, True)):
            mine = [r for r in rows if r["data"] == data and r["flip"] == flip]
            worst, mean = [r["worst_accuracy"] for r in mine], [r["mean_accuracy"] for r in mine]
            axis.bar(
                positions + offset,
                [100 * w["mean"] for w in worst],
                0.4,
                yerr=[100 * w["max_dev"] for w in worst],
                capsize=3,
                label=f"worst silo, {'30% flipped' if flip else 'clean'}",
            )
            axis.plot(positions + offset, [100 * m["mean"] for m in mean], "wD", mec="k", ms=5)
        axis.set_xticks(positions, [r["method"] for r in mine])
        axis.set_ylim(50, 100)
        axis.set_ylabel("test accuracy (%); diamonds: mean over silos")
        axis.set_title(title, fontsize=10)
        axis.legend(fontsize=7, loc="lower right")
    return fig


def write_label_flip(quick: bool) -> None:
    seeds = SEEDS[:1] if quick else SEEDS
    rounds = 30 if quick else LABEL_FLIP_ROUNDS
    started = time.perf_counter()
    digits, confusions = confusable_digits()
    rows = label_flip(seeds, rounds, digits)
    found = label_flip_claims(rows, len(seeds))
    print(found)
    sources = label_flip_sources(digits)
    path = write(
        "mixing_label_flip",
        {
            "seeds": list(seeds),
            "quick": quick,
            "seconds": time.perf_counter() - started,
            "rounds": rounds,
            "training": DRFLM_TRAINING,
            "flip_probability": LABEL_FLIP_PROBABILITY,
            "data": {
                "digits": {
                    "classes": list(digits),
                    "rule": "the triple with the most pairwise confusions of a pooled softmax "
                    "regression, 5-fold cross-validated on all 10 digits",
                    "top_triples_by_confusions": confusions,
                },
                "breast_cancer": f"standardised, k-means k={LABEL_FLIP_CLUSTERS} silos",
            },
            "silo_train_test_sizes": {
                data: {seed: [[len(a), len(b)] for a, b in rows_of(seed)[2]] for seed in seeds}
                for data, rows_of in sources.items()
            },
            "rows": rows,
            "ours_percent": {data: worst_table(rows, data, None) for data in sources},
            "paper": PAPER_TABLE_2,
            "claims": found,
        },
        label_flip_plot(rows, digits),
    )
    print(f"wrote {path} and {path.with_suffix('.png')}")


def cell(entry: dict[str, Any], scale: float = 1.0) -> str:
    return f"{scale * entry['mean']:.4g} ± {scale * entry['max_dev']:.2g}"


def claims(
    regression_rows: list[dict[str, Any]], fairness_rows: list[dict[str, Any]]
) -> dict[str, Any]:
    """Which of the seeds' claims hold on the means over seeds."""
    found: dict[str, Any] = {}
    for split in SPLITS:
        by = {(r["noise_std"], r["method"]): r for r in regression_rows if r["split"] == split}
        noisy = [std for std in NOISE_STDS if std > 0]
        if not noisy or (noisy[0], "DRFLM") not in by:
            continue

        def worst(std: float, method: str) -> float:
            return by[(std, method)]["worst_rmse"]["mean"]  # noqa: B023

        found[split] = {
            "drflm_worst_below_drfa_at_every_noise": all(
                worst(s, "DRFLM") < worst(s, "DRFA") for s in noisy
            ),
            "drflm_worst_not_above_fedavg_at_every_noise": all(
                worst(s, "DRFLM") <= worst(s, "FedAvg") for s in noisy
            ),
            "drflm_mean_minus_fedavg_mean": {
                s: by[(s, "DRFLM")]["mean_rmse"]["mean"] - by[(s, "FedAvg")]["mean_rmse"]["mean"]
                for s in NOISE_STDS
            },
        }
    for flip in (True, False):
        methods = {r["method"]: r for r in fairness_rows if r["flip"] == flip}
        if not {"FedAvg", "AAggFF"} <= set(methods):
            continue
        fed, agg = methods["FedAvg"], methods["AAggFF"]

        def relative_drop(key: str) -> float:
            return 1 - agg[key]["mean"] / fed[key]["mean"]  # noqa: B023

        found[f"aaggff_{'flip' if flip else 'clean'}"] = {
            "accuracy_gini_relative_drop": relative_drop("accuracy_gini"),
            "loss_gini_relative_drop": relative_drop("loss_gini"),
            "accuracy_gini_drop_at_least_10pct": relative_drop("accuracy_gini") >= 0.10,
            "worst_10_raised": agg["accuracy_worst_10"]["mean"] > fed["accuracy_worst_10"]["mean"],
            "mean_minus_fedavg_points": 100
            * (agg["accuracy_mean"]["mean"] - fed["accuracy_mean"]["mean"]),
        }
    return found


def plot(regression_rows: list[dict[str, Any]], fairness_rows: list[dict[str, Any]]) -> plt.Figure:
    fig, axes = plt.subplots(1, 4, figsize=(21, 4.8))
    styles = {"FedAvg": "tab:blue", "DRFA": "tab:orange", "DRFLM": "tab:green"}
    for axis, split in zip(axes[:2], SPLITS, strict=True):
        for method, color in styles.items():
            mine = [r for r in regression_rows if r["split"] == split and r["method"] == method]
            stds = [r["noise_std"] for r in mine]
            for key, line in (("worst_rmse", "-"), ("mean_rmse", ":")):
                axis.errorbar(
                    stds,
                    [r[key]["mean"] for r in mine],
                    yerr=[r[key]["max_dev"] for r in mine],
                    color=color,
                    linestyle=line,
                    marker="o",
                    capsize=3,
                    label=f"{method} {'worst silo' if key == 'worst_rmse' else 'mean'}",
                )
        axis.set_xlabel("label-noise std (target standard deviations), 2 of 3 silos, p = 0.3")
        axis.set_ylabel("test RMSE (standardised target)")
        axis.set_title(f"diabetes, 3 silos {split}")
        axis.legend(fontsize=7)
    keys = (("accuracy_mean", "mean acc"), ("accuracy_worst_10", "worst-10% acc"),
            ("accuracy_gini", "Gini acc x10"))  # fmt: skip
    width = 0.8 / len(keys)
    for axis, flip in zip(axes[2:], (True, False), strict=True):
        mine = [r for r in fairness_rows if r["flip"] == flip]
        positions = np.arange(len(mine))
        for j, (key, label) in enumerate(keys):
            scale = 10.0 if "gini" in key else 1.0
            axis.bar(
                positions + j * width,
                [scale * r[key]["mean"] for r in mine],
                width,
                yerr=[scale * r[key]["max_dev"] for r in mine],
                capsize=2,
                label=label,
            )
        axis.set_xticks(positions + width, [r["method"] for r in mine], fontsize=8)
        axis.set_ylim(0, 1.05)
        what = "one silo 15% flipped" if flip else "no flipped labels"
        axis.set_title(f"breast_cancer, 7 k-means silos, {what}", fontsize=10)
        axis.legend(fontsize=7)
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, 30 rounds (smoke test)")
    parser.add_argument(
        "--cross-device",
        action="store_true",
        help="only AAggFF-D on digits, 50 silos, 20%% sampled (mixing_cross_device.json)",
    )
    parser.add_argument(
        "--label-flip",
        action="store_true",
        help="only DRFLM's Table 2: 30%% flipped labels, digits and breast_cancer "
        "(mixing_label_flip.json)",
    )
    args = parser.parse_args()
    # DRFA warns once per skipped round; the rows count them instead
    logging.getLogger("fedsilo.coordinator.strategies.drfa").setLevel(logging.ERROR)
    if args.label_flip:
        write_label_flip(args.quick)
        return
    if args.cross_device:
        seeds = SEEDS[:1] if args.quick else SEEDS
        rounds = 30 if args.quick else CROSS_DEVICE_ROUNDS
        rows = cross_device(seeds, rounds)
        path = write(
            "mixing_cross_device",
            {"seeds": list(seeds), "rounds": rounds, "training": CROSS_DEVICE_TRAINING,
             "data": "sklearn:digits, 50 silos, Dirichlet(0.3) labels", "rows": rows},
            cross_device_plot(rows),
        )  # fmt: skip
        print(f"wrote {path}")
        return
    seeds = SEEDS[:1] if args.quick else SEEDS
    started = time.perf_counter()
    rounds = 30 if args.quick else FAIRNESS_ROUNDS
    fairness_rows = fairness(seeds, rounds, flip=True) + fairness(seeds, rounds, flip=False)
    regression_rows = regression(seeds, 30 if args.quick else REGRESSION_ROUNDS)
    found = claims(regression_rows, fairness_rows)
    print(found)
    path = write(
        "mixing",
        {
            "seeds": list(seeds),
            "quick": args.quick,
            "seconds": time.perf_counter() - started,
            "regression": {
                "data": "sklearn:diabetes, pooled standardisation of features and target",
                "rounds": 30 if args.quick else REGRESSION_ROUNDS,
                "splits": {k: list(v) for k, v in SPLITS.items()},
                "noise": {
                    "silo_fraction": NOISY_SILO_FRACTION,
                    "noisy_silos": 2,
                    "probability": NOISE_PROBABILITY,
                    "stds": list(NOISE_STDS),
                },
                "rows": regression_rows,
            },  # fmt: skip
            "fairness": {
                "data": "sklearn:breast_cancer, k-means k=7 silos, 15% flipped in one (flip)",
                "rounds": rounds,
                "silo_train_test_sizes": {
                    seed: [
                        [len(d.y_train), len(d.y_test)] for d in breast_cancer_silos(seed, False)
                    ]
                    for seed in seeds
                },
                "flipped_silo": {seed: f"silo-{flipped_silo(seed)}" for seed in seeds},
                "rows": fairness_rows,
            },
            "claims": found,
        },
        plot(regression_rows, fairness_rows),
    )
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
