"""Secure aggregation: what pairwise masking and CKKS cost a FedAvg round against plaintext
averaging, side by side, for MLPs of about 1e5 and 1e6 parameters and 5, 10 and 20 silos.
Masking runs twice: on the complete graph (every silo masks with every other) and on
SecAgg+'s sparse graph with `neighbours: 4` ("sparse"; from 6 silos, where 4 neighbours are
fewer than all the others).

Each configuration runs the same seeded consortium through the in-process engine once per
`secure_aggregation` method (none, masking, ckks): synthetic classification data, 32 samples
per silo, one local SGD step on a batch of 8 (the default "step" workload), so that
aggregation dominates the round. The
three deployments take turns, one round each, so that load from elsewhere on the machine
falls on all of them alike. Every silo endpoint is wrapped to count the bytes of the tasks it
receives and the results it sends, and to time the silo's work (decoding, the task,
encoding) in wall and CPU time (torch runs on one thread; a silo's CPU counts the thread that
computes its mask streams while it trains).

Silos answer one at a time (the in-process transport with max_parallel=1: one worker thread
that runs the tasks in turn), so a round is the coordinator's work plus the sum of the silos'; the
coordinator's share is the difference. Reported beside the wall time: the process's CPU time
per round (steadier on a shared machine), and the round time a deployment would see with
every silo on its own machine, network excluded, estimated from CPU times as the
coordinator's work plus, for each step, the slowest silo's.

Round 1 warms caches up and, with CKKS, includes the one-off key generation at the key holder
and each silo's first opening of the keys (reported separately); the steady state is the
median of rounds 2..R. Reported per configuration: round seconds, bytes per silo per round
(down: tasks received; up: results sent) and their ratios to plaintext, a per-step breakdown,
and the largest difference from plaintext's global model after each round (precision). For
CKKS also, from `privacy.ckks.measure`, the encryption time per 1e6 parameters and the
ciphertext expansion over fp32. Goal: masking <= 2x plaintext round time at 1e6 parameters x
10 silos.

Masking where it matters: `--workload trained` gives each silo 256 training samples and one
local epoch (batch 64, lr 0.01: bench/engine_overhead.py's 256 x 1 epoch) instead of the
default "step" workload above; its goal: masking <= 1.3x plaintext at 1e6 x 10, and beside
it Flower's SecAgg+ over Flower's plaintext on the same workload (`python -m
bench.flower_secagg --workload trained`). `--rtt-ms L` puts a link with an L ms round trip
under the in-process transport: every silo call (task delivered, answer returned) first
sleeps L ms in the wiretap, outside the silo's timed work and CPU (kept apart as the round's
link seconds). Which number is which, then: the round's wall time is measured, and since the
silos answer one at a time it holds L once per silo call (silos x steps of them); the CPU
time holds none of it (sleeping costs none); the deployment estimate, silos in parallel,
adds L once per step (one round trip to all silos at once): coordinator CPU + per step the
slowest silo's CPU + L.

About 6 minutes on 2 CPU cores shared with other work, and up to 7 GB of memory (20 silos
x 1e6 with CKKS: the coordinator holds every silo's 82 MB of ciphertexts). Run:
`python -m bench.secagg` (`--quick`: a small smoke configuration that writes nothing); writes
bench/results/secagg.json and secagg.png. `--sizes 1e6 --silos 10,20 --methods
none,masking,sparse` reruns only those rows (plaintext always runs beside them) and, like
`--quick`, writes nothing: the result file comes from full runs only. So do a run with
another `--workload` or a `--rtt-ms`, unless `--out NAME` names its own result file
(bench/results/NAME.json and NAME.png), as it may for a filtered run, e.g. `python -m
bench.secagg --workload trained --sizes 1e6 --silos 10 --methods masking,sparse --rtt-ms 20
--out secagg_trained_rtt20`.
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
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import matplotlib.pyplot as plt
import numpy as np
import torch
from matplotlib.ticker import FuncFormatter, NullFormatter
from nacl.public import PrivateKey
from nacl.signing import SigningKey
from sklearn.datasets import make_classification

from bench.common import count_parameters, write
from bench.turns import Turns, take_turns
from fedsilo.coordinator.engine import RoundEngine, RoundRecord
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.strategies.base import (
    EvaluationScript,
    RoundContext,
    RoundScript,
    ServerState,
    Strategy,
)
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.models.zoo import build_model
from fedsilo.policies.loading import parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.privacy.ckks import FP32_BYTES, CkksParameters, measure
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import SiloDataset
from fedsilo.silo.tasks.base import SiloKeys
from fedsilo.wire.messages import SiloEndpoint
from fedsilo.wire.payload import as_payload
from fedsilo.wire.tensors import index_tensors

METHODS = ("none", "masking", "sparse", "ckks")
SPARSE_NEIGHBOURS = 4  # "sparse": masking with secure_aggregation.neighbours 4 (t = 3)
NO_LINEAGE = "masking-nolineage"  # masking with lineage off (bench/lineage.py; not in METHODS)
FEATURES, SAMPLES, CLASSES = 100, 32, 2  # SAMPLES: the "step" workload's
MODELS = {"1e5": [330, 200], "1e6": [1000, 900]}  # MLP hidden layers: 99,932 and 1,003,702
SILO_COUNTS = (5, 10, 20)
QUICK_MODELS, QUICK_SILOS = {"1e4": [64]}, (3,)
MAX_PARALLEL = 1
TRAINING = {"steps": 1, "batch_size": 8, "lr": 0.01}  # the "step" workload's


@dataclass(frozen=True)
class Workload:
    """Each silo's training samples and local training per round."""

    samples: int
    training: dict[str, Any]
    max_ratio: float  # the goal: masking's round time over plaintext's at 1e6 x 10, at most
    title: str


