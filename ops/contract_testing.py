"""The silo-contract property a strategy plug-in's own tests run (`check_silo_contract`), the
very one fedsilo's tests hold every built-in algorithm to (tests/test_silo_contracts.py).

The policy runs honestly in this process, through the real engine and silo agents built by
the simulation's builder (ops/sim_silos.py), every task recorded as it arrived. Then every
recorded task must pass its silo's contract gate (silo/contract_gate.py), and every mutation
Hypothesis draws of a recorded task (its round, phase or id; a config key's value, the key
itself, or the task a secure sum wraps; its kind; a tensor's shape or dtype, a tensor added or
dropped; its parameter spec) that changes anything but a field the contract gives the
coordinator must be refused by the silo's gates (the contract gate, or the model-lineage gate
for what a masked round's silos derive). Hypothesis is imported when the check runs: plug-in
authors install it with their tests (`pip install 'fedsilo[testing]'`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

from fedsilo.coordinator.engine import RoundEngine
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.strategies.references import POOLED_SILO, Central
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.sim_silos import ConsortiumKeys, build_agent
from fedsilo.ops.simulate import load_silos
from fedsilo.policies.algorithms.contract import chosen_train_options
from fedsilo.policies.schema import Policy
from fedsilo.silo import contract_gate, lineage
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import pool
from fedsilo.wire.messages import TaskMessage
from fedsilo.wire.payload import as_payload
from fedsilo.wire.tasks import decode_task_config
from fedsilo.wire.tensors import ParameterSpec, TensorSpec, WireError

try:
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st
except ImportError as missing:  # an optional dependency: the testing extra
    raise ImportError(
        "fedsilo.check_silo_contract needs Hypothesis: pip install 'fedsilo[testing]'"
    ) from missing


class ContractViolation(AssertionError):
    """A task an honest coordinator sent that its silo refused, or a mutation it accepted."""


# What a contract gives the coordinator to choose, by task kind (and, for a secure sum's
# input, in the task it wraps): every other field of a task is derived by the silo itself.
CHOSEN: dict[str, frozenset[str]] = {
    "train": frozenset({"domain_weights", "update_scale", "cohort"}),
    "daisy_train": frozenset({"adopt", "send", "handoff"}),
    "boost_probe": frozenset({"edges"}),
    "secagg_share": frozenset({"advertisements"}),
    "secagg_mask": frozenset({"weights", "shares"}),
    "secagg_confirm": frozenset({"survivors"}),
    "secagg_unmask": frozenset({"survivors", "signatures", "advertise_next"}),
    "ckks_keygen": frozenset({"recipients"}),
    "ckks_join": frozenset({"key_holder", "context_digest"}),
    "ckks_encrypt": frozenset({"weights"}),
    "ckks_confirm": frozenset({"contributors"}),
    "ckks_decrypt": frozenset({"weights", "contributors"}),
}
# The tensors whose presence the coordinator chooses: a silo's sealed copy of the CKKS context
# (until it holds one), and the signed inputs a decryptor sums (one per contributor chosen).
CHOSEN_TENSORS = ("ckks_join", "ckks_decrypt")
WRAPPERS = ("secagg_mask", "ckks_encrypt")


@dataclass(frozen=True)
class Arrival:
    """A task as it reached its silo, with the pieces of the silo's memory the gate reads: the
    (round, phase) of the hand-off it hosted then, and that model's holders."""

    payload: bytes
    delivered: tuple[int, str] | None
    holders: tuple[str, ...] = ()

    @property
    def message(self) -> TaskMessage:
        return TaskMessage.decode(self.payload)


@dataclass(frozen=True)
class Recording:
    policy: Policy
    agents: Mapping[str, SiloAgent]
    arrivals: tuple[Arrival, ...]
    replies: tuple[bytes, ...]  # every answer, as its silo sent it

    def refusal(
        self,
        message: TaskMessage,
        delivered: tuple[int, str] | None,
        holders: tuple[str, ...] = (),
    ) -> str | None:
        """The gate's verdict on `message` at its silo, with the silo's hosted hand-off (and
        its holders) as it was when the recorded task arrived."""
        agent = self.agents[message.silo]
        agent.context.store.hosted.delivered = delivered
        agent.context.store.hosted.holders = holders
        return contract_gate.refusal(message, agent.context)

    def lineage_refusal(self, message: TaskMessage) -> str | None:
        """The model-lineage gate's verdict (silo/lineage.py), which checks the tensors the
        contract gate leaves to it (the `lineage/` evidence beside a model)."""
        return lineage.refusal(message, self.agents[message.silo].context)


