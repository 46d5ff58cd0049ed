"""Flower's own SecAgg+ against Flower's own plaintext FedAvg round, for bench/flower_secagg.py:
bench/secagg.py's workload at 1e6 parameters run by Flower 1.41 instead of fedsilo.

Runs under Flower's interpreter (FEDSILO_FLOWER_PYTHON; flwr pins protobuf<7 while fedsilo's
stubs need protobuf 7), so it imports neither fedsilo nor bench.common (only bench.turns, which
needs the standard library), and it writes JSON only; it runs from the repository root.

    python -m bench.flower_secagg_peer --rounds R --order plain,secaggplus_sparse,...
        [--workload step|trained] --out F.json

One process, no network: for each method one Flower ServerApp (legacy `LegacyContext` +
`DefaultWorkflow`, as Flower's secure-aggregation example runs it) and ten ClientApps
(`client_fn` returning a NumPyClient as a Client; the SecAgg+ methods add Flower's
`secaggplus_mod`). A hand-written Grid (`Loopback`) delivers each message to its destination
node's ClientApp at once, one client at a time, each node keeping one `Context` for the whole
run (secaggplus_mod keeps its keys and shares in `context.state` from stage to stage). On the
way out and back every message goes through Flower's own deployed encoding: the sender
deflates it into its object tree (SHA-256 object IDs, arrays in chunks), as Flower's grids
push it, and the receiver inflates it again; no broker sits in between. So a round is the
server's work plus the sum of the clients', as in bench/secagg.py (the in-process engine with
max_parallel=1).

Methods:
- plain: `DefaultWorkflow()` (its default fit workflow);
- secaggplus_complete: `DefaultWorkflow(fit_workflow=SecAggPlusWorkflow(num_shares=10,
  reconstruction_threshold=7))`: every client shares with all ten (itself included),
  threshold floor(2n/3)+1 as fedsilo's complete graph;
- secaggplus_sparse: `SecAggPlusWorkflow(num_shares=5, reconstruction_threshold=3)`: four
  neighbours plus itself, as fedsilo's `neighbours: 4`.
Every other SecAgg+ parameter is Flower's default (clipping_range 8, quantization_range 2**22,
modulus_range 2**32, max_weight 1000, no timeout). The strategy is Flower's FedAvg over all
ten clients every round, starting from the same seeded model, with no evaluation
(fraction_evaluate 0, no evaluate_fn).

Workload, as bench/secagg.py's (shapes and work, not the same numbers): an MLP 100 -> 1000 ->
900 -> 2 with ReLU (1,003,702 parameters), numpy normal rows seeded by the client's index
(label: the sign of the sum of the first 20 features), SGD (lr 0.01, cross-entropy) on
minibatches of a permutation drawn from a generator seeded by client and round; torch runs
on one thread, as in bench/secagg.py. `--workload step` (the default): 32 samples per client,
one step on a batch of 8 (the permutation's first 8). `--workload trained`: 256 samples per
client, one epoch in batches of 64 (4 steps), as bench/secagg.py's `--workload trained`.

Timing: the methods' ServerApps run in three threads that take turns, one round each (a
ServerApp works only while it holds the turn, between-round work included), in the order
given by --order, so that load from elsewhere falls on all of them alike. Each method's fit
workflow is wrapped (`Clock`): a round's wall time (perf_counter) and process CPU time
(process_time; the other ServerApps wait meanwhile) are taken around one call of the fit
workflow, i.e. from `configure_fit` through all of its stages to the aggregate stored in the
server's state. Centralized and federated evaluation, both empty here, fall outside. After
each round the global model is kept (outside the timing) to compare with plain's.

F.json holds per method and round the wall and CPU seconds, the messages and the encoded bytes
that went down and up, and the largest difference of the global model from plain's after
each round; also Flower's version, the order, the parameter count and the peak RSS.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from bench.turns import Turns, take_turns

if TYPE_CHECKING:
    import torch
    from flwr.app import Context, Message
    from flwr.serverapp import Grid
    from flwr.supercore.run import Run

METHODS = ("plain", "secaggplus_complete", "secaggplus_sparse")
SHARES = {"secaggplus_complete": (10, 7), "secaggplus_sparse": (5, 3)}  # num_shares, threshold
CLIENTS = 10
FEATURES, HIDDEN, CLASSES = 100, (1000, 900), 2
SAMPLES, INFORMATIVE, BATCH, LR = 32, 20, 8, 0.01  # SAMPLES, BATCH: the "step" workload's
# per workload: samples per client, batch size, steps per round (None: one epoch)
WORKLOADS: dict[str, tuple[int, int, int | None]] = {
    "step": (SAMPLES, BATCH, 1),
    "trained": (256, 64, None),
}
RUN_ID, TASK_ID = 1, 1


def node_id(client: int) -> int:
    return 1001 + client


def mlp() -> torch.nn.Sequential:
    import torch
    from torch import nn

    torch.manual_seed(0)
    layers: list[nn.Module] = []
    for width, hidden in zip((FEATURES, *HIDDEN[:-1]), HIDDEN, strict=True):
        layers += [nn.Linear(width, hidden), nn.ReLU()]
    layers.append(nn.Linear(HIDDEN[-1], CLASSES))
    return nn.Sequential(*layers)


def client_data(client: int, samples: int = SAMPLES) -> tuple[np.ndarray, np.ndarray]:
    x = np.random.default_rng(client).normal(size=(samples, FEATURES)).astype(np.float32)
    return x, (x[:, :INFORMATIVE].sum(axis=1) > 0).astype(np.int64)


def peak_rss_bytes() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmHWM in /proc (Linux only)")


@dataclass
class Traffic:
    """One round's messages, their encoded bytes both ways, the seconds spent encoding and
    decoding them (both ends) and the seconds spent in the ClientApps."""

    messages: int = 0
    down: int = 0
    up: int = 0
    wire_seconds: float = 0.0
    client_seconds: float = 0.0


def over_the_wire(message: Message) -> tuple[Message, int]:
    """`message` as its receiver gets it from Flower's deployed transport, and its encoded
    size: the sender computes the object IDs and deflates every object of the message's tree,
    as Flower's grids and SuperNodes push them; the receiver inflates the tree."""
    from flwr.supercore.inflatable.inflatable_object import (
        get_all_nested_objects,
        no_object_id_recompute,
    )
    from flwr.supercore.inflatable.inflatable_utils import inflate_object_from_contents

    with no_object_id_recompute():
        message_id = message.object_id
        contents = {i: o.deflate() for i, o in get_all_nested_objects(message).items()}
    size = sum(len(c) for c in contents.values())
    received = inflate_object_from_contents(message_id, contents)
    received.metadata.__dict__["_message_id"] = message_id  # as Flower's grids set it
    return received, size


