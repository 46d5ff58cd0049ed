"""Model lineage under masking: what lets every silo derive each model it is sent, instead of
taking it from the coordinator (docs/secure-aggregation.md, "Model lineage").

A lineage job's state (the model and the server optimiser's moments) starts as each silo builds
it from the policy's seed and model section, and changes only by the policy's server step
applied to an aggregate the silo recomputed itself: from the survivors' masked inputs, each
signed by its sender (`input_statement`), and the shares the unmasking revealed, each set signed
by its revealer (`reveal_statement`). The coordinator relays these as the aggregation's
evidence (`LineageRecord` and the tensors named in wire/tasks/tensor_names.py) with every task
that carries the model, beside the digest of the state the model is part of (`state_digest`).

A silo that was not in the aggregation takes the state the aggregation's silos trained from
(the evidence's prior) on the word of the consistency check: at least its threshold of
survivors signed a statement binding the task they were sent (`task_digest_of`: its config,
its spec and the digest of every tensor but the evidence, among them this state's digest:
`digested`), and each of them had derived that state itself. This module holds what both ends
compute alike; the silo's checks are silo/lineage.py, the coordinator's evidence
coordinator/lineage.py.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from fedsilo.policies.algorithms.contract import PER_SILO_KEYS
from fedsilo.wire.payload import digest_of
from fedsilo.wire.tasks import TaskConfig
from fedsilo.wire.tasks.tensor_names import LINEAGE, LINEAGE_STATE
from fedsilo.wire.tensors import WireError

# The phase of FedAvg's round whose mean the server step turns into the next state.
LINEAGE_PHASE = "train"


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """A tensor's digest: its dtype, shape and bytes."""
    flat = tensor.detach().to("cpu").contiguous()
    header = f"{str(flat.dtype).removeprefix('torch.')}|{list(flat.shape)}|".encode()
    data = memoryview(flat.reshape(-1).view(torch.uint8).numpy()) if flat.numel() else b""
    return digest_of([header, data])


