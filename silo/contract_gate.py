"""The silo's check of every task against its own algorithm's contract
(policies/algorithms/contract.py), before anything runs: deny by default. A task passes only
when, by the silo's own signed policy,

- its round and phase are a position of the algorithm (setup's phases in round 0, a round's
  within the policy's rounds, evaluation only after an evaluation round) and its id is the one
  that position's task has (`wire/messages.py: task_id`), so each position is answered once
  and a scalar report is released once per position, the allowance that bounds an oracle;
- its kind is the phase's, or a step of the policy's secure aggregation wrapping the phase's
  kind when the phase is a weighted mean (and only then), or a hand-off's step in a phase
  that hands models on;
- its config is, key for key, the one the position asks for: every setting derived from the
  policy, and the few the algorithm lets the coordinator choose within their checks (a masked
  input's inner task, its summed tensors, the next aggregation its unmask step folds keys
  for, a CKKS sum's length, included);
- its tensors are exactly the ones the position carries, each of the shape and dtype the
  silo's own model and data schema give (a secure sum's references all zeros or the model
  where the protocol says so), and its parameter spec, if any, is the silo's model's;
- a position that trains a model handed on earlier in the round (a cyclic visit) finds that
  hand-off delivered: the silo never trains, for the coordinator to see, a model no member
  handed it (hand-offs are signed by their sender: privacy/handoff.py); a silo takes one
  cyclic visit a round, recorded in its aggregation log; and a FedDC silo puts into a secure
  sum only a hosted model that descends from the sum's reference (its root);
- a sealed hand-off goes to none of the hosted model's last `no_return_window` holders the
  silo knows of (the member that handed it on, those that member's signed hand-off names,
  those this silo sealed it to while keeping it), and a hosted model is sealed to one member
  a round (a second sealed copy would let its two holders difference each other's next
  hand-offs), recorded in the aggregation log.

What the protocols choose per aggregation (advertisements, shares, survivors, signatures,
weights, key holders) is checked by the steps' handlers (silo/tasks/secure_sum.py,
ckks_sum.py); which task kinds may send what under the policy, by silo/release_gate.py.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fedsilo.policies.algorithms.contract import (
    ContractError,
    PhaseRule,
    Position,
    SiloFacts,
    TensorRule,
    return_window,
    routed_receive,
)
from fedsilo.silo.aggregation_log import StepAlreadyTaken, aggregation_log
from fedsilo.silo.tasks.base import SiloContext, model_digest
from fedsilo.wire.messages import TASK_STEPS, TaskMessage, task_id
from fedsilo.wire.tasks import (
    CkksDecrypt,
    EncryptedInput,
    Handoff,
    MaskedInput,
    SecAggUnmask,
    TaskConfig,
)
from fedsilo.wire.tasks.tensor_names import (
    CHUNK,
    CONFIRMATION,
    CONTRIBUTION,
    HANDOFF,
    LINEAGE,
    MODEL,
    SEALED_CONTEXT,
)
from fedsilo.wire.tensors import TensorsOnDemand, read_only

PROTOCOL_OF = {kind: "masking" for kind in TASK_STEPS if kind.startswith("secagg_")} | {
    kind: "ckks" for kind in TASK_STEPS if kind.startswith("ckks_")
}
HANDOFF_STEPS = ("daisy_receive",)


def refusal(message: TaskMessage, ctx: SiloContext) -> str | None:
    """Why `message` is outside the silo's contract, or None when it is the task its position
    asks for."""
    try:
        check(message, ctx)
    except ContractError as exc:
        return f"{ctx.algorithm.name} asks no such task: {exc}"
    return None


def check(message: TaskMessage, ctx: SiloContext) -> None:
    facts = ctx.facts
    rule, position = ctx.contract.position(message.round, message.phase, ctx.name, facts)
    kind = message.kind
    expected = task_id(ctx.deployment, message.round, message.phase, TASK_STEPS.get(kind), ctx.name)
    if message.task_id != expected:
        raise ContractError(f"its id is {message.task_id!r}; this position's task is {expected!r}")
    if message.spec is not None and message.spec != facts.spec:
        raise ContractError("its parameter spec is not this silo's model's")
    protocol = PROTOCOL_OF.get(kind)
    if protocol is not None:
        _check_secure_step(message, rule, position, ctx, protocol)
    elif kind in HANDOFF_STEPS:
        _check_handoff_step(message, rule, ctx)
    else:
        if kind != rule.kind:
            raise ContractError(f"phase {message.phase!r} sends {rule.kind} tasks, not {kind}")
        method = ctx.secure_aggregation.method
        if rule.sums and method != "none":
            raise ContractError(
                f"phase {message.phase!r} is a weighted mean, which this silo's policy takes "
                f"under secure_aggregation {method}: its {kind} task comes wrapped in that protocol"
            )
        _check_config(message.config, rule.expected(message.config, position, facts))
        _check_tensors(message.tensors, rule.tensors(message.config, position, facts), ctx)
        _check_handed(rule, position, ctx)
        if rule.routed:
            adopting = bool(getattr(message.config, "adopt", False))
            _check_seal(getattr(message.config, "handoff", None), adopting, position, ctx)
        if rule.slot is not None:
            _take_once(rule.slot, position, ctx)


def _check_root(message: TaskMessage, ctx: SiloContext) -> None:
    """A hosted model goes into a secure sum only if it descends from the sum's reference:
    otherwise a coordinator could first have the other silos adopt models whose training says
    nothing (in a phase with no sum), then sum them with the target's honest one."""
    if ctx.store.hosted.root != model_digest(read_only(message.tensors, MODEL)):
        raise ContractError(
            "the model this silo hosts does not descend from the sum's reference (it was adopted "
            "from, or handed on from a silo that adopted, another model)"
        )