def record(
    p: Policy,
    base_dir: Path | str = ".",
    rewrite: Callable[[TaskMessage], TaskMessage] | None = None,
) -> Recording:
    """The honest run of `p` (its data read relative to `base_dir`) through the real engine and
    silo agents built by the simulation's builder, every task recorded as it arrived at its
    silo, every answer as the silo sent it; `rewrite`: a deviating coordinator's change to each
    task on its way (none: honest)."""
    datasets = load_silos(p, Path(base_dir))
    keys = ConsortiumKeys.generate(d.name for d in datasets)
    silos = {d.name: d for d in datasets}
    strategy = make_strategy(p)
    if isinstance(strategy, Central):
        silos[POOLED_SILO] = pool(datasets)
    agents = {n: build_agent(p, n, d, torch.device("cpu"), keys) for n, d in silos.items()}
    arrivals: list[Arrival] = []
    replies: list[bytes] = []

    def endpoint(name: str) -> Callable[[Any], Any]:
        def call(payload: Any) -> Any:
            data = as_payload(payload).to_bytes()
            if rewrite is not None:
                data = rewrite(TaskMessage.decode(data)).encode()
            hosted = agents[name].context.store.hosted
            arrivals.append(Arrival(data, hosted.delivered, hosted.holders))
            reply = agents[name].handle_bytes(data).to_bytes()
            replies.append(reply)
            return reply

        return call

    engine = RoundEngine(
        strategy,
        InProcessTransport({n: endpoint(n) for n in agents}, max_parallel=1),
        p,
        [d.name for d in datasets],
        handoff_keys={n: bytes(k) for n, k in keys.sealing_roster.items()},
    )
    history = engine.run()
    failed = [r for r in history.records if r.status != "completed"]
    if failed:
        raise ContractViolation(f"the honest run failed: {failed[0]}")
    return Recording(p, agents, tuple(arrivals), tuple(replies))


# -- mutations --------------------------------------------------------------------------------


def other_value(value: Any) -> st.SearchStrategy[Any]:
    """A JSON value other than `value`, mostly of its type."""
    if isinstance(value, bool):
        return st.just(not value)
    if isinstance(value, int):
        return st.one_of(st.integers(-3, 10**6), st.sampled_from([0, -1, 2**40])).filter(
            lambda v: v != value
        )
    if isinstance(value, float):
        return st.one_of(
            st.floats(allow_nan=True, allow_infinity=True), st.sampled_from([0.0, -1.0, 1e9])
        ).filter(lambda v: v != value)
    if isinstance(value, str):
        return st.text(max_size=12).filter(lambda v: v != value)
    if value is None:
        return st.one_of(st.integers(0, 9), st.floats(0, 2), st.text(max_size=4), st.just(True))
    if isinstance(value, list):
        return st.one_of(
            st.just(value[:-1]) if value else st.just([0]),
            st.just([*value, value[0] if value else 1]),
        ).filter(lambda v: v != value)
    if isinstance(value, dict):
        return st.one_of(
            st.just({**value, "ghost": 0.0}),
            st.just(dict(list(value.items())[:-1])) if value else st.just({"x": 1}),
        ).filter(lambda v: v != value)
    return st.nothing()


@st.composite
def config_mutation(draw: st.DrawFn, message: TaskMessage) -> tuple[TaskMessage, str] | None:
    """`message` with one config key (of the task a secure sum wraps, when it wraps one)
    changed, added or removed; None when the new config does not decode (the wire refuses it)."""
    document = message.config.to_json()
    target, kind = document, message.kind
    inner = message.kind in WRAPPERS and draw(st.booleans())
    if inner:
        target, kind = dict(document["inner_config"]), document["inner_kind"]
    keys = sorted(target)
    key = draw(st.sampled_from([*keys, "__added__"])) if keys else "__added__"
    if key == "__added__":
        key = draw(st.sampled_from(["lr", "seed", "epochs", "prox_mu", "split", "weights", "x"]))
        if key in target:
            return None
        target = {**target, key: draw(other_value(None))}
    elif draw(st.integers(0, 9)) == 0:
        target = {k: v for k, v in target.items() if k != key}
    else:
        target = {**target, key: draw(other_value(target[key]))}
    document = {**document, "inner_config": target} if inner else target
    try:
        config = decode_task_config(message.kind, document)
    except WireError:
        return None
    if config.to_json() == message.config.to_json():
        return None
    return replace(message, config=config), key if not inner else f"inner:{kind}:{key}"


def chosen(field: str, kind: str, choices: Mapping[str, frozenset[str]] = CHOSEN) -> bool:
    """Whether `field` (a key of a `kind` task, or "inner:<kind>:<key>") is the coordinator's
    under `choices` (what the contract gives it, by task kind)."""
    if field.startswith("inner:"):
        _, inner_kind, key = field.split(":", 2)
        return key in choices.get(inner_kind, frozenset())
    return field in choices.get(kind, frozenset())


@st.composite
def header_mutation(draw: st.DrawFn, message: TaskMessage) -> TaskMessage:
    which = draw(st.sampled_from(["round", "phase", "task_id", "spec"]))
    if which == "round":
        round_no = draw(st.one_of(st.integers(-2, 6), st.sampled_from([505, 2**31])))
        return replace(message, round=round_no) if round_no != message.round else None
    if which == "phase":
        phases = [
            *("train", "loss", "probe", "evaluate", "aggregate", "daisy", "local", "energy"),
            *("visit_0", "visit_1", "visit_9", "base-0", "base-3", "support", "boost"),
            *("init", "schema", "moments", "standardise", "evaluate_local_test"),
        ]
        phase = draw(st.one_of(st.sampled_from(phases), st.text(max_size=8)))
        return replace(message, phase=phase) if phase != message.phase else None
    if which == "task_id":
        suffix = draw(st.text(min_size=1, max_size=6))
        return replace(message, task_id=message.task_id + suffix)
    spec = message.spec or ParameterSpec((TensorSpec("w", (1,)),))
    entries = list(spec.entries)
    i = draw(st.integers(0, len(entries) - 1))
    entries[i] = TensorSpec(entries[i].name, (*entries[i].shape, 1))
    return replace(message, spec=ParameterSpec(tuple(entries), spec.dtype))


