"""Rounds over bandwidth-limited links: fedsilo and Flower side by side on a shaped star, each
round's time over the limit its link sets.

Each configuration (model size x silo count x link rate) runs in a star of network namespaces
made by bench/netns.py: the coordinator and every silo in a namespace of its own, each link
shaped to the rate in both directions. The workload is bench/transport.py's (an MLP, FedAvg,
one local SGD step, real processes over mutual TLS; Flower 1.41's legacy gRPC transport with
server-authenticated TLS, `make flower-env`), run in turn, fedsilo first, `--repeats` times.

The limit of a round (`bound_seconds`) is what physics leaves a synchronous round on a star:
the coordinator's link is the busiest, and carries S models of M bytes down and S updates of M
bytes up. The last silo to have its model has it no earlier than S model-times of the link
after the round starts, then trains, then sends its update, one model-time more, so

    bound = (S + 1) * M / rate + slowest silo's training + RTT * trips

with M = 4 bytes a parameter (what the protocol must move: the float32 model, no framing), the
round trips of one round's exchange (`ROUND_TRIPS`) and the round trip measured between the
namespaces. Each system's bound uses its own measured training time. Only a broadcast sent one
silo after the other reaches it (the first silos train and answer while later ones download).
A broadcast sent to every silo at once shares the downlink, every model arrives at its end,
and the uplink idles until then: its limit, 2 * S * M / rate + training + RTT * trips, is
reported beside it (`side_by_side_bound_seconds`).

fedsilo runs in each mode of `--sends` (the coordinator's `--sends`: `concurrent` or
`staggered`, coordinator/staggered_sends.py), Flower as it is (side by side).

Per row: both systems' median round seconds and their ratios over the bound (medians, and each
repeat's value under `*_runs`), fedsilo over Flower, the bytes on the coordinator's link (every
byte the veth carried: Ethernet, IP, TCP, TLS, HTTP/2 and the payload) over the protocol's
bytes, fedsilo's payload counter, each party's CPU a round, and the coordinator's and largest
silo's peak RSS.

Run as root: `python -m bench.links [--sizes 1e6,1e7,1e8] [--silos 3,10] [--rates 100,1000]
[--rounds 3] [--repeats 3] [--out links] [--policy-extra YAML]`. `--policy-extra` merges a YAML
mapping into fedsilo's policy (`'{compression: {bits: 8}}'`); Flower runs as it is.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import matplotlib.pyplot as plt
import psutil
import yaml

from bench.common import write
from bench.flower_peer import hidden_width, parameter_count
from bench.flower_runner import FlowerFailed, flower_python, run_flower
from bench.netns import Star, link_problem, shaped_star
from bench.transport import cpu_per_round, cpu_seconds, peak_rss, rounds_saved, write_site
from fedsilo.coordinator.staggered_sends import SEND_MODES
from fedsilo.ops.demo import DemoFailed, LocalConsortium


class RunFailed(RuntimeError):
    """A run ended without its rounds; the message names its logs."""


# One request and its answer per silo a round: the task goes down, the update comes up.
ROUND_TRIPS = 1
GOAL_OVER_BOUND = 1.15


def bound_seconds(
    model_bytes: int, silos: int, rate_mbit: float, train_s: float, rtt_s: float
) -> dict[str, float]:
    """The round's limit on a star whose every link carries `rate_mbit` each way, and the
    limit of a broadcast sent side by side (see the module's docstring)."""
    one_model = model_bytes * 8 / (rate_mbit * 1e6)
    trips = ROUND_TRIPS * rtt_s
    return {
        "bound_seconds": (silos + 1) * one_model + train_s + trips,
        "side_by_side_bound_seconds": 2 * silos * one_model + train_s + trips,
    }


def run_fedsilo(
    star: Star, root: Path, parameters: float, rounds: int, sends: str, extra: dict
) -> dict[str, float]:
    """One fedsilo job on `star`, its coordinator sending in mode `sends`; its round time,
    bytes, CPU and memory."""
    names = [f"s{i}" for i in range(star.silos)]
    consortium, port = LocalConsortium.provision(root, "links", names, host=star.coordinator_ip)
    consortium.launchers = {"coordinator": star.run_in(star.coordinator, [])}
    consortium.launchers |= {name: star.run_in(star.silo(i), []) for i, name in enumerate(names)}
    policy = {
        "version": 1,
        "name": "links-bench",
        "rounds": rounds,
        "eval_every": rounds,
        "algorithm": {"name": "fedavg"},
        "model": {"name": "mlp", "hidden": [hidden_width(parameters)]},
        "training": {"steps": 1, "batch_size": 64, "lr": 0.01},
        "participants": {"min_silos": star.silos, "phase_timeout_s": 3600},
        "compute": {"device": "cpu"},
    } | extra
    (root / "policy.yaml").write_text(yaml.safe_dump(policy))
    consortium.sign_policy(root / "policy.yaml")
    for i, name in enumerate(names):
        write_site(root, name, i)
    metrics_port = 9400
    sent_before, received_before = star.coordinator_link_bytes()
    try:
        consortium.start_coordinator(
            metrics_port,
            0.5,
            "--linger-seconds",
            "3600",
            "--max-payload-mb",
            "4096",
            "--sends",
            sends,
        )
        for name in names:
            consortium.start_silo(name, root / "sites" / name / "silo.yaml", 0.5)
        rtt = _round_trip(star, port)
        spans: list[tuple[int, dict[str, float]]] = []
        link: list[int] = []  # the coordinator link's bytes at each span
        history_file = root / "results" / "history.json"
        while (now := rounds_saved(root / "state.db")) < rounds:
            if history_file.exists():  # the job ended short of its rounds
                raise RunFailed(f"fedsilo completed {now} of {rounds} rounds; see {root}/logs")
            consortium.check()
            if now >= 1 and (not spans or spans[-1][0] != now):
                spans.append((now, cpu_seconds(consortium.processes)))
                link.append(sum(star.coordinator_link_bytes()))
            time.sleep(0.05)
        while not history_file.exists():
            consortium.check()
            time.sleep(0.2)
        peaks = {name: peak_rss(p.pid) for name, p in consortium.processes.items()}
        payload = _payload_bytes(star, metrics_port)
        sent, received = star.coordinator_link_bytes()
    finally:
        consortium.stop()
    history = json.loads(history_file.read_text())["rounds"]
    return {
        "round_seconds": statistics.median(r["seconds"] for r in history),
        "train_seconds": statistics.median(
            max(r["compute_seconds"]["train"].values()) for r in history
        ),
        "rtt_seconds": rtt,
        "link_bytes": sent - sent_before + received - received_before,
        "payload_bytes": payload,
        **_link_bytes_per_round(spans, link),
        "coordinator_peak_rss_bytes": peaks["coordinator"],
        "silo_peak_rss_bytes": max(peaks[name] for name in names),
        **cpu_per_round(spans, names),
    }


def _link_bytes_per_round(spans: list[tuple[int, dict]], link: list[int]) -> dict[str, float]:
    """The coordinator link's bytes a round between the first and the last round seen
    passing (no start-up, joins or final evaluation)."""
    if len(spans) < 2 or spans[-1][0] == spans[0][0]:
        return {}
    return {"link_bytes_per_round": (link[-1] - link[0]) / (spans[-1][0] - spans[0][0])}


def run_flower_on(star: Star, root: Path, parameters: float, rounds: int) -> dict | None:
    """The same workload under Flower on `star`; None without Flower's interpreter."""
    sent_before, received_before = star.coordinator_link_bytes()

    def inside(name: str) -> list[str]:
        if name == "server":
            return star.run_in(star.coordinator, [])
        return star.run_in(star.silo(int(name.removeprefix("s"))), [])

    peer = run_flower(
        root, parameters, star.silos, rounds, timeout_s=7200, host=star.coordinator_ip,
        inside=inside,
    )  # fmt: skip
    if peer is None:
        return None
    sent, received = star.coordinator_link_bytes()
    return {
        "round_seconds": peer["round_seconds"],
        "train_seconds": peer["round_seconds"] - peer["round_overhead_seconds"],
        "link_bytes": sent - sent_before + received - received_before,
        "coordinator_peak_rss_bytes": peer["server_peak_rss_bytes"],
    }


def _round_trip(star: Star, port: int) -> float:
    """The median TCP handshake between silo 0's namespace and the coordinator's port, once
    the coordinator listens."""
    probe = (
        "import socket, statistics, time\n"
        "deadline = time.monotonic() + 120\n"
        "while True:\n"
        "    try:\n"
        f"        socket.create_connection(({star.coordinator_ip!r}, {port}), timeout=1).close()\n"
        "        break\n"
        "    except OSError:\n"
        "        if time.monotonic() > deadline: raise\n"
        "        time.sleep(0.1)\n"
        "times = []\n"
        "for _ in range(20):\n"
        "    t = time.perf_counter()\n"
        f"    socket.create_connection(({star.coordinator_ip!r}, {port}), timeout=1).close()\n"
        "    times.append(time.perf_counter() - t)\n"
        "print(statistics.median(times))\n"
    )
    out = subprocess.run(
        star.run_in(star.silo(0), [sys.executable, "-c", probe]),
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout)


def _payload_bytes(star: Star, port: int) -> float:
    """fedsilo's payload counter, scraped from inside the coordinator's namespace."""
    scrape = (
        "import urllib.request\n"
        "from prometheus_client.parser import text_string_to_metric_families\n"
        f"text = urllib.request.urlopen('http://127.0.0.1:{port}/metrics', timeout=5).read()\n"
        "print(sum(s.value for f in text_string_to_metric_families(text.decode())\n"
        "          for s in f.samples if s.name == 'fedsilo_bytes_total'))\n"
    )
    out = subprocess.run(
        star.run_in(star.coordinator, [sys.executable, "-c", scrape]),
        capture_output=True,
        text=True,
        check=True,
    )
    return float(out.stdout)


def measure(
    tmp: Path,
    star: Star,
    parameters: float,
    rounds: int,
    repeats: int,
    sends: list[str],
    extra: dict,
) -> dict:
    """One configuration: fedsilo in each mode of `sends`, then Flower, in turn, `repeats`
    times; per system the medians and each repeat's ratio over the bound."""
    count = parameter_count(hidden_width(parameters))
    model_bytes = 4 * count
    runs: list[dict[str, dict]] = []
    failures: list[str] = []
    for repeat in range(repeats):
        tag = f"p{parameters:.0e}-k{star.silos}-r{star.rate_mbit:g}-{repeat}"
        run = {}
        for mode in sends:
            try:
                run[f"fedsilo {mode}"] = run_fedsilo(
                    star, tmp / f"{mode}-{tag}", parameters, rounds, mode, extra
                )
            except (RunFailed, DemoFailed) as exc:
                failures.append(f"fedsilo {mode}, repeat {repeat}: {exc}")
        rtt = statistics.median([m["rtt_seconds"] for m in run.values()] or [0.0])
        try:
            flower = run_flower_on(star, tmp / f"flower-{tag}", parameters, rounds)
        except FlowerFailed as exc:
            failures.append(f"Flower, repeat {repeat}: {str(exc).split(';')[0]}")
            flower = None
        if flower is not None:
            run["Flower"] = flower | {"rtt_seconds": rtt}
        for measured in run.values():
            measured |= bound_seconds(
                model_bytes, star.silos, star.rate_mbit, measured["train_seconds"], rtt
            )
        runs.append(run)
        print(json.dumps({"repeat": repeat, "parameters": count, **run}), flush=True)
    row = {
        "parameters": count,
        "silos": star.silos,
        "rate_mbit": star.rate_mbit,
        "model_bytes": model_bytes,
        "repeats": repeats,
        "systems": {
            system: _summary([run[system] for run in runs], 2 * star.silos * model_bytes, rounds)
            for system in runs[0]
            if all(system in run for run in runs)
        },
    }
    if failures:
        row["failures"] = failures
    if "Flower" in row["systems"]:
        for mode in (m for m in sends if f"fedsilo {m}" in row["systems"]):
            versus = [
                run[f"fedsilo {mode}"]["round_seconds"] / run["Flower"]["round_seconds"]
                for run in runs
            ]
            row["systems"][f"fedsilo {mode}"] |= {
                "round_seconds_over_flower": statistics.median(versus),
                "round_seconds_over_flower_runs": versus,
            }
    return row


def _summary(measured: list[dict], round_bytes: int, rounds: int) -> dict:
    """One system's repeats of a configuration: medians, each repeat's ratio over the bound
    (`over_bound_runs`), and the bytes the coordinator's link carried over the `round_bytes`
    the protocol must move a round (between rounds where measured, else over the whole run)."""
    over = [m["round_seconds"] / m["bound_seconds"] for m in measured]
    summary = {
        key: statistics.median(m[key] for m in measured)
        for key in measured[0]
        if isinstance(measured[0][key], int | float) and all(key in m for m in measured)
    }
    return summary | {
        "over_bound": statistics.median(over),
        "over_bound_runs": over,
        "over_side_by_side_bound": statistics.median(
            m["round_seconds"] / m["side_by_side_bound_seconds"] for m in measured
        ),
        "link_bytes_over_protocol": summary["link_bytes_per_round"] / round_bytes
        if "link_bytes_per_round" in summary
        else summary["link_bytes"] / (round_bytes * rounds),
    }


def _memory_needed(parameters: float, silos: int) -> float:
    """What one configuration's processes hold at once on this machine: each silo its model a
    few times over (parameters, gradients, the received and the sent copy) beside the
    interpreter, and the coordinator its mean and a few copies. The two systems take turns."""
    return silos * (6 * 4 * parameters + 0.4e9) + 4 * 4 * parameters + 0.4e9


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sizes", default="1e6,1e7,1e8")
    parser.add_argument("--silos", default="3,10")
    parser.add_argument("--rates", default="100,1000", help="link rates, Mbit/s")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3, help="runs of each system, alternated")
    parser.add_argument("--out", default="links", help="results name: bench/results/OUT.json")
    parser.add_argument("--sends", default="concurrent,staggered", help="fedsilo's modes")
    parser.add_argument("--policy-extra", default="{}", help="YAML merged into fedsilo's policy")
    args = parser.parse_args(argv)
    problem = link_problem()
    if problem is not None:
        print(f"error: {problem}", file=sys.stderr)
        raise SystemExit(1)
    extra = yaml.safe_load(args.policy_extra)
    if not isinstance(extra, dict):
        print("error: --policy-extra: a YAML mapping, such as '{compression: {bits: 8}}'",
              file=sys.stderr)  # fmt: skip
        raise SystemExit(1)
    sizes = [float(s) for s in args.sizes.split(",")]
    sends = args.sends.split(",")
    unknown = [mode for mode in sends if mode not in SEND_MODES]
    if unknown:
        print(f"error: --sends: {unknown} are not among {list(SEND_MODES)}", file=sys.stderr)
        raise SystemExit(1)
    rows, skipped = [], []
    with tempfile.TemporaryDirectory(prefix="fedsilo-links-") as tmp:
        for rate in (float(r) for r in args.rates.split(",")):
            for silos in (int(k) for k in args.silos.split(",")):
                with shaped_star(silos, rate) as star:
                    for size in sizes:
                        needed = _memory_needed(size, silos)
                        if needed > psutil.virtual_memory().available:
                            skipped.append(
                                f"{size:.0e} parameters x {silos} silos: needs ~"
                                f"{needed / 1e9:.0f} GB, "
                                f"{psutil.virtual_memory().available / 1e9:.0f} GB free"
                            )
                            continue
                        row = measure(
                            Path(tmp), star, size, args.rounds, args.repeats, sends, extra
                        )
                        rows.append(row)
                        print(_line(row), flush=True)
    document = {
        "rows": rows,
        "rounds": args.rounds,
        "policy_extra": extra,
        "round_trips": ROUND_TRIPS,
        "sends": sends,
        "goal": {"over_bound_at_1e7_and_above": GOAL_OVER_BOUND, "round_seconds_over_flower": 1},
        "flower": "flwr legacy gRPC, server-authenticated TLS"
        if flower_python()
        else "not measured: make flower-env",
    }
    if skipped:
        document["skipped_for_memory"] = skipped
    path = write(args.out, document, figure(rows))
    print(table(rows))
    print(f"wrote {path} and {path.with_suffix('.png')}")
    return document