def loopback_grid(clients: dict[int, Any], contexts: dict[int, Context]) -> Grid:
    """A Grid that hands each message to its node's ClientApp at once, one at a time."""
    from flwr.app import Message, RecordDict
    from flwr.serverapp import Grid
    from flwr.supercore.run import Run

    class Loopback(Grid):
        def __init__(self) -> None:
            self._run = Run.create_empty(RUN_ID)
            self._replies: dict[str, Message] = {}
            self.traffic: list[Traffic] = []  # one per round, appended by the Clock

        def set_run(self, run: Run) -> None:
            self._run = run

        @property
        def run(self) -> Run:
            return self._run

        def create_message(
            self,
            content: RecordDict,
            message_type: str,
            dst_node_id: int,
            group_id: str,
            ttl: float | None = None,
        ) -> Message:
            return Message(content, dst_node_id, message_type, ttl=ttl, group_id=group_id)

        def get_node_ids(self) -> list[int]:
            return list(contexts)

        def push_messages(self, messages: Any) -> list[str]:
            ids = []
            for message in messages:
                node = message.metadata.dst_node_id
                started = time.perf_counter()
                received, down = over_the_wire(message)
                delivered = time.perf_counter()
                answer = clients[node](received, contexts[node])
                answered = time.perf_counter()
                reply, up = over_the_wire(answer)
                self._replies[received.metadata.message_id] = reply
                if self.traffic:
                    t = self.traffic[-1]
                    t.messages, t.down, t.up = t.messages + 1, t.down + down, t.up + up
                    t.client_seconds += answered - delivered
                    t.wire_seconds += delivered - started + time.perf_counter() - answered
                ids.append(received.metadata.message_id)
            return ids

        def pull_messages(self, message_ids: Any) -> list[Message]:
            return [self._replies.pop(i) for i in message_ids if i in self._replies]

        def send_and_receive(self, messages: Any, *, timeout: float | None = None) -> list[Message]:
            return self.pull_messages(self.push_messages(messages))

    return Loopback()