@st.composite
def tensor_mutation(draw: st.DrawFn, message: TaskMessage) -> TaskMessage | None:
    tensors = {n: message.tensors[n] for n in message.tensors}
    how = draw(st.sampled_from(["drop", "add", "reshape", "dtype", "one element"]))
    if how == "drop" and message.kind in CHOSEN_TENSORS:
        return None
    if how == "add" or not tensors:
        name = draw(st.sampled_from(["model", "checkpoint", "control", "extra", "handoff"]))
        if name in tensors:
            return None
        tensors[name] = torch.zeros(draw(st.integers(1, 5)))
        return replace(message, tensors=tensors)
    name = draw(st.sampled_from(sorted(tensors)))
    tensor = tensors[name]
    if tensor.dtype == torch.uint8 and how in ("reshape", "one element"):
        return None  # opaque bytes (a sealed hand-off, a context): their length is their value
    if how == "drop":
        del tensors[name]
    elif how == "reshape":
        tensors[name] = torch.zeros(tensor.numel() + 1, dtype=tensor.dtype)
    elif how == "dtype":
        dtypes = [torch.float64, torch.float16, torch.int64, torch.uint8]
        tensors[name] = tensor.to(draw(st.sampled_from([d for d in dtypes if d != tensor.dtype])))
    else:
        tensors[name] = tensor.reshape(-1)[:1].clone()
        if tensors[name].shape == tensor.shape:
            return None
    return replace(message, tensors=tensors)


@st.composite
def kind_mutation(draw: st.DrawFn, message: TaskMessage, others: list[TaskMessage]) -> Any:
    """`message` carrying another kind's recorded config, or, for a secure sum's input,
    wrapping a task of another kind."""
    other = draw(st.sampled_from(others))
    if other.kind == message.kind:
        return None
    if message.kind in WRAPPERS and draw(st.booleans()) and other.kind not in WRAPPERS:
        if other.config.KIND == message.config.inner.KIND:
            return None
        return replace(message, config=replace(message.config, inner=other.config))
    return replace(message, config=other.config)


def check_silo_contract(
    policy: Policy, base_dir: Path | str = ".", examples: int = 60
) -> Recording:
    """Hold `policy`'s algorithm to its silo contract (see the module's docstring): raise
    `ContractViolation` naming the task when an honest task is refused or a mutation of what
    the contract does not give the coordinator is accepted; the recording otherwise. The
    coordinator's choices are the protocol's (`CHOSEN`) and, in `train` tasks, the
    algorithm's own `chosen_train_options`."""
    run = record(policy, base_dir)
    for arrival in run.arrivals:
        refused = run.refusal(arrival.message, arrival.delivered, arrival.holders)
        if refused is not None:
            raise ContractViolation(
                f"{arrival.message.task_id}: an honest task is refused: {refused}"
            )
    choices = {**CHOSEN, "train": CHOSEN["train"] | set(chosen_train_options(policy))}

    @settings(
        max_examples=examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
    )
    @given(data=st.data())
    def mutations(data: st.DataObject) -> None:
        drawn = draw_mutation(run, data, choices)
        if drawn is None:
            return
        arrival, mutated, field = drawn
        refused = run.refusal(mutated, arrival.delivered, arrival.holders)
        if (refused or run.lineage_refusal(mutated)) is None:
            raise ContractViolation(f"{arrival.message.task_id}: changing {field} was not refused")

    mutations()
    return run


def draw_mutation(
    run: Recording, data: st.DataObject, choices: Mapping[str, frozenset[str]] = CHOSEN
) -> tuple[Arrival, TaskMessage, str] | None:
    """A recorded arrival and a mutation of its task that changes something `choices` does not
    give the coordinator, with what it changed (None: the draw made none)."""
    arrival = data.draw(st.sampled_from(run.arrivals), label="task")
    message = arrival.message
    how = data.draw(st.sampled_from(["config", "header", "tensors", "kind"]), label="mutation")
    if how == "config":
        drawn = data.draw(config_mutation(message))
        if drawn is None or chosen(drawn[1], message.kind, choices):
            return None
        mutated, field = drawn
    elif how == "header":
        mutated, field = data.draw(header_mutation(message)), "header"
    elif how == "tensors":
        mutated, field = data.draw(tensor_mutation(message)), "tensors"
    else:
        others = [a.message for a in run.arrivals[:200]]
        mutated, field = data.draw(kind_mutation(message, others)), "kind"
    return None if mutated is None else (arrival, mutated, field)
