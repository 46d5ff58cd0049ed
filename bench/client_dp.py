"""Client-level DP (DP-FedAvg): accuracy against the published model's epsilon, and what each
silo's update costs it against the coordinator.

FedAvg on breast_cancer over 5 IID silos (policies/examples/fedavg_client_dp.yaml, its 30
rounds, clip S = 0.1: between the first rounds' update norms, about 0.33, and the last ones',
about 0.03), noise multiplier z in 0.5..8, noise added centrally or in shares by the silos,
3 seeds each, beside the same runs without DP. Reported per setting: the mean test accuracy
over silos of the final model, evaluated exactly (mean, min and max over seeds); the client-
level epsilon of the published model (the coordinator's accounting, delta 1e-5); and, with
distributed noise, the epsilon of the 30 updates a silo sends, as its ledger books them
(noise multiplier z / sqrt(5): the coordinator sees each update with only its share of the
noise until secure aggregation hides them; its noisy reports add to that).

About a minute on 2 CPU cores. Run: `python -m bench.client_dp`; writes
bench/results/client_dp.json and client_dp.png.
"""

from __future__ import annotations

import statistics
from importlib.resources import files
from pathlib import Path
from typing import Any

import matplotlib.pyplot as plt

from bench.common import write
from bench.dp import exact_test_summary
from fedsilo.ops.simulate import load_silos, simulate
from fedsilo.policies.loading import load_policy
from fedsilo.policies.schema import Policy
from fedsilo.privacy.accounting import Mechanism, epsilon

POLICY = Path(str(files("fedsilo.policies") / "examples" / "fedavg_client_dp.yaml"))
NOISE_MULTIPLIERS = (0.5, 1.0, 2.0, 4.0, 8.0)
NOISES = ("central", "distributed")
SEEDS = (0, 1, 2)


def with_client_dp(policy: Policy, noise: str | None, z: float = 1.0) -> Policy:
    """The policy with client-level DP at noise multiplier `z`, or without DP (None)."""
    document = policy.model_dump()
    client_dp = document["privacy"]["client_dp"]
    document["privacy"]["client_dp"] = (
        None if noise is None else {**client_dp, "noise": noise, "noise_multiplier": z}
    )
    return Policy.model_validate(document)


def accuracies(policy: Policy) -> tuple[list[float], float | None]:
    """Per seed, the final model's exact mean test accuracy; and the published epsilon."""
    values, published = [], None
    for seed in SEEDS:
        run = policy.with_overrides(seed=seed)
        datasets = load_silos(run, None)
        history = simulate(run, datasets).history
        values.append(exact_test_summary(run, datasets, history.state)["accuracy"]["mean"])
        published = history.records[-1].client_epsilon
    return values, published


def silo_epsilon(policy: Policy) -> float:
    """What a silo's updates cost against the coordinator with distributed noise."""
    dp = policy.privacy.client_dp
    silos = policy.data.partition.silos
    share = Mechanism.gaussian(
        sensitivity=dp.clip, noise_std=dp.noise_multiplier * dp.clip / silos**0.5
    )
    return epsilon([share] * policy.rounds, policy.privacy.delta, policy.privacy.accountant)


def sweep(policy: Policy) -> list[dict[str, Any]]:
    rows = []
    settings = [(None, None)] + [(n, z) for n in NOISES for z in NOISE_MULTIPLIERS]
    for noise, z in settings:
        run = with_client_dp(policy, noise, z or 1.0)
        values, published = accuracies(run)
        rows.append(
            {
                "noise": noise,
                "noise_multiplier": z,
                "seeds": list(SEEDS),
                "mean_test_accuracy": values,
                "mean": statistics.mean(values),
                "min": min(values),
                "max": max(values),
                "published_epsilon": published,
                "silo_update_epsilon": silo_epsilon(run) if noise == "distributed" else None,
            }
        )
        print(rows[-1], flush=True)
    return rows


def plot(rows: list[dict[str, Any]]) -> plt.Figure:
    fig, axis = plt.subplots(figsize=(6.5, 4.2))
    (plain,) = [row for row in rows if row["noise"] is None]
    for noise, marker in zip(NOISES, "os", strict=True):
        mine = [row for row in rows if row["noise"] == noise]
        x = [row["published_epsilon"] for row in mine]
        means = [row["mean"] for row in mine]
        axis.errorbar(
            x,
            means,
            yerr=[
                [m - row["min"] for m, row in zip(means, mine, strict=True)],
                [row["max"] - m for m, row in zip(means, mine, strict=True)],
            ],
            marker=marker,
            capsize=4,
            label=f"{noise} noise (z = {', '.join(str(r['noise_multiplier']) for r in mine)})",
        )
    axis.axhline(plain["mean"], color="tab:green", linestyle="--", label="no DP (mean)")
    axis.set_xscale("log")
    axis.set_xlabel("client-level epsilon of the published model (delta 1e-5)")
    axis.set_ylabel("mean test accuracy over silos")
    axis.set_title(f"DP-FedAvg, breast_cancer, 5 silos, {len(SEEDS)} seeds")
    axis.legend(loc="lower right", fontsize=8)
    return fig


def main() -> None:
    policy = load_policy(POLICY)
    rows = sweep(policy)
    path = write(
        "client_dp",
        {
            "policy": POLICY.name,
            "rounds": policy.rounds,
            "clip": policy.privacy.client_dp.clip,
            "delta": policy.privacy.delta,
            "accountant": policy.privacy.accountant,
            "rows": rows,
        },
        plot(rows),
    )
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