def _line(row: dict) -> str:
    if not row["systems"]:
        return f"{row['parameters']:.0e} x {row['silos']}: no system completed: {row['failures']}"
    systems = ", ".join(
        f"{name} {m['round_seconds']:.2f} s ({m['over_bound']:.2f}x)"
        for name, m in row["systems"].items()
    )
    return (
        f"{row['parameters']:.0e} x {row['silos']} at {row['rate_mbit']:g} Mbit/s, bound "
        f"{row['systems'][next(iter(row['systems']))]['bound_seconds']:.2f} s: {systems}"
    )


def table(rows: list[dict]) -> str:
    """The rows as a Markdown table, one line per configuration and system."""
    lines = [
        "| parameters x silos | link | system | round (s) | bound (s) | over bound "
        "| over the side-by-side bound | over Flower |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        for name, m in r["systems"].items():
            spread = f"{min(m['over_bound_runs']):.2f}-{max(m['over_bound_runs']):.2f}"
            versus = "-"
            if "round_seconds_over_flower" in m:
                runs = m["round_seconds_over_flower_runs"]
                versus = f"{m['round_seconds_over_flower']:.2f} ({min(runs):.2f}-{max(runs):.2f})"
            lines.append(
                f"| {r['parameters']:.0e} x {r['silos']} | {r['rate_mbit']:g} Mbit/s | {name} "
                f"| {m['round_seconds']:.2f} | {m['bound_seconds']:.2f} "
                f"| {m['over_bound']:.2f} ({spread}) | {m['over_side_by_side_bound']:.2f} "
                f"| {versus} |"
            )
    return "\n".join(lines)


def figure(rows: list[dict]) -> plt.Figure:
    """Round time over the bound by model size: a panel per link rate, a line per system and
    silo count."""
    rates = sorted({r["rate_mbit"] for r in rows})
    fig, axes = plt.subplots(1, len(rates), figsize=(6.5 * len(rates), 4.5), squeeze=False)
    styles = {"fedsilo staggered": "o-", "fedsilo concurrent": "^:", "Flower": "s--"}
    for ax, rate in zip(axes[0], rates, strict=True):
        for silos in sorted({r["silos"] for r in rows}):
            mine = [r for r in rows if (r["silos"], r["rate_mbit"]) == (silos, rate)]
            systems = sorted({name for r in mine for name in r["systems"]})
            for name in systems:
                points = [
                    (r["parameters"], r["systems"][name]) for r in mine if name in r["systems"]
                ]
                ax.errorbar(
                    [x for x, _ in points],
                    [m["over_bound"] for _, m in points],
                    yerr=[
                        [m["over_bound"] - min(m["over_bound_runs"]) for _, m in points],
                        [max(m["over_bound_runs"]) - m["over_bound"] for _, m in points],
                    ],
                    fmt=styles.get(name, "o-"),
                    capsize=3,
                    label=f"{name}, {silos} silos",
                )
        ax.axhline(GOAL_OVER_BOUND, color="grey", ls=":", label="goal (1.15x)")
        ax.axhline(1.0, color="black", lw=0.8)
        ax.set_xscale("log")
        ax.set_xlabel("parameters")
        ax.set_ylabel("round time / the link's bound")
        ax.set_title(f"every link {rate:g} Mbit/s each way", fontsize=10)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    return fig


if __name__ == "__main__":
    main()
