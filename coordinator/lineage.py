"""The coordinator's side of model lineage (privacy/lineage.py), under a policy whose silos
derive every model they are sent (`Policy.uses_lineage`): every task that carries the model
also carries the digest of the server state it is part of and the evidence of the aggregation
that state derives from, and a masked aggregation of the lineage phase leaves its evidence
(`evidence`). The engine keeps the evidence in the server state, under the `lineage/` names,
so a coordinator resumed from its state file still has it; it never leaves in a final model.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace

import torch

from fedsilo.coordinator.phases import Phase, Task
from fedsilo.coordinator.replies import Accepted
from fedsilo.privacy.lineage import (
    LineageRecord,
    digest_entry,
    digested,
    state_digest,
    state_tensors,
    wrapped_config,
)
from fedsilo.privacy.masking import Advertisement
from fedsilo.wire.tasks.tensor_names import (
    CONFIRMATION,
    INPUT_SIGNATURE,
    LINEAGE,
    LINEAGE_INPUT,
    LINEAGE_PRIOR,
    LINEAGE_RECORD,
    LINEAGE_REVEAL,
    LINEAGE_STATE,
    MODEL,
    REVEAL_SIGNATURE,
    REVEALED_KEY,
    REVEALED_SEED,
    SHARE_TO,
)
from fedsilo.wire.tensors import bytes_tensor, tensor_bytes


def attached(phase: Phase, state: Mapping[str, torch.Tensor]) -> Phase:
    """`phase` with every task that carries the model also carrying the digest of the server
    `state` it is part of and the evidence kept in it (none before the first aggregation)."""
    lineage = {name: t for name, t in state.items() if name.startswith(LINEAGE)}
    lineage[LINEAGE_STATE] = bytes_tensor(state_digest(state_tensors(state)))
    tasks = tuple(
        replace(task, tensors={**task.tensors, **lineage}) if MODEL in task.tensors else task
        for task in phase.tasks
    )
    return replace(phase, tasks=tasks)


def kept(
    state: Mapping[str, torch.Tensor],
    prior: Mapping[str, torch.Tensor],
    evidence: Mapping[str, torch.Tensor] | None,
) -> dict[str, torch.Tensor]:
    """The state after a round: its server state, beside the evidence of the round's
    aggregation with the state its silos trained from (`prior`), or the evidence it had."""
    if evidence is None:
        return dict(state)
    before = {LINEAGE_PRIOR + name: t for name, t in state_tensors(prior).items()}
    return {**state_tensors(state), **evidence, **before}


def evidence(
    round_no: int,
    phase: str,
    adverts: Mapping[str, Advertisement],
    weights: Mapping[str, float],
    survivors: Sequence[str],
    task: Task,
    shared: Mapping[str, Accepted],
    summed: Mapping[str, Accepted],
    confirmed: Mapping[str, Accepted],
    revealed: Mapping[str, Accepted],
    names: Sequence[str],
    counted: int,
) -> dict[str, torch.Tensor]:
    """What lets a silo recompute one masked aggregation: its record, each summed silo's
    signed masked input (`summed`: their masking answers; `confirmed`: their confirmations)
    and each revealer's signed shares; `counted`: the silos the round counts active."""
    tensors: dict[str, torch.Tensor] = {}
    peers, input_signatures = {}, {}
    for silo, reply in sorted(summed.items()):
        for name in names:
            tensors[f"{LINEAGE_INPUT}{silo}/{name}"] = reply.lazy[name].load()
        input_signatures[silo] = tensor_bytes(reply.lazy[INPUT_SIGNATURE].load()).hex()
        peers[silo] = tuple(
            sorted(u for u in shared if u != silo and SHARE_TO + silo in shared[u].result.tensors)
        )
    reveal_signatures = {}
    for silo, reply in sorted(revealed.items()):
        for name, tensor in reply.result.tensors.items():
            if name.startswith((REVEALED_SEED, REVEALED_KEY)):
                tensors[f"{LINEAGE_REVEAL}{silo}/{name}"] = tensor
        reveal_signatures[silo] = tensor_bytes(reply.result.tensors[REVEAL_SIGNATURE]).hex()
    record = LineageRecord(
        round=round_no,
        phase=phase,
        adverts={silo: advert.to_bytes().hex() for silo, advert in adverts.items()},
        weights=dict(weights),
        survivors=tuple(survivors),
        signatures={
            silo: tensor_bytes(reply.result.tensors[CONFIRMATION]).hex()
            for silo, reply in confirmed.items()
        },
        kind=task.config.KIND,
        config=wrapped_config(task.config),
        spec=task.spec.to_json() if task.spec is not None else None,
        digests={name: digest_entry(t) for name, t in task.tensors.items() if digested(name)},
        tensors=tuple(names),
        peers=peers,
        input_signatures=input_signatures,
        reveal_signatures=reveal_signatures,
        counted=counted,
    )
    return {LINEAGE_RECORD: bytes_tensor(record.to_bytes()), **tensors}
