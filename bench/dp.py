"""DP-SGD: what sample-level privacy costs in time and in accuracy.

(a) Epoch time of DP-SGD (silo/dp_training.py: per-sample clipping in one backward pass
    with Opacus' per-layer functions, Gaussian noise, Poisson sampling; noise multiplier 1)
    over non-private training, for the MLP and the small CNN of the model zoo (default
    sizes) on scikit-learn's 8x8 digits: one silo with all 1,437 training rows, the same
    batch size for both, swept over 32..256 (64 is the headline).
    Each time is one `train` task of one epoch through the silo agent (its contract check and
    model loading included), a round's task of a policy of that batch size; the median of
    several rounds' tasks, private and non-private interleaved so that load from other
    processes hits both alike. Goal: <= 2.5x.
(b) The accuracy/epsilon trade-off: FedAvg on breast_cancer over 5 silos
    (policies/examples/fedavg_dp.yaml, its full 30 rounds) at target epsilon 1, 2, 4, 8, 16
    per silo (delta 1e-5, RDP) and without DP, 3 seeds each; the mean test accuracy over silos
    (mean, min and max over seeds). The eps=8 point is the issue's acceptance run. Under DP the
    silos report only noisy metrics, so the final model is evaluated here, exactly, on every
    silo's test split (a simulation may; a deployment cannot).

About a minute on 2 CPU cores, so nothing is cut short. Run: `python -m bench.dp`; writes
bench/results/dp.json and dp.png.
"""

from __future__ import annotations

import argparse
import math
import statistics
import time
from importlib.resources import files
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import torch

from bench.common import write
from fedsilo.coordinator.phases import Task
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.strategies.base import RoundContext, ServerState
from fedsilo.coordinator.summary import summarize_metrics
from fedsilo.ops.simulate import load_silos, simulate
from fedsilo.policies.algorithms.contract import init_config
from fedsilo.policies.loading import load_policy, parse_policy
from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.policies.schema import Policy
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import SiloDataset, load_consortium
from fedsilo.wire.messages import SIMULATION, TaskMessage, task_id
from fedsilo.wire.tasks import EvaluateTask, TaskConfig

BATCHES = (32, 64, 128, 256)
HEADLINE_BATCH = 64
DP_TIMED = PrivacyConfig.model_validate({"dp_sgd": {"noise_multiplier": 1.0}})
MODELS = {
    "mlp": {"name": "mlp", "hidden": [64, 64]},
    "cnn": {"name": "cnn", "channels": [16, 32], "hidden": 64},
}
EPSILONS = (1.0, 2.0, 4.0, 8.0, 16.0, math.inf)
SEEDS = (0, 1, 2)
TRADE_OFF_POLICY = Path(str(files("fedsilo.policies") / "examples" / "fedavg_dp.yaml"))


# -- (a) epoch time ---------------------------------------------------------------------------


def epoch_times(model: dict[str, Any], repeats: int) -> list[dict[str, Any]]:
    """One row per batch size: median epoch seconds, plain and DP-SGD, and their ratio."""
    rows = []
    for batch in BATCHES:
        policy = parse_policy(
            {
                "version": 1,
                "rounds": repeats + 1,
                "model": model,
                "training": {"epochs": 1, "batch_size": batch, "optimizer": "sgd", "lr": 0.05},
                "data": {"source": "sklearn:digits", "partition": {"kind": "iid", "silos": 1}},
            }
        )
        (data,) = load_consortium(policy.data, seed=0)
        agents = {
            "plain": SiloAgent("s", data, policy),
            "dp_sgd": SiloAgent("s", data, policy.model_copy(update={"privacy": DP_TIMED})),
        }
        initial = agents["plain"].handle(_task(init_config(policy), 0, "init"))
        seconds: dict[str, list[float]] = {name: [] for name in agents}
        for round_no in range(1, repeats + 2):  # the first round warms caches up, dropped
            context = RoundContext(round_no, policy.rounds, ("s",), policy.seed, 1)
            task = make_strategy(policy).train_task("s", initial.tensors["model"], initial.spec,
                                                   context)  # fmt: skip
            for name, agent in agents.items():
                elapsed = _timed_train(agent, _task(task.config, round_no, "train", task))
                if round_no > 1:
                    seconds[name].append(elapsed)
        plain, private = (statistics.median(seconds[name]) for name in agents)
        rows.append(
            {
                "model": model,
                "train_rows": len(data.y_train),
                "batch_size": batch,
                "repeats": repeats,
                "plain_epoch_seconds": plain,
                "dp_sgd_epoch_seconds": private,
                "ratio": private / plain,
            }
        )
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in rows[-1].items()})
    return rows


def _task(config: TaskConfig, round_no: int, phase: str, sent: Task | None = None) -> TaskMessage:
    """The task of silo "s" at (`round_no`, `phase`), as the engine names it."""
    return TaskMessage(
        task_id(SIMULATION, round_no, phase, None, "s"),
        round_no,
        phase,
        "s",
        config,
        dict(sent.tensors) if sent else {},
        sent.spec if sent else None,
    )


def _timed_train(agent: SiloAgent, message: TaskMessage) -> float:
    started = time.perf_counter()
    result = agent.handle(message)
    elapsed = time.perf_counter() - started
    if not result.ok:
        raise RuntimeError(result.error)
    return elapsed


