"""Update compression (`compression:`, docs/compression.md): FedAvg on three bundled datasets
(the four heart-disease hospitals, scikit-learn's digits over 4 label-skewed sites, its breast
cancer data over 4 IID sites) with each silo's update sent as it is, quantized to 16 bits and
to 8 bits (block scales, and 8 bits with tensor scales), 3 seeds each, and FedAvg with DP-SGD
on breast cancer, as it is and 8-bit.

Reported per run: the payload bytes of every message, counted as `fedsilo_bytes_total` counts
them (each message's payload length; here at the silos' endpoints of the in-process transport,
which carries the same encoded messages as gRPC): the silos' answers to `train` tasks (what
compression shrinks), everything the silos send, everything the coordinator sends, and the
total; the final accuracy and test loss (sample-weighted means over every site's test split);
under DP-SGD the largest epsilon a silo's ledger books. Per configuration, the medians over
the seeds of the ratios bytes(as it is) / bytes(compressed) and of the differences
compressed - as it is of accuracy and loss, each against the uncompressed run of the same
seed.

    python -m bench.compression            # about 2 minutes on 2 cores
    python -m bench.compression --quick    # a tiny configuration that writes nothing
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import torch

from bench.common import write
from fedsilo.coordinator.engine import RoundEngine, RunHistory
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.sim_silos import ConsortiumKeys, build_agent
from fedsilo.ops.simulate import check_consortium, load_silos
from fedsilo.policies.loading import parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.agent import SiloAgent
from fedsilo.wire.payload import AnyPayload, Payload, as_payload
from fedsilo.wire.tasks import TrainTask
from fedsilo.wire.tensors import index_tensors

SITES, ROUNDS, SEEDS = 4, 20, (0, 1, 2)
COMPRESSION: dict[str, dict[str, Any] | None] = {
    "none": None,
    "16-bit block": {"bits": 16},
    "8-bit block": {"bits": 8},
    "8-bit tensor": {"bits": 8, "scale": "tensor"},
}
# Each with an MLP whose answers are mostly its parameters (so the bytes measure the model, not
# the messages' headers): the heart-disease data's four hospitals (its natural partition), the
# digits over label-skewed sites (standardised with the consortium's moments, so that skew
# leaves one feature space), the breast cancer data over IID sites.
MLP = {"name": "mlp", "hidden": [256, 256]}
DATA: dict[str, dict[str, Any]] = {
    "heart": {
        "data": {"source": "heart", "split": {"train": 0.8, "val": 0.1, "test": 0.1}},
        "model": MLP,
        "training": {"epochs": 1, "batch_size": 32, "lr": 0.05},
    },
    "digits": {
        "data": {
            "source": "sklearn:digits",
            "scaling": "federated",
            "partition": {"kind": "dirichlet", "alpha": 0.5, "silos": SITES},
        },
        "model": MLP,
        "training": {"epochs": 1, "batch_size": 32, "lr": 0.1},
    },
    "breast_cancer": {
        "data": {"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": SITES}},
        "model": MLP,
        "training": {"epochs": 1, "batch_size": 16, "lr": 0.05},
    },
}
DP_DATA, DP_COMPRESSION = "breast_cancer", ("none", "8-bit block")
DP_SGD = {"noise_multiplier": 1.0, "max_grad_norm": 1.0}
QUICK = {"rounds": 2, "seeds": (0,), "data": ("heart",)}


@dataclass
class CountedSite:
    """A silo's endpoint as the bench runs it: its real agent, with the payload bytes of every
    message to it and from it counted (by the kind of task answered, for the answers)."""

    agent: SiloAgent
    received: int = 0
    sent: Counter[str] = field(default_factory=Counter)

    def __call__(self, payload: AnyPayload) -> Payload | bytes:
        task = as_payload(payload)
        self.received += len(task)
        _, header = index_tensors(task)
        answer = self.agent.handle_bytes(payload)
        self.sent[header["kind"]] += len(as_payload(answer))
        return answer


def run_consortium(
    policy: Policy, ledgers: Path | None = None
) -> tuple[RunHistory, list[CountedSite]]:
    """`policy` run by the round engine over one agent per site, in this process, each behind
    a `CountedSite` (booking its releases in `ledgers`, if given)."""
    datasets = load_silos(policy, None)
    check_consortium(policy, datasets)
    keys = ConsortiumKeys.generate(d.name for d in datasets)
    device = torch.device("cpu")
    sites = {
        d.name: CountedSite(build_agent(policy, d.name, d, device, keys, ledgers)) for d in datasets
    }
    transport = InProcessTransport(sites, max_parallel=1)
    try:
        history = RoundEngine(make_strategy(policy), transport, policy, list(sites)).run()
    finally:
        transport.close()
    return history, list(sites.values())


def bench_policy(data: str, compression: str, seed: int, rounds: int, dp: bool = False) -> Policy:
    chosen = COMPRESSION[compression]
    return parse_policy(
        {
            "version": 1,
            "name": "compression-bench",
            "seed": seed,
            "rounds": rounds,
            "eval_every": rounds,
            "algorithm": {"name": "fedavg"},
            "participants": {"min_silos": 3},
            **DATA[data],
            **({"compression": chosen} if chosen else {}),
            **({"privacy": {"dp_sgd": DP_SGD}} if dp else {}),
        }
    )


def one_run(data: str, compression: str, seed: int, rounds: int, dp: bool = False) -> dict:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="fedsilo-bench-") as ledgers:
        policy = bench_policy(data, compression, seed, rounds, dp)
        history, sites = run_consortium(policy, Path(ledgers) if dp else None)
    upload = sum(sum(site.sent.values()) for site in sites)
    download = sum(site.received for site in sites)
    privacy = history.records[-1].privacy or {}
    return {
        "data": data,
        "compression": compression,
        "dp_sgd": dp,
        "seed": seed,
        "train_upload_bytes": sum(site.sent[TrainTask.KIND] for site in sites),
        "upload_bytes": upload,
        "download_bytes": download,
        "total_bytes": upload + download,
        "accuracy": history.final.summary["accuracy"]["weighted_mean"],
        "loss": history.final.summary["loss"]["weighted_mean"],
        "epsilon": max((p["epsilon"] for p in privacy.values()), default=None),
        "seconds": time.perf_counter() - started,
    }


BYTES = ("train_upload_bytes", "upload_bytes", "total_bytes")


def summarised(runs: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per (data, DP-SGD, compression): the medians over the seeds of each byte count, of
    bytes(none) / bytes(compressed), of the accuracy and the loss and of their differences
    compressed - none (with their spread), each against the run of the same seed, and of the
    epsilon."""
    baseline = {(r["data"], r["dp_sgd"], r["seed"]): r for r in runs if r["compression"] == "none"}
    groups: dict[tuple[str, bool, str], list[dict[str, Any]]] = {}
    for run in runs:
        groups.setdefault((run["data"], run["dp_sgd"], run["compression"]), []).append(run)
    rows = []
    for (data, dp, compression), group in groups.items():
        plain = [baseline[(data, dp, r["seed"])] for r in group]
        row: dict[str, Any] = {"data": data, "dp_sgd": dp, "compression": compression}
        for key in BYTES:
            row[key] = statistics.median(r[key] for r in group)
            row[f"{key}_ratio"] = statistics.median(
                b[key] / r[key] for r, b in zip(group, plain, strict=True)
            )
        for metric in ("accuracy", "loss"):
            row[metric] = statistics.median(r[metric] for r in group)
            differences = [r[metric] - b[metric] for r, b in zip(group, plain, strict=True)]
            row[f"{metric}_difference"] = {
                "median": statistics.median(differences),
                "min": min(differences),
                "max": max(differences),
            }
        epsilons = [r["epsilon"] for r in group if r["epsilon"] is not None]
        row["epsilon"] = statistics.median(epsilons) if epsilons else None
        rows.append(row)
    return rows


