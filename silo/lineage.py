"""Model lineage, checked by the silo (privacy/lineage.py; docs/secure-aggregation.md): under a
policy that uses it (`Policy.uses_lineage`), a task that carries a model runs only when the
model is the one this silo derives itself, bit for bit:

- before the first aggregation, the model it builds from the policy's seed and model section
  (the `init` task's), with the server optimiser's initial moments; under a warm start
  (`model.init`), whose file only the coordinator reads, the first model it is sent once the
  digest of its tensors, named by this silo's own network, is the one its policy pins;
- after it, the server step of its own policy applied to the state the aggregation's silos
  trained from and to the mean this silo recomputes from the evidence: the advertisements and
  confirmations (at least the consistency threshold of survivors signed the statement binding
  the task they were sent, the state's digest among its tensors), each summed silo's signed
  masked input and each revealer's signed shares.

It also refuses a model derived from an aggregation older than the latest one it unmasked (a
model re-sent after its sum was taken: two sums over the same model, one without this silo,
would give its update) and the initial model once it unmasked any. Nothing here trusts the
coordinator: every fact comes from the silo's policy and roster, or is signed by a member.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch
from nacl.exceptions import BadSignatureError

from fedsilo.models.warm_start import digest_problem, flat_digest
from fedsilo.policies.algorithms.contract import init_config
from fedsilo.policies.algorithms.server_step import initial_state, server_step
from fedsilo.privacy.lineage import (
    LINEAGE_PHASE,
    LineageRecord,
    digest_entry,
    input_statement,
    reveal_statement,
    state_digest,
    state_digest_of,
    task_digest_of,
)
from fedsilo.privacy.masking import (
    Advertisement,
    advertisement_digest,
    aggregation_label,
    consistency_statement,
    signed_by,
    weight_problem,
)
from fedsilo.privacy.unmasking import Held, unmasked_means
from fedsilo.silo.aggregation_log import aggregation_log
from fedsilo.silo.tasks.base import SiloContext, flat_parameters, parameter_spec, tensor_digests
from fedsilo.wire.messages import TaskMessage
from fedsilo.wire.payload import digest_of
from fedsilo.wire.tasks.tensor_names import (
    LINEAGE,
    LINEAGE_INPUT,
    LINEAGE_PRIOR,
    LINEAGE_RECORD,
    LINEAGE_REVEAL,
    LINEAGE_STATE,
    MODEL,
)
from fedsilo.wire.tensors import bytes_tensor, read_only, tensor_bytes

KEEP_STATES = 4  # derived states a silo keeps (an evaluation reads the round's again)


class LineageError(ValueError):
    """A model this silo does not derive; the message names the round and what differs."""


def refusal(message: TaskMessage, ctx: SiloContext) -> str | None:
    """Why `message`'s model is not one this silo derives, or None (no model, or no lineage)."""
    if not ctx.policy.uses_lineage or MODEL not in message.tensors:
        return None
    try:
        check(message, ctx)
    except (ValueError, TypeError, KeyError) as exc:  # LineageError, MaskingError, WireError
        return f"model lineage, round {message.round}: {exc}"
    return None


def check(message: TaskMessage, ctx: SiloContext) -> None:
    """Raise unless the task's model and state digest are those this silo derives."""
    tensors = message.tensors
    if LINEAGE_STATE not in tensors:
        raise LineageError("the model comes without the digest of its server state")
    unmasked = aggregation_log(ctx).last_round(ctx.deployment, LINEAGE_PHASE, "unmask")
    if LINEAGE_RECORD in tensors:
        record = LineageRecord.from_bytes(_bytes(tensors, LINEAGE_RECORD))
        if record.round > message.round:
            raise LineageError(f"the evidence is of round {record.round}, a later one")
        if unmasked is not None and record.round < unmasked:
            raise LineageError(
                f"the model derives from round {record.round}'s aggregation, and this silo "
                f"unmasked round {unmasked}'s since: a model re-sent after its sum was taken"
            )
        source = f"round {record.round}'s aggregation"
        key = _evidence_digest(tensors)
        state = _cached(ctx, key, lambda: _derived(message, ctx, record))
    else:
        if unmasked is not None:
            raise LineageError(
                f"the initial model again, after this silo unmasked round {unmasked}'s aggregation"
            )
        source = "the policy's seed" if ctx.policy.model.init is None else "model.init"
        state = _cached(ctx, b"initial", lambda: _initial(message, ctx))
    for name in sorted(state):  # the model, and SCAFFOLD's control variate
        if name in tensors and not _same(read_only(tensors, name), state[name]):
            raise LineageError(f"the {name} sent is not the one this silo derives from {source}")
    if _bytes(tensors, LINEAGE_STATE) != state_digest(state):
        raise LineageError(
            f"the server state the model is part of is not the one derived from {source}"
        )


