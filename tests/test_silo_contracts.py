"""Every algorithm's silo contract (policies/algorithms/contract.py), held by every silo
(silo/contract_gate.py), as a specification.

For each algorithm, its example policy runs two rounds honestly, in this process, through the
real engine and silo agents built by the simulation's builder (with masking or CKKS where it
averages), and every task a silo received is recorded as it arrived. Then:

- every recorded task passes its silo's contract gate (an honest coordinator is never
  refused);
- every mutation Hypothesis draws of a recorded task (its round, phase or id; the value of a
  config key, of the task a secure sum wraps, or the key itself; its kind; a tensor's shape or
  dtype, a tensor added or dropped; its parameter spec) that changes anything but a field its
  algorithm's contract gives the coordinator (`CHOSEN`) is refused by the silo's gate;
- a field the contract gives the coordinator is refused outside its bounds (`OUT_OF_BOUNDS`);
- weights outside the rules of a secure sum are refused by every silo of a real masked or
  CKKS sum (the weights are checked by the protocols' steps, with the silos' state);
- every answer of a kind whose model leaves masked, encrypted or sealed (a secure sum's steps,
  a hand-off) holds tensors only, as the silo sent it, and an answer of such a kind with a
  report beside its tensors is refused when built and when decoded.
"""

from __future__ import annotations

import functools
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsilo.coordinator.engine import RoundEngine
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.strategies.references import POOLED_SILO, Central
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.sim_silos import ConsortiumKeys, build_agent
from fedsilo.ops.simulate import load_silos
from fedsilo.policies.algorithms.base import algorithm_classes, names_of
from fedsilo.policies.loading import PolicyError, load_policy, parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo import contract_gate, lineage
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import pool
from fedsilo.silo.tasks import TASK_KINDS
from fedsilo.wire.messages import TaskMessage, TaskResult, versions
from fedsilo.wire.payload import as_payload
from fedsilo.wire.tasks import TASK_CONFIGS, decode_task_config
from fedsilo.wire.tasks.release import Release
from fedsilo.wire.tensors import ParameterSpec, TensorSpec, WireError, encode_tensors, index_tensors
from tests.adversarial.rewriting import Consortium, policy
from tests.adversarial.test_deny_by_default import attempt, train_phase, weights_rewritten

EXAMPLES = Path(__file__).parent.parent / "policies" / "examples"

# Each algorithm's example policy, and what two short rounds need to show every phase.
SOURCES: dict[str, tuple[str, dict[str, Any]]] = {
    "fedavg": ("heart-fedavg.yaml", {}),
    "fedprox": ("heart-fedprox.yaml", {}),
    "approx_fedavg": ("heart-approx-fedavg.yaml", {}),
    "fedadam": ("heart-fedadam.yaml", {}),
    "fedyogi": ("heart-fedyogi.yaml", {}),
    "fedadagrad": ("heart-fedadagrad.yaml", {}),
    "central": ("heart-central.yaml", {}),
    "local": ("heart-local.yaml", {}),
    "feddc": ("heart-feddc.yaml", {"aggregation_period": 2}),
    "drfa": ("heart-drfa.yaml", {}),
    "drfa-fedtorch": ("heart-drfa-fedtorch.yaml", {}),
    "drflm": ("heart-drflm.yaml", {}),
    "afl": ("heart-afl.yaml", {}),
    "agnostic_fedavg": ("heart-agnostic-fedavg-by-sex.yaml", {}),
    "qfedavg": ("heart-qfedavg.yaml", {}),
    "term": ("heart-term.yaml", {}),
    "propfair": ("heart-propfair.yaml", {}),
    "aaggff": ("heart-aaggff.yaml", {}),
    "superfed": ("heart-superfed.yaml", {}),
    "fedevg": ("digits-fedevg.yaml", {"samples_per_class": 2, "classifier_epochs": 1}),
    "scaffold": ("heart-scaffold.yaml", {}),
    "cyclic": ("heart-cyclic.yaml", {}),
    "feddro": ("digits-feddro.yaml", {"barycenter_rounds": 1, "support_points": 4}),
    "multiboost": ("heart-multiboost.yaml", {"base_learners": 2}),
}
AVERAGING = [
    name
    for name in SOURCES
    if name not in ("central", "local", "cyclic", "multiboost", "drfa-fedtorch", "agnostic_fedavg")
]
CASES = (
    [(name, "none") for name in SOURCES]
    + [(name, "masking") for name in AVERAGING]
    + [
        ("fedavg", "ckks"),
        ("scaffold", "ckks"),
        ("drfa", "ckks"),
    ]
)

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


