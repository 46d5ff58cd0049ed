"""Engine overhead: rounds/second of the in-process engine for FedAvg with 10 silos and a
1M-parameter MLP, and the engine's own time per round (encoding, dispatch, checks,
aggregation) as a fraction of the silos' local training time.

The process keeps freed memory as `fedsilo simulate` does (ops/memory.py).
Silos run one at a time (max_parallel=1) for the accounting, so that
overhead = round wall time - sum of the silos' training time; a second configuration runs
them in parallel threads for throughput. Run: `make bench` or `python -m bench.engine_overhead`.
"""

from __future__ import annotations

import argparse
import statistics

import matplotlib.pyplot as plt
import numpy as np
import torch
from sklearn.datasets import make_classification

from bench.common import count_parameters, write
from fedsilo.coordinator.engine import RoundEngine, RoundRecord
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.models.zoo import build_model
from fedsilo.ops.memory import keep_freed_memory
from fedsilo.policies.loading import parse_policy
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import SiloDataset

SILOS, FEATURES, HIDDEN = 10, 100, [1000, 900]


def silo_data(name: str, samples: int, seed: int) -> SiloDataset:
    x, y = make_classification(samples + 20, FEATURES, n_informative=20, random_state=seed)
    x = torch.tensor(x, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.int64)
    names = tuple(f"f{i}" for i in range(FEATURES))
    return SiloDataset(
        name,
        x[:samples],
        y[:samples],
        x[samples : samples + 10],
        y[samples : samples + 10],
        x[samples + 10 :],
        y[samples + 10 :],
        "classification",
        2,
        names,
        (FEATURES,),
    )


class Timings:
    def __init__(self) -> None:
        self.records: list[RoundRecord] = []

    def on_round(self, record: RoundRecord, total_rounds: int) -> None:
        self.records.append(record)


def measure(samples: int, epochs: int, parallel: int, rounds: int) -> dict[str, float]:
    policy = parse_policy(
        {
            "version": 1,
            "rounds": rounds,
            "eval_every": rounds,
            "algorithm": {"name": "fedavg"},
            "model": {"name": "mlp", "hidden": HIDDEN},
            "training": {"epochs": epochs, "batch_size": 64, "lr": 0.01},
            "compute": {"device": "cpu"},
        }
    )
    agents = {
        f"s{i}": SiloAgent(f"s{i}", silo_data(f"s{i}", samples, i), policy) for i in range(SILOS)
    }
    timings = Timings()
    transport = InProcessTransport(
        {n: a.handle_bytes for n, a in agents.items()}, max_parallel=parallel
    )
    RoundEngine(make_strategy(policy), transport, policy, list(agents), [timings]).run()
    measured = timings.records[1:]  # the first round warms caches up
    wall = [r.seconds for r in measured]
    compute = [sum(r.compute_seconds["train"].values()) for r in measured]
    overhead = [w - c for w, c in zip(wall, compute, strict=True)]
    return {
        "samples_per_silo": samples,
        "local_epochs": epochs,
        "max_parallel": parallel,
        "rounds_measured": len(measured),
        "round_seconds": statistics.median(wall),
        "rounds_per_second": 1 / statistics.median(wall),
        "silo_training_seconds": statistics.median(compute),
        "engine_overhead_seconds": statistics.median(overhead) if parallel == 1 else None,
        "overhead_fraction": statistics.median(
            o / c for o, c in zip(overhead, compute, strict=True)
        )
        if parallel == 1
        else None,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=6)
    args = parser.parse_args()
    keep_freed_memory()
    torch.manual_seed(0)
    params = count_parameters(
        build_model(
            parse_policy({"version": 1, "model": {"name": "mlp", "hidden": HIDDEN}}).model,
            (FEATURES,),
            2,
            0,
        )
    )
    configs = [(256, 1, 1), (1024, 1, 1), (1024, 3, 1), (1024, 1, 4)]
    rows = [measure(s, e, p, args.rounds) for s, e, p in configs]
    for row in rows:
        print({k: round(v, 4) if isinstance(v, float) else v for k, v in row.items()})

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    serial = [r for r in rows if r["max_parallel"] == 1]
    labels = [f"{r['samples_per_silo']} x {r['local_epochs']} ep" for r in serial]
    left.bar(labels, [r["silo_training_seconds"] for r in serial], label="silo training")
    left.bar(
        labels,
        [r["engine_overhead_seconds"] for r in serial],
        bottom=[r["silo_training_seconds"] for r in serial],
        label="engine overhead",
    )
    for i, r in enumerate(serial):
        left.text(i, r["round_seconds"], f"{r['overhead_fraction']:.1%}", ha="center", va="bottom")
    left.set_ylabel("seconds per round (silos serial)")
    left.legend()
    right.bar(
        [f"{r['samples_per_silo']}/p{r['max_parallel']}" for r in rows],
        [r["rounds_per_second"] for r in rows],
    )
    right.set_ylabel("rounds / second")
    right.set_xlabel("samples per silo / parallel silos")
    fig.suptitle(f"FedAvg, {SILOS} silos, MLP with {params:,} parameters, in-process engine")
    path = write(
        "engine_overhead",
        {
            "parameters": params,
            "silos": SILOS,
            "rows": rows,
            "goal": "engine overhead under 5% of local training time",
        },
        fig,
    )
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    np.set_printoptions(precision=4)
    main()
