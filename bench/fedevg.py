"""FedEvg (Hahn 2024, thesis ch. IV; docs/algorithms/fedevg.md) on sklearn digits, on CPU.

What it measures: how good a synthetic set the coordinator distils from the silos' energy
signals alone. A fresh CNN trained only on the final synthetic set (X~_T, y~) is tested on the
real held-out digits, against (a) the same classifier trained on the initial noise X~_0, (b)
the same classifier trained on 10 random real training images per class, and (c) FedAvg with
the same CNN and training settings; and a proxy Frechet distance between the synthetic set and
real digits, over rounds.

Set-up, seeds 0, 1, 2 (the seed changes the partition, the splits, the synthetic noise and all
training):
- Data: `sklearn:digits` (1,797 images of 8x8 pixels, `data.scaling: none`: pixels in [0, 1]),
  10 silos by `partition: {kind: dirichlet, silos: 10, alpha: A}`, A in {0.1, 1.0} (the
  partition's default min_size of 2 rows suffices at 0.1: no redraw limit was hit); each
  silo's rows split train 0.8 / val 0 / test 0.2. The held-out real digits are the silos' test
  splits pooled (about 360 rows).
- FedEvg: spc 10 (N = 100 synthetic points, X~_0 ~ N(0, I), balanced labels), T = 200 rounds,
  every silo every round, E = 1 epoch, B = 32, Adam lr 1e-3, weight decay 1e-4, lr x 0.9 every
  50 rounds (the reference code's schedule), client SGLD alpha 1, sigma 0.01, K_c 1, clip tau 3,
  lambda_ce 0.1, joint energy, spectral norm on the last layer, fresh local model every round;
  server step eta_max -> 1 on the cosine-beta curve, eta_max in {10, 1} (a sweep),
  sigma_s 1e-4. Model: the library's small CNN {name: cnn, channels: [32, 64], hidden: 0,
  activation: silu, norm: group} (3x3 conv, SiLU, GroupNorm, 2x2 max-pool, twice, then one
  Linear: the zoo pools where the reference code uses a stride-2 convolution).
- Evaluation: the strategy's own, every 20 rounds and at T: the same CNN, fresh, trained on the
  synthetic set alone for 100 epochs (Adam lr 1e-3, batch 64), evaluated by every silo on its
  test split (`silo_mean`: the mean over the 10 silos); `pooled`: the state's final classifier
  on all silos' test rows together (the headline). References (a) and (b) use the same
  architecture, epochs, batch and lr (one model seed per data seed, shared by (a) and (b)); X~_0
  is regenerated exactly as the strategy draws it. (b) draws its 10 images per class from the
  pooled training rows of the seed's silos. (c) FedAvg runs 200 rounds (the same training
  settings, the same schedule).
- Proxy Frechet distance: features are the 64 hidden units (after ReLU) of an MLP 64-64-10
  (the zoo's `mlp`, hidden [64]) trained on the pooled training rows of the seed's silos (50
  epochs, Adam lr 1e-3, batch 64; its pooled test accuracy is reported). At every snapshot
  (every 10 rounds, and round 0 = X~_0) the distance between the synthetic set's features and
  those of a random subset of N = 100 pooled test rows, averaged over 10 subsets (the same 10
  per seed for every round and every reference). Floors: two disjoint random real test subsets
  of 100 (the estimator's own value at N = 100), and (b)'s 100 real training images. The
  distance is |mu_1 - mu_2|^2 + tr(S_1 + S_2 - 2 (S_1 S_2)^(1/2)), scipy.linalg.sqrtm, checked
  at start-up against Gaussians with a known answer (`frechet_check` in the JSON).

Claims (computed on the means over seeds, with the number of seeds in which each holds; never
asserted, nothing tuned on them): (1) pooled accuracy >= 60% at Dirichlet 1.0; (2) far above
chance and closer to (b) than to (a); (3) the accuracy rises over rounds (the last evaluation
above the first, round 20; beside it the curve's lowest point and its rank correlation with the
round); (4) the Frechet distance falls (start, round 0 > middle, round 100 > end, round 200;
beside it, added after seeing the curves, the same from the first snapshot, round 10, on, the
highest point after round 10 and the rank correlation with the round); (5) Dirichlet 0.1
degrades gracefully against 1.0, read here as: at most 10 points lower, and still closer to (b)
than to (a). Cells are the mean over seeds and the largest deviation of a seed from it.

Run: `python -m bench.fedevg` (4 FedEvg settings x 3 seeds = 12 runs of 200 rounds, and per
alpha and seed one reference job with a 200-round FedAvg run, in 2 spawned worker processes of
one torch thread each): 27 to 32 minutes on 2 CPU cores shared with other jobs (a FedEvg run
took 145 to 440 s depending on the load, a FedAvg run about 40 s; two full runs gave identical
numbers); `--quick` for a smoke run (one
seed, 20 rounds, FedAvg 5 rounds, about 1 minute; it overwrites the same files); `--workers N`.
Writes bench/results/fedevg.json, fedevg.png (accuracy bars with the references, the Frechet
curves, accuracy over rounds), and the final synthetic set of seed 0, one row per class:
fedevg_samples.png (Dirichlet 1.0, eta_max 10), fedevg_samples_alpha0.1.png (Dirichlet 0.1,
eta_max 10) and fedevg_samples_eta1.png (Dirichlet 1.0, eta_max 1).
"""