WORKLOADS = {
    # aggregation dominates the round
    "step": Workload(SAMPLES, TRAINING, 2.0, "1 local step of 8 samples"),
    # real local training, as bench/engine_overhead.py's 256 samples x 1 epoch (batch 64)
    "trained": Workload(
        256, {"epochs": 1, "batch_size": 64, "lr": 0.01}, 1.3, "1 local epoch of 256 samples"
    ),
}
GOAL = {"parameters": "1e6", "silos": 10, "method": "masking"}  # max_ratio: the workload's
ANCHORS = {
    "nvflare_ckks_end_to_end_ratio": 2.7,  # NVFLARE, CKKS on a 3.5M-parameter CNN
    "tenseal_encrypt_seconds_per_1e5": 0.11,  # this machine, N=8192, [60,40,40,60], 2^40
    "tenseal_expansion_vs_fp32": 20.7,
}


# -- one run ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Call:
    """One task as a silo saw it: its wall and CPU time and the bytes in and out."""

    silo: str
    round: int
    kind: str
    seconds: float
    cpu: float  # the silo thread's CPU time (torch runs on one thread here)
    down: int
    up: int
    link: float = 0.0  # wall seconds the injected round-trip delay took (not the silo's)


class Wiretap:
    """Wraps silo endpoints: times each task (wall and CPU time) and counts the bytes of task
    and result. With `rtt` seconds, every call first waits that long (the link's round trip:
    task delivered, answer returned), outside the silo's timed work; the wait is kept apart in
    `Call.link`."""

    def __init__(self, rtt: float = 0.0) -> None:
        self.calls: list[Call] = []
        self.rtt = rtt
        self._lock = threading.Lock()

    def wrap(self, silo: str, endpoint: SiloEndpoint) -> SiloEndpoint:
        # A silo's CPU is the process's less the engine's (the main thread) while the silo
        # answers: its worker thread and the thread that computes its mask streams meanwhile
        # (silos answer one at a time, MAX_PARALLEL = 1).
        engine = time.pthread_getcpuclockid(threading.main_thread().ident)

        def answer(payload: bytes) -> bytes:
            link = 0.0
            if self.rtt:
                waited = time.perf_counter()
                time.sleep(self.rtt)
                link = time.perf_counter() - waited
            started = time.perf_counter()
            started_cpu = time.process_time() - time.clock_gettime(engine)
            result = endpoint(payload)
            seconds = time.perf_counter() - started
            cpu = time.process_time() - time.clock_gettime(engine) - started_cpu
            _, header = index_tensors(as_payload(payload))
            round_no, kind = int(header["round"]), str(header["kind"])
            call = Call(silo, round_no, kind, seconds, cpu, len(payload), len(result), link)
            with self._lock:
                self.calls.append(call)
            return result

        return answer

    def of_round(self, round_no: int) -> list[Call]:
        return [c for c in self.calls if c.round == round_no and c.kind != "evaluate"]