@dataclass
class Clock:
    """Wraps a fit workflow: takes the turn, times one round, keeps the global model after it."""

    name: str
    turns: Turns
    fit: Any
    rounds: list[dict[str, float]] = field(default_factory=list)
    models: list[np.ndarray] = field(default_factory=list)
    dtypes: set[str] = field(default_factory=set)  # of the global model after each round

    def __call__(self, grid: Any, context: Any) -> None:
        from flwr.server.workflow.constant import MAIN_PARAMS_RECORD

        if self.rounds:  # the turn is held from the start of the ServerApp (see `deployment`)
            self.turns.pass_on(self.name)
            self.turns.wait(self.name)
        grid.traffic.append(Traffic())
        started, started_cpu = time.perf_counter(), time.process_time()
        self.fit(grid, context)
        cpu, wall = time.process_time() - started_cpu, time.perf_counter() - started
        traffic = grid.traffic[-1]
        self.rounds.append(
            {
                "round": len(self.rounds) + 1,
                "seconds": wall,
                "cpu_seconds": cpu,
                "client_seconds": traffic.client_seconds,
                "wire_seconds": traffic.wire_seconds,
                "server_seconds": wall - traffic.client_seconds - traffic.wire_seconds,
                "messages": traffic.messages,
                "bytes_down": traffic.down,
                "bytes_up": traffic.up,
            }
        )
        arrays = context.state.array_records[MAIN_PARAMS_RECORD].to_numpy_ndarrays()
        self.dtypes.add(str(arrays[0].dtype))
        self.models.append(np.concatenate([a.ravel() for a in arrays]).astype(np.float32))


def minibatches(client: int, fits: int, workload: str) -> list[np.ndarray]:
    """The row indices of each local step of a client's `fits`-th fit under `workload`."""
    samples, batch, steps = WORKLOADS[workload]
    order = np.random.default_rng((client, fits)).permutation(samples)
    batches = [order[start : start + batch] for start in range(0, samples, batch)]
    return batches if steps is None else batches[:steps]


def client_app(method: str, workload: str = "step") -> Any:
    """Ten clients' ClientApp: each node trains its own model on its own data."""
    import torch
    from flwr.client import ClientApp, NumPyClient
    from flwr.client.mod import secaggplus_mod

    samples = WORKLOADS[workload][0]

    class Client(NumPyClient):
        def __init__(self, client: int) -> None:
            self.client, self.fits, self.model = client, 0, mlp()
            x, y = client_data(client, samples)
            self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)

        def fit(self, parameters: list[np.ndarray], config: dict[str, Any]) -> Any:
            for p, received in zip(self.model.parameters(), parameters, strict=True):
                p.detach().numpy()[...] = received
            self.fits += 1
            optimizer = torch.optim.SGD(self.model.parameters(), lr=LR)
            for batch in minibatches(self.client, self.fits, workload):
                optimizer.zero_grad(set_to_none=True)
                loss = torch.nn.functional.cross_entropy(self.model(self.x[batch]), self.y[batch])
                loss.backward()
                optimizer.step()
            return [p.detach().numpy().copy() for p in self.model.parameters()], samples, {}

    nodes = {node_id(c): Client(c) for c in range(CLIENTS)}

    def client_fn(context: Context) -> Any:
        return nodes[context.node_id].to_client()

    return ClientApp(client_fn=client_fn, mods=[secaggplus_mod] if method in SHARES else [])


def deployment(method: str, rounds: int, turns: Turns) -> tuple[Any, Clock]:
    """`method`'s ServerApp (taking turns) and the clock around its fit rounds."""
    from flwr.common import ndarrays_to_parameters
    from flwr.server import LegacyContext, ServerApp, ServerConfig
    from flwr.server.strategy import FedAvg
    from flwr.server.workflow import DefaultWorkflow, SecAggPlusWorkflow

    initial = ndarrays_to_parameters([p.detach().numpy() for p in mlp().parameters()])
    if method in SHARES:
        shares, threshold = SHARES[method]
        workflow = DefaultWorkflow(
            fit_workflow=SecAggPlusWorkflow(num_shares=shares, reconstruction_threshold=threshold)
        )
    else:
        workflow = DefaultWorkflow()
    clock = Clock(method, turns, workflow.fit_workflow)
    workflow.fit_workflow = clock
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        strategy = FedAvg(
            fraction_fit=1.0,
            fraction_evaluate=0.0,
            min_fit_clients=CLIENTS,
            min_evaluate_clients=0,
            min_available_clients=CLIENTS,
            initial_parameters=initial,
        )
        config = ServerConfig(num_rounds=rounds)
        workflow(grid, LegacyContext(context=context, config=config, strategy=strategy))

    return app, clock


