"""The contract between coordinator and silos: a task message and its result.

Each message is one safetensors blob: its tensors, and a JSON header with everything else
(ids, round, task kind, configuration, scalar reports). A task's configuration is its kind's
typed config (wire/tasks/); a header whose config does not read as its kind's is refused with
a `BadTaskConfig` that still names the task. `SiloEndpoint` is what every transport delivers
a task to: a function from an encoded task (bytes, or the payload's parts unjoined, as the
in-process transport hands them over) to an encoded result.

It also holds the protocol version, the rule for mixing versions (at `PROTOCOL_VERSION`), the
header keys that name what a sender speaks (`versions`) and the one line that tells two sides
of different protocols apart (`version_mismatch`).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from fedsilo import __version__
from fedsilo.wire.payload import AnyPayload, Payload, as_payload
from fedsilo.wire.tasks import TASK_CONFIGS, TaskConfig, decode_task_config
from fedsilo.wire.tasks.release import answer_problem
from fedsilo.wire.tensors import (
    LazyTensor,
    ParameterSpec,
    TensorBlock,
    TensorBlocks,
    TensorsOnDemand,
    WireError,
    decode_tensors,
    encode_payload,
    index_tensors,
    tensor_block,
)
from fedsilo.wire.version import PROTOCOL_VERSION

# The deployment a simulation's engine and silos both name when none is given: aggregation
# labels, task ids (so every noise draw) and ledger bookings derive from it, so it is one name.
SIMULATION = "simulation"
# 2: a result is answered with the next task, not an ack; 3: masks are AES-256 keystreams
# read through GCM (privacy/masking.py `_keystream`), not CTR with another counter: silos of
# versions 2 and 3 would make pairwise masks that do not cancel, so they must not meet; 4: an
# unmask task may ask for the next aggregation's keys (`advertise_next`), which a silo of
# version 3 refuses as an unknown key, so the masked rounds of a mixed consortium would fail;
# 5: a silo holds every task to its algorithm's contract (silo/contract_gate.py: task ids name
# their position, a hand-off's own task no step), a masking survivor's statement and a CKKS
# contribution cover the digest of the task they are for, and hand-offs are signed by their
# sender: a silo of version 4 would sign other statements, so the two must not meet; 6: silos
# heartbeat (wire/control.py) and a coordinator takes one silent for its window for gone, so a
# silo of version 5, which never beats, would be a dropout in every round; 7: model lineage
# (privacy/lineage.py): a task that carries the model under masking carries the evidence of
# the last aggregation, which a silo of version 6 refuses as tensors outside its contract, a
# masked input and an unmask answer carry their sender's signature, a task's digest is of its
# tensors' digests (silos of versions 6 and 7 in one sum would sign different statements), and
# an answer of a secure sum's step or a hand-off carries tensors only
#
# Mixing versions: a silo, the operator's admin CLI and a coordinator work together exactly when
# they speak the same protocol version, whatever their fedsilo package versions. So that any two
# releases, past or future, can tell each other apart, the handshake never changes: a message
# crosses in the frames and signed envelope of wire/framing.py and wire/envelope.py; its payload
# is a safetensors message whose JSON header carries "type", "protocol" (this number) and
# "fedsilo" (the sender's package version; fedsilo 0.1.0 and older send none); and a coordinator
# refuses a message of another protocol with the gRPC status FAILED_PRECONDITION, whose details
# are the whole message to show (`version_mismatch`: both sides' protocol and package versions
# and what to upgrade), printed by the other side as they are. These keys, that status and the
# use of its details must never change; everything else may, with the protocol version.
# PROTOCOL_VERSION is in wire/version.py, light for `fedsilo --version`.

SiloEndpoint = Callable[[bytes | AnyPayload], bytes | AnyPayload]

# The steps of a phase that are tasks of their own kind (a secure sum's protocol steps, a
# hand-off's reseal and delivery), by kind: a task id names its step; a phase's own tasks, which
# these steps wrap or follow, name none.
TASK_STEPS: dict[str, str] = {
    "secagg_advertise": "advertise",
    "secagg_share": "share",
    "secagg_mask": "mask",
    "secagg_confirm": "confirm",
    "secagg_unmask": "unmask",
    "ckks_keygen": "keygen",
    "ckks_join": "join",
    "ckks_encrypt": "encrypt",
    "ckks_confirm": "confirm",
    "ckks_decrypt": "decrypt",
    "daisy_receive": "deliver",
}


def task_id(deployment: str, round_no: int, phase: str, step: str | None, silo: str) -> str:
    """The id of `silo`'s task at one position of a deployment: `<deployment>/r<round>/<phase>`,
    then the step when it is one of `TASK_STEPS`, then the silo. The engine names every task so
    and a silo accepts no other name, so a position is answered once (silo/answers.py)."""
    return f"{deployment}/r{round_no}/{phase}" + (f"/{step}" if step else "") + f"/{silo}"


STATUS_OK = "ok"
STATUS_ERROR = "error"
STATUS_BUDGET_EXHAUSTED = "budget_exhausted"  # the silo's privacy budget cannot pay for the task

# A `loss` task with `by_domain` reports, per domain d, these two metrics: the sum of d's rows'
# losses and d's row count.
DOMAIN_LOSS_SUM, DOMAIN_COUNT = "loss_sum", "count"


def schema_metrics(input_shape: tuple[int, ...], classes: int | None) -> dict[str, float]:
    """A `schema` task's answer: one input row's shape and the number of classes (0: a
    regression task)."""
    metrics = {f"input_shape[{i}]": float(side) for i, side in enumerate(input_shape)}
    return metrics | {"classes": float(classes or 0)}


def schema_of(metrics: Mapping[str, float]) -> tuple[tuple[int, ...], int]:
    """The input shape and number of classes a `schema` answer reports."""
    sides = sorted(
        (int(key[len("input_shape[") : -1]), int(value))
        for key, value in metrics.items()
        if key.startswith("input_shape[")
    )
    return tuple(side for _, side in sides), int(metrics["classes"])


def domain_metric(kind: str, domain: str) -> str:
    """The metric name of `kind` (DOMAIN_LOSS_SUM or DOMAIN_COUNT) for `domain`."""
    return f"{kind}[{domain}]"


def domains_in(metrics: Mapping[str, float]) -> set[str]:
    """The domains a result's metrics report a count for."""
    prefix = f"{DOMAIN_COUNT}["
    return {k[len(prefix) : -1] for k in metrics if k.startswith(prefix) and k.endswith("]")}