def table(rows: Sequence[dict[str, Any]]) -> str:
    lines = [
        f"{'data':<19}{'compression':<14}{'train up':>10}{'x':>6}{'all up':>10}{'x':>6}"
        f"{'total':>10}{'x':>6}{'accuracy':>10}{'diff':>8}{'loss':>8}{'diff':>9}{'epsilon':>9}"
    ]
    for row in rows:
        name = row["data"] + (" +DP" if row["dp_sgd"] else "")
        epsilon = f"{row['epsilon']:>9.2f}" if row["epsilon"] is not None else f"{'':>9}"
        lines.append(
            f"{name:<19}{row['compression']:<14}"
            + "".join(f"{row[key] / 1e3:>9.0f}k{row[f'{key}_ratio']:>6.2f}" for key in BYTES)
            + f"{row['accuracy']:>10.3f}{row['accuracy_difference']['median']:>+8.3f}"
            + f"{row['loss']:>8.3f}{row['loss_difference']['median']:>+9.1e}{epsilon}"
        )
    return "\n".join(lines)


def figure(rows: Sequence[dict[str, Any]]) -> plt.Figure:
    """Train upload bytes against accuracy, one panel per dataset (and DP-SGD)."""
    settings = sorted({(r["data"], r["dp_sgd"]) for r in rows})
    columns = min(len(settings), 2)
    lines = -(-len(settings) // columns)
    fig, grid = plt.subplots(lines, columns, figsize=(4.6 * columns, 3.6 * lines), squeeze=False)
    for axis in grid.ravel()[len(settings) :]:
        axis.set_visible(False)
    for axis, (data, dp) in zip(grid.ravel(), settings, strict=False):
        for row in (r for r in rows if (r["data"], r["dp_sgd"]) == (data, dp)):
            axis.scatter(row["train_upload_bytes"] / 1e6, row["accuracy"], label=row["compression"])
        axis.set_xlabel("train answers' payload, MB (median)")
        axis.set_ylabel("final accuracy (median)")
        axis.set_title(data + (" with DP-SGD" if dp else ""))
        axis.legend(fontsize=7)
    return fig


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run, print, write (not with --quick), and return the document."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny smoke run; writes nothing")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    rounds = QUICK["rounds"] if args.quick else ROUNDS
    seeds = QUICK["seeds"] if args.quick else SEEDS
    datasets = QUICK["data"] if args.quick else tuple(DATA)
    started = time.perf_counter()
    runs = []
    for seed in seeds:
        for data in datasets:
            runs += [one_run(data, c, seed, rounds) for c in COMPRESSION]
        if not args.quick:
            runs += [one_run(DP_DATA, c, seed, rounds, dp=True) for c in DP_COMPRESSION]
        print(f"seed {seed}: {len(runs)} runs, {time.perf_counter() - started:.0f} s")
    rows = summarised(runs)
    print(table(rows))
    document: dict[str, Any] = {
        "settings": {
            "data": {name: setting["data"] for name, setting in DATA.items()},
            "model": {name: setting["model"] for name, setting in DATA.items()},
            "training": {name: setting["training"] for name, setting in DATA.items()},
            "algorithm": "fedavg, every site every round",
            "compression": COMPRESSION,
            "dp_sgd": {"data": DP_DATA, **DP_SGD, "compression": list(DP_COMPRESSION)},
            "rounds": rounds,
            "seeds": list(seeds),
            "bytes": (
                "payload bytes of every message (what fedsilo_bytes_total counts), summed over "
                "the sites and the run"
            ),
            "quick": args.quick,
        },
        "runs": runs,
        "summary": rows,
        "seconds": time.perf_counter() - started,
    }
    plot = figure(rows)
    if args.quick:
        plt.close(plot)
    else:
        write("compression", document, plot)
    return document


if __name__ == "__main__":
    main()
