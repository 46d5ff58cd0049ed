"""The domain-aware methods against FedAvg: four hospitals, patients' sex as the domain.

What it measures: whether AgnosticFedAvg over the patients' sex (Ro et al. 2021; lambda over
the sexes, exponentiated-gradient ascent on their mean losses) or ApproxFedAvg (the survey's
soft maximum over the sexes' losses in each minibatch) raises the accuracy of the worse sex of
the final global model over FedAvg, and what it costs in overall accuracy. This is the
cross-silo case ApproxFedAvg is proposed for: every hospital holds both domains, and women are
a minority at every hospital (per seed 151-161 of the 738 training rows: 73-82 of 244 at
Cleveland, 61-66 of 235 at Hungary, 8-10 of 99 at Switzerland, 3-6 of 160 at VA Long Beach).

Set-up, the same for every method: the bundled heart-disease data (`data: {source: heart,
domain: sex}`, the four hospitals as silos, each hospital's rows split 80/10/10 into
train/val/test by the seed, locally standardised; sex stays a feature, one-hot); linear
(logistic) model; 40 rounds, every hospital every round, 5 local SGD steps of batch 32 at lr
0.05 (the settings of policies/examples/heart-agnostic-fedavg-by-sex.yaml); seeds 0-4 (the
seed changes every hospital's split and the training). The grid, fixed before any run, every
point reported (a sweep, not tuning):

- FedAvg;
- AgnosticFedAvg, `domains: data` (lambda over Male/Female), EG step 0.1 (the default)
  and 1.0, count_window 5;
- AgnosticFedAvg, `domains: silo` (each hospital one domain), step 0.1, for contrast;
- ApproxFedAvg, `domain_reduction: sum` (the survey's form), temperature mu in {1, 10, 100};
- ApproxFedAvg, `domain_reduction: mean` at the same mu (our option, added beside the
  survey's form: with sums a domain's batch loss grows with its share of the batch, so the
  soft maximum leans toward the majority sex; with means it does not).

Metrics, computed here from the final global model (history.state.model, loaded into the silos'
model builder) and the hospitals' own rows: accuracy per sex pooled over the four hospitals,
the worst-sex accuracy (the lower of the two), the overall pooled accuracy, and the mean of the
four hospitals' accuracies; and each sex's mean log loss (the quantity AgnosticFedAvg's lambda
reads). On the test rows, and again on the pooled TRAINING rows: the test split holds only
19-24 women per seed (one woman is 4-5 points of female accuracy), so the training rows
(151-161 women) are the less noisy view of whether a method moves the model toward a sex. The
per-hospital test accuracies are checked against the engine's own final evaluation. Cells are
the mean over seeds and the largest deviation of a seed from it; the claims (computed, never
asserted) compare each method with FedAvg on the means and count the seeds, paired by seed,
where it does better (with the paired per-seed differences).

Run: `python -m bench.domains` (about 70 s on 2 CPU cores: 50 runs of about 1 s once torch is
warm, one torch thread per silo thread) writes bench/results/domains.json and domains.png;
`--quick`: one seed, 10 rounds, a smoke test (about 15 s; writes the same files).
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch
from torch import nn
from torch.nn import functional

from bench.common import write
from bench.mixing import cell, spread
from fedsilo.coordinator.engine import RunHistory
from fedsilo.models.zoo import build_model, load_flat
from fedsilo.ops.simulate import simulate
from fedsilo.policies.loading import parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.data import SiloDataset, load_consortium
from fedsilo.silo.tasks.base import parameter_spec

SEEDS = (0, 1, 2, 3, 4)
ROUNDS = 40
QUICK_ROUNDS = 10
TRAINING = {"steps": 5, "batch_size": 32, "optimizer": "sgd", "lr": 0.05}
DATA = {"source": "heart", "domain": "sex", "split": {"train": 0.8, "val": 0.1, "test": 0.1}}
PARTICIPANTS = {"min_silos": 3, "phase_timeout_s": 120}
SPLITS = ("test", "train")
BASELINE = "FedAvg"
METHODS: dict[str, dict[str, Any]] = {
    BASELINE: {"algorithm": {"name": "fedavg"}},
    **{
        f"AFA sex step {step:g}": {
            "algorithm": {
                "name": "agnostic_fedavg",
                "domains": "data",
                "step": step,
                "count_window": 5,
            },
        }
        for step in (0.1, 1.0)
    },
    "AFA hospital step 0.1": {
        "algorithm": {"name": "agnostic_fedavg", "domains": "silo", "step": 0.1, "count_window": 5},
    },
    **{
        f"Approx {reduction} mu {mu:g}": {
            "algorithm": {
                "name": "approx_fedavg",
                "temperature": mu,
                "domain_reduction": reduction,
            },
        }
        for reduction in ("sum", "mean")
        for mu in (1.0, 10.0, 100.0)
    },
}
SEX_METHODS = ("AFA sex step 0.1", "AFA sex step 1")
ACCURACIES = ("Male", "Female", "worst", "overall", "mean_hospital")


def policy(method: dict[str, Any], seed: int, rounds: int) -> Policy:
    return parse_policy(
        {
            "version": 1,
            "seed": seed,
            "rounds": rounds,
            "eval_every": rounds,
            "model": {"name": "linear"},
            "training": TRAINING,
            "participants": PARTICIPANTS,
            "data": DATA,
            **method,
        }
    )


def final_model(p: Policy, data: SiloDataset, history: RunHistory) -> nn.Module:
    """The final global model, built as a silo builds it and loaded from the server state."""
    model = build_model(p.model, data.input_shape, data.output_dim, seed=0)
    spec = parameter_spec(model)
    if spec != history.state.spec:
        raise RuntimeError("the server's model does not fit the silos' model")
    return load_flat(model, history.state.model).eval()


@torch.no_grad()
def split_metrics(model: nn.Module, silos: Sequence[SiloDataset], split: str) -> dict[str, Any]:
    """Accuracy and mean log loss per domain on `split`'s rows pooled over the silos, the worst
    domain's accuracy, the pooled accuracy, and each silo's accuracy and their mean."""
    xs, ys, codes, per_silo = [], [], [], {}
    for data in silos:
        x, y = getattr(data, f"x_{split}"), getattr(data, f"y_{split}")
        xs.append(x)
        ys.append(y)
        codes.append(data.domain_codes[split])
        per_silo[data.name] = float((model(x).argmax(1) == y).double().mean())
    x, y, code = torch.cat(xs), torch.cat(ys), torch.cat(codes)
    logits = model(x)
    correct = (logits.argmax(1) == y).double()
    loss = functional.cross_entropy(logits, y, reduction="none").double()
    found: dict[str, Any] = {"overall": float(correct.mean())}
    for index, domain in enumerate(silos[0].domains):
        rows = code == index
        found[domain] = float(correct[rows].mean())
        found[f"loss_{domain}"] = float(loss[rows].mean())
        found[f"n_{domain}"] = int(rows.sum())
    found["worst"] = min(found[d] for d in silos[0].domains)
    found["worst_domain"] = min(silos[0].domains, key=found.__getitem__)
    found["per_hospital"] = per_silo
    found["mean_hospital"] = statistics.mean(per_silo.values())
    return found


def check_against_engine(found: dict[str, Any], history: RunHistory) -> None:
    """Our per-hospital test accuracies must be the engine's own final evaluation."""
    engine = {s: m["accuracy"] for s, m in history.final.evaluation.items()}
    ours = found["test"]["per_hospital"]
    if engine.keys() != ours.keys() or any(abs(engine[s] - ours[s]) > 1e-9 for s in engine):
        raise RuntimeError(f"bench evaluation {ours} differs from the engine's {engine}")