@dataclass(frozen=True)
class TaskHeader:
    """Who a task is for and under what: everything of a task message but its config and
    tensors (what a silo needs to book the refusal of a task it cannot read)."""

    task_id: str
    round: int
    phase: str
    kind: str
    silo: str
    policy_digest: str = ""


class BadTaskConfig(WireError):
    """A task whose header reads but whose config is not its kind's (or whose kind is
    unknown); `header` names the task."""

    def __init__(self, header: TaskHeader, why: WireError) -> None:
        super().__init__(str(why))
        self.header = header


@dataclass(frozen=True)
class TaskMessage:
    """Work the coordinator asks of one silo: a task of `config.KIND`."""

    task_id: str
    round: int
    phase: str
    silo: str
    config: TaskConfig
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    spec: ParameterSpec | None = None
    policy_digest: str = ""  # the deployment policy this task runs under (policy pinning)

    @property
    def kind(self) -> str:
        return self.config.KIND

    @property
    def header(self) -> TaskHeader:
        return TaskHeader(
            self.task_id, self.round, self.phase, self.kind, self.silo, self.policy_digest
        )

    def encode(self) -> bytes:
        return self.encode_payload(TensorBlocks()).to_bytes()

    def encode_payload(self, blocks: TensorBlocks) -> Payload:
        """The encoded task, sharing its tensor block with every task in `blocks` that carries
        the same tensors (a broadcast model is held once, whatever the number of silos)."""
        header = {
            "type": "task",
            "policy_digest": self.policy_digest,
            **versions(),
            "task_id": self.task_id,
            "round": self.round,
            "phase": self.phase,
            "kind": self.kind,
            "silo": self.silo,
            "config": self.config.to_json(),
            "spec": self.spec.to_json() if self.spec else None,
        }
        return encode_payload(blocks.of(self.tensors), header)

    @classmethod
    def decode(cls, data: bytes | AnyPayload) -> TaskMessage:
        """The task in `data`; its tensors are copied out when first read (`TensorsOnDemand`)."""
        lazy, header = index_tensors(as_payload(data))
        tensors = TensorsOnDemand(lazy)
        h = _checked(header, "task")
        try:
            named = TaskHeader(
                task_id=str(h["task_id"]),
                round=_count(h, "round"),
                phase=str(h["phase"]),
                kind=str(h["kind"]),
                silo=str(h["silo"]),
                policy_digest=str(h["policy_digest"]),
            )
            spec = ParameterSpec.from_json(h["spec"]) if h["spec"] else None
            config = h["config"]
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"malformed task header: {exc}") from exc
        try:
            typed = decode_task_config(named.kind, config)
        except WireError as exc:
            raise BadTaskConfig(named, exc) from exc
        return cls(
            task_id=named.task_id,
            round=named.round,
            phase=named.phase,
            silo=named.silo,
            config=typed,
            tensors=tensors,
            spec=spec,
            policy_digest=named.policy_digest,
        )