from __future__ import annotations

import argparse
import multiprocessing
import statistics
import time
import warnings
from collections.abc import Mapping, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch
from scipy import linalg, stats
from torch import nn

from bench.common import RESULTS, write
from bench.mixing import cell, spread
from fedsilo.coordinator.engine import RunHistory
from fedsilo.coordinator.synthetic import initial_synthetic_set, step_sizes, train_classifier
from fedsilo.models.zoo import build_model, load_flat
from fedsilo.ops.simulate import simulate
from fedsilo.ops.synthetic import save_grid
from fedsilo.policies.loading import parse_policy
from fedsilo.policies.model import CnnModel, MlpModel
from fedsilo.policies.schema import Policy
from fedsilo.policies.seeding import derive_seed
from fedsilo.silo.data import SiloDataset, load_consortium
from fedsilo.silo.tasks.base import parameter_spec

SEEDS = (0, 1, 2)
ROUNDS = 200
FEDAVG_ROUNDS = 200
QUICK_ROUNDS, QUICK_FEDAVG_ROUNDS = 20, 5
EVAL_EVERY = 20
IMAGE_EVERY = 10
ALPHAS = (1.0, 0.1)
STEPS = (10.0, 1.0)  # eta_max
SPC, CLASSES, INPUT_SHAPE = 10, 10, (1, 8, 8)
CLASSIFIER = {"epochs": 100, "batch_size": 64, "lr": 1e-3}
FEATURES = {"hidden": 64, "epochs": 50, "batch_size": 64, "lr": 1e-3}
FRECHET_DRAWS = 10
POINTS = 100.0
TARGET = 60.0  # points: claim (1)
GRACEFUL_DROP = 10.0  # points: claim (5)
MODEL = {"name": "cnn", "channels": [32, 64], "hidden": 0, "activation": "silu", "norm": "group"}
TRAINING = {
    "epochs": 1,
    "batch_size": 32,
    "optimizer": "adam",
    "lr": 1e-3,
    "weight_decay": 1e-4,
    "lr_schedule": {"kind": "step", "every": 50, "gamma": 0.9},
}
FEDEVG = {
    "name": "fedevg",
    "samples_per_class": SPC,
    "energy": "joint",
    "server_step_min": 1.0,
    "server_noise": 1e-4,
    "client_sgld_steps": 1,
    "client_sgld_step": 1.0,
    "client_sgld_noise": 0.01,
    "gradient_clip": 3.0,
    "synthetic_ce_weight": 0.1,
    "spectral_norm": True,
    "persist_local_model": False,
    "classifier_epochs": CLASSIFIER["epochs"],
    "classifier_lr": CLASSIFIER["lr"],
    "classifier_batch_size": CLASSIFIER["batch_size"],
    "image_every": IMAGE_EVERY,
}
NOISE, REAL, FEDAVG = "(a) trained on X~_0 (noise)", "(b) 10 real per class", "(c) FedAvg"


def data_config(alpha: float) -> dict[str, Any]:
    return {
        "source": "sklearn:digits",
        "scaling": "none",
        "partition": {"kind": "dirichlet", "silos": 10, "alpha": alpha},
        "split": {"train": 0.8, "val": 0.0, "test": 0.2},
    }


def setting_name(alpha: float, step: float) -> str:
    return f"FedEvg alpha {alpha:g}, eta_max {step:g}"


def make_policy(algorithm: dict[str, Any], alpha: float, seed: int, rounds: int) -> Policy:
    return parse_policy(
        {
            "version": 1,
            "name": f"bench-{algorithm['name']}",
            "seed": seed,
            "rounds": rounds,
            "eval_every": min(EVAL_EVERY, rounds),
            "algorithm": algorithm,
            "model": MODEL,
            "training": TRAINING,
            "data": data_config(alpha),
        }
    )


# ---------------------------------------------------------------------------------------------
# The Frechet distance


def gaussian_frechet(mu1: np.ndarray, cov1: np.ndarray, mu2: np.ndarray, cov2: np.ndarray) -> float:
    """|mu1 - mu2|^2 + tr(S1 + S2 - 2 (S1 S2)^(1/2)); a small ridge where sqrtm is not finite
    (singular covariances), the imaginary round-off dropped."""
    with warnings.catch_warnings():  # singular covariances (dead units, N < 2 d) are expected
        warnings.simplefilter("ignore", linalg.LinAlgWarning)
        root = linalg.sqrtm(cov1 @ cov2)
        if not np.isfinite(root).all():
            ridge = 1e-6 * np.eye(len(mu1))
            root = linalg.sqrtm((cov1 + ridge) @ (cov2 + ridge))
    value = np.sum((mu1 - mu2) ** 2) + np.trace(cov1) + np.trace(cov2) - 2 * np.trace(root.real)
    return float(value)


