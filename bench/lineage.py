"""Model lineage: what it costs a masked FedAvg round, with lineage against without
(`secure_aggregation: {method: masking, lineage: true|false}`), at about 1e6 parameters x 10
silos, beside 1e5 x 10 and 1e6 x 3, with real local training.

bench/secagg.py's machinery and its "trained" workload (256 samples per silo, one local epoch
in batches of 64): the same seeded consortium runs through the in-process engine twice, once
with lineage ("masking") and once without ("masking-nolineage"), the two deployments taking
turns round by round so that load from elsewhere on the machine falls on both alike. Every
silo endpoint is wiretapped (bytes of the tasks received and results sent, the silo's wall and
CPU time); silos answer one at a time, so a round is the coordinator's work plus the silos'.
Reported beside the wall time, as in bench/secagg.py: the process's CPU time per round and the
deployment estimate (every silo on its own machine, network excluded: coordinator CPU plus,
per step, the slowest silo's CPU).

With lineage every task that carries the model also carries the evidence of the last masked
aggregation (each survivor's signed masked input, the revealed shares, the prior server state),
and each silo recomputes the unmasked mean and the server step before it runs the task: k
masked inputs down per silo per round (k survivors) and the unmasking. The silo's check is
timed directly (its thread's CPU and wall time in `silo.lineage.refusal`, wrapped for the run)
and, as a cross-check, as the difference in the mask step's silo CPU with and without.

Each configuration is repeated `--repeats` times (3), the order of the two deployments
alternating between repeats; per repeat the steady state is the median of rounds 2..R (round
1 warms caches up and checks only the initial model). Reported per repeat and as the median
over repeats with the spread (min-max): round seconds (wall, CPU, deployment estimate) and the
ratio lineage / no lineage, bytes down and up per silo per round and their ratios, the lineage
check's silo CPU, and whether the global model after every round is bit-identical with and
without lineage (lineage changes nothing in an honest run).

About 1.5 minutes on 2 CPU cores (2 GB of memory). Run: `python -m bench.lineage` (`--quick`:
a tiny configuration that writes nothing); writes bench/results/lineage.json and lineage.png.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import resource
import statistics
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch

from bench.common import count_parameters, write
from bench.secagg import (
    CLASSES,
    FEATURES,
    MODELS,
    NO_LINEAGE,
    QUICK_MODELS,
    WORKLOADS,
    bench_policy,
    side_by_side,
    summarize,
)
from fedsilo.models.zoo import build_model
from fedsilo.silo import lineage as silo_lineage

WITH, WITHOUT = "masking", NO_LINEAGE
WORKLOAD = "trained"
CONFIGS = (("1e6", 10), ("1e5", 10), ("1e6", 3))
QUICK_CONFIGS = (("1e4", 3),)
MASK_STEP = "secagg_mask"  # the step whose task carries the model (and so the evidence)
TIMES = ("round_seconds", "round_cpu_seconds", "deployment_estimate_seconds")
BYTES = ("bytes_down_per_silo", "bytes_up_per_silo")
COMPARED = (*TIMES, "coordinator_cpu_seconds", "silo_cpu_seconds_total", *BYTES)


# -- the silo's lineage check, timed ---------------------------------------------------------


@dataclass(frozen=True)
class Check:
    """One lineage check as a silo ran it before a task."""

    lineage: bool  # whether the silo's policy uses lineage (else the check returns at once)
    silo: str
    round: int
    kind: str
    seconds: float
    cpu: float  # the silo's thread's: the check runs on the thread that answers the task


@contextmanager
def timed_checks() -> Iterator[list[Check]]:
    """Every `silo.lineage.refusal` call in the block, timed (the agent calls it through the
    module, so replacing the module's function reaches every agent)."""
    checks: list[Check] = []
    lock = threading.Lock()
    original = silo_lineage.refusal

    def refusal(message: Any, ctx: Any) -> str | None:
        started, started_cpu = time.perf_counter(), time.thread_time()
        try:
            return original(message, ctx)
        finally:
            check = Check(
                ctx.policy.uses_lineage,
                ctx.name,
                int(message.round),
                str(message.kind),
                time.perf_counter() - started,
                time.thread_time() - started_cpu,
            )
            with lock:
                checks.append(check)

    silo_lineage.refusal = refusal
    try:
        yield checks
    finally:
        silo_lineage.refusal = original


def check_costs(checks: list[Check], rounds: int, silos: int) -> dict[str, float]:
    """The lineage deployment's checks in the steady state (median over rounds 2..R, evaluation
    tasks left out): CPU and wall seconds per silo per round, and the slowest silo's CPU."""
    per_round = []
    for r in range(2, rounds + 1):
        ran = [c for c in checks if c.lineage and c.round == r and c.kind != "evaluate"]
        if not ran:
            raise RuntimeError(f"no lineage check ran in round {r}")
        per_round.append(
            {
                "cpu_seconds_per_silo": sum(c.cpu for c in ran) / silos,
                "wall_seconds_per_silo": sum(c.seconds for c in ran) / silos,
                "cpu_seconds_max_silo": max(c.cpu for c in ran),
            }
        )
    return {k: statistics.median(p[k] for p in per_round) for k in per_round[0]}


# -- one repeat ------------------------------------------------------------------------------


def bits(model: torch.Tensor) -> bytes:
    return model.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def repeat(
    hidden: list[int], silos: int, rounds: int, order: tuple[str, str], params: int
) -> dict[str, Any]:
    """Both deployments of `rounds` rounds side by side, taking turns in `order`: each one's
    steady state, the ratios lineage / no lineage, the lineage check's cost and whether the
    global models after every round are bit-identical."""
    with timed_checks() as checks:
        outcomes = side_by_side(hidden, silos, dict.fromkeys(order, rounds), WORKLOAD)
    summaries = {m: summarize(outcomes[m], silos, params) for m in order}
    models = {m: outcomes[m]["models"] for m in order}
    if sorted(models[WITH]) != list(range(1, rounds + 1)) or sorted(models[WITHOUT]) != sorted(
        models[WITH]
    ):
        raise RuntimeError(f"rounds missing: {sorted(models[WITH])}, {sorted(models[WITHOUT])}")
    identical = [bits(models[WITH][r]) == bits(models[WITHOUT][r]) for r in sorted(models[WITH])]
    digests = [hashlib.sha256(bits(models[WITH][r])).hexdigest() for r in sorted(models[WITH])]
    del outcomes, models
    gc.collect()
    mask = {m: summaries[m]["steps"][MASK_STEP]["silo_cpu_seconds_total"] / silos for m in order}
    return {
        "order": list(order),
        "with": summaries[WITH],
        "without": summaries[WITHOUT],
        "ratio": {k: summaries[WITH][k] / summaries[WITHOUT][k] for k in COMPARED},
        "lineage_check": check_costs(checks, rounds, silos),
        "mask_step_silo_cpu_seconds_per_silo": {
            "with": mask[WITH],
            "without": mask[WITHOUT],
            "difference": mask[WITH] - mask[WITHOUT],
        },
        "checks_without_lineage": sum(1 for c in checks if not c.lineage),
        "models_bit_identical_by_round": identical,
        "models_bit_identical": all(identical),
        "model_sha256_by_round": digests,
    }


# -- one configuration -----------------------------------------------------------------------


def spread(values: list[float]) -> dict[str, Any]:
    return {
        "median": statistics.median(values),
        "min": min(values),
        "max": max(values),
        "by_repeat": values,
    }


def configuration(
    label: str, hidden: list[int], silos: int, rounds: int, repeats: int
) -> dict[str, Any]:
    """`repeats` repeats of lineage against no lineage at one (size, silos), the order of the
    deployments alternating, and the median and spread of every number over them."""
    params = count_parameters(
        build_model(bench_policy(WITH, hidden, 1, 1).model, (FEATURES,), CLASSES, 0)
    )
    runs = [
        repeat(hidden, silos, rounds, (WITH, WITHOUT) if i % 2 == 0 else (WITHOUT, WITH), params)
        for i in range(repeats)
    ]
    summary: dict[str, Any] = {
        side: {k: spread([run[side][k] for run in runs]) for k in COMPARED}
        for side in ("with", "without", "ratio")
    }
    for part in ("lineage_check", "mask_step_silo_cpu_seconds_per_silo"):
        summary[part] = {k: spread([run[part][k] for run in runs]) for k in runs[0][part]}
    identical = all(run["models_bit_identical"] for run in runs)
    across = len({tuple(run["model_sha256_by_round"]) for run in runs}) == 1
    row = {
        "label": label,
        "parameters": params,
        "silos": silos,
        "rounds": rounds,
        "summary": summary,
        "models_bit_identical": identical,
        "models_identical_across_repeats": across,
        "repeats": runs,
    }
    ratio = summary["ratio"]
    print(
        f"  {label} x {silos:>2} silos: lineage / none, round wall "
        f"{ratio['round_seconds']['median']:.2f}x, deployment "
        f"{ratio['deployment_estimate_seconds']['median']:.2f}x, down "
        f"{ratio['bytes_down_per_silo']['median']:.2f}x; models bit-identical: {identical}",
        flush=True,
    )
    return row


# -- report ----------------------------------------------------------------------------------


def cell(s: dict[str, Any], scale: float = 1.0, digits: int = 2) -> str:
    return (
        f"{s['median'] * scale:.{digits}f} [{s['min'] * scale:.{digits}f}-"
        f"{s['max'] * scale:.{digits}f}]"
    )


def table(rows: list[dict[str, Any]]) -> str:
    """Per configuration: median [min-max] over repeats."""
    lines = []
    for row in rows:
        s = row["summary"]
        lines.append(
            f"{row['parameters']:,} params x {row['silos']} silos, {row['rounds']} rounds, "
            f"{len(row['repeats'])} repeats; models bit-identical: {row['models_bit_identical']}"
        )
        for name, key, scale, unit, digits in (
            ("round wall", "round_seconds", 1.0, "s", 3),
            ("round CPU", "round_cpu_seconds", 1.0, "s", 3),
            ("deployment est.", "deployment_estimate_seconds", 1.0, "s", 3),
            ("coordinator CPU", "coordinator_cpu_seconds", 1.0, "s", 3),
            ("bytes down/silo", "bytes_down_per_silo", 1e-6, "MB", 2),
            ("bytes up/silo", "bytes_up_per_silo", 1e-6, "MB", 2),
        ):
            lines.append(
                f"  {name:<16} with {cell(s['with'][key], scale, digits)} {unit}, without "
                f"{cell(s['without'][key], scale, digits)} {unit}, ratio {cell(s['ratio'][key])}"
            )
        check, mask = s["lineage_check"], s["mask_step_silo_cpu_seconds_per_silo"]
        lines.append(
            f"  lineage check    CPU/silo {cell(check['cpu_seconds_per_silo'], 1e3, 1)} ms, "
            f"slowest silo {cell(check['cpu_seconds_max_silo'], 1e3, 1)} ms; mask step CPU/silo "
            f"with {cell(mask['with'], 1e3, 1)} ms, without {cell(mask['without'], 1e3, 1)} ms"
        )
    return "\n".join(lines)


def plot(rows: list[dict[str, Any]]) -> plt.Figure:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    x = np.arange(len(rows))
    labels = [f"{r['label']}\n{r['silos']} silos" for r in rows]

    def bars(axis: Any, series: list[tuple[str, Any, str]], fmt: str = ".2f") -> None:
        width = 0.8 / len(series)
        for i, (name, pick, colour) in enumerate(series):
            stats = [pick(r) for r in rows]
            at = x + (i - (len(series) - 1) / 2) * width
            mid = np.array([s["median"] for s in stats])
            low = mid - np.array([s["min"] for s in stats])
            high = np.array([s["max"] for s in stats]) - mid
            axis.bar(at, mid, width, label=name, color=colour, yerr=[low, high], capsize=3)
            for xi, v, top in zip(at, mid, mid + high, strict=True):
                axis.text(xi, top, f"{v:{fmt}}", ha="center", va="bottom", fontsize=7)
        axis.set_xticks(x, labels, fontsize=8)

    ratio = "ratio"
    bars(
        axes[0],
        [
            ("wall", lambda r: r["summary"][ratio]["round_seconds"], "tab:blue"),
            ("CPU", lambda r: r["summary"][ratio]["round_cpu_seconds"], "tab:cyan"),
            (
                "deployment estimate",
                lambda r: r["summary"][ratio]["deployment_estimate_seconds"],
                "tab:purple",
            ),
        ],
    )
    axes[0].set_ylabel("round time, lineage / no lineage")
    bars(
        axes[1],
        [
            ("down", lambda r: r["summary"][ratio]["bytes_down_per_silo"], "tab:orange"),
            ("up", lambda r: r["summary"][ratio]["bytes_up_per_silo"], "tab:green"),
        ],
    )
    axes[1].set_ylabel("bytes per silo per round, lineage / no lineage")
    for axis in axes[:2]:
        axis.axhline(1.0, color="tab:gray", linewidth=0.8)
    bars(
        axes[2],
        [
            (
                "lineage check, CPU per silo",
                lambda r: scaled(r["summary"]["lineage_check"]["cpu_seconds_per_silo"]),
                "tab:red",
            ),
            (
                "mask step with lineage (training, masking, check), CPU per silo",
                lambda r: scaled(r["summary"]["mask_step_silo_cpu_seconds_per_silo"]["with"]),
                "tab:blue",
            ),
            (
                "mask step without lineage, CPU per silo",
                lambda r: scaled(r["summary"]["mask_step_silo_cpu_seconds_per_silo"]["without"]),
                "tab:gray",
            ),
        ],
        ".0f",
    )
    axes[2].set_ylabel("ms per silo per round (steady state)")
    for axis in axes:
        axis.set_ylim(top=axis.get_ylim()[1] * 1.25)
        axis.legend(fontsize=7, loc="upper left")
    fig.suptitle(
        f"Model lineage vs none, masked FedAvg ({WORKLOADS[WORKLOAD].title}): median over "
        f"repeats, bars min-max"
    )
    return fig


def scaled(s: dict[str, Any], by: float = 1e3) -> dict[str, float]:
    return {k: s[k] * by for k in ("median", "min", "max")}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    """Run, print, write (not with --quick), and return the document."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, help="rounds per run (>= 2; default 10, quick 3)")
    parser.add_argument(
        "--repeats", type=int, help="repeats per configuration (default 3, quick 2)"
    )
    parser.add_argument("--quick", action="store_true", help="tiny smoke run; writes nothing")
    args = parser.parse_args(argv)
    if args.rounds is None:
        args.rounds = 3 if args.quick else 10
    if args.repeats is None:
        args.repeats = 2 if args.quick else 3
    if args.rounds < 2:
        parser.error("every run needs at least 2 rounds: round 1 is the warm-up")
    if args.repeats < 1:
        parser.error("--repeats: at least 1")
    load_before = os.getloadavg()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # so that a silo's CPU time is its thread's
    models = QUICK_MODELS if args.quick else MODELS
    configs = QUICK_CONFIGS if args.quick else CONFIGS
    started = time.perf_counter()
    rows = [
        configuration(label, models[label], silos, args.rounds, args.repeats)
        for label, silos in configs
    ]
    print(table(rows))
    document = {
        "settings": {
            "features": FEATURES,
            "workload": WORKLOAD,
            "samples_per_silo": WORKLOADS[WORKLOAD].samples,
            "training": WORKLOADS[WORKLOAD].training,
            "deployments": {
                WITH: "secure_aggregation: masking (lineage on, the default)",
                WITHOUT: "secure_aggregation: {method: masking, lineage: false}",
            },
            "rounds": args.rounds,
            "repeats": args.repeats,
            "order": "the two deployments take turns, one round each; the first alternates "
            "between repeats",
            "steady_state": "per repeat, median of rounds 2..R; summary: median and min-max "
            "over repeats",
            "lineage_check": "silo.lineage.refusal timed on the silo's answering thread "
            "(CPU and wall), steady-state rounds, evaluation tasks left out",
            "transport": "InProcessTransport: one worker thread, tasks in turn",
            "torch_threads": 1,
        },
        "seconds_total": time.perf_counter() - started,
        "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
        "load_average_1min": {"start": load_before[0], "end": os.getloadavg()[0]},
        "models_bit_identical": all(r["models_bit_identical"] for r in rows),
        "rows": rows,
    }
    figure = plot(rows)
    if args.quick:
        plt.close(figure)
        return document
    path = write("lineage", document, figure)
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return document


if __name__ == "__main__":
    main()