@dataclass(frozen=True)
class TaskResult:
    """What a silo returns: tensors, and scalar reports (sample count, metrics, timing). An
    answer of a kind whose model leaves masked, encrypted or sealed holds tensors only (its
    kind's `SENDS`, wire/tasks/release.py): one that carries metrics, a spec or a count its
    kind does not release cannot be built, so a silo cannot send it and a coordinator decodes
    none."""

    task_id: str
    silo: str
    kind: str
    status: str = STATUS_OK
    num_samples: int = 0
    metrics: Mapping[str, float] = field(default_factory=dict)
    tensors: Mapping[str, torch.Tensor] = field(default_factory=dict)
    spec: ParameterSpec | None = None
    error: str | None = None
    compute_seconds: float = 0.0
    epsilon: float | None = None  # the silo's epsilon for the deployment once this is released
    ledger_head: str | None = None  # the silo's ledger head before this release was booked
    # The silo's signed receipt of the booking (privacy/receipts.py), JSON; it is not part of
    # the body the ledger books (the result encoded with `receipt` None).
    receipt: Mapping[str, Any] | None = None

    def __post_init__(self) -> None:
        config = TASK_CONFIGS.get(self.kind)
        if config is not None:
            problem = answer_problem(
                self.kind,
                config.SENDS,
                config.RELEASES_COUNT,
                self.num_samples,
                self.metrics,
                self.spec,
            )
            if problem is not None:
                raise WireError(problem)

    @property
    def ok(self) -> bool:
        return self.status == STATUS_OK

    def encode(self) -> bytes:
        return self.encode_payload(tensor_block(self.tensors)).to_bytes()

    def encode_payload(self, block: TensorBlock) -> Payload:
        """The encoded result around `block`, its tensors' data section: a result encoded
        again with another header (a receipt added) reuses the block instead of copying its
        tensors twice."""
        header = {
            "type": "result",
            **versions(),
            "task_id": self.task_id,
            "silo": self.silo,
            "kind": self.kind,
            "status": self.status,
            "num_samples": self.num_samples,
            "metrics": {k: float(v) for k, v in self.metrics.items()},
            "spec": self.spec.to_json() if self.spec else None,
            "error": self.error,
            "compute_seconds": self.compute_seconds,
            "epsilon": _epsilon_to_json(self.epsilon),
            "ledger_head": self.ledger_head,
            "receipt": None if self.receipt is None else dict(self.receipt),
        }
        return encode_payload(block, header)

    @classmethod
    def decode(cls, data: bytes | AnyPayload) -> TaskResult:
        tensors, header = decode_tensors(data)
        return cls._from(_checked(header, "result"), tensors)

    @classmethod
    def decode_lazily(cls, payload: AnyPayload) -> tuple[TaskResult, dict[str, LazyTensor]]:
        """The result without its tensors, and the tensors still in `payload`, to be read
        slice by slice (how the coordinator aggregates results too large to hold at once)."""
        lazy, header = index_tensors(payload)
        return cls._from(_checked(header, "result"), {}), lazy

    @classmethod
    def _from(cls, h: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> TaskResult:
        try:
            return cls(
                task_id=str(h["task_id"]),
                silo=str(h["silo"]),
                kind=str(h["kind"]),
                status=str(h["status"]),
                num_samples=int(h["num_samples"]),
                metrics={str(k): float(v) for k, v in h["metrics"].items()},
                tensors=tensors,
                spec=ParameterSpec.from_json(h["spec"]) if h["spec"] else None,
                error=h["error"],
                compute_seconds=float(h["compute_seconds"]),
                epsilon=None if h.get("epsilon") is None else float(h["epsilon"]),
                ledger_head=None if h.get("ledger_head") is None else str(h["ledger_head"]),
                receipt=_receipt(h.get("receipt")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise WireError(f"malformed result header: {exc}") from exc


def _count(header: Mapping[str, Any], key: str) -> int:
    """The header's `key`, a non-negative JSON integer: not a bool, a string or a float, which
    `int()` would read as the integer they look like ("1", 1.7, true)."""
    value = header[key]
    if type(value) is not int or value < 0:
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise WireError(f"task header key {key!r} must be a non-negative integer, not {shown}")
    return value


def _epsilon_to_json(epsilon: float | None) -> float | str | None:
    """Infinity as the string "inf" (float() reads it back), so the header stays standard JSON."""
    return "inf" if epsilon == math.inf else epsilon


def _receipt(value: Any) -> Mapping[str, Any] | None:
    if value is not None and not isinstance(value, dict):
        raise TypeError(f"receipt must be a JSON object, not {type(value).__name__}")
    return value


def _checked(header: Mapping[str, Any], expected_type: str) -> Mapping[str, Any]:
    if header.get("type") != expected_type:
        raise WireError(f"expected a {expected_type} message, got {header.get('type')!r}")
    check_protocol(header)
    return header


def versions() -> dict[str, Any]:
    """The header keys naming what the sender speaks: the protocol and its package version."""
    return {"protocol": PROTOCOL_VERSION, "fedsilo": __version__}


def check_protocol(header: Mapping[str, Any]) -> None:
    """WireError unless `header` speaks this protocol version (a JSON integer: not 6.0)."""
    theirs = header.get("protocol")
    if type(theirs) is not int or theirs != PROTOCOL_VERSION:
        raise WireError(
            f"protocol version {header.get('protocol')!r} is not {PROTOCOL_VERSION} "
            "(upgrade one side)"
        )


def version_mismatch(header: Mapping[str, Any], them: str, us: str) -> str | None:
    """The one line that says a message of `them` (e.g. "silo hungary") speaks another protocol
    than this `us` ("coordinator", "silo", "admin CLI"): both sides' protocol and package
    versions, and which side to upgrade (the older). None when `header` speaks this protocol, or
    names none (not a fedsilo message: its own decoding refuses it)."""
    theirs = header.get("protocol")
    if type(theirs) is not int or theirs == PROTOCOL_VERSION:
        return None
    if theirs < PROTOCOL_VERSION:
        upgrade = f"upgrade {them} to fedsilo {__version__} (protocol {PROTOCOL_VERSION})"
    else:
        upgrade = f"upgrade the {us} to a fedsilo release that speaks protocol {theirs}"
    return (
        f"{them} speaks protocol {theirs} ({_release(header.get('fedsilo'))}); "
        f"this {us} speaks protocol {PROTOCOL_VERSION} (fedsilo {__version__}): {upgrade}"
    )


def payload_mismatch(payload: bytes | AnyPayload, them: str, us: str) -> str | None:
    """`version_mismatch` of the payload's header; None also for a payload whose header does not
    read (its own decoding refuses it)."""
    try:
        _, header = index_tensors(as_payload(payload))
    except WireError:
        return None
    return version_mismatch(header, them, us)


_RELEASE = re.compile(r"[0-9A-Za-z.+!_-]{1,40}")  # a package version a mismatch may quote


def _release(named: Any) -> str:
    if named is None:
        return "fedsilo 0.1.0 or older"  # the releases before headers named one
    if isinstance(named, str) and _RELEASE.fullmatch(named):
        return f"fedsilo {named}"
    return "fedsilo of an unreadable version"