# -- (b) accuracy against epsilon ---------------------------------------------------------------


def with_target_epsilon(policy: Policy, target: float) -> Policy:
    """The policy with DP-SGD at `target` (its other DP settings kept), or without DP (inf)."""
    document = policy.model_dump()
    dp_sgd = document["privacy"]["dp_sgd"]
    document["privacy"]["dp_sgd"] = (
        None
        if math.isinf(target)
        else {**dp_sgd, "noise_multiplier": None, "target_epsilon": target}
    )
    return Policy.model_validate(document)


def trade_off(policy: Policy) -> list[dict[str, Any]]:
    rows = []
    for target in EPSILONS:
        accuracies, losses = [], []
        for seed in SEEDS:
            run = with_target_epsilon(policy, target).with_overrides(seed=seed)
            datasets = load_silos(run, None)
            summary = exact_test_summary(run, datasets, simulate(run, datasets).history.state)
            accuracies.append(summary["accuracy"]["mean"])
            losses.append(summary["loss"]["mean"])
        rows.append(
            {
                "target_epsilon": None if math.isinf(target) else target,
                "seeds": list(SEEDS),
                "mean_test_accuracy": accuracies,
                "mean": statistics.mean(accuracies),
                "min": min(accuracies),
                "max": max(accuracies),
                "mean_test_loss": losses,
            }
        )
        print(rows[-1], flush=True)
    return rows


def exact_test_summary(
    policy: Policy, datasets: list[SiloDataset], state: ServerState
) -> dict[str, dict[str, float]]:
    """The cross-silo summary of the final model's exact test metrics (no report noise)."""
    metrics, sizes = {}, {}
    exact = policy.model_copy(update={"privacy": PrivacyConfig()})  # no report noise
    for data in datasets:
        agent = SiloAgent(data.name, data, exact)
        message = TaskMessage(
            task_id(SIMULATION, policy.rounds, "evaluate", None, data.name),
            policy.rounds,
            "evaluate",
            data.name,
            EvaluateTask(),
            {"model": state.model},
            state.spec,
        )
        result = agent.handle(message)
        metrics[data.name], sizes[data.name] = dict(result.metrics), result.num_samples
    return {k: v.as_dict() for k, v in summarize_metrics(metrics, sizes, {}).items()}


def plot(timing: list[dict[str, Any]], curve: list[dict[str, Any]]) -> plt.Figure:
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for name in MODELS:
        rows = [row for row in timing if row["model"]["name"] == name]
        left.plot([r["batch_size"] for r in rows], [r["ratio"] for r in rows], "o-", label=name)
        for r in rows:
            if r["batch_size"] == HEADLINE_BATCH:
                left.annotate(
                    f"{r['ratio']:.1f}x",
                    (HEADLINE_BATCH, r["ratio"]),
                    xytext=(4, 4),
                    textcoords="offset points",
                )
    left.axhline(2.5, color="tab:red", linestyle="--", label="goal 2.5x")
    left.set_xscale("log", base=2)
    left.set_xticks(BATCHES, [str(b) for b in BATCHES])
    left.set_ylim(bottom=0)
    left.set_xlabel("batch size (expected, under Poisson sampling)")
    left.set_ylabel("DP-SGD epoch time / non-private")
    left.set_title("(a) epoch time, digits 8x8, one silo")
    left.legend()

    private = [row for row in curve if row["target_epsilon"] is not None]
    (plain,) = [row for row in curve if row["target_epsilon"] is None]
    x = [row["target_epsilon"] for row in private]
    means = [row["mean"] for row in private]
    right.errorbar(
        x,
        means,
        yerr=[
            [m - row["min"] for m, row in zip(means, private, strict=True)],
            [row["max"] - m for m, row in zip(means, private, strict=True)],
        ],
        marker="o",
        capsize=4,
        label="DP-SGD (mean, min-max over seeds)",
    )
    right.axhline(plain["mean"], color="tab:green", linestyle="--", label="no DP (mean)")
    right.axhspan(
        plain["min"], plain["max"], color="tab:green", alpha=0.15, label="no DP (min-max)"
    )
    right.set_xscale("log", base=2)
    right.set_xticks(x, [f"{e:g}" for e in x])
    right.set_xlabel("target epsilon per silo (delta 1e-5)")
    right.set_ylabel("mean test accuracy over silos")
    right.set_title(f"(b) FedAvg, breast_cancer, 5 silos, {len(SEEDS)} seeds")
    right.legend(loc="lower right")
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7, help="timed epochs per model and mode")
    args = parser.parse_args()
    torch.manual_seed(0)
    timing = [row for model in MODELS.values() for row in epoch_times(model, args.repeats)]
    policy = load_policy(TRADE_OFF_POLICY)
    curve = trade_off(policy)
    path = write(
        "dp",
        {
            "epoch_time": {
                "rows": timing,
                "dp_sgd": DP_TIMED.dp_sgd.model_dump(),
                "goal": "DP-SGD epoch time <= 2.5x non-private",
                "headline_batch_size": HEADLINE_BATCH,
            },
            "trade_off": {
                "policy": str(TRADE_OFF_POLICY.name),
                "rounds": policy.rounds,
                "delta": policy.privacy.delta,
                "accountant": policy.privacy.accountant,
                "rows": curve,
            },
        },
        plot(timing, curve),
    )
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