class Rounds:
    """Each round's record and the process's CPU time in it (from the end of the previous
    round's turn, None for round 1), taking turns with the other deployments in between."""

    def __init__(self, turns: Turns, name: str) -> None:
        self.turns, self.name = turns, name
        self.records: list[RoundRecord] = []
        self.cpu: list[float | None] = []
        self._resumed: float | None = None

    def on_round(self, record: RoundRecord, total_rounds: int) -> None:
        ended = time.process_time()
        self.records.append(record)
        self.cpu.append(None if self._resumed is None else ended - self._resumed)
        self.turns.pass_on(self.name)
        self.turns.wait(self.name)
        self._resumed = time.process_time()


class Snapshots(Strategy):
    """A strategy's rounds, keeping the global model after each (the engine returns only the
    last). It keeps the strategy's own tensors, which later rounds replace and never modify,
    so nothing is copied inside a timed round."""

    name = "snapshots"

    def __init__(self, strategy: Strategy) -> None:
        super().__init__(strategy.policy)
        self.strategy = strategy
        self.models: dict[int, torch.Tensor] = {}

    def setup(self, ctx: RoundContext) -> RoundScript:
        return self.strategy.setup(ctx)

    def round(self, state: ServerState, ctx: RoundContext) -> RoundScript:
        after = yield from self.strategy.round(state, ctx)
        self.models[ctx.round] = after.model
        return after

    def evaluate(self, state: ServerState, ctx: RoundContext) -> EvaluationScript:
        return self.strategy.evaluate(state, ctx)


def silo_data(name: str, seed: int, samples: int = SAMPLES) -> SiloDataset:
    x, y = make_classification(samples + 20, FEATURES, n_informative=20, random_state=seed)
    x = torch.tensor(x, dtype=torch.float32)
    y = torch.tensor(y, dtype=torch.int64)
    names = tuple(f"f{i}" for i in range(FEATURES))
    s = samples
    return SiloDataset(
        name,
        x[:s],
        y[:s],
        x[s : s + 10],
        y[s : s + 10],
        x[s + 10 :],
        y[s + 10 :],
        "classification",
        CLASSES,
        names,
        (FEATURES,),
    )


def bench_policy(
    method: str, hidden: list[int], silos: int, rounds: int, workload: str = "step"
) -> Policy:
    return parse_policy(
        {
            "version": 1,
            "seed": 0,
            "rounds": rounds,
            "eval_every": rounds + 1,  # the final evaluation comes after the last round's mark
            "algorithm": {"name": "fedavg"},
            "model": {"name": "mlp", "hidden": hidden},
            "training": WORKLOADS[workload].training,
            "compute": {"device": "cpu"},
            "participants": {"min_silos": silos, "phase_timeout_s": 600},
            "secure_aggregation": secure_aggregation_of(method),
        }
    )


def secure_aggregation_of(method: str) -> str | dict[str, Any]:
    """The policy's `secure_aggregation` section for a bench method name."""
    if method == "sparse":
        return {"method": "masking", "neighbours": SPARSE_NEIGHBOURS}
    if method == NO_LINEAGE:
        return {"method": "masking", "lineage": False}
    return method


def derived(name: str, purpose: str) -> bytes:
    """32 bytes of key material for a silo's key, derived from its name so that runs repeat."""
    return hashlib.sha256(f"bench.secagg/{purpose}/{name}".encode()).digest()


