"""What a long-running consortium saves per job: `fedsilo coordinator serve` with silo agents
that stay connected, beside starting the coordinator and every silo again for each job (the
only way before `serve`).

Both run the same jobs on the same provisioned consortium of real processes on loopback
(mTLS gRPC, breast_cancer split over the silos, a linear model, FedAvg): each job is a new
signed policy (another seed), so neither side can reuse anything of an earlier job.

Per job it reports:
- time to the first completed round: from `fedsilo job submit` (its own process start
  included) to round 1 saved in the state file, against from launching the coordinator and
  silo processes to the same;
- per-job overhead: the job's wall time (submit to `completed` in the queue, against launch to
  every process exited, when the next job could start) minus the seconds its rounds took (the
  round records' own timings): what is spent outside rounds.

The serving side first runs one unmeasured job, so its agents are up and connected (as in a
consortium that serves jobs); the two systems then alternate job by job, and each ratio
(serve over per-job processes) is the median over the repeats with its spread (min, max):
these machines are shared and noisy.
Run: `python -m bench.job_overhead [--repeats 5] [--silos 3] [--rounds 3]` (about 3 minutes).
"""

from __future__ import annotations

import argparse
import json
import sqlite3
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import numpy as np
import yaml

from bench.common import write
from fedsilo.ops.demo import LocalConsortium, free_port
from fedsilo.ops.job_id import job_id
from fedsilo.ops.provision import load_operator_kit
from fedsilo.privacy.policy_signing import signature_path, verify_policy

POLL_S = 0.5
TIMEOUT_S = 300.0


def policy_document(seed: int, rounds: int, silos: int) -> dict:
    return {
        "version": 1,
        "name": f"bench-job-{seed}",
        "seed": seed,
        "rounds": rounds,
        "eval_every": rounds,
        "algorithm": {"name": "fedavg"},
        "model": {"name": "linear"},
        "training": {"epochs": 1, "batch_size": 16, "lr": 0.05},
        "participants": {"min_silos": silos, "phase_timeout_s": 60},
        "data": {"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": silos}},
    }


def write_policy(consortium: LocalConsortium, seed: int, rounds: int, silos: int) -> Path:
    path = consortium.folder / f"policy-{seed}.yaml"
    path.write_text(yaml.safe_dump(policy_document(seed, rounds, silos), sort_keys=False))
    consortium.sign_policy(path)
    return path


def job_of(policy: Path) -> str:
    kit = load_operator_kit(policy.parent / "kits" / "operator")
    digest = verify_policy(
        policy.read_bytes(), signature_path(policy).read_text().strip(), kit.signing_key.verify_key
    )
    return job_id(yaml.safe_load(policy.read_text())["name"], digest)


def silo_configs(consortium: LocalConsortium, names: list[str], silos: int) -> dict[str, Path]:
    configs = {}
    for name in names:
        site = consortium.folder / "sites" / name
        site.mkdir(parents=True, exist_ok=True)
        configs[name] = site / "silo.yaml"
        configs[name].write_text(
            yaml.safe_dump(
                {
                    "version": 1,
                    "kit": str(consortium.folder / "kits" / "silos" / name),
                    "data": {
                        "source": policy_document(0, 1, silos)["data"],
                        "select": name,
                    },
                }
            )
        )
    return configs


class StateFile:
    """Read-only looks into the coordinator's state file (SQLite readers never block it)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def _rows(self, sql: str, args: tuple) -> list[tuple]:
        if not self.path.exists():
            return []
        try:
            with sqlite3.connect(f"file:{self.path}?mode=ro", uri=True, timeout=5) as db:
                return db.execute(sql, args).fetchall()
        except sqlite3.OperationalError:  # not created yet
            return []

    def round_done(self, job: str, round_no: int) -> bool:
        return bool(
            self._rows(
                "SELECT 1 FROM rounds WHERE deployment_id = ? AND round = ? AND status = "
                "'completed'",
                (job, round_no),
            )
        )

    def round_seconds(self, job: str) -> float:
        rows = self._rows(
            "SELECT record_json FROM rounds WHERE deployment_id = ? AND round > 0", (job,)
        )
        return sum(json.loads(record)["seconds"] for (record,) in rows)

    def job_status(self, job: str) -> str | None:
        rows = self._rows("SELECT status FROM jobs WHERE job_id = ?", (job,))
        return rows[0][0] if rows else None


def wait_until(check, what: str, consortium: LocalConsortium) -> float:
    deadline = time.monotonic() + TIMEOUT_S
    while not check():
        consortium.check()
        if time.monotonic() > deadline:
            raise RuntimeError(f"{what} not reached in {TIMEOUT_S:.0f}s; see {consortium.folder}")
        time.sleep(0.02)
    return time.perf_counter()


def per_job_processes(
    consortium: LocalConsortium, configs: dict[str, Path], policy: Path, state: StateFile
) -> dict:
    """Today's way without serve: start the coordinator and every silo for this one job."""
    job = job_of(policy)
    started = time.perf_counter()
    consortium.start(
        f"coordinator-{job}",
        "coordinator",
        "start",
        "--kit",
        "kits/coordinator",
        "--policy",
        str(policy),
        "--state",
        str(state.path),
        "--poll-seconds",
        str(POLL_S),
        "--join-timeout",
        "120",
    )
    for name, config in configs.items():
        consortium.start(
            f"{name}-{job}", "silo", "start", "--config", str(config), "--poll-seconds", str(POLL_S)
        )
    first = wait_until(lambda: state.round_done(job, 1), f"round 1 of {job}", consortium)
    for process in consortium.processes.values():
        process.wait(timeout=TIMEOUT_S)
    ended = time.perf_counter()
    consortium.processes.clear()
    return timings(started, first, ended, state.round_seconds(job))