def _cached(
    ctx: SiloContext, key: bytes, derive: Callable[[], dict[str, torch.Tensor]]
) -> dict[str, torch.Tensor]:
    states = ctx.store.lineage
    if key not in states:
        states[key] = derive()
        for old in list(states)[:-KEEP_STATES]:
            del states[old]
    return states[key]


def _bytes(tensors: Mapping[str, torch.Tensor], name: str) -> bytes:
    """The bytes a flat uint8 tensor of the evidence carries."""
    tensor = read_only(tensors, name)
    if tensor.dtype != torch.uint8 or tensor.dim() != 1:
        raise LineageError(f"{name!r} is {tensor.dtype} of shape {tuple(tensor.shape)}, not bytes")
    return tensor_bytes(tensor)


def _evidence_digest(tensors: Mapping[str, torch.Tensor]) -> bytes:
    """What a derived state is kept under: the digest of every evidence tensor (a state is
    reused only for the very evidence it was derived and checked from)."""
    digests = tensor_digests(tensors)
    names = sorted(n for n in digests if n.startswith(LINEAGE) and n != LINEAGE_STATE)
    return digest_of([f"{name}|".encode() + digests[name] for name in names])


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit: dtype, shape and bytes."""
    a, b = a.detach().cpu().contiguous(), b.detach().cpu().contiguous()
    return a.dtype == b.dtype and a.shape == b.shape and bool(torch.equal(_bits(a), _bits(b)))


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _initial(message: TaskMessage, ctx: SiloContext) -> dict[str, torch.Tensor]:
    """The state before any aggregation, with initial moments: the `init` task's model, or
    under a warm start the model `message` carries once its digest is the policy's."""
    init = ctx.policy.model.init
    if init is None:
        model = ctx.new_model(init_config(ctx.policy).seed)
        flat = flat_parameters(model, parameter_spec(model)).detach().cpu()
    else:
        flat = read_only(message.tensors, MODEL).detach().cpu().clone()
        sent = flat_digest(flat, ctx.facts.spec)
        problem = digest_problem(init, sent, "the first model this silo was sent")
        if problem is not None:
            raise LineageError(problem)
    return initial_state(ctx.algorithm, flat)


def _derived(
    message: TaskMessage, ctx: SiloContext, record: LineageRecord
) -> dict[str, torch.Tensor]:
    """The state after `record`'s aggregation, from its evidence in `message`, every part of
    it checked."""
    tensors = message.tensors
    received = tensor_digests(tensors)
    if record.phase != LINEAGE_PHASE:
        raise LineageError(f"the evidence is of phase {record.phase!r}, not {LINEAGE_PHASE!r}")
    label = aggregation_label(ctx.deployment, record.round, record.phase)
    adverts = _adverts(record, ctx, label)
    prior = _prior(message, record, ctx)
    secure = ctx.secure_aggregation
    survivors = set(record.survivors)
    problem = weight_problem(
        record.weights,
        None,
        survivors,
        secure.min_group,
        secure.weight_floor(len(survivors)),
        adverts,
    )
    if problem:
        raise LineageError(f"round {record.round}'s weights: {problem}")
    statement = consistency_statement(
        label,
        advertisement_digest(label, adverts),
        record.weights,
        record.survivors,
        task_digest_of(record.kind, record.config, record.spec, record.digests),
    )
    signatures = {s: bytes.fromhex(h) for s, h in record.signatures.items() if s in survivors}
    summed = signed_by(statement, signatures, ctx.roster)
    threshold = secure.consistency_threshold(len(adverts))
    if len(summed) < threshold:
        raise LineageError(
            f"{len(summed)} survivors of round {record.round} signed that they were sent the "
            f"state it derives from; this silo's policy needs {threshold}"
        )
    references = _references(record, prior)
    inputs, dropped = {}, {}
    for silo in sorted(summed):
        masked = {
            name: _input(tensors, f"{LINEAGE_INPUT}{silo}/{name}", references[name])
            for name in record.tensors
        }
        peers = record.peers.get(silo, ())
        digests = {name: received[f"{LINEAGE_INPUT}{silo}/{name}"] for name in record.tensors}
        _verify(ctx, silo, input_statement(label, silo, peers, digests), record.input_signatures)
        inputs[silo] = {name: Held(t) for name, t in masked.items()}
        for peer in peers:
            if peer not in adverts:
                raise LineageError(f"{silo} masked with {peer!r}, which advertised no keys")
            if peer not in summed:
                dropped.setdefault(peer, set()).add(silo)
    revealed = {}
    for silo in sorted(record.reveal_signatures):
        prefix = f"{LINEAGE_REVEAL}{silo}/"
        pieces = {
            name.removeprefix(prefix): read_only(tensors, name)
            for name in tensors
            if name.startswith(prefix)
        }
        digests = {name: received[prefix + name] for name in pieces}
        _verify(ctx, silo, reveal_statement(label, silo, digests), record.reveal_signatures)
        revealed[silo] = {name: tensor_bytes(t) for name, t in pieces.items()}
    mean = unmasked_means(
        label,
        adverts,
        inputs,
        dropped,
        revealed,
        record.weights,
        references,
        secure.bound,
        secure.share_threshold(len(adverts)),
    )
    if not len(summed) <= record.counted <= ctx.consortium:
        raise LineageError(
            f"round {record.round} counts {record.counted} silos active, not between the "
            f"{len(summed)} summed and the {ctx.consortium} of this silo's roster"
        )
    state = server_step(ctx.algorithm, prior, mean, len(summed) / record.counted)
    return {name: t.detach().clone() for name, t in state.items()}