def frechet_distance(a: np.ndarray, b: np.ndarray) -> float:
    """The Frechet distance between Gaussians fitted to the rows of `a` and of `b`."""
    return gaussian_frechet(a.mean(0), np.cov(a, rowvar=False), b.mean(0), np.cov(b, rowvar=False))


def frechet_check() -> dict[str, Any]:
    """The implementation against answers known in closed form: diagonal Gaussians (distance
    |mu1 - mu2|^2 + sum (sqrt v1 - sqrt v2)^2), the same pair rotated (unchanged), a pair with
    non-commuting covariances against the symmetric form tr(S1 + S2 - 2 (S1^(1/2) S2
    S1^(1/2))^(1/2)), and 200,000 samples of the diagonal pair (within 2%)."""
    rng = np.random.default_rng(0)
    dim = 6
    mu1, mu2 = rng.normal(size=dim), rng.normal(size=dim)
    var1, var2 = rng.uniform(0.3, 3.0, dim), rng.uniform(0.3, 3.0, dim)
    exact = float(np.sum((mu1 - mu2) ** 2) + np.sum((np.sqrt(var1) - np.sqrt(var2)) ** 2))
    diagonal = gaussian_frechet(mu1, np.diag(var1), mu2, np.diag(var2))
    q, _ = np.linalg.qr(rng.normal(size=(dim, dim)))
    rotated = gaussian_frechet(q @ mu1, q @ np.diag(var1) @ q.T, q @ mu2, q @ np.diag(var2) @ q.T)
    a, b = rng.normal(size=(dim, dim)), rng.normal(size=(dim, dim))
    cov1, cov2 = a @ a.T + 0.1 * np.eye(dim), b @ b.T + 0.1 * np.eye(dim)
    half = linalg.sqrtm(cov1).real
    symmetric = float(
        np.sum((mu1 - mu2) ** 2) + np.trace(cov1 + cov2 - 2 * linalg.sqrtm(half @ cov2 @ half).real)
    )
    general = gaussian_frechet(mu1, cov1, mu2, cov2)
    draws = 200_000
    sampled = frechet_distance(
        mu1 + rng.normal(size=(draws, dim)) * np.sqrt(var1),
        mu2 + rng.normal(size=(draws, dim)) * np.sqrt(var2),
    )
    return {
        "known": exact,
        "diagonal": diagonal,
        "rotated": rotated,
        "non_commuting": {"product_form": general, "symmetric_form": symmetric},
        "sampled_200000": sampled,
        "holds": bool(
            abs(diagonal - exact) < 1e-9 * max(1.0, exact)
            and abs(rotated - exact) < 1e-6 * max(1.0, exact)
            and abs(general - symmetric) < 1e-6 * max(1.0, symmetric)
            and abs(sampled - exact) < 0.02 * exact
        ),
    }


# ---------------------------------------------------------------------------------------------
# Data, models, accuracy


def pooled(silos: Sequence[SiloDataset], split: str) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.cat([getattr(s, f"x_{split}") for s in silos])
    return x, torch.cat([getattr(s, f"y_{split}") for s in silos])


@torch.no_grad()
def accuracies(model: nn.Module, silos: Sequence[SiloDataset]) -> dict[str, float]:
    """`pooled`: accuracy on all silos' test rows together; `silo_mean`: the mean over silos."""
    model.eval()
    per_silo = [float((model(s.x_test).argmax(1) == s.y_test).double().mean()) for s in silos]
    x, y = pooled(silos, "test")
    return {
        "pooled": float((model(x).argmax(1) == y).double().mean()),
        "silo_mean": statistics.mean(per_silo),
    }


def final_model(policy: Policy, history: RunHistory) -> nn.Module:
    """The state's final model (FedEvg: the classifier trained on the synthetic set)."""
    model = build_model(policy.model, INPUT_SHAPE, CLASSES, seed=0)
    spec = parameter_spec(model)
    if spec != history.state.spec:
        raise RuntimeError("the state's model does not fit the policy's model")
    return load_flat(model, history.state.model).eval()


def trained_classifier(x: torch.Tensor, y: torch.Tensor, seed: int) -> nn.Module:
    """The evaluation CNN, fresh from `seed`, trained on (x, y) alone as the strategy does."""
    model = build_model(CnnModel.model_validate(MODEL), INPUT_SHAPE, CLASSES, seed)
    generator = torch.Generator().manual_seed(derive_seed(seed, "bench-classifier"))
    return train_classifier(
        model, (x, y), CLASSIFIER["epochs"], CLASSIFIER["batch_size"], CLASSIFIER["lr"], generator
    )