def example(source: str, method: str) -> Policy:
    """The `source` example policy, two rounds evaluated after each, under `method`."""
    file, settings_ = SOURCES[source]
    document = json.loads(load_policy(EXAMPLES / file).model_dump_json(exclude_unset=True))
    document["algorithm"] |= settings_
    document |= {"rounds": 2, "eval_every": 1, "secure_aggregation": {"method": method}}
    if method != "none" and document["data"].get("scaling") == "federated":
        document["data"] = {**document["data"], "scaling": "local"}  # no secure sum of moments
    return parse_policy(document)


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


@functools.cache
def recording(source: str, method: str) -> Recording:
    """The honest run of `example(source, method)`, every task recorded as it arrived."""
    p = example(source, method)
    datasets = load_silos(p, EXAMPLES)
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
    assert all(r.status == "completed" for r in history.records), history.records
    return Recording(p, agents, tuple(arrivals), tuple(replies))


@pytest.mark.parametrize(("source", "method"), CASES)
def test_an_honest_coordinators_every_task_passes_its_silos_contract(
    source: str, method: str
) -> None:
    run = recording(source, method)
    kinds = set()
    for arrival in run.arrivals:
        message = arrival.message
        kinds.add(message.kind)
        assert run.refusal(message, arrival.delivered, arrival.holders) is None, message.task_id
    assert kinds, "the run sent no task"


TENSORS_ONLY = sorted(kind for kind, config in TASK_CONFIGS.items() if config.SENDS.tensors_only)


@pytest.mark.parametrize(("source", "method"), CASES)
def test_every_answer_of_a_secure_sums_step_or_a_hand_off_holds_tensors_only(
    source: str, method: str
) -> None:
    """Each answer of the honest run as its silo sent it (its header, not `TaskResult`'s
    reading): one of a kind whose model leaves masked, encrypted or sealed holds no metric and
    no spec, and a count only at the steps that release the training count (advertise, keys
    folded into an unmask answer, a CKKS join)."""
    run = recording(source, method)
    checked = set()
    for reply in run.replies:
        _, header = index_tensors(as_payload(reply))
        config = TASK_CONFIGS.get(header["kind"])
        if header["status"] != "ok" or config is None or not config.SENDS.tensors_only:
            continue
        checked.add(header["kind"])
        assert header["metrics"] == {} and header["spec"] is None, header
        assert config.RELEASES_COUNT or header["num_samples"] == 0, header
    if method != "none" and source in AVERAGING:
        assert {"secagg_mask", "ckks_encrypt"} & checked
    if source in ("feddc", "cyclic"):
        assert "daisy_train" in checked


def test_every_task_kind_declares_what_its_answer_sends() -> None:
    """One list: a kind's config says what its answer sends, for the silo's release gate and
    for `TaskResult` alike; the silo runs no kind the wire does not know."""
    assert set(TASK_KINDS) <= set(TASK_CONFIGS)
    assert all(isinstance(config.SENDS, Release) for config in TASK_CONFIGS.values())
    assert {"secagg_mask", "ckks_encrypt", "daisy_train"} <= set(TENSORS_ONLY)


@settings(max_examples=60, deadline=None, derandomize=True)
@given(
    kind=st.sampled_from(TENSORS_ONLY),
    metrics=st.dictionaries(st.text(min_size=1, max_size=8), st.floats(-1e6, 1e6), max_size=3),
    num_samples=st.integers(0, 10**6),
    with_spec=st.booleans(),
)
def test_an_answer_of_such_a_kind_with_a_report_beside_its_tensors_is_refused(
    kind: str, metrics: dict[str, float], num_samples: int, with_spec: bool
) -> None:
    """Built by a silo or decoded by a coordinator: an answer of a tensors-only kind with a
    metric, a spec or a count its kind does not release is refused, naming the kind."""
    spec = ParameterSpec.of({"w": torch.zeros(2)}) if with_spec else None
    beside = metrics or spec or (num_samples and not TASK_CONFIGS[kind].RELEASES_COUNT)
    header = {
        "type": "result",
        **versions(),
        "task_id": "t",
        "silo": "s",
        "kind": kind,
        "status": "ok",
        "num_samples": num_samples,
        "metrics": metrics,
        "spec": spec.to_json() if spec else None,
        "error": None,
        "compute_seconds": 0.0,
        "epsilon": None,
        "ledger_head": None,
        "receipt": None,
    }
    payload = encode_tensors({"x": torch.zeros(1)}, header)
    if not beside:
        assert list(TaskResult.decode(payload).tensors) == ["x"]
        return
    with pytest.raises(WireError, match=f"a {kind} answer holds tensors only"):
        TaskResult.decode(payload)
    with pytest.raises(WireError, match=f"a {kind} answer holds tensors only"):
        TaskResult("t", "s", kind, num_samples=num_samples, metrics=metrics, spec=spec)