def submitted_job(consortium: LocalConsortium, policy: Path, state: StateFile) -> dict:
    """The long-running way: one `fedsilo job submit` to the serving coordinator."""
    job = job_of(policy)
    started = time.perf_counter()
    subprocess.run(
        [sys.executable, "-m", "fedsilo", "job", "submit", str(policy), "--kit", "kits/operator"],
        cwd=consortium.folder,
        check=True,
        capture_output=True,
    )
    first = wait_until(
        lambda: state.round_done(job, 1) or state.job_status(job) == "failed",
        f"round 1 of {job}",
        consortium,
    )
    ended = wait_until(lambda: state.job_status(job) == "completed", f"{job} completed", consortium)
    return timings(started, first, ended, state.round_seconds(job))


def timings(started: float, first: float, ended: float, rounds_s: float) -> dict:
    return {
        "to_first_round_s": first - started,
        "job_s": ended - started,
        "rounds_s": rounds_s,
        "overhead_s": ended - started - rounds_s,
    }


def spread(values: list[float]) -> dict:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--silos", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    names = [f"silo-{i}" for i in range(args.silos)]  # the partition's silo names
    with tempfile.TemporaryDirectory(prefix="fedsilo-bench-jobs-") as tmp:
        root = Path(tmp)
        per_job, _ = LocalConsortium.provision(root / "per-job", "bench-per-job", names)
        serving, _ = LocalConsortium.provision(root / "serve", "bench-serve", names)
        per_job_configs = silo_configs(per_job, names, args.silos)
        serve_configs = silo_configs(serving, names, args.silos)
        per_job_state = StateFile(per_job.folder / "state.db")
        serve_state = StateFile(serving.folder / "state.db")
        serving.start(
            "coordinator",
            "coordinator",
            "serve",
            "--kit",
            "kits/coordinator",
            "--state",
            "state.db",
            "--poll-seconds",
            str(POLL_S),
            "--metrics-port",
            str(free_port()),
        )
        for name, config in serve_configs.items():
            serving.start(name, "silo", "start", "--config", str(config), "--poll-seconds", "0.5")
        rows: list[dict] = []
        try:
            # an unmeasured first job: the agents are up and connected before any timing,
            # as they are in a consortium that serves jobs
            warm_up = write_policy(serving, 99, args.rounds, args.silos)
            submitted_job(serving, warm_up, serve_state)
            for repeat in range(args.repeats):
                seed = 100 + repeat
                # alternate which system goes first, so drift in the machine's load is shared
                order = ("serve", "per_job") if repeat % 2 == 0 else ("per_job", "serve")
                row: dict = {"repeat": repeat, "seed": seed, "first": order[0]}
                for system in order:
                    if system == "serve":
                        policy = write_policy(serving, seed, args.rounds, args.silos)
                        row["serve"] = submitted_job(serving, policy, serve_state)
                    else:
                        policy = write_policy(per_job, seed, args.rounds, args.silos)
                        row["per_job"] = per_job_processes(
                            per_job, per_job_configs, policy, per_job_state
                        )
                rows.append(row)
                print(row, flush=True)
        finally:
            serving.stop()
            per_job.stop()
    ratios = {
        metric: spread([r["serve"][metric] / r["per_job"][metric] for r in rows])
        for metric in ("to_first_round_s", "job_s", "overhead_s")
    }
    document = {
        "what": "serve with connected silos vs processes started per job (FedAvg, linear)",
        "silos": args.silos,
        "rounds": args.rounds,
        "poll_seconds": POLL_S,
        "repeats": rows,
        "serve": {
            m: spread([r["serve"][m] for r in rows])
            for m in ("to_first_round_s", "job_s", "overhead_s")
        },
        "per_job": {
            m: spread([r["per_job"][m] for r in rows])
            for m in ("to_first_round_s", "job_s", "overhead_s")
        },
        "serve_over_per_job": ratios,
    }
    figure, axes = plt.subplots(1, 2, figsize=(10, 4))
    labels = ["to first round", "per-job overhead"]
    for index, (system, colour) in enumerate((("per_job", "tab:gray"), ("serve", "tab:blue"))):
        medians = [document[system][m]["median"] for m in ("to_first_round_s", "overhead_s")]
        errors = np.array(
            [
                [document[system][m]["median"] - document[system][m]["min"] for m in
                 ("to_first_round_s", "overhead_s")],
                [document[system][m]["max"] - document[system][m]["median"] for m in
                 ("to_first_round_s", "overhead_s")],
            ]
        )  # fmt: skip
        axes[0].bar(
            np.arange(2) + index * 0.4, medians, 0.4, yerr=errors, color=colour, label=system
        )
    axes[0].set_xticks(np.arange(2) + 0.2, labels)
    axes[0].set_ylabel("seconds (median, min-max)")
    axes[0].legend()
    axes[1].bar(
        ["to first round", "job wall time", "per-job overhead"],
        [ratios[m]["median"] for m in ("to_first_round_s", "job_s", "overhead_s")],
        color="tab:blue",
    )
    axes[1].axhline(1.0, color="black", linewidth=0.8)
    axes[1].set_ylabel("serve / per-job processes (median)")
    print(write("job_overhead", document, figure))


if __name__ == "__main__":
    main()