def deployment(
    method: str,
    hidden: list[int],
    silos: int,
    rounds: int,
    turns: Turns,
    workload: str = "step",
    rtt: float = 0.0,
) -> tuple[RoundEngine, Rounds, Wiretap, Snapshots]:
    """An engine over `silos` wiretapped silo agents, run under `method`, taking turns; each
    silo call waits `rtt` seconds (the link's round trip)."""
    policy = bench_policy(method, hidden, silos, rounds, workload)
    samples = WORKLOADS[workload].samples
    names = [f"s{i:02d}" for i in range(silos)]
    identities = {n: SigningKey(derived(n, "identity")) for n in names}
    sealing = {n: PrivateKey(derived(n, "sealing")) for n in names}
    agents = {
        n: SiloAgent(
            n,
            silo_data(n, i, samples),
            policy,
            keys=SiloKeys(
                identity=identities[n],
                roster={m: key.verify_key for m, key in identities.items()},
                sealing_key=sealing[n],
                sealing_roster={m: key.public_key for m, key in sealing.items()},
            ),
        )
        for i, n in enumerate(names)
    }
    tap, seen = Wiretap(rtt), Rounds(turns, method)
    transport = InProcessTransport(
        {n: tap.wrap(n, a.handle_bytes) for n, a in agents.items()}, max_parallel=MAX_PARALLEL
    )
    strategy = Snapshots(make_strategy(policy))
    return RoundEngine(strategy, transport, policy, names, [seen]), seen, tap, strategy


def side_by_side(
    hidden: list[int],
    silos: int,
    rounds: dict[str, int],
    workload: str = "step",
    rtt: float = 0.0,
) -> dict[str, dict[str, Any]]:
    """Every method's deployment of `rounds[method]` FedAvg rounds, taking turns: per method,
    its round records and CPU times, the wiretap's calls and the global model after each
    round."""
    outcomes: dict[str, dict[str, Any]] = {}

    def run(method: str, turns: Turns) -> None:
        engine, seen, tap, strategy = deployment(
            method, hidden, silos, rounds[method], turns, workload, rtt
        )
        engine.run()
        failed = [r.error for r in seen.records if r.status != "completed"]
        if failed:
            raise RuntimeError(f"{method}, {silos} silos: a round failed: {failed[0]}")
        outcomes[method] = {
            "records": seen.records,
            "cpu": seen.cpu,
            "tap": tap,
            "models": strategy.models,
        }

    take_turns(list(rounds), run, "bench")
    return outcomes


# -- summaries -------------------------------------------------------------------------------


def round_costs(
    calls: list[Call], wall: float, cpu: float | None, silos: int, rtt: float = 0.0
) -> dict[str, Any]:
    """One round's time split between coordinator, silos and the injected link delay (wall;
    and CPU when `cpu`, the process's CPU time in the round, is known), the deployment
    estimate (coordinator CPU + per step the slowest silo's CPU + one round trip `rtt`), and
    bytes per silo."""
    steps: dict[str, list[Call]] = defaultdict(list)
    down: dict[str, int] = defaultdict(int)
    up: dict[str, int] = defaultdict(int)
    for call in calls:
        steps[call.kind].append(call)
        down[call.silo] += call.down
        up[call.silo] += call.up
    silos_wall, silos_cpu = sum(c.seconds for c in calls), sum(c.cpu for c in calls)
    link_wall = sum(c.link for c in calls)
    slowest = {k: max(c.cpu for c in cs) for k, cs in steps.items()}
    coordinator_cpu = None if cpu is None else cpu - silos_cpu
    return {
        "wall": wall,
        "coordinator_wall": wall - silos_wall - link_wall,
        "silos_wall": silos_wall,
        "link_wall": link_wall,
        "cpu": cpu,
        "coordinator_cpu": coordinator_cpu,
        "silos_cpu": silos_cpu,
        "deployment_estimate": None
        if coordinator_cpu is None
        else coordinator_cpu + sum(slowest.values()) + rtt * len(steps),
        "steps": {
            k: {
                "silo_seconds_total": sum(c.seconds for c in cs),
                "silo_cpu_seconds_total": sum(c.cpu for c in cs),
                "silo_cpu_seconds_max": slowest[k],
                "bytes_down_per_silo": sum(c.down for c in cs) / silos,
                "bytes_up_per_silo": sum(c.up for c in cs) / silos,
            }
            for k, cs in steps.items()
        },
        "down_mean": sum(down.values()) / silos,
        "up_mean": sum(up.values()) / silos,
        "down_max": max(down.values()),
        "up_max": max(up.values()),
    }