def run_all(order: list[str], rounds: int, workload: str = "step") -> dict[str, Clock]:
    """Every method's ServerApp in its own thread, taking turns round by round."""
    from flwr.app import Context, RecordDict
    from flwr.common.constant import SUPERLINK_NODE_ID
    from flwr.supercore.task_identity import TaskIdentity

    # The process's identity, as Flower's ServerApp runner sets it (instruction messages
    # take their run and source node from it; replies take theirs from the instruction).
    TaskIdentity.task_id, TaskIdentity.run_id = TASK_ID, RUN_ID
    TaskIdentity.node_id = SUPERLINK_NODE_ID
    clocks: dict[str, Clock] = {}

    def run(method: str, turns: Turns) -> None:
        app, clocks[method] = deployment(method, rounds, turns)
        contexts = {
            node_id(c): Context(RUN_ID, node_id(c), {}, RecordDict(), {}) for c in range(CLIENTS)
        }
        grid = loopback_grid(dict.fromkeys(contexts, client_app(method, workload)), contexts)
        app(grid, Context(RUN_ID, SUPERLINK_NODE_ID, {}, RecordDict(), {}))

    take_turns(order, run, "flower")
    return clocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, required=True)
    parser.add_argument("--order", default=",".join(METHODS), help="methods, comma-separated")
    parser.add_argument("--workload", choices=list(WORKLOADS), default="step")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    order = args.order.split(",")
    if "plain" not in order or not set(order) <= set(METHODS) or len(set(order)) != len(order):
        parser.error(f"--order: distinct methods of {METHODS}, plain among them")

    import flwr
    import torch
    from flwr.server.workflow import SecAggPlusWorkflow

    defaults = SecAggPlusWorkflow(*SHARES["secaggplus_complete"])
    step = 2 * defaults.clipping_range / defaults.quantization_range
    torch.set_num_threads(1)
    random.seed(0)  # SecAgg+'s shuffle of the clients into neighbourhoods
    clocks = run_all(order, args.rounds, args.workload)
    samples, batch, steps = WORKLOADS[args.workload]
    plain = clocks["plain"].models
    report = {
        "flwr": flwr.__version__,
        "torch_threads": torch.get_num_threads(),
        "order": order,
        "parameters": sum(p.numel() for p in mlp().parameters()),
        "clients": CLIENTS,
        "workload": {
            "features": FEATURES,
            "hidden": list(HIDDEN),
            "classes": CLASSES,
            "name": args.workload,
            "samples_per_client": samples,
            "training": {"batch_size": batch, "lr": LR, "optimizer": "sgd"}
            | ({"epochs": 1} if steps is None else {"steps": steps}),
        },
        "secaggplus_defaults": {
            "clipping_range": defaults.clipping_range,
            "quantization_range": defaults.quantization_range,
            "modulus_range": defaults.modulus_range,
            "max_weight": defaults.max_weight,
        },
        # Each client quantizes (weight / max_weight) x parameters stochastically, one step
        # 2 clipping_range / quantization_range at most; the mean divides the sum of the n
        # clients' by n weight / max_weight: an error below step x max_weight / weight.
        "quantization_error_bound": step * defaults.max_weight / samples,
        "methods": {
            m: {
                "num_shares_threshold": SHARES.get(m),
                "global_model_dtypes": sorted(c.dtypes),
                "rounds": c.rounds,
                "max_abs_diff_vs_plain_by_round": [
                    float(np.abs(model - plain[r]).max()) for r, model in enumerate(c.models)
                ],
            }
            for m, c in clocks.items()
        },
        "peak_rss_bytes": peak_rss_bytes(),
    }
    args.out.write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