def test_every_algorithm_declares_a_silo_contract_and_is_specified_here() -> None:
    declared = {name for cls in algorithm_classes() for name in names_of(cls)}
    examples = {source: example(source, "none") for source in SOURCES}
    assert {p.algorithm.name for p in examples.values()} == declared
    for p in examples.values():
        contract = p.algorithm.silo_contract(p)
        assert contract.algorithm == p.algorithm.name and contract.rules


# -- mutations ------------------------------------------------------------------------------------


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


def chosen(field: str, kind: str) -> bool:
    """Whether `field` (a key of a `kind` task, or "inner:<kind>:<key>") is the coordinator's."""
    if field.startswith("inner:"):
        _, inner_kind, key = field.split(":", 2)
        return key in CHOSEN.get(inner_kind, frozenset())
    return field in CHOSEN.get(kind, frozenset())


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


@pytest.mark.parametrize(("source", "method"), CASES)
@settings(
    max_examples=60,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much],
)
@given(data=st.data())
def test_a_mutation_of_anything_the_contract_does_not_give_the_coordinator_is_refused(
    source: str, method: str, data: st.DataObject
) -> None:
    run = recording(source, method)
    arrival = data.draw(st.sampled_from(run.arrivals), label="task")
    message = arrival.message
    how = data.draw(st.sampled_from(["config", "header", "tensors", "kind"]), label="mutation")
    if how == "config":
        drawn = data.draw(config_mutation(message))
        if drawn is None or chosen(drawn[1], message.kind):
            return
        mutated, field = drawn
    elif how == "header":
        mutated, field = data.draw(header_mutation(message)), "header"
    elif how == "tensors":
        mutated, field = data.draw(tensor_mutation(message)), "tensors"
    else:
        others = [a.message for a in run.arrivals[:200]]
        mutated, field = data.draw(kind_mutation(message, others)), "kind"
    if mutated is None:
        return
    refused = run.refusal(mutated, arrival.delivered, arrival.holders)
    assert (refused or run.lineage_refusal(mutated)) is not None, (
        f"{message.task_id}: changing {field} was not refused"
    )


# -- what a coordinator chooses, out of bounds ---------------------------------------------------


def refused_config(run: Recording, kind: str, phase: str | None, **changes: Any) -> bool:
    """Whether the silo refuses the first recorded `kind` task (of `phase`) with `changes`."""
    arrival = next(
        a for a in run.arrivals if a.message.kind == kind and phase in (None, a.message.phase)
    )
    message = arrival.message
    try:
        config = decode_task_config(kind, message.config.to_json() | changes)
    except WireError:
        return True
    mutated = replace(message, config=config)
    return run.refusal(mutated, arrival.delivered, arrival.holders) is not None


OUT_OF_BOUNDS: list[tuple[str, str, str, str | None, dict[str, Any]]] = [
    ("an update scale above K", "drfa-fedtorch", "train", None, {"update_scale": 4.5}),
    ("a negative update scale", "drfa-fedtorch", "train", None, {"update_scale": -0.5}),
    ("a NaN update scale", "drfa-fedtorch", "train", None, {"update_scale": math.nan}),
    ("an update scale under drfa's paper variant", "drfa", "train", None, {"update_scale": 1.0}),
    ("a negative domain weight", "agnostic_fedavg", "train", None,
     {"domain_weights": {"female": -1.0, "male": 1.0}}),
    ("every domain weight 0", "agnostic_fedavg", "train", None,
     {"domain_weights": {"female": 0.0, "male": 0.0}}),
    ("domain weights under fedavg", "fedavg", "train", None, {"domain_weights": {"a": 1.0}}),
    ("an edge past the ensemble", "multiboost", "boost_probe", "boost", {"edges": [99]}),
    ("more edges than a silo has classifiers", "multiboost", "boost_probe", "boost",
     {"edges": [0, 1, 2]}),
    ("an edge twice", "multiboost", "boost_probe", "boost", {"edges": [0, 0]}),
    ("a hand-off to a key of no member", "feddc", "daisy_train", "daisy",
     {"handoff": {"seal_to": "ab" * 32}}),
    ("a plain hand-off under sealed hand-offs", "feddc", "daisy_train", "daisy",
     {"handoff": {"plain": True}}),
    ("sending in a feddc daisy phase", "feddc", "daisy_train", "daisy", {"send": True}),
    ("a first cyclic visit that adopts nothing", "cyclic", "daisy_train", "visit_0",
     {"adopt": False}),
    ("a first cyclic visit that sends its model", "cyclic", "daisy_train", "visit_0",
     {"send": True}),
]  # fmt: skip