def median_of(costs: list[dict[str, Any]], key: str) -> float:
    return statistics.median(c[key] for c in costs)


def summarize(outcome: dict[str, Any], silos: int, params: int) -> dict[str, Any]:
    """The steady state (median over rounds 2..R) and round 1 of one run."""
    records: list[RoundRecord] = outcome["records"]
    tap: Wiretap = outcome["tap"]
    costs = [
        round_costs(tap.of_round(r.round), r.seconds, c, silos, tap.rtt)
        for r, c in zip(records, outcome["cpu"], strict=True)
    ]
    steady = costs[1:]
    keygen = [c for c in tap.of_round(1) if c.kind == "ckks_keygen"]
    steps = {
        kind: {
            field: statistics.median(c["steps"][kind][field] for c in steady) for field in fields
        }
        for kind, fields in steady[0]["steps"].items()
    }
    keys = (
        "wall",
        "coordinator_wall",
        "silos_wall",
        "link_wall",
        "cpu",
        "coordinator_cpu",
        "silos_cpu",
        "deployment_estimate",
    )
    return {
        "round_seconds": median_of(steady, "wall"),
        "round_cpu_seconds": median_of(steady, "cpu"),
        "coordinator_seconds": median_of(steady, "coordinator_wall"),
        "silo_seconds_total": median_of(steady, "silos_wall"),
        "link_seconds_total": median_of(steady, "link_wall"),
        "coordinator_cpu_seconds": median_of(steady, "coordinator_cpu"),
        "silo_cpu_seconds_total": median_of(steady, "silos_cpu"),
        "deployment_estimate_seconds": median_of(steady, "deployment_estimate"),
        "round1_seconds": costs[0]["wall"],
        "keygen_seconds": keygen[0].seconds if keygen else None,
        "keygen_bytes": keygen[0].up if keygen else None,
        "per_round": [{k: c[k] for k in keys} for c in costs],
        "steps": steps,
        "round1_steps": costs[0]["steps"],
        "bytes_down_per_silo": median_of(steady, "down_mean"),
        "bytes_up_per_silo": median_of(steady, "up_mean"),
        "bytes_down_max_silo": median_of(steady, "down_max"),
        "bytes_up_max_silo": median_of(steady, "up_max"),
        "up_vs_fp32": median_of(steady, "up_mean") / (FP32_BYTES * params),
    }


def with_ratios(methods: dict[str, dict[str, Any]], plain: dict[str, Any]) -> None:
    for row in methods.values():
        row["ratio"] = {
            key: row[key] / plain[key]
            for key in (
                "round_seconds",
                "round_cpu_seconds",
                "deployment_estimate_seconds",
                "bytes_down_per_silo",
                "bytes_up_per_silo",
            )
        }


def methods_for(silos: int, wanted: tuple[str, ...]) -> tuple[str, ...]:
    """The methods to run at `silos` silos: plaintext always, the sparse graph only where it
    is sparse (the policy refuses neighbours >= silos - 1)."""
    return tuple(
        m
        for m in METHODS
        if (m == "none" or m in wanted) and (m != "sparse" or silos - 1 > SPARSE_NEIGHBOURS)
    )