def state_tensors(tensors: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The server state in `tensors`: every tensor but the lineage evidence kept beside it."""
    return {name: t for name, t in tensors.items() if not name.startswith(LINEAGE)}


def state_digest(state: Mapping[str, torch.Tensor]) -> bytes:
    """The digest of a server state (`state_tensors`): each tensor's name and digest."""
    return state_digest_of({name: tensor_digest(t) for name, t in state.items()})


def state_digest_of(digests: Mapping[str, bytes]) -> bytes:
    """`state_digest` from each tensor's `tensor_digest`, by name."""
    parts = [f"{name}|".encode() + digest for name, digest in sorted(digests.items())]
    return digest_of([b"fedsilo/lineage-state", *parts])


def digested(name: str) -> bool:
    """Whether a task's digest covers its tensor `name`: every tensor but the evidence of
    model lineage, which binds itself (its members' signatures) and whose state it derives the
    task's digest covers (LINEAGE_STATE)."""
    return name == LINEAGE_STATE or not name.startswith(LINEAGE)


def task_digest_of(
    kind: str,
    config: Mapping[str, Any],
    spec: Any,
    digests: Mapping[str, tuple[str, list[int], str]],
) -> bytes:
    """What every silo of one secure sum signs it was sent (silo/tasks/base.py `task_digest`):
    the wrapped task's kind and config (less its per-silo keys), its parameter spec and, per
    tensor, its dtype, shape and digest (hex)."""
    header = {
        "kind": kind,
        "config": dict(config),
        "spec": spec,
        "tensors": {name: list(entry) for name, entry in sorted(digests.items()) if digested(name)},
    }
    return digest_of([b"fedsilo/task|", json.dumps(header, sort_keys=True).encode()])


def wrapped_config(inner: TaskConfig) -> dict[str, Any]:
    """A wrapped task's config as every silo of a sum receives it: less `PER_SILO_KEYS`."""
    return {k: v for k, v in inner.to_json().items() if k not in PER_SILO_KEYS}


def digest_entry(tensor: torch.Tensor, digest: bytes | None = None) -> tuple[str, list[int], str]:
    """A tensor's entry in `task_digest_of`: dtype, shape, digest (`digest`: its
    `tensor_digest`, when already computed)."""
    digest = tensor_digest(tensor) if digest is None else digest
    return str(tensor.dtype), list(tensor.shape), digest.hex()


def input_statement(
    label: bytes, silo: str, peers: Iterable[str], digests: Mapping[str, bytes]
) -> bytes:
    """What a silo signs over its masked input: the aggregation, itself, the silos it masked
    pairwise with and each masked tensor's `tensor_digest`."""
    body = {
        "silo": silo,
        "peers": sorted(peers),
        "tensors": {name: digest.hex() for name, digest in sorted(digests.items())},
    }
    return b"|".join((b"fedsilo/secagg-input", label, json.dumps(body).encode()))


def reveal_statement(label: bytes, silo: str, digests: Mapping[str, bytes]) -> bytes:
    """What a silo signs over the shares it revealed to unmask an aggregation (each one's
    `tensor_digest`)."""
    body = {
        "silo": silo,
        "revealed": {name: digest.hex() for name, digest in sorted(digests.items())},
    }
    return b"|".join((b"fedsilo/secagg-reveal", label, json.dumps(body).encode()))


@dataclass(frozen=True)
class LineageRecord:
    """The public facts of one masked aggregation, as its evidence carries them: its round and
    phase; the signed advertisements (hex); the weights and survivors every survivor signed,
    with their signatures (hex); the task they were sent (`kind`, `config` less per-silo keys,
    `spec`, the tensors' `digests`); each summed silo's pairwise peers and input signature; and
    each revealer's signature over its shares; `counted`: the silos the coordinator counted
    active in the round (SCAFFOLD's N, which a silo bounds by the sum's size and its roster's).
    The tensors themselves travel beside it."""

    round: int
    phase: str
    adverts: Mapping[str, str]
    weights: Mapping[str, float]
    survivors: tuple[str, ...]
    signatures: Mapping[str, str]
    kind: str
    config: Mapping[str, Any]
    spec: Any
    digests: Mapping[str, tuple[str, list[int], str]]
    tensors: tuple[str, ...]  # the names the aggregation summed
    peers: Mapping[str, tuple[str, ...]]
    input_signatures: Mapping[str, str]
    reveal_signatures: Mapping[str, str]
    counted: int

    def to_bytes(self) -> bytes:
        body = {
            "round": self.round,
            "phase": self.phase,
            "adverts": dict(self.adverts),
            "weights": dict(self.weights),
            "survivors": list(self.survivors),
            "signatures": dict(self.signatures),
            "kind": self.kind,
            "config": dict(self.config),
            "spec": self.spec,
            "digests": {k: list(v) for k, v in self.digests.items()},
            "tensors": list(self.tensors),
            "peers": {k: list(v) for k, v in self.peers.items()},
            "input_signatures": dict(self.input_signatures),
            "reveal_signatures": dict(self.reveal_signatures),
            "counted": self.counted,
        }
        return json.dumps(body, sort_keys=True).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> LineageRecord:
        try:
            b = json.loads(data)
            if type(b["round"]) is not int or type(b["counted"]) is not int:
                raise TypeError("round and counted must be integers")
            return cls(
                round=b["round"],
                phase=str(b["phase"]),
                adverts={str(k): str(v) for k, v in b["adverts"].items()},
                weights={str(k): float(v) for k, v in b["weights"].items()},
                survivors=tuple(str(s) for s in b["survivors"]),
                signatures={str(k): str(v) for k, v in b["signatures"].items()},
                kind=str(b["kind"]),
                config=dict(b["config"]),
                spec=b["spec"],
                digests={
                    str(k): (str(v[0]), list(v[1]), str(v[2])) for k, v in b["digests"].items()
                },
                tensors=tuple(str(t) for t in b["tensors"]),
                peers={str(k): tuple(str(p) for p in v) for k, v in b["peers"].items()},
                input_signatures={str(k): str(v) for k, v in b["input_signatures"].items()},
                reveal_signatures={str(k): str(v) for k, v in b["reveal_signatures"].items()},
                counted=b["counted"],
            )
        except (ValueError, KeyError, TypeError, AttributeError, IndexError) as exc:
            raise WireError(f"malformed lineage record: {exc}") from exc
