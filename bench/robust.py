"""Robust aggregation against faulty sites (docs/robust-aggregation.md): FedAvg and each robust
rule (`algorithm.robust`: median, trimmed_mean, krum, multi_krum, norm_bounded) on scikit-learn's
digits split IID over 8 sites, with 0, 1 and 2 faulty sites, 3 seeds.

A faulty site is simulated honestly, from outside the product: it is a real silo agent whose
training data is corrupted before it starts (`shuffled_labels`: its training labels permuted;
`backdoor`: half its training rows stamped with a trigger, the four corner pixels, blank in
nearly every clean digit, and relabelled 0), or whose outgoing training answer is rewritten by
a wrapper around its endpoint (`Site`: `scaled` sends reference - 10 (model - reference), a
large update pointing back, `sign_flipped` reference - (model - reference)). The coordinator
and every other silo run fedsilo's own code, in process, through the round engine.

Reported per rule, attack and number of faulty sites: the final clean test accuracy (the
sample-weighted mean over every site's test split, faulty sites' included: only their training
data or answers are corrupted) and, for the backdoor, the attack success rate: the share of the
honest sites' triggered test rows whose true label is not 0 that the model calls 0. Median and
spread (min-max) over the seeds. norm_bounded's M is the median norm of the honest updates of
the same seed's clean FedAvg run (the wrapper measures every update it forwards). Beside them,
each rule's clean accuracy with no faulty site on the same digits over 8 label-skewed sites
(Dirichlet 0.3): what a rule costs when honest sites differ.

    python -m bench.robust            # about 2.5 minutes on 2 cores (6 when others load them)
    python -m bench.robust --quick    # a tiny configuration that writes nothing
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch

from bench.common import write
from fedsilo.coordinator.engine import RoundEngine, RunHistory
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.models.zoo import build_model, load_flat
from fedsilo.ops.sim_silos import ConsortiumKeys, build_agent
from fedsilo.ops.simulate import check_consortium, load_silos
from fedsilo.policies.loading import parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import SiloDataset
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.payload import AnyPayload, Payload
from fedsilo.wire.tasks import TrainTask
from fedsilo.wire.tasks.tensor_names import MODEL

SITES, ROUNDS, SEEDS, FAULTY = 8, 20, (0, 1, 2), (0, 1, 2)
ATTACKS = ("shuffled_labels", "scaled", "sign_flipped", "backdoor")
SCALES = {"scaled": -10.0, "sign_flipped": -1.0}  # what a wrapper multiplies an update by
RULES: dict[str, dict[str, Any] | None] = {
    "fedavg": None,
    "median": {"name": "median"},
    "trimmed_mean": {"name": "trimmed_mean", "beta": 0.25},
    "krum": {"name": "krum", "f": 2},
    "multi_krum": {"name": "multi_krum", "f": 2},
    "norm_bounded": {"name": "norm_bounded"},  # max_norm: measured on the clean FedAvg run
}
TARGET, POISONED_SHARE, TRIGGER_VALUE = 0, 0.5, 4.0
CORNERS = ([0, 0, 7, 7], [0, 7, 0, 7])  # the trigger's pixels (rows, columns): the corners
# how the digits become sites: IID (every run), and label-skewed (clean runs only: what a rule
# costs when honest sites differ), with federated scaling so that skew leaves one feature space
DATA: dict[str, dict[str, Any]] = {
    "iid": {"source": "sklearn:digits", "partition": {"kind": "iid", "silos": SITES}},
    "label_skew": {
        "source": "sklearn:digits",
        "scaling": "federated",
        "partition": {"kind": "dirichlet", "alpha": 0.3, "silos": SITES},
    },
}
QUICK = {"rounds": 2, "seeds": (0,), "faulty": (0, 1), "attacks": ("scaled",), "data": ("iid",)}


@dataclass
class Site:
    """A silo's endpoint as the bench runs it: its real agent, whose training answers leave
    with the update (model - the model it was sent) multiplied by `scale` (1: honest), and the
    norm of every update the agent computed."""

    agent: SiloAgent
    scale: float = 1.0
    norms: list[float] = field(default_factory=list)

    def __call__(self, payload: AnyPayload) -> Payload | bytes:
        task = TaskMessage.decode(payload)
        answer = self.agent.handle_bytes(payload)
        if task.kind != TrainTask.KIND:
            return answer
        result = TaskResult.decode(answer)
        if not result.ok:
            return answer
        reference = task.tensors[MODEL]
        update = result.tensors[MODEL] - reference
        self.norms.append(float(update.double().norm()))
        if self.scale == 1.0:
            return answer
        moved = reference + self.scale * update
        return replace(result, tensors={**result.tensors, MODEL: moved}).encode()


def run_consortium(
    policy: Policy, datasets: Sequence[SiloDataset], scales: Mapping[str, float] | None = None
) -> tuple[RunHistory, dict[str, list[float]]]:
    """`policy` run by the round engine over one agent per dataset, in this process, each
    behind a `Site` (`scales`: the faulty sites' update multipliers); the history and each
    site's update norms."""
    check_consortium(policy, datasets)
    keys = ConsortiumKeys.generate(d.name for d in datasets)
    sites = {
        d.name: Site(build_agent(policy, d.name, d, torch.device("cpu"), keys)) for d in datasets
    }
    for name, scale in (scales or {}).items():
        sites[name].scale = scale
    transport = InProcessTransport(sites, max_parallel=1)
    try:
        engine = RoundEngine(make_strategy(policy), transport, policy, list(sites))
        history = engine.run()
    finally:
        transport.close()
    return history, {name: site.norms for name, site in sites.items()}


def bench_policy(rule: dict[str, Any] | None, seed: int, rounds: int, data: str = "iid") -> Policy:
    algorithm: dict[str, Any] = {"name": "fedavg", **({"robust": rule} if rule else {})}
    return parse_policy(
        {
            "version": 1,
            "name": "robust-bench",
            "seed": seed,
            "rounds": rounds,
            "eval_every": rounds,
            "algorithm": algorithm,
            "model": {"name": "linear"},
            "training": {"epochs": 1, "batch_size": 32, "lr": 0.1},
            "participants": {"min_silos": SITES},
            "data": DATA[data],
        }
    )


def stamped(x: torch.Tensor) -> torch.Tensor:
    """`x` (rows of 1 x 8 x 8 standardised digits) with the trigger stamped on."""
    x = x.clone()
    x[:, 0, CORNERS[0], CORNERS[1]] = TRIGGER_VALUE
    return x


def corrupted(data: SiloDataset, attack: str, rng: np.random.Generator) -> SiloDataset:
    """A faulty site's own data for `attack` (unchanged for the attacks on its answers)."""
    if attack == "shuffled_labels":
        order = torch.from_numpy(rng.permutation(len(data.y_train)))
        return replace(data, y_train=data.y_train[order])
    if attack == "backdoor":
        rows = torch.from_numpy(
            rng.choice(len(data.y_train), int(POISONED_SHARE * len(data.y_train)), replace=False)
        )
        x, y = data.x_train.clone(), data.y_train.clone()
        x[rows] = stamped(x[rows])
        y[rows] = TARGET
        return replace(data, x_train=x, y_train=y)
    return data


def attack_success(policy: Policy, model: torch.Tensor, honest: Sequence[SiloDataset]) -> float:
    """The share of the honest sites' triggered test rows (true label not the target) that
    the model classifies as the target."""
    first = honest[0]
    network = load_flat(
        build_model(policy.model, first.input_shape, first.output_dim, policy.seed), model
    )
    hits = total = 0
    with torch.no_grad():
        for data in honest:
            rows = data.y_test != TARGET
            predicted = network(stamped(data.x_test[rows])).argmax(dim=1)
            hits += int((predicted == TARGET).sum())
            total += int(rows.sum())
    return hits / total


def one_run(
    rule: str,
    attack: str | None,
    faulty: int,
    seed: int,
    rounds: int,
    max_norm: float | None,
    data: str = "iid",
) -> dict[str, Any]:
    """One consortium run on the `data` sites: `faulty` of them (drawn by the seed) under
    `attack`."""
    spec = RULES[rule]
    if spec is not None and spec["name"] == "norm_bounded":
        spec = {**spec, "max_norm": max_norm}
    policy = bench_policy(spec, seed, rounds, data)
    datasets = load_silos(policy, None)
    rng = np.random.default_rng(seed)
    bad = sorted(rng.choice([d.name for d in datasets], faulty, replace=False).tolist())
    if attack is not None:
        datasets = [corrupted(d, attack, rng) if d.name in bad else d for d in datasets]
    scales = {name: SCALES[attack] for name in bad} if attack in SCALES else {}
    started = time.perf_counter()
    history, norms = run_consortium(policy, datasets, scales)
    honest = [d for d in datasets if d.name not in bad]
    summary = history.final.summary or {}
    return {
        "data": data,
        "rule": rule,
        "attack": attack or "none",
        "faulty": faulty,
        "seed": seed,
        "faulty_sites": bad,
        "accuracy": summary["accuracy"]["weighted_mean"],
        "attack_success": (
            attack_success(policy, history.state.model, honest) if attack == "backdoor" else None
        ),
        "max_norm": max_norm if rule == "norm_bounded" else None,
        "honest_update_norm": statistics.median(
            n for name, ns in norms.items() if name not in bad for n in ns
        ),
        "seconds": time.perf_counter() - started,
    }


def spread(values: Sequence[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarised(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Median and spread over seeds per (sites, rule, attack, faulty sites)."""
    groups: dict[tuple[str, str, str, int], list[dict[str, Any]]] = {}
    for run in runs:
        key = (run["data"], run["rule"], run["attack"], run["faulty"])
        groups.setdefault(key, []).append(run)
    rows = []
    for (data, rule, attack, faulty), group in groups.items():
        row = {
            "data": data,
            "rule": rule,
            "attack": attack,
            "faulty": faulty,
            "accuracy": spread([r["accuracy"] for r in group]),
        }
        if attack == "backdoor":
            row["attack_success"] = spread([r["attack_success"] for r in group])
        rows.append(row)
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    """Clean accuracy (and backdoor success) medians: one line per sites, rule, attack and
    count."""
    lines = [
        f"{'sites':<11}{'rule':<13}{'attack':<17}{'faulty':>6}{'accuracy':>10}{'backdoor':>10}"
    ]
    for row in rows:
        asr = row.get("attack_success")
        lines.append(
            f"{row['data']:<11}{row['rule']:<13}{row['attack']:<17}{row['faulty']:>6}"
            f"{row['accuracy']['median']:>10.3f}"
            + (f"{asr['median']:>10.3f}" if asr else f"{'':>10}")
        )
    return "\n".join(lines)


def found(rows: Sequence[dict[str, Any]], *key: object) -> dict[str, Any] | None:
    """The summary row of (sites, rule, attack, faulty), if it ran."""
    return next((r for r in rows if (r["data"], r["rule"], r["attack"], r["faulty"]) == key), None)


def errorbars(cells: Sequence[dict[str, float]]) -> list[list[float]]:
    return [[c["median"] - c["min"] for c in cells], [c["max"] - c["median"] for c in cells]]


def figure(rows: Sequence[dict[str, Any]], faulty: Sequence[int]) -> plt.Figure:
    """Clean accuracy against faulty IID sites, one panel per attack; the backdoor's success;
    and each rule's clean accuracy on IID and on label-skewed sites."""
    attacks = sorted({r["attack"] for r in rows if r["attack"] != "none"}, key=ATTACKS.index)
    panels = [(a, "accuracy") for a in attacks]
    if "backdoor" in attacks:
        panels.append(("backdoor", "attack_success"))
    skewed = any(r["data"] == "label_skew" for r in rows)
    count = len(panels) + skewed
    columns = min(count, 3)
    fig, grid = plt.subplots(
        -(-count // columns), columns, figsize=(3.8 * columns, 3.6 * -(-count // columns))
    )
    axes = np.atleast_1d(grid).ravel()
    for axis, (attack, metric) in zip(axes, panels, strict=False):
        for rule in RULES:
            cells = [
                (n, row[metric])
                for n in faulty
                if (row := found(rows, "iid", rule, "none" if n == 0 else attack, n))
                and metric in row
            ]
            if cells:
                axis.errorbar(
                    [n for n, _ in cells],
                    [c["median"] for _, c in cells],
                    yerr=errorbars([c for _, c in cells]),
                    marker="o",
                    capsize=3,
                    label=rule,
                )
        axis.set_xticks(list(faulty))
        axis.set_xlabel(f"faulty sites of {SITES}")
        axis.set_ylabel("attack success" if metric == "attack_success" else "clean accuracy")
        axis.set_title(attack if metric == "accuracy" else "backdoor: attack success")
        axis.set_ylim(0, 1)
    if skewed:
        axis = axes[count - 1]
        width = 0.4
        for offset, data in ((-width / 2, "iid"), (width / 2, "label_skew")):
            cells = [found(rows, data, rule, "none", 0)["accuracy"] for rule in RULES]  # type: ignore[index]
            axis.bar(
                np.arange(len(RULES)) + offset,
                [c["median"] for c in cells],
                width,
                yerr=errorbars(cells),
                capsize=2,
                label=data,
            )
        axis.set_xticks(np.arange(len(RULES)), list(RULES), rotation=45, ha="right", fontsize=7)
        axis.set_ylabel("clean accuracy, no faulty site")
        axis.set_title("IID against label-skewed sites")
        axis.set_ylim(0, 1.15)
        axis.legend(fontsize=7, loc="upper center", ncol=2)
    axes[0].legend(fontsize=7)
    return fig


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run, print, write (not with --quick), and return the document."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run; writes nothing")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rounds = QUICK["rounds"] if args.quick else ROUNDS
    seeds = QUICK["seeds"] if args.quick else SEEDS
    faulty = QUICK["faulty"] if args.quick else FAULTY
    attacks = QUICK["attacks"] if args.quick else ATTACKS
    settings = QUICK["data"] if args.quick else tuple(DATA)
    started = time.perf_counter()
    runs = []
    for seed in seeds:
        for data in settings:
            clean = one_run("fedavg", None, 0, seed, rounds, None, data)
            max_norm = clean["honest_update_norm"]
            runs.append(clean)
            for rule in RULES:
                if rule != "fedavg":
                    runs.append(one_run(rule, None, 0, seed, rounds, max_norm, data))
                if data != "iid":
                    continue  # label-skewed sites: what each rule costs without faulty sites
                for attack in attacks:
                    for n in (n for n in faulty if n > 0):
                        runs.append(one_run(rule, attack, n, seed, rounds, max_norm, data))
        print(f"seed {seed}: {len(runs)} runs, {time.perf_counter() - started:.0f} s")
    rows = summarised(runs)
    print(table(rows))
    document: dict[str, Any] = {
        "settings": {
            "data": {
                "iid": f"sklearn digits (1 x 8 x 8, standardised per site), IID over {SITES} sites",
                "label_skew": (
                    f"the same digits over {SITES} sites with Dirichlet(0.3) label skew, "
                    "standardised with the consortium's moments (federated scaling); clean runs "
                    "only"
                ),
            },
            "model": "linear (softmax regression), SGD lr 0.1, batch 32, 1 local epoch",
            "rounds": rounds,
            "seeds": list(seeds),
            "faulty_sites": list(faulty),
            "attacks": {
                "shuffled_labels": "a faulty site's training labels permuted",
                "scaled": f"a faulty site's update multiplied by {SCALES['scaled']:g}",
                "sign_flipped": f"a faulty site's update multiplied by {SCALES['sign_flipped']:g}",
                "backdoor": (
                    f"{POISONED_SHARE:.0%} of a faulty site's training rows get the four corner "
                    f"pixels set to {TRIGGER_VALUE:g} (standardised; blank in nearly every clean "
                    f"digit) and label {TARGET}"
                ),
            },
            "rules": RULES,
            "norm_bounded_max_norm": (
                "the median norm of the honest updates of the seed's clean FedAvg run on the same "
                "sites"
            ),
            "quick": args.quick,
        },
        "runs": runs,
        "summary": rows,
        "seconds": time.perf_counter() - started,
    }
    plot = figure(rows, faulty)
    if args.quick:
        plt.close(plot)
    else:
        write("robust", document, plot)
    return document


if __name__ == "__main__":
    main()