def configuration(
    label: str,
    hidden: list[int],
    silos: int,
    rounds: dict[str, int],
    workload: str = "step",
    rtt: float = 0.0,
) -> dict[str, Any]:
    """The three methods on one (model size, silo count), side by side, with ratios to
    plaintext. Precision: the largest difference from plaintext's global model after each
    round that every method ran; after round 1 it is one aggregation's error alone (the same
    initial model and local training), later rounds add its effect on training."""
    params = count_parameters(
        build_model(bench_policy("none", hidden, 1, 1).model, (FEATURES,), CLASSES, 0)
    )
    outcomes = side_by_side(hidden, silos, rounds, workload, rtt)
    methods = {m: summarize(outcomes[m], silos, params) for m in rounds}
    plain = outcomes["none"]["models"]
    for method, row in methods.items():
        row["rounds"] = rounds[method]
        row["max_abs_diff_vs_plaintext_by_round"] = [
            float((model - plain[r]).abs().max())
            for r, model in sorted(outcomes[method]["models"].items())
            if r <= min(rounds.values())
        ]
        row["max_abs_diff_vs_plaintext"] = row["max_abs_diff_vs_plaintext_by_round"][0]
    del outcomes
    gc.collect()
    with_ratios(methods, methods["none"])
    if "ckks" in methods:
        plain_train = methods["none"]["steps"]["train"]["silo_cpu_seconds_total"] / silos
        encrypt = methods["ckks"]["steps"]["ckks_encrypt"]["silo_cpu_seconds_total"] / silos
        methods["ckks"]["in_round_encrypt_ms_per_1e6"] = (encrypt - plain_train) / params * 1e9
    print(
        f"  {label} x {silos:>2} silos: "
        + ", ".join(f"{m} {row['round_seconds']:.3f} s" for m, row in methods.items()),
        flush=True,
    )
    return {"label": label, "parameters": params, "silos": silos, "methods": methods}


def ckks_costs(params: int) -> dict[str, Any]:
    """CKKS at the policy's default parameters, measured outside the engine."""
    m = measure(CkksParameters(), length=params, silos=2)
    return {
        "parameters": params,
        "encrypt_ms_per_1e6": m.encrypt_seconds / params * 1e9,
        "add_ms_per_1e6_per_silo": m.add_seconds / 2 / params * 1e9,
        "decrypt_ms_per_1e6": m.decrypt_seconds / params * 1e9,
        "expansion_vs_fp32": m.expansion_vs_fp32,
        "max_abs_error_of_sum": m.max_abs_error,
    }


# -- report ----------------------------------------------------------------------------------


def table(rows: list[dict[str, Any]]) -> str:
    columns = (
        ("round s", "round_seconds", 1.0),
        ("cpu s", "round_cpu_seconds", 1.0),
        ("deploy s", "deployment_estimate_seconds", 1.0),
        ("up MB", "bytes_up_per_silo", 1e-6),
        ("down MB", "bytes_down_per_silo", 1e-6),
    )
    header = "".join(f"{name:>9}{'x plain':>8}" for name, _, _ in columns)
    lines = [f"{'params':>9} {'silos':>5} {'method':>7}{header} {'r1 |diff|':>10}"]
    for row in rows:
        for method, m in row["methods"].items():
            cells = "".join(
                f"{m[key] * scale:>9.3f}{m['ratio'][key]:>8.2f}" for _, key, scale in columns
            )
            lines.append(
                f"{row['parameters']:>9,} {row['silos']:>5} {method:>7}{cells} "
                f"{m['max_abs_diff_vs_plaintext']:>10.2e}"
            )
    return "\n".join(lines)


def goal_check(rows: list[dict[str, Any]], goal: dict[str, Any]) -> dict[str, Any] | None:
    """The goal (GOAL with its workload's max_ratio), judged on wall time and on CPU time (both
    must hold), for the complete graph and, beside it, the sparse one."""
    for row in rows:
        if row["label"] == goal["parameters"] and row["silos"] == goal["silos"]:
            judged = {}
            for method in ("masking", "sparse"):
                if method not in row["methods"]:
                    continue
                ratio = row["methods"][method]["ratio"]
                judged[method] = {
                    "ratio": ratio["round_seconds"],
                    "cpu_ratio": ratio["round_cpu_seconds"],
                    "deployment_estimate_ratio": ratio["deployment_estimate_seconds"],
                    "met": max(ratio["round_seconds"], ratio["round_cpu_seconds"])
                    <= goal["max_ratio"],
                }
            return {**goal, **judged.get(goal["method"], {}), "by_method": judged}
    return None