def _take_once(slot: str, position: Position, ctx: SiloContext) -> None:
    """One position of a slot a round (a cyclic visit: a silo in two cycles of one round would
    let their answers be differenced; FedDC's one local step a round, trained twice would cost
    twice the planned budget), recorded in the silo's aggregation log."""
    label = f"{ctx.deployment}/r{position.round}/{slot}".encode()
    try:
        aggregation_log(ctx).choose(label, position.phase)
    except StepAlreadyTaken as exc:
        raise ContractError(str(exc)) from None


def _check_seal(
    handoff: Handoff | None, adopting: bool, position: Position, ctx: SiloContext
) -> None:
    """A hosted model sealed to a member (`handoff`): never to one of its last
    `no_return_window` holders this silo knows of (empty when the task adopts a model first),
    which would give that member this silo's exact update; and to one member a round, recorded
    in the aggregation log. A plain hand-off names no recipient: the coordinator reads it."""
    if handoff is None or handoff.seal_to is None:
        return
    facts = ctx.facts
    named = [n for n, k in facts.sealing_keys.items() if k == handoff.seal_to and n != ctx.name]
    if not named:
        return  # checked_handoff refuses it
    recipient, window = named[0], return_window(ctx.policy)
    if not adopting and recipient in ctx.store.hosted.holders[:window]:
        raise ContractError(
            f"config key 'handoff' seals the model this silo hosts to {recipient}, one of its "
            f"last {window} holders (algorithm.no_return_window), which would learn this silo's "
            "update from it"
        )
    label = f"{ctx.deployment}/r{position.round}/hand-off".encode()
    try:
        aggregation_log(ctx).choose(label, recipient)
    except StepAlreadyTaken:
        raise ContractError(
            f"this silo sealed the model it hosts to another member in round {position.round} "
            "already; it seals a hosted model to one member a round"
        ) from None


def _check_handed(rule: PhaseRule, position: Position, ctx: SiloContext) -> None:
    """A position that trains the model an earlier phase of the round handed the silo (a
    cyclic visit after the first) needs that hand-off, delivered and not trained since."""
    previous = rule.handed_from(position)
    if previous is not None and ctx.store.hosted.delivered != (position.round, previous):
        raise ContractError(
            f"it trains the model handed to this silo at {previous!r} of round "
            f"{position.round}, and no such hand-off was delivered"
        )


def _check_secure_step(
    message: TaskMessage, rule: PhaseRule, position: Position, ctx: SiloContext, protocol: str
) -> None:
    method = ctx.secure_aggregation.method
    if protocol != method:
        raise ContractError(
            f"{message.kind} belongs to secure_aggregation {protocol}; this silo's policy says "
            f"{method}"
        )
    if not rule.sums:
        raise ContractError(f"phase {message.phase!r} sums nothing; {message.kind} is a sum's step")
    config, facts = message.config, ctx.facts
    if isinstance(config, MaskedInput | EncryptedInput):
        if tuple(config.tensors) != rule.sums:
            raise ContractError(
                f"config key 'tensors' is {list(config.tensors)}; phase {message.phase!r} sums "
                f"{list(rule.sums)}"
            )
        inner = config.inner
        if rule.kind != inner.KIND:
            raise ContractError(
                f"config key 'inner_kind' is {inner.KIND}; phase {message.phase!r} sums the "
                f"results of {rule.kind} tasks"
            )
        _check_config(inner, rule.expected(inner, position, facts), "inner_config")
        carried = rule.tensors(inner, position, facts)
        references = {n: r for n, r in rule.references(facts).items() if n not in carried}
        _check_tensors(message.tensors, carried | references, ctx)
        if rule.from_reference and not getattr(inner, "adopt", False):
            _check_root(message, ctx)
    elif isinstance(config, SecAggUnmask) and config.advertise_next is not None:
        ahead, phase = config.advertise_next, message.phase
        following = ctx.contract.next_aggregation(message.round, phase)
        if (ahead.round, ahead.phase) != (following, phase):
            nearest = "none" if following is None else f"round {following}"
            raise ContractError(
                f"config key 'advertise_next' names round {ahead.round}, phase {ahead.phase!r}; "
                f"keys are folded for the next weighted mean of phase {phase!r} only, which "
                f"this silo's policy makes {nearest}"
            )
        _check_tensors(message.tensors, {})
    elif isinstance(config, CkksDecrypt):
        length = sum(math.prod(r.shape) for r in _summed(rule, ctx).values())
        if config.length != length:
            raise ContractError(
                f"config key 'length' is {config.length}; phase {message.phase!r} sums {length} "
                "values"
            )
        _check_byte_tensors(message.tensors, _signed_inputs(facts), "signed inputs")
    elif message.kind == "ckks_join":
        _check_byte_tensors(message.tensors, lambda name: name == SEALED_CONTEXT, "sealed context")
    else:  # advertise, share, confirm, keygen, CKKS's confirm: their values are the config
        _check_tensors(message.tensors, {})