def _adverts(record: LineageRecord, ctx: SiloContext, label: bytes) -> dict[str, Advertisement]:
    adverts = {}
    for silo, hex_advert in sorted(record.adverts.items()):
        if silo not in ctx.roster:
            raise LineageError(f"{silo!r}, in round {record.round}'s sum, is no member")
        advert = Advertisement.from_bytes(silo, bytes.fromhex(hex_advert))
        advert.verify(ctx.roster[silo], label)
        adverts[silo] = advert
    return adverts


def _prior(
    message: TaskMessage, record: LineageRecord, ctx: SiloContext
) -> dict[str, torch.Tensor]:
    """The state the aggregation's silos trained from, checked against the digests of the task
    they signed for: its model's, and its state digest's."""
    tensors = message.tensors
    prior = {
        name.removeprefix(LINEAGE_PRIOR): read_only(tensors, name)
        for name in tensors
        if name.startswith(LINEAGE_PRIOR)
    }
    if MODEL not in prior:
        raise LineageError(f"the evidence of round {record.round} holds no prior model")
    if record.spec != ctx.facts.spec.to_json():
        raise LineageError(f"round {record.round}'s task was for a model of another layout")
    received = tensor_digests(message.tensors)
    digest = bytes_tensor(state_digest_of({n: received[LINEAGE_PRIOR + n] for n in prior}))
    model = digest_entry(prior[MODEL], received[LINEAGE_PRIOR + MODEL])
    if _entry(record, MODEL) != model or _entry(record, LINEAGE_STATE) != digest_entry(digest):
        raise LineageError(f"the prior state is not the one round {record.round}'s silos were sent")
    return prior


def _references(
    record: LineageRecord, prior: Mapping[str, torch.Tensor]
) -> dict[str, torch.Tensor]:
    """What each summed tensor is an update to: the state's tensor of its name (the model),
    else zeros (SCAFFOLD's control change), as the task the silos signed for carried it."""
    references = {}
    for name in record.tensors:
        entry = _entry(record, name)
        if name in prior:
            references[name] = prior[name]
        elif entry is not None and entry[0].startswith("torch."):
            dtype = getattr(torch, entry[0].removeprefix("torch."), None)
            if not isinstance(dtype, torch.dtype):
                raise LineageError(f"{name!r} has no dtype {entry[0]!r}")
            references[name] = torch.zeros(entry[1], dtype=dtype)
        if name not in references or digest_entry(references[name]) != entry:
            raise LineageError(f"the sum's reference for {name!r} is not what the silos were sent")
    return references


def _entry(record: LineageRecord, name: str) -> tuple[str, list[int], str] | None:
    entry = record.digests.get(name)
    return None if entry is None else (entry[0], list(entry[1]), entry[2])


def _input(tensors: Mapping[str, torch.Tensor], name: str, like: torch.Tensor) -> torch.Tensor:
    """A masked input of the evidence: int32, one value per element of the tensor summed."""
    if name not in tensors:
        raise LineageError(f"the evidence lacks {name!r}")
    tensor = read_only(tensors, name)
    if tensor.dtype != torch.int32 or tensor.numel() != like.numel():
        raise LineageError(f"{name!r} is no masked input of {like.numel()} values")
    return tensor


def _verify(ctx: SiloContext, silo: str, statement: bytes, signatures: Mapping[str, str]) -> None:
    """A member's signature over `statement`, or LineageError."""
    if silo not in ctx.roster or silo not in signatures:
        raise LineageError(f"no signature of {silo!r} over what the evidence says it sent")
    try:
        ctx.roster[silo].verify(statement, bytes.fromhex(signatures[silo]))
    except (BadSignatureError, ValueError) as exc:
        raise LineageError(
            f"{silo}'s signature does not cover what the evidence says it sent"
        ) from exc