def initial_set(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """X~_0 and y~ exactly as the strategy draws them for a run with policy seed `seed`."""
    generator = torch.Generator().manual_seed(derive_seed(seed, "synthetic-init"))
    return initial_synthetic_set(SPC, CLASSES, INPUT_SHAPE, generator)


def real_per_class(silos: Sequence[SiloDataset], seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """SPC random real training images per class from the silos' pooled training rows."""
    x, y = pooled(silos, "train")
    rng = np.random.default_rng(derive_seed(seed, "bench-real-per-class"))
    rows = np.concatenate(
        [rng.choice(np.flatnonzero(y.numpy() == c), SPC, replace=False) for c in range(CLASSES)]
    )
    return x[rows], y[rows]


# ---------------------------------------------------------------------------------------------
# Features for the Frechet distance


class FeatureSpace:
    """The hidden layer of an MLP trained on real digits, and 10 fixed random real subsets of
    N points (pooled test rows) to compare a set of points with."""

    def __init__(self, silos: Sequence[SiloDataset], seed: int) -> None:
        mlp = MlpModel(name="mlp", hidden=[FEATURES["hidden"]], activation="relu")
        self.model = build_model(mlp, INPUT_SHAPE, CLASSES, derive_seed(seed, "bench-features"))
        generator = torch.Generator().manual_seed(derive_seed(seed, "bench-features-training"))
        train_classifier(
            self.model,
            pooled(silos, "train"),
            FEATURES["epochs"],
            FEATURES["batch_size"],
            FEATURES["lr"],
            generator,
        )
        self.embedding = self.model[:-1]
        x_test, y_test = pooled(silos, "test")
        with torch.no_grad():
            self.accuracy = float((self.model(x_test).argmax(1) == y_test).double().mean())
        self.real = self.features(x_test)
        rng = np.random.default_rng(derive_seed(seed, "bench-frechet-subsets"))
        n = SPC * CLASSES
        self.orders = [rng.permutation(len(self.real)) for _ in range(FRECHET_DRAWS)]
        self.subsets = [self.real[order[:n]] for order in self.orders]
        self.others = [self.real[order[n : 2 * n]] for order in self.orders]

    @torch.no_grad()
    def features(self, x: torch.Tensor) -> np.ndarray:
        return self.embedding(x.float()).double().numpy()

    def distance(self, x: torch.Tensor) -> float:
        """The mean over the 10 real subsets of the Frechet distance to `x`'s features."""
        found = self.features(x)
        return statistics.mean(frechet_distance(found, real) for real in self.subsets)

    def floor(self) -> float:
        """Real against real: each subset against a disjoint random subset of the same size."""
        pairs = zip(self.subsets, self.others, strict=True)
        return statistics.mean(frechet_distance(a, b) for a, b in pairs)


# ---------------------------------------------------------------------------------------------
# Jobs (each in a worker process)


def fedevg_job(alpha: float, step: float, seed: int, rounds: int) -> dict[str, Any]:
    """One FedEvg run: final accuracy (pooled and per silo), accuracy over rounds, the Frechet
    curve over snapshots, and the final synthetic set."""
    torch.set_num_threads(1)
    policy = make_policy({**FEDEVG, "server_step_max": step}, alpha, seed, rounds)
    silos = load_consortium(policy.data, seed)
    started = time.perf_counter()
    result = simulate(policy, silos)
    seconds = time.perf_counter() - started
    history = result.history
    space = FeatureSpace(silos, seed)
    snapshots = result.snapshots  # X~_0 (round 0) and every 10th round
    final = history.state.tensors["synthetic"]
    evaluation = history.final.evaluation or {}
    return {
        "job": "fedevg",
        "alpha": alpha,
        "step": step,
        "seed": seed,
        "seconds": seconds,
        "accuracy": {
            **accuracies(final_model(policy, history), silos),
            "strategy_silo_mean": statistics.mean(m["accuracy"] for m in evaluation.values()),
        },
        "per_silo_accuracy": {s: m["accuracy"] for s, m in sorted(evaluation.items())},
        "accuracy_curve": {
            r.round: statistics.mean(m["accuracy"] for m in r.evaluation.values())
            for r in history.records
            if r.evaluation
        },
        "frechet_curve": {r: space.distance(x) for r, (x, _) in sorted(snapshots.items())},
        "feature_accuracy": space.accuracy,
        "silo_sizes": [len(s.y_train) for s in silos],
        "silo_classes": [int(torch.unique(s.y_train).numel()) for s in silos],
        "synthetic": (final.clone(), history.state.tensors["synthetic_labels"].clone()),
        "synthetic_range": [float(final.min()), float(final.max())],
    }


def reference_job(alpha: float, seed: int, fedavg_rounds: int) -> dict[str, Any]:
    """(a) the CNN trained on X~_0, (b) on 10 real training images per class, (c) FedAvg; the
    Frechet floors; the feature classifier's accuracy."""
    torch.set_num_threads(1)
    policy = make_policy({"name": "fedavg"}, alpha, seed, fedavg_rounds)
    silos = load_consortium(policy.data, seed)
    model_seed = derive_seed(seed, "bench-reference-model")
    noise, real = initial_set(seed), real_per_class(silos, seed)
    started = time.perf_counter()
    history = simulate(policy, silos).history
    seconds = time.perf_counter() - started
    space = FeatureSpace(silos, seed)
    return {
        "job": "reference",
        "alpha": alpha,
        "seed": seed,
        "accuracy": {
            NOISE: accuracies(trained_classifier(*noise, model_seed), silos),
            REAL: accuracies(trained_classifier(*real, model_seed), silos),
            FEDAVG: accuracies(final_model(policy, history), silos),
        },
        "fedavg_seconds": seconds,
        "frechet": {
            "real_vs_real": space.floor(),
            "real_10_per_class": space.distance(real[0]),
            "noise": space.distance(noise[0]),
        },
        "feature_accuracy": space.accuracy,
    }


# ---------------------------------------------------------------------------------------------
# Tables and claims

Runs = list[dict[str, Any]]


def fedevg_rows(runs: Runs) -> dict[str, dict[str, Any]]:
    """Per setting: accuracy (pooled, silo mean), its curve over rounds, the Frechet curve."""
    rows: dict[str, dict[str, Any]] = {}
    for alpha, step in sorted(
        {(r["alpha"], r["step"]) for r in runs}, key=lambda k: (-k[0], -k[1])
    ):
        found = sorted(
            (r for r in runs if (r["alpha"], r["step"]) == (alpha, step)), key=lambda r: r["seed"]
        )
        curve_rounds = sorted(found[0]["frechet_curve"])
        accuracy_rounds = sorted(found[0]["accuracy_curve"])
        rows[setting_name(alpha, step)] = {
            "alpha": alpha,
            "eta_max": step,
            "seeds": [r["seed"] for r in found],
            "pooled_accuracy": spread([r["accuracy"]["pooled"] for r in found]),
            "silo_mean_accuracy": spread([r["accuracy"]["silo_mean"] for r in found]),
            "accuracy_curve": {
                t: spread([r["accuracy_curve"][t] for r in found]) for t in accuracy_rounds
            },
            "frechet_curve": {
                t: spread([r["frechet_curve"][t] for r in found]) for t in curve_rounds
            },
            "seconds_per_run": statistics.mean(r["seconds"] for r in found),
            "per_seed": [{k: v for k, v in r.items() if k != "synthetic"} for r in found],
        }
    return rows


def reference_rows(runs: Runs) -> dict[str, dict[str, Any]]:
    """Per alpha: the three references' accuracies and the Frechet floors."""
    rows: dict[str, dict[str, Any]] = {}
    for alpha in sorted({r["alpha"] for r in runs}, reverse=True):
        found = sorted((r for r in runs if r["alpha"] == alpha), key=lambda r: r["seed"])
        rows[f"alpha {alpha:g}"] = {
            "alpha": alpha,
            **{
                label: {
                    metric: spread([r["accuracy"][label][metric] for r in found])
                    for metric in ("pooled", "silo_mean")
                }
                for label in (NOISE, REAL, FEDAVG)
            },
            "frechet": {
                key: spread([r["frechet"][key] for r in found])
                for key in ("real_vs_real", "real_10_per_class", "noise")
            },
            "feature_classifier_pooled_accuracy": spread([r["feature_accuracy"] for r in found]),
            "fedavg_seconds_per_run": statistics.mean(r["fedavg_seconds"] for r in found),
        }
    return rows


def three_points(curve: Mapping[int, Any]) -> dict[str, int]:
    """The rounds read as start (0), middle and end of a curve."""
    rounds = sorted(curve)
    middle = min(rounds, key=lambda t: abs(t - rounds[-1] / 2))
    return {"start": rounds[0], "first_snapshot": rounds[1], "middle": middle, "end": rounds[-1]}


def closer_to_real(acc: float, noise: float, real: float) -> bool:
    return acc - noise > real - acc


def spearman(curve: Mapping[int, float]) -> float:
    rounds = sorted(curve)
    return float(stats.spearmanr(rounds, [curve[t] for t in rounds])[0])


def closer_claim(row: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """(2): the pooled accuracy nearer (b) than (a)."""
    pooled_of = (row["pooled_accuracy"], reference[NOISE]["pooled"], reference[REAL]["pooled"])
    mean = tuple(p["mean"] for p in pooled_of)
    per_seed = list(zip(*(p["values"] for p in pooled_of), strict=True))
    return {
        "accuracy_points": POINTS * mean[0],
        "a_points": POINTS * mean[1],
        "b_points": POINTS * mean[2],
        "gap_to_a_points": POINTS * (mean[0] - mean[1]),
        "gap_to_b_points": POINTS * (mean[2] - mean[0]),
        "holds": closer_to_real(*mean),
        "seeds_holding": sum(closer_to_real(*v) for v in per_seed),
    }


def rises_claim(row: dict[str, Any]) -> dict[str, Any]:
    """(3): the last evaluation above the first; beside it the curve's lowest point and the
    rank correlation of accuracy with the round, per seed."""
    curve = {t: v["mean"] for t, v in row["accuracy_curve"].items()}
    seeds = [r["accuracy_curve"] for r in row["per_seed"]]
    first, last = min(curve), max(curve)
    lowest = min(curve, key=curve.__getitem__)
    return {
        "first_round": first,
        "last_round": last,
        "first_points": POINTS * curve[first],
        "last_points": POINTS * curve[last],
        "lowest_points": POINTS * curve[lowest],
        "lowest_round": lowest,
        "holds": curve[last] > curve[first],
        "seeds_holding": sum(c[last] > c[first] for c in seeds),
        "spearman_round_vs_accuracy": [spearman(c) for c in seeds],
    }


def falls_claim(row: dict[str, Any]) -> dict[str, Any]:
    """(4): start (round 0) > middle > end, as declared before the run; and, added after
    seeing the curves, the stricter reading from the first snapshot (round 10) on, and the
    curve's highest point after it."""
    marks = three_points(row["frechet_curve"])
    curve = {t: v["mean"] for t, v in row["frechet_curve"].items()}
    seeds = [r["frechet_curve"] for r in row["per_seed"]]

    def falls(values: Mapping[int, float], begin: str) -> bool:
        return values[marks[begin]] > values[marks["middle"]] > values[marks["end"]]

    later = [t for t in curve if t > marks["first_snapshot"]]
    peak = max(later, key=curve.__getitem__) if later else marks["end"]
    return {
        "rounds": marks,
        **{k: curve[t] for k, t in marks.items()},
        "holds": falls(curve, "start"),
        "seeds_holding": sum(falls(c, "start") for c in seeds),
        "after_first_snapshot": {
            "added_after_seeing_the_curves": True,
            "holds": falls(curve, "first_snapshot"),
            "seeds_holding": sum(falls(c, "first_snapshot") for c in seeds),
            "highest_after_first_snapshot": curve[peak],
            "highest_round": peak,
        },
        "spearman_round_vs_distance": [spearman(c) for c in seeds],
    }


def setting_claims(row: dict[str, Any], reference: dict[str, Any]) -> dict[str, Any]:
    """Claims (2), (3), (4) for one setting, on the means and per seed."""
    return {
        "closer_to_b_than_to_a": closer_claim(row, reference),
        "accuracy_rises_over_rounds": rises_claim(row),
        "frechet_falls": falls_claim(row),
    }


def claims(rows: dict[str, dict[str, Any]], refs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    found: dict[str, Any] = {"per_setting": {}}
    for name, row in rows.items():
        found["per_setting"][name] = setting_claims(row, refs[f"alpha {row['alpha']:g}"])
    target: dict[str, Any] = {}
    graceful: dict[str, Any] = {}
    for step in STEPS:
        high, low = setting_name(1.0, step), setting_name(0.1, step)
        if high in rows:
            accuracy = rows[high]["pooled_accuracy"]
            target[high] = {
                "points": POINTS * accuracy["mean"],
                "holds": POINTS * accuracy["mean"] >= TARGET,
                "seeds_holding": sum(POINTS * v >= TARGET for v in accuracy["values"]),
            }
        if high in rows and low in rows:
            drop = POINTS * (
                rows[high]["pooled_accuracy"]["mean"] - rows[low]["pooled_accuracy"]["mean"]
            )
            fedavg_of = [refs[f"alpha {a:g}"][FEDAVG]["pooled"]["mean"] for a in (1.0, 0.1)]
            fedavg = POINTS * (fedavg_of[0] - fedavg_of[1])
            still = found["per_setting"][low]["closer_to_b_than_to_a"]["holds"]
            graceful[f"eta_max {step:g}"] = {
                "alpha_1_points": POINTS * rows[high]["pooled_accuracy"]["mean"],
                "alpha_0.1_points": POINTS * rows[low]["pooled_accuracy"]["mean"],
                "drop_points": drop,
                "fedavg_drop_points": fedavg,
                "alpha_0.1_closer_to_b_than_to_a": still,
                "holds": drop <= GRACEFUL_DROP and still,
            }
    found["1_at_least_60_percent_at_alpha_1"] = target
    found["5_alpha_0.1_degrades_gracefully"] = graceful
    return found


# ---------------------------------------------------------------------------------------------
# Plots


COLOURS = {NOISE: "tab:gray", REAL: "tab:green", FEDAVG: "tab:orange"}


def accuracy_bars(axis: plt.Axes, rows: dict[str, Any], refs: dict[str, Any]) -> None:
    """Pooled test accuracy per setting and reference, grouped by alpha (error bars: max
    deviation over seeds)."""
    labels, values, errors, colours = [], [], [], []
    for ref in refs.values():
        alpha = ref["alpha"]
        for row in rows.values():
            if row["alpha"] == alpha:
                labels.append(f"a={alpha:g}\neta {row['eta_max']:g}")
                values.append(POINTS * row["pooled_accuracy"]["mean"])
                errors.append(POINTS * row["pooled_accuracy"]["max_dev"])
                colours.append("tab:blue" if row["eta_max"] == max(STEPS) else "tab:cyan")
        for label in (NOISE, REAL, FEDAVG):
            labels.append(f"a={alpha:g}\n{label[:3]}")
            values.append(POINTS * ref[label]["pooled"]["mean"])
            errors.append(POINTS * ref[label]["pooled"]["max_dev"])
            colours.append(COLOURS[label])
    positions = np.arange(len(labels))
    axis.bar(positions, values, yerr=errors, capsize=3, color=colours)
    for x, y in zip(positions, values, strict=True):
        axis.text(x, y + 2, f"{y:.0f}", ha="center", fontsize=7)
    axis.axhline(TARGET, color="k", linestyle=":", linewidth=1, label="60% (target)")
    axis.axhline(10, color="gray", linestyle="--", linewidth=1, label="chance")
    colours_of = ("tab:blue", "tab:cyan", *COLOURS.values())
    handles = [plt.Rectangle((0, 0), 1, 1, color=c) for c in colours_of]
    names = [f"FedEvg eta_max {max(STEPS):g}", f"FedEvg eta_max {min(STEPS):g}", *COLOURS]
    lines, texts = axis.get_legend_handles_labels()
    axis.legend(handles + lines, names + texts, fontsize=6, loc="upper center", ncol=4)
    axis.set_xticks(positions, labels, fontsize=6)
    axis.set_ylim(0, 125)
    axis.set_ylabel("pooled test accuracy (%)")
    axis.set_title("CNN trained on 100 points, tested on real digits", fontsize=9)


def frechet_curves(axis: plt.Axes, rows: dict[str, Any], refs: dict[str, Any]) -> None:
    for name, row in rows.items():
        rounds = sorted(row["frechet_curve"])
        mean = np.array([row["frechet_curve"][t]["mean"] for t in rounds])
        dev = np.array([row["frechet_curve"][t]["max_dev"] for t in rounds])
        (line,) = axis.plot(rounds, mean, marker=".", label=name.removeprefix("FedEvg "))
        axis.fill_between(rounds, mean - dev, mean + dev, color=line.get_color(), alpha=0.15)
    for ref, style in zip(refs.values(), ("--", ":"), strict=False):
        floor, alpha = ref["frechet"]["real_vs_real"]["mean"], ref["alpha"]
        axis.axhline(floor, color="k", ls=style, lw=1, label=f"real vs real, alpha {alpha:g}")
        real = ref["frechet"]["real_10_per_class"]["mean"]
        label = f"(b)'s 10 real/class, alpha {alpha:g}"
        axis.axhline(real, color="tab:green", ls=style, lw=1, label=label)
    axis.set_yscale("log")
    axis.set_xlabel("round (0: X~_0)")
    axis.set_ylabel("proxy Frechet distance (MLP features, N = 100)")
    axis.set_title("Frechet distance to real test digits", fontsize=9)
    axis.legend(fontsize=6)


def accuracy_curves(axis: plt.Axes, rows: dict[str, Any]) -> None:
    for name, row in rows.items():
        rounds = sorted(row["accuracy_curve"])
        mean = np.array([POINTS * row["accuracy_curve"][t]["mean"] for t in rounds])
        dev = np.array([POINTS * row["accuracy_curve"][t]["max_dev"] for t in rounds])
        label = name.removeprefix("FedEvg ")
        axis.errorbar(rounds, mean, yerr=dev, marker="o", ms=3, capsize=2, label=label)
    axis.axhline(TARGET, color="k", linestyle=":", linewidth=1)
    axis.set_xlabel("round")
    axis.set_ylabel("mean test accuracy over silos (%)")
    axis.set_title("synthetic-trained classifier over rounds", fontsize=9)
    axis.legend(fontsize=6)


def figure(rows: dict[str, Any], refs: dict[str, Any]) -> plt.Figure:
    fig, axes = plt.subplots(1, 3, figsize=(17, 5), gridspec_kw={"width_ratios": [1.6, 1, 1]})
    accuracy_bars(axes[0], rows, refs)
    frechet_curves(axes[1], rows, refs)
    accuracy_curves(axes[2], rows)
    return fig


GRIDS = {"": (1.0, 10.0), "_alpha0.1": (0.1, 10.0), "_eta1": (1.0, 1.0)}  # suffix: alpha, eta


def sample_grids(runs: Runs) -> list[str]:
    """The final synthetic set of the first seed: Dirichlet 1.0 and 0.1 at eta_max 10, and
    Dirichlet 1.0 at eta_max 1."""
    written = []
    seed = min(r["seed"] for r in runs)
    for suffix, (alpha, step) in GRIDS.items():
        found = [r for r in runs if (r["alpha"], r["step"], r["seed"]) == (alpha, step, seed)]
        if not found:
            continue
        x, y = found[0]["synthetic"]
        rounds = max(found[0]["frechet_curve"])
        path = RESULTS / f"fedevg_samples{suffix}.png"
        title = f"FedEvg, Dirichlet {alpha:g}, eta_max {step:g}, seed {seed}, round {rounds}"
        save_grid(path, x, y, title)
        written.append(path.name)
    return written


# ---------------------------------------------------------------------------------------------
# Running


Job = tuple[str, tuple[Any, ...]]
COST = {"fedevg": 3.0, "reference": 1.0}


def jobs_for(quick: bool) -> list[Job]:
    seeds = SEEDS[:1] if quick else SEEDS
    rounds = QUICK_ROUNDS if quick else ROUNDS
    fedavg_rounds = QUICK_FEDAVG_ROUNDS if quick else FEDAVG_ROUNDS
    jobs: list[Job] = [
        ("fedevg", (alpha, step, seed, rounds))
        for alpha in ALPHAS
        for step in STEPS
        for seed in seeds
    ]
    jobs += [("reference", (alpha, seed, fedavg_rounds)) for alpha in ALPHAS for seed in seeds]
    return jobs


def run_all(jobs: list[Job], workers: int) -> tuple[Runs, Runs]:
    """The jobs in `workers` spawned processes, FedEvg runs first."""
    functions = {"fedevg": fedevg_job, "reference": reference_job}
    fedevg_runs, reference_runs = [], []
    context = multiprocessing.get_context("spawn")
    with ProcessPoolExecutor(workers, mp_context=context) as pool:
        ordered = sorted(jobs, key=lambda job: -COST[job[0]])
        futures = [pool.submit(functions[kind], *args) for kind, args in ordered]
        for future in as_completed(futures):
            found = future.result()
            if found["job"] == "fedevg":
                fedevg_runs.append(found)
                curve = found["frechet_curve"]
                print(
                    f"{setting_name(found['alpha'], found['step'])} seed {found['seed']}: pooled "
                    f"{POINTS * found['accuracy']['pooled']:.1f}%  Frechet "
                    f"{curve[0]:.2f} -> {curve[max(curve)]:.2f}  ({found['seconds']:.0f} s)",
                    flush=True,
                )
            else:
                reference_runs.append(found)
                accuracy = found["accuracy"]
                print(
                    f"references alpha {found['alpha']:g} seed {found['seed']}: "
                    + "  ".join(f"{k} {POINTS * v['pooled']:.1f}%" for k, v in accuracy.items())
                    + f"  (FedAvg {found['fedavg_seconds']:.0f} s)",
                    flush=True,
                )
    return fedevg_runs, reference_runs


def print_summary(rows: dict[str, Any], refs: dict[str, Any]) -> None:
    print("pooled test accuracy (%), silo-mean test accuracy (%), mean ± max dev over seeds")
    for name, row in rows.items():
        marks = three_points(row["frechet_curve"])
        curve = "  ".join(f"{k} {cell(row['frechet_curve'][t])}" for k, t in marks.items())
        print(
            f"  {name:32s} {cell(row['pooled_accuracy'], POINTS)}  "
            f"{cell(row['silo_mean_accuracy'], POINTS)}  Frechet {curve}"
        )
    for key, ref in refs.items():
        for label in (NOISE, REAL, FEDAVG):
            found = f"{cell(ref[label]['pooled'], POINTS)}  {cell(ref[label]['silo_mean'], POINTS)}"
            print(f"  {key:9s} {label:28s} {found}")
        floors = "  ".join(f"{k} {cell(v)}" for k, v in ref["frechet"].items())
        print(f"  {key:9s} Frechet references: {floors}", flush=True)


def settings(quick: bool, check: dict[str, Any]) -> dict[str, Any]:
    jobs = jobs_for(quick)
    rounds = QUICK_ROUNDS if quick else ROUNDS
    return {
        "quick": quick,
        "seeds": sorted({args[-1] for kind, args in jobs if kind == "fedevg"}),
        "rounds": rounds,
        "fedavg_rounds": QUICK_FEDAVG_ROUNDS if quick else FEDAVG_ROUNDS,
        "eval_every": EVAL_EVERY,
        "image_every": IMAGE_EVERY,
        "alphas": list(ALPHAS),
        "eta_max": list(STEPS),
        "data": data_config(1.0) | {"partition": "dirichlet, 10 silos, alpha as above, min_size 2"},
        "model": MODEL,
        "training": TRAINING,
        "fedevg": FEDEVG,
        "server_steps_first_middle_last": {
            f"eta_max {s:g}": [float(v) for v in step_sizes(rounds, s, 1.0)[[0, rounds // 2, -1]]]
            for s in STEPS
        },
        "reference_classifier": CLASSIFIER,
        "frechet": {
            "features": "hidden layer (64 units, ReLU) of the zoo's mlp, hidden [64], trained on "
            "the pooled training rows of the seed's silos",
            "feature_training": FEATURES,
            "real_side": "10 random subsets of 100 pooled test rows (fixed per seed)",
            "synthetic_side": "the 100 synthetic points at rounds 0 (X~_0), 10, 20, ...",
        },
        "accuracy": "pooled: the state's final classifier on all silos' test rows; silo_mean: "
        "the mean of the silos' test accuracies",
        "frechet_check": check,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, 20 rounds (smoke test)")
    parser.add_argument("--workers", type=int, default=2, help="processes (default 2)")
    args = parser.parse_args()
    check = frechet_check()
    print(f"Frechet check: {check}", flush=True)
    started = time.perf_counter()
    fedevg_runs, reference_runs = run_all(jobs_for(args.quick), args.workers)
    seconds = time.perf_counter() - started
    rows, refs = fedevg_rows(fedevg_runs), reference_rows(reference_runs)
    found = claims(rows, refs)
    print_summary(rows, refs)
    print(found, flush=True)
    RESULTS.mkdir(parents=True, exist_ok=True)
    grids = sample_grids(fedevg_runs)
    path = write(
        "fedevg",
        {
            "settings": settings(args.quick, check),
            "wall_seconds": seconds,
            "claims": found,
            "rows": rows,
            "references": refs,
            "sample_grids": grids,
        },
        figure(rows, refs),
    )
    print(f"wrote {path}, {path.with_suffix('.png')} and {', '.join(grids)}; total {seconds:.0f} s")


if __name__ == "__main__":
    main()