def plot(rows: list[dict[str, Any]], goal: dict[str, Any], title: str) -> plt.Figure:
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.8))
    x = np.arange(len(rows))
    shown = [m for m in METHODS if any(m in r["methods"] for r in rows)]
    width = 0.8 / len(shown)
    colours = {
        "none": "tab:gray",
        "masking": "tab:blue",
        "sparse": "tab:cyan",
        "ckks": "tab:orange",
    }
    for i, method in enumerate(shown):
        present = [j for j, r in enumerate(rows) if method in r["methods"]]
        ms = [rows[j]["methods"][method] for j in present]
        axes[0].bar(
            x[present] + (i - (len(shown) - 1) / 2) * width,
            [m["round_seconds"] for m in ms],
            width,
            label=method,
            color=colours[method],
        )
        if method == "none":
            continue
        at = x[present] + (i - len(shown) / 2) * width
        for axis, key in ((axes[1], "round_seconds"), (axes[2], "bytes_up_per_silo")):
            values = [m["ratio"][key] for m in ms]
            axis.bar(at, values, width, label=method, color=colours[method])
            for xi, v in zip(at, values, strict=True):
                axis.text(
                    xi,
                    v,
                    f"{v:.1f}",
                    ha="center",
                    va="bottom",
                    fontsize=7,
                    zorder=4,
                    bbox={"facecolor": "white", "alpha": 0.7, "linewidth": 0, "pad": 0.5},
                )
        for key, marker, name in (
            ("round_cpu_seconds", ".", "CPU time"),
            ("deployment_estimate_seconds", "_", "deployment estimate"),
        ):
            axes[1].scatter(
                at + 0.3 * width,
                [m["ratio"][key] for m in ms],
                marker=marker,
                s=90,
                color="black",
                zorder=3,
                label=name if method == "masking" else None,
            )
    axes[0].set_ylabel("wall seconds per round (steady state, silos serial)")
    axes[1].set_ylabel("round time / plaintext")
    axes[1].axhline(
        goal["max_ratio"],
        color="tab:red",
        linestyle="--",
        label=f"goal: masking <= {goal['max_ratio']:g}x",
    )
    axes[1].axhline(
        ANCHORS["nvflare_ckks_end_to_end_ratio"],
        color="tab:orange",
        linestyle=":",
        label="NVFLARE CKKS 2.7x (3.5M CNN)",
    )
    axes[2].set_ylabel("bytes sent per silo per round / plaintext")
    axes[2].axhline(
        ANCHORS["tenseal_expansion_vs_fp32"],
        color="tab:orange",
        linestyle=":",
        label="TenSEAL CKKS 20.7x fp32",
    )
    for axis in axes:
        axis.set_xticks(x, [f"{r['label']}\n{r['silos']} silos" for r in rows], fontsize=8)
        axis.set_yscale("log")
    for axis in axes[1:]:
        axis.axhline(1.0, color="tab:gray", linewidth=0.8)
        axis.set_ylim(bottom=0.5)
        axis.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}x"))
        axis.yaxis.set_minor_formatter(NullFormatter())
    for axis in axes:
        axis.set_ylim(top=axis.get_ylim()[1] * 8)  # room for the legend above the bars
        axis.legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Secure aggregation vs plaintext FedAvg: {title}, in-process engine")
    return fig


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--rounds", type=int, default=8, help="rounds of the plaintext and masking runs (>= 2)"
    )
    parser.add_argument("--ckks-rounds", type=int, default=4, help="rounds of the CKKS runs")
    parser.add_argument("--quick", action="store_true", help="small smoke run; writes nothing")
    parser.add_argument("--sizes", help=f"only these model sizes, of {','.join(MODELS)}")
    parser.add_argument("--silos", help="only these silo counts, e.g. 10,20")
    parser.add_argument("--methods", help=f"only these methods (plaintext always), of {METHODS}")
    parser.add_argument(
        "--workload",
        choices=list(WORKLOADS),
        default="step",
        help="step: 32 samples, 1 SGD step on 8 (default); trained: 256 samples, 1 epoch",
    )
    parser.add_argument(
        "--rtt-ms",
        type=float,
        default=0.0,
        help="round-trip delay of the link: every silo call waits this long (default 0)",
    )
    parser.add_argument(
        "--out",
        help="with a filter, another workload or a delay: write bench/results/OUT.json (and "
        ".png) instead of nothing",
    )
    args = parser.parse_args()
    if min(args.rounds, args.ckks_rounds) < 2:
        parser.error("every run needs at least 2 rounds: round 1 is the warm-up")
    if args.rtt_ms < 0:
        parser.error("--rtt-ms: a delay is not negative")
    wanted = tuple(args.methods.split(",")) if args.methods else METHODS
    sizes = args.sizes.split(",") if args.sizes else list(MODELS)
    unknown = sorted({*wanted} - {*METHODS} | {*sizes} - {*MODELS})
    if unknown:
        parser.error(f"unknown size or method: {unknown}")
    filtered = bool(args.sizes or args.silos or args.methods)
    variant = args.workload != "step" or args.rtt_ms > 0  # not the default result file's
    workload, rtt = WORKLOADS[args.workload], args.rtt_ms / 1000
    goal_of = {**GOAL, "max_ratio": workload.max_ratio}
    title = workload.title + (f", link RTT {args.rtt_ms:g} ms" if args.rtt_ms else "")
    load_before = os.getloadavg()
    torch.manual_seed(0)
    torch.set_num_threads(1)  # so that a silo's CPU time is its thread's
    models, silo_counts = (QUICK_MODELS, QUICK_SILOS) if args.quick else (MODELS, SILO_COUNTS)
    if not args.quick:
        models = {label: models[label] for label in sizes}
        silo_counts = tuple(int(n) for n in args.silos.split(",")) if args.silos else silo_counts
    each = {"none": args.rounds, "masking": args.rounds, "sparse": args.rounds}
    each["ckks"] = args.ckks_rounds
    rows = [
        configuration(
            label,
            hidden,
            silos,
            {m: each[m] for m in methods_for(silos, wanted)},
            args.workload,
            rtt,
        )
        for label, hidden in models.items()
        for silos in silo_counts
    ]
    rounds = {m: each[m] for m in wanted}
    ckks = [
        ckks_costs(row["parameters"])
        for row in rows
        if row["silos"] == silo_counts[0] and "ckks" in row["methods"]
    ]
    goal = goal_check(rows, goal_of)
    print(table(rows))
    for c in ckks:
        print(
            f"CKKS, {c['parameters']:,} parameters: encrypt {c['encrypt_ms_per_1e6']:.0f} ms "
            f"per 1e6, expansion {c['expansion_vs_fp32']:.1f}x fp32"
        )
    print(f"anchors: {ANCHORS}")
    print(f"goal: {goal or 'not in this configuration'}")
    figure = plot(rows, goal_of, title)
    if args.quick or ((filtered or variant) and not args.out):
        plt.close(figure)
        return
    path = write(
        args.out if (filtered or variant) else "secagg",
        {
            "settings": {
                "features": FEATURES,
                "workload": args.workload,
                "samples_per_silo": workload.samples,
                "training": workload.training,
                "rtt_ms": args.rtt_ms,
                "link": "each silo call waits rtt_ms (sleep in the wiretap, outside the silo's "
                "timed work): serialized here, so the wall time holds silos x steps of them; "
                "the deployment estimate adds one rtt per step (silos in parallel)",
                "rounds": rounds,
                "steady_state": "median of rounds 2..R; the methods take turns, one round each",
                "precision": "max |model - plaintext's| after round 1 (and by round)",
                "transport": "InProcessTransport: one worker thread, tasks in turn",
                "max_parallel": MAX_PARALLEL,
                "torch_threads": 1,
                "ckks": CkksParameters().__dict__,
                "masking_bound": bench_policy("masking", [1], 1, 1).secure_aggregation.bound,
                "sparse_neighbours": SPARSE_NEIGHBOURS,
                "filter": {"sizes": args.sizes, "silos": args.silos, "methods": args.methods}
                if filtered
                else None,
            },
            "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
            "load_average_1min": {"start": load_before[0], "end": os.getloadavg()[0]},
            "anchors": ANCHORS,
            "goal": goal,
            "ckks_measured": ckks,
            "rows": rows,
        },
        figure,
    )
    print(f"wrote {path} and {path.with_suffix('.png')}")


if __name__ == "__main__":
    main()