def _summed(rule: PhaseRule, ctx: SiloContext) -> dict[str, TensorRule]:
    """The tensors a phase sums, each as the silo's answer has it: the model, or the shape of
    its reference."""
    facts = ctx.facts
    references = rule.references(facts)
    return {name: references.get(name, facts.model()) for name in rule.sums}


def _signed_inputs(facts: SiloFacts) -> Callable[[str], bool]:
    members = set(facts.members)

    def named(name: str) -> bool:
        silo, _, part = name.partition("/")
        return silo in members and (part in (CONTRIBUTION, CONFIRMATION) or part.startswith(CHUNK))

    return named


def _check_handoff_step(message: TaskMessage, rule: PhaseRule, ctx: SiloContext) -> None:
    if not rule.routed:
        raise ContractError(f"phase {message.phase!r} hands no model on; {message.kind} does")
    _check_config(message.config, routed_receive(ctx.policy))
    _check_byte_tensors(message.tensors, lambda name: name == HANDOFF, "hand-off", exactly=1)


def _check_config(received: TaskConfig, expected: TaskConfig, where: str = "config") -> None:
    got, want = received.to_json(), expected.to_json()
    if got == want:
        return
    for key in sorted(set(got) | set(want)):
        if key not in want:
            raise ContractError(f"{where} key {key!r} is set; this silo's policy sets none")
        if key not in got:
            raise ContractError(f"{where} key {key!r} is missing; this silo's policy says "
                                f"{_shown(want[key])}")  # fmt: skip
        if got[key] != want[key]:
            raise ContractError(
                f"{where} key {key!r} is {_shown(got[key])}; this silo's policy says "
                f"{_shown(want[key])}"
            )


def _shown(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _check_tensors(
    tensors: Mapping[str, torch.Tensor],
    rules: Mapping[str, TensorRule],
    ctx: SiloContext | None = None,
) -> None:
    """The tensors `rules` name, each as it describes; beside a model, under model lineage
    (`ctx`'s policy), the lineage evidence too, which silo/lineage.py checks."""
    names = set(tensors)
    if ctx is not None and MODEL in rules and ctx.policy.uses_lineage:
        names = {name for name in names if not name.startswith(LINEAGE)}
    if names != set(rules):
        raise ContractError(
            f"it carries tensors {sorted(names)}; this position's task carries {sorted(rules)}"
        )
    chosen: dict[str, int] = {}
    for name, rule in rules.items():
        shape, dtype = _described(tensors, name)
        if not rule.fits(shape, dtype, chosen):
            raise ContractError(
                f"tensor {name!r} is {shape} {str(dtype).removeprefix('torch.')}; this silo's is "
                f"{rule.describe()}"
            )
        if rule.value == "zeros" and bool(read_only(tensors, name).any()):
            raise ContractError(f"tensor {name!r} is a sum's reference, all zeros; it is not")
        if rule.value == "model" and not torch.equal(
            read_only(tensors, name), read_only(tensors, MODEL)
        ):
            raise ContractError(f"tensor {name!r} is a sum's reference, the model sent; it is not")


def _described(tensors: Mapping[str, torch.Tensor], name: str) -> tuple[tuple[int, ...], Any]:
    """A tensor's shape and dtype, from its message's index where it is still unread there
    (no view of its bytes made)."""
    lazy = tensors.unread(name) if isinstance(tensors, TensorsOnDemand) else None
    tensor = lazy if lazy is not None else tensors[name]
    return tuple(tensor.shape), tensor.dtype


def _check_byte_tensors(
    tensors: Mapping[str, torch.Tensor],
    named: Callable[[str], bool],
    what: str,
    exactly: int | None = None,
) -> None:
    """Opaque bytes (sealed boxes, ciphertexts, signatures), one flat uint8 tensor each."""
    for name in tensors:
        shape, dtype = _described(tensors, name)
        if not named(name) or len(shape) != 1 or dtype != torch.uint8:
            raise ContractError(f"tensor {name!r} is none of the {what} this step carries")
    if exactly is not None and len(tensors) != exactly:
        raise ContractError(f"it carries {len(tensors)} tensors; this step carries {exactly}")