def run(method: dict[str, Any], seed: int, rounds: int) -> dict[str, Any]:
    """One simulation; the final model's metrics on test and train, and AFA's final lambda."""
    p = policy(method, seed, rounds)
    silos = load_consortium(p.data, seed)
    started = time.perf_counter()
    history = simulate(p, silos).history
    seconds = time.perf_counter() - started
    model = final_model(p, silos[0], history)
    found: dict[str, Any] = {split: split_metrics(model, silos, split) for split in SPLITS}
    check_against_engine(found, history)
    mixing = history.state.extra.get("mixing", {})
    if "lam" in mixing:
        names = mixing.get("domains", mixing.get("silos"))
        found["final_lambda"] = dict(zip(names, mixing["lam"], strict=True))
    return {"seed": seed, "seconds": seconds, **found}


def summarise(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Mean over seeds and max deviation of every accuracy and per-domain loss, per split."""
    summary: dict[str, Any] = {}
    for split in SPLITS:
        keys = [*ACCURACIES, "loss_Male", "loss_Female"]
        summary[split] = {k: spread([r[split][k] for r in runs]) for k in keys}
    return summary


def method_rows(seeds: tuple[int, ...], rounds: int) -> list[dict[str, Any]]:
    rows = []
    for label, method in METHODS.items():
        runs = [run(method, seed, rounds) for seed in seeds]
        rows.append({"method": label, **method, "summary": summarise(runs), "runs": runs})
        print(
            f"{label:22s} "
            + "  ".join(
                f"{split} M {cell(rows[-1]['summary'][split]['Male'], 100)} "
                f"F {cell(rows[-1]['summary'][split]['Female'], 100)} "
                f"worst {cell(rows[-1]['summary'][split]['worst'], 100)} "
                f"all {cell(rows[-1]['summary'][split]['overall'], 100)}"
                for split in SPLITS
            ),
            flush=True,
        )
    return rows


def table(rows: list[dict[str, Any]]) -> list[dict[str, str]]:
    """The summary as printable cells (percent, mean ± max deviation over seeds)."""
    return [
        {
            "method": row["method"],
            **{
                f"{split} {key}": cell(row["summary"][split][key], 100)
                for split in SPLITS
                for key in ACCURACIES
            },
        }
        for row in rows
    ]


def versus_baseline(row: dict[str, Any], baseline: dict[str, Any]) -> dict[str, Any]:
    """A method against FedAvg, per split: the differences of the means (points) and the seeds,
    paired, in which its worst-sex accuracy is strictly higher or its overall strictly lower."""
    found: dict[str, Any] = {}
    for split in SPLITS:

        def points(key: str) -> float:
            ours, theirs = row["summary"][split][key], baseline["summary"][split][key]  # noqa: B023
            return 100 * (ours["mean"] - theirs["mean"])

        pairs = list(zip(row["runs"], baseline["runs"], strict=True))
        found[split] = {
            "worst_minus_fedavg_points": points("worst"),
            "female_minus_fedavg_points": points("Female"),
            "male_minus_fedavg_points": points("Male"),
            "overall_minus_fedavg_points": points("overall"),
            "mean_hospital_minus_fedavg_points": points("mean_hospital"),
            "raises_worst": points("worst") > 0,
            "worst_paired_diff_points": [
                100 * (a[split]["worst"] - b[split]["worst"]) for a, b in pairs
            ],
            "overall_paired_diff_points": [
                100 * (a[split]["overall"] - b[split]["overall"]) for a, b in pairs
            ],
            "seeds_worst_higher": sum(a[split]["worst"] > b[split]["worst"] for a, b in pairs),
            "seeds_worst_lower": sum(a[split]["worst"] < b[split]["worst"] for a, b in pairs),
            "seeds_overall_lower": sum(a[split]["overall"] < b[split]["overall"] for a, b in pairs),
        }
    return found


def claims(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Computed from the numbers: which sex is worse under FedAvg, and each method against it;
    'raises' means a strictly higher mean over seeds."""
    by = {row["method"]: row for row in rows}
    baseline = by[BASELINE]
    found: dict[str, Any] = {
        "fedavg_worst_domain_per_seed": {
            split: [r[split]["worst_domain"] for r in baseline["runs"]] for split in SPLITS
        },
        "one_female_test_row_in_points": 100 / min(r["test"]["n_Female"] for r in baseline["runs"]),
        "vs_fedavg": {m: versus_baseline(row, baseline) for m, row in by.items() if m != BASELINE},
    }
    found["summary"] = {
        family: {
            m: {split: headline(found["vs_fedavg"][m][split]) for split in SPLITS} for m in members
        }
        for family, members in (
            ("agnostic_fedavg_by_sex", [m for m in SEX_METHODS if m in by]),
            ("approx_fedavg", [m for m in by if m.startswith("Approx")]),
        )
    }
    return found


def headline(versus: dict[str, Any]) -> dict[str, Any]:
    """Does the worst sex gain (mean over seeds, and in how many seeds), at what overall cost."""
    return {
        "raises_worst": versus["raises_worst"],
        "worst_points": round(versus["worst_minus_fedavg_points"], 2),
        "seeds_higher_lower": [versus["seeds_worst_higher"], versus["seeds_worst_lower"]],
        "overall_points": round(versus["overall_minus_fedavg_points"], 2),
    }


def plot(rows: list[dict[str, Any]]) -> plt.Figure:
    """Worst-sex and overall accuracy per method, test and train (error bars: max deviation
    over seeds; markers: each sex's accuracy)."""
    fig, axes = plt.subplots(2, 1, figsize=(13, 8), sharex=True)
    positions = np.arange(len(rows))
    for axis, split in zip(axes, SPLITS, strict=True):
        for offset, key, label in ((-0.2, "worst", "worst sex"), (0.2, "overall", "overall")):
            cells = [row["summary"][split][key] for row in rows]
            axis.bar(
                positions + offset,
                [100 * c["mean"] for c in cells],
                0.4,
                yerr=[100 * c["max_dev"] for c in cells],
                capsize=3,
                label=f"{label} accuracy",
            )
        for domain, marker in (("Male", "k^"), ("Female", "rv")):
            means = [100 * row["summary"][split][domain]["mean"] for row in rows]
            axis.plot(positions - 0.2, means, marker, label=f"{domain.lower()} accuracy")
        axis.set_ylim(50, 100)
        axis.set_ylabel(f"{split} accuracy (%), pooled")
        axis.set_title(
            f"heart, 4 hospitals, domain = sex: final global model on the {split} rows "
            "(mean over seeds ± max deviation)",
            fontsize=10,
        )
        axis.legend(fontsize=8, loc="upper right", ncol=4)
    axes[-1].set_xticks(positions, [row["method"] for row in rows], rotation=30, ha="right")
    return fig


def domain_counts(seeds: tuple[int, ...]) -> dict[int, dict[str, dict[str, list[int]]]]:
    """Per seed and hospital, the [Male, Female] row counts of each split."""
    p = policy(METHODS[BASELINE], 0, 1)
    counts: dict[int, dict[str, dict[str, list[int]]]] = {}
    for seed in seeds:
        counts[seed] = {
            data.name: {
                split: torch.bincount(data.domain_codes[split], minlength=2).tolist()
                for split in ("train", "val", "test")
            }
            for data in load_consortium(p.data, seed)
        }
    return counts


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="one seed, 10 rounds (smoke test)")
    args = parser.parse_args()
    torch.set_num_threads(1)  # the silos run in threads; one torch thread each is fastest here
    seeds = SEEDS[:1] if args.quick else SEEDS
    rounds = QUICK_ROUNDS if args.quick else ROUNDS
    started = time.perf_counter()
    rows = method_rows(seeds, rounds)
    found = claims(rows)
    printable = table(rows)
    for line in printable:
        print(line)
    print(found["summary"])
    path = write(
        "domains",
        {
            "seeds": list(seeds),
            "quick": args.quick,
            "seconds": time.perf_counter() - started,
            "settings": {
                "rounds": rounds,
                "training": TRAINING,
                "data": DATA,
                "participants": PARTICIPANTS,
                "model": "linear",
                "methods": METHODS,
                "domain_counts_male_female": domain_counts(seeds),
            },
            "table_percent": printable,
            "rows": rows,
            "claims": found,
        },
        plot(rows),
    )
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
