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
  algorithm's contract gives the coordinator (`CHOSEN`) is refused by the silo's gate (the
  property of ops/contract_testing.py, which a strategy plug-in's own tests run too);
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
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from fedsilo.ops.contract_testing import (
    Recording,
    draw_mutation,
    record,
)
from fedsilo.policies.algorithms.base import algorithm_classes, names_of
from fedsilo.policies.loading import PolicyError, load_policy, parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.tasks import TASK_KINDS
from fedsilo.wire.messages import TaskResult, versions
from fedsilo.wire.payload import as_payload
from fedsilo.wire.tasks import TASK_CONFIGS, decode_task_config
from fedsilo.wire.tasks.release import Release
from fedsilo.wire.tensors import ParameterSpec, WireError, encode_tensors, index_tensors
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


def example(source: str, method: str) -> Policy:
    """The `source` example policy, two rounds evaluated after each, under `method`."""
    file, settings_ = SOURCES[source]
    document = json.loads(load_policy(EXAMPLES / file).model_dump_json(exclude_unset=True))
    document["algorithm"] |= settings_
    document |= {"rounds": 2, "eval_every": 1, "secure_aggregation": {"method": method}}
    if method != "none" and document["data"].get("scaling") == "federated":
        document["data"] = {**document["data"], "scaling": "local"}  # no secure sum of moments
    return parse_policy(document)


@functools.cache
def recording(source: str, method: str) -> Recording:
    """The honest run of `example(source, method)`, every task recorded as it arrived."""
    return record(example(source, method), EXAMPLES)


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
    drawn = draw_mutation(run, data)
    if drawn is None:
        return
    arrival, mutated, field = drawn
    refused = run.refusal(mutated, arrival.delivered, arrival.holders)
    assert (refused or run.lineage_refusal(mutated)) is not None, (
        f"{arrival.message.task_id}: changing {field} was not refused"
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
