"""What the privacy planner costs a silo: `plan_job` (every release of the job, walked from
the silo's contract) runs at every acceptance, and under `privacy.job_epsilon` the silo first
calibrates DP-SGD's noise over the whole plan (a bisection on the composed epsilon).

For the heart example (FedAvg, an MLP, evaluation every round, Cleveland's 243 training rows)
at 10, 100 and 1,000 rounds, under the three ways a policy sets DP-SGD's noise (a fixed
noise multiplier, a training-only epsilon, the job's total), it times the plan and its
composed epsilon, and the calibration, each the median of `--repeats` runs with its spread
(min, max): these machines are shared and noisy. The model and the accountant's import are
warmed once before timing (a silo has built its model before it plans).
Run: `python -m bench.budget_plan [--repeats 5]` (about a minute).
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt
import torch

from bench.common import write
from fedsilo.ops.sim_silos import ConsortiumKeys, build_agent
from fedsilo.ops.simulate import load_silos
from fedsilo.policies.loading import load_policy
from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.silo.budget_plan import calibrated_job_noise, plan_job
from fedsilo.silo.tasks.base import SiloContext

EXAMPLE = Path(__file__).parent.parent / "policies" / "examples" / "heart-fedavg.yaml"
ROUNDS = (10, 100, 1000)
NOISE = {
    "noise_multiplier": {"dp_sgd": {"noise_multiplier": 1.0}},
    "training_epsilon": {"dp_sgd": {"training_epsilon": 4.0}},
    "job_epsilon": {"job_epsilon": 200.0, "dp_sgd": {}},
}


def context(rounds: int, privacy: dict[str, Any]) -> SiloContext:
    base = load_policy(EXAMPLE)
    policy = base.model_copy(
        update={
            "rounds": rounds,
            "eval_every": 1,
            "privacy": PrivacyConfig.model_validate(privacy),
        }
    )
    data = load_silos(base, EXAMPLE.parent)[0]
    keys = ConsortiumKeys.generate([data.name])
    ctx = build_agent(policy, data.name, data, torch.device("cpu"), keys).context
    assert ctx.facts is not None  # the model's layout, built before planning as at acceptance
    return ctx


def timed(work: Any, repeats: int) -> dict[str, float]:
    seconds = []
    for _ in range(repeats):
        started = time.perf_counter()
        work()
        seconds.append(time.perf_counter() - started)
    return {"median_s": statistics.median(seconds), "min_s": min(seconds), "max_s": max(seconds)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    warm = plan_job(context(2, NOISE["noise_multiplier"])).epsilon  # opacus, the model
    assert warm is not None
    rows = []
    for setting, privacy in NOISE.items():
        for rounds in ROUNDS:
            ctx = context(rounds, privacy)
            noise = ctx.job_noise()  # the calibration, cached on the context as at a silo
            row: dict[str, Any] = {"noise": setting, "rounds": rounds}
            row["plan"] = timed(lambda ctx=ctx: plan_job(ctx).epsilon, args.repeats)
            if noise is not None:
                fresh = replace(ctx)  # a context without the cached calibration
                row["calibration"] = timed(
                    lambda fresh=fresh: calibrated_job_noise(fresh), args.repeats
                )
            row["epsilon"] = plan_job(ctx).epsilon
            row["tasks"] = len(plan_job(ctx).tasks)
            print(
                f"{setting:17} {rounds:5} rounds: plan {row['plan']['median_s']:.3f} s"
                + (
                    f", calibration {row['calibration']['median_s']:.3f} s"
                    if "calibration" in row
                    else ""
                )
                + f" (epsilon {row['epsilon']:.4g}, {row['tasks']} positions)"
            )
            rows.append(row)
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for setting in NOISE:
        mine = [r for r in rows if r["noise"] == setting]
        ax.plot(ROUNDS, [r["plan"]["median_s"] for r in mine], marker="o", label=f"plan, {setting}")
        if "calibration" in mine[0]:
            ax.plot(
                ROUNDS,
                [r["calibration"]["median_s"] for r in mine],
                marker="s",
                linestyle="--",
                label=f"calibration, {setting}",
            )
    ax.set_xscale("log")
    ax.set_xlabel("rounds")
    ax.set_ylabel("seconds (median)")
    ax.set_title("privacy planner at one silo (heart, FedAvg, eval every round)", fontsize=9)
    ax.legend(fontsize=7)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    path = write("budget_plan", {"repeats": args.repeats, "rows": rows}, fig)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