@pytest.mark.parametrize(
    ("source", "kind", "phase", "changes"),
    [case[1:] for case in OUT_OF_BOUNDS],
    ids=[case[0] for case in OUT_OF_BOUNDS],
)
def test_a_chosen_field_out_of_its_bounds_is_refused(
    source: str, kind: str, phase: str | None, changes: dict[str, Any]
) -> None:
    assert refused_config(recording(source, "none"), kind, phase, **changes)


# -- weights outside a secure sum's rules, against silos in the middle of one -------------------


@st.composite
def bad_weights(draw: st.DrawFn, silos: list[str]) -> dict[str, float]:
    """A weight vector that breaks one rule a secure sum's weights keep."""
    honest = {s: 1 / len(silos) for s in silos}
    rule = draw(st.sampled_from(["stranger", "not finite", "negative", "above 1", "sum", "skew"]))
    target = draw(st.sampled_from(silos))
    if rule == "stranger":
        return honest | {draw(st.text(min_size=1, max_size=6).filter(lambda s: s not in silos)):
                         draw(st.floats(-1, 1))}  # fmt: skip
    if rule == "not finite":
        return honest | {target: draw(st.sampled_from([math.nan, math.inf, -math.inf]))}
    if rule == "negative":
        return honest | {target: -draw(st.floats(1e-6, 1))}
    if rule == "above 1":
        return honest | {target: 1 + draw(st.floats(1e-6, 10))}
    if rule == "sum":
        return {s: draw(st.floats(0.5, 1)) for s in silos}
    return {s: (1.0 if s == target else 0.0) for s in silos}


@pytest.mark.parametrize("method", ["masking", "ckks"])
@settings(max_examples=12, deadline=None, derandomize=True)
@given(data=st.data())
def test_weights_outside_a_secure_sums_rules_are_refused_by_every_silo(
    method: str, data: st.DataObject
) -> None:
    c = Consortium(policy(method))
    weights = data.draw(bad_weights(c.silos))
    model, spec = c.initial_model()
    c.rewrite = weights_rewritten(weights)
    assert attempt(c, train_phase(c, model, spec)) is None
    kind = "secagg_mask" if method == "masking" else "ckks_encrypt"
    assert set(c.refusals(kind)) == set(c.silos), c.refusals()


# -- what no contract can hold a secure sum to ----------------------------------------------------


REFUSED_UNDER_SECURE_SUMS = {
    "drfa's fedtorch variant (a chosen update scale per silo)": (
        {"name": "drfa", "variant": "fedtorch"},
        {"steps": 3},
        "the fedtorch variant scales each silo's update",
    ),
    "agnostic_fedavg over the data's domains (chosen domain weights)": (
        {"name": "agnostic_fedavg", "domains": "data"},
        {},
        "domain weights",
    ),
    "feddc with a client fraction (silos keep models of older aggregates)": (
        {"name": "feddc", "client_fraction": 0.5},
        {"steps": 1},
        "client_fraction 1",
    ),
}


@pytest.mark.parametrize("method", ["masking", "ckks"])
@pytest.mark.parametrize(
    ("algorithm", "training", "message"),
    list(REFUSED_UNDER_SECURE_SUMS.values()),
    ids=list(REFUSED_UNDER_SECURE_SUMS),
)
def test_a_policy_whose_chosen_fields_could_silence_a_secure_sum_is_refused_when_read(
    method: str, algorithm: dict, training: dict, message: str
) -> None:
    """Each of these lets the coordinator choose, per silo or per domain, something that could
    leave one silo's update alone in a sum, and no silo could check it inside a secure sum."""
    document = {
        "version": 1,
        "algorithm": algorithm,
        "training": training,
        "data": {"source": "heart", "domain": "sex"} if "domains" in algorithm else {},
        "channel": {"sealed_handoffs": True} if algorithm["name"] == "feddc" else {},
        "secure_aggregation": method,
    }
    with pytest.raises(PolicyError, match=message):
        parse_policy(document)
    parse_policy(document | {"secure_aggregation": "none"})  # the same without a secure sum
