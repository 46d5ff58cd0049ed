"""The silo's side of CKKS secure aggregation (privacy/ckks.py has the cryptography).

- `ckks_keygen`, at the key holder only, once per deployment (again after the key holder or
  the coordinator restarts): a fresh CKKS context under the silo's own policy parameters; its
  public part for the coordinator, and its secret part sealed to each member's X25519 sealing
  key, as provisioning pinned it in every kit (the key holder's own included), and signed by
  the key holder's identity.
- `ckks_join`, every aggregation: open the sealed context relayed by the coordinator, check
  the key holder's signature (the policy's key holder, when it names one) and that it is the
  context the coordinator announces (by the digest of its public part), and release the
  training sample count as the `train` task would release it.
  A silo joins at most one aggregation per (job, round, phase), persisted
  (silo/aggregation_log.py): no second sum of the same round over other silos.
- `ckks_encrypt`: check the whole weight vector (`weights`, the policy's `min_group` and
  `min_weight`), run the real task (`inner_kind`) and send its update (result minus the model
  received) times its own weight, clipped to the policy's bound, encrypted in slot-sized
  chunks, with its signature over (label, context, weights, digest of the chunks).
- `ckks_confirm`, every contributor: sign the set of contributors the coordinator names (this
  silo among them, at least the policy's group, carrying the weights the rule needs) with its
  input's aggregation, context, weights and task digest; one set per (job, round, phase),
  persisted. Without it, the signed inputs of one aggregation could be decrypted twice, by two
  silos, over two sets of contributors, and the two sums differenced.
- `ckks_decrypt`, at the decryptor: given every contributor's chunks, signature and
  confirmation (not a sum the coordinator made, which could hold one input), check each
  signature against the roster, that every contributor confirmed exactly this set of
  contributors (the one the decryptor confirmed itself), that at least the policy's
  `min_group` silos contributed under one weight vector that passes the policy's rule, add
  them, decrypt the sum once per (job, round, phase) (persisted) and return it rounded to a
  grid well above CKKS's approximation error, so the exact decryption (which would let the
  coordinator solve for the secret key, Li and Micciancio 2021) never leaves the silo.

A silo's first `ckks_join` carries its sealed copy of the context; later ones only the digest.
A silo restarted since then holds no context and fails its join, and the coordinator sends
the sealed copy again with the next.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import tenseal as ts
import torch
from nacl.exceptions import BadSignatureError, CryptoError
from nacl.public import PrivateKey
from nacl.signing import SigningKey

from fedsilo.privacy.accounting import Mechanism
from fedsilo.privacy.ckks import (
    CkksError,
    CkksParameters,
    add_encrypted,
    chunk_name,
    context_digest,
    decrypt,
    encrypt,
    load_secret_context,
    new_secret_context,
    open_sealed_context,
    public_context,
    seal_context,
)
from fedsilo.privacy.masking import aggregation_label, weight_problem
from fedsilo.silo.aggregation_log import aggregation_log
from fedsilo.silo.reports import reports_mechanism
from fedsilo.silo.tasks.base import (
    SiloContext,
    config_of,
    find_session,
    inner_message,
    new_session,
    protocol_answer,
    session_id,
    summable,
    task_digest,
    task_result,
)
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tasks import CkksConfirm, CkksDecrypt, CkksJoin, CkksKeygen, EncryptedInput
from fedsilo.wire.tasks.tensor_names import (
    CHUNK,
    CONFIRMATION,
    CONTRIBUTION,
    PUBLIC_CONTEXT,
    SEALED_CONTEXT,
    SUM,
)
from fedsilo.wire.tensors import bytes_tensor, tensor_bytes

GRID_BELOW_SCALE_BITS = 18  # the decrypted sum is rounded to 2^-(scale bits - 18)


def keygen(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    identity = _identity(ctx)
    named = ctx.secure_aggregation.key_holder
    if named is not None and named != ctx.name:
        raise CkksError(f"the policy names {named!r} as the CKKS key holder, not {ctx.name!r}")
    recipients = sorted(config_of(message, CkksKeygen).recipients)
    outsiders = [r for r in recipients if r not in ctx.sealing_roster]
    if outsiders:
        raise CkksError(f"{outsiders} are not members of this consortium; no key for them")
    if ctx.name not in recipients:
        raise CkksError("the key holder seals its context to itself too, to survive a restart")
    made = ctx.store.ckks_made
    if made is not None and made[0] == tuple(recipients):
        # the keys it made already, to a coordinator restarted since (it keeps no keys): the
        # public part and sealed copies only, so the silos finish the sums they began with them
        return task_result(message, ctx, {name: t.clone() for name, t in made[1].items()})
    secret = new_secret_context(_parameters(ctx))
    public = public_context(secret)
    _contexts(ctx)[context_digest(public)] = load_secret_context(secret)
    sealed = {
        f"{SEALED_CONTEXT}/{r}": bytes_tensor(seal_context(secret, ctx.sealing_roster[r], identity))
        for r in recipients
    }
    tensors = {PUBLIC_CONTEXT: bytes_tensor(public), **sealed}
    ctx.store.ckks_made = (tuple(recipients), {name: t.clone() for name, t in tensors.items()})
    return task_result(message, ctx, tensors)


def join(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    task = config_of(message, CkksJoin)
    key_holder = task.key_holder
    named = ctx.secure_aggregation.key_holder
    if named is not None and named != key_holder:
        raise CkksError(f"the policy names {named!r} as the CKKS key holder, not {key_holder!r}")
    if key_holder not in ctx.roster:
        raise CkksError(f"the key holder {key_holder!r} is not a member of this consortium")
    digest = task.context_digest
    contexts = _contexts(ctx)
    if digest not in contexts:
        if SEALED_CONTEXT not in message.tensors:
            raise CkksError("ckks_join carries no sealed context and this silo holds none")
        try:
            secret = open_sealed_context(
                tensor_bytes(message.tensors[SEALED_CONTEXT]),
                _sealing_key(ctx),
                ctx.roster[key_holder],
            )
        except CryptoError as exc:
            raise CkksError(
                f"the sealed context is not for {ctx.name} or not signed by {key_holder}'s "
                f"identity ({exc})"
            ) from None
        if context_digest(public_context(secret)) != digest:
            raise CkksError(
                "the sealed context is not the one the coordinator sums under (digests differ)"
            )
        contexts.clear()  # one deployment key at a time
        contexts[digest] = load_secret_context(secret, expected=_parameters(ctx))
    aggregation_log(ctx).claim(_label(message, ctx), "join")
    new_session(ctx, "ckks", session_id(message))["digest"] = digest
    reports = ctx.reports(message.task_id, "train")
    ctx.released_count("train")
    return task_result(message, ctx, {}, num_samples=reports.count(len(ctx.data.y_train)))


def encrypted_input(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    from fedsilo.silo.tasks import TASK_KINDS

    session = _session(message, ctx, "digest")
    if session.get("encrypted"):
        raise CkksError("this aggregation already has this silo's input; a second is refused")
    context = _contexts(ctx)[session["digest"]]
    task = config_of(message, EncryptedInput)
    weights = _weights(task.weights)
    _check_weights(weights, ctx, ctx.name)
    weight = weights[ctx.name]
    session |= {"task": task_digest(message), "weights": weights}
    inner = inner_message(message)
    result = summable(TASK_KINDS[inner.kind].handler(inner, ctx), task.tensors)
    bound = ctx.secure_aggregation.bound
    updates = []
    for name in task.tensors:
        trained, sent = result.tensors[name], inner.tensors[name]
        if trained.shape != sent.shape:
            raise CkksError(
                f"the {name!r} sent is {tuple(sent.shape)}, the result {tuple(trained.shape)}: "
                "an update is taken only to a tensor of its shape"
            )
        updates.append((trained.double().cpu() - sent.double().cpu()).reshape(-1))
    flat = torch.cat(updates).clamp_(-bound, bound).mul_(weight) if updates else torch.zeros(0)
    session["encrypted"] = True
    chunks = encrypt(flat.numpy(), context)
    statement = _contribution(message, ctx, session, weights, chunks)
    signature = _identity(ctx).sign(statement).signature
    tensors = {chunk_name(i): bytes_tensor(c) for i, c in enumerate(chunks)}
    return protocol_answer(message, ctx, {**tensors, CONTRIBUTION: bytes_tensor(signature)})


def confirm_contributors(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    """Sign the set of contributors of this aggregation's sum: one set per aggregation, ever."""
    session = _own_input(message, ctx)
    contributors = sorted(set(config_of(message, CkksConfirm).contributors))
    if ctx.name not in contributors:
        raise CkksError(f"{ctx.name} is not among the contributors it is asked to confirm")
    outsiders = [s for s in contributors if s not in session["weights"]]
    if outsiders:
        raise CkksError(f"{outsiders} carry no weight in the vector this silo encrypted under")
    _check_weights(session["weights"], ctx, ctx.name, members=contributors)
    aggregation_log(ctx).claim(_label(message, ctx), "confirm")
    session["confirmed"] = contributors
    signature = _identity(ctx).sign(_confirmation(message, ctx, session, contributors))
    return task_result(message, ctx, {CONFIRMATION: bytes_tensor(signature.signature)})


def decrypted_sum(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    session = _own_input(message, ctx)
    if session.get("decrypted"):
        raise CkksError("this aggregation's sum was already decrypted; a second is refused")
    context = _contexts(ctx)[session["digest"]]
    task = config_of(message, CkksDecrypt)
    contributors = sorted(set(task.contributors))
    if session.get("confirmed") != contributors:
        raise CkksError(
            "the contributors to decrypt are not the set this silo confirmed for this "
            "aggregation: refusing to decrypt"
        )
    weights = _weights(task.weights)
    inputs = _signed_inputs(message, contributors, ctx, session, weights)
    _confirmed_by_all(message, contributors, ctx, session)
    _check_weights(weights, ctx, None, members=list(inputs))
    aggregation_log(ctx).claim(_label(message, ctx), "decrypt")
    session["decrypted"] = True
    summed = add_encrypted(context, [inputs[silo] for silo in sorted(inputs)])
    total = decrypt(summed, context, task.length)
    grid = 2.0 ** (GRID_BELOW_SCALE_BITS - ctx.secure_aggregation.ckks.global_scale_bits)
    return task_result(message, ctx, {SUM: torch.from_numpy(np.round(total / grid) * grid)})


def join_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    """The context is the key holder's; the sample count is released as `train` releases it."""
    return [Mechanism.public(), *reports_mechanism(ctx.privacy, ctx.unreleased_counts("train"))]


def encrypted_input_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    """What the inner task releases: encryption hides it from the coordinator, not from the
    sum, and a coordinator colluding with any silo could decrypt it."""
    from fedsilo.silo.tasks import TASK_KINDS

    inner = inner_message(message)
    return TASK_KINDS[inner.kind].releases(inner, ctx)


def _signed_inputs(
    message: TaskMessage,
    contributors: Sequence[str],
    ctx: SiloContext,
    session: dict[str, Any],
    weights: Mapping[str, float],
) -> dict[str, list[bytes]]:
    """Each contributor's chunks, after checking its signature over them: at least the
    policy's `min_group` contributors, each a member that encrypted under this weight vector
    for the same task as this silo's own input."""
    inputs: dict[str, list[bytes]] = {}
    for silo in sorted(set(contributors)):
        if silo not in ctx.roster:
            raise CkksError(f"{silo!r} is not a member of this consortium")
        prefix = f"{silo}/"  # the coordinator relays each input's tensors under its silo
        names = sorted(n for n in message.tensors if n.startswith(prefix + CHUNK))
        chunks = [tensor_bytes(message.tensors[n]) for n in names]
        _check_signature(
            message,
            ctx,
            silo,
            CONTRIBUTION,
            _contribution(message, ctx, session, weights, chunks),
            f"the input said to be {silo}'s is not signed by {silo}'s identity for this "
            "aggregation and weight vector: refusing to decrypt",
        )
        inputs[silo] = chunks
    smallest = ctx.secure_aggregation.min_group
    if len(inputs) < smallest:
        raise CkksError(
            f"a sum of {len(inputs)} signed inputs; this silo's policy decrypts sums of at "
            f"least secure_aggregation.min_group {smallest}"
        )
    return inputs


def _own_input(message: TaskMessage, ctx: SiloContext) -> dict[str, Any]:
    """This aggregation's session, where this silo sent its own input: it confirms and
    decrypts only sums it is in (its own input's task is what every contributor signed)."""
    session = _session(message, ctx, "digest")
    if not session.get("encrypted"):
        raise CkksError(
            "this silo sent no input to this aggregation; it confirms and decrypts only sums "
            "it is in"
        )
    return session


def _confirmed_by_all(
    message: TaskMessage, contributors: list[str], ctx: SiloContext, session: dict[str, Any]
) -> None:
    """Every contributor's confirmation of exactly `contributors` (under "<silo>/")."""
    statement = _confirmation(message, ctx, session, contributors)
    for silo in contributors:
        _check_signature(
            message,
            ctx,
            silo,
            CONFIRMATION,
            statement,
            f"{silo} did not confirm exactly these contributors for this aggregation: refusing "
            "to decrypt",
        )


def _check_signature(
    message: TaskMessage, ctx: SiloContext, silo: str, name: str, statement: bytes, refusal: str
) -> None:
    """`silo`'s signature over `statement`, relayed as its tensor `name` (under "<silo>/"),
    checked against the roster; `refusal` otherwise."""
    signature = message.tensors.get(f"{silo}/{name}")
    try:
        if signature is None:
            raise BadSignatureError(f"no {name}")
        ctx.roster[silo].verify(statement, tensor_bytes(signature))
    except (BadSignatureError, ValueError):
        raise CkksError(refusal) from None


def _confirmation(
    message: TaskMessage, ctx: SiloContext, session: dict[str, Any], contributors: list[str]
) -> bytes:
    """What a contributor confirms: the aggregation, the context, the weights, the task of
    its input and the contributors of the sum."""
    body = json.dumps(
        {
            "context": session["digest"],
            "weights": sorted(session["weights"].items()),
            "task": session["task"].hex(),
            "contributors": contributors,
        }
    ).encode()
    return b"|".join((b"fedsilo/ckks-confirm", _label(message, ctx), body))


def _contribution(
    message: TaskMessage,
    ctx: SiloContext,
    session: dict[str, Any],
    weights: Mapping[str, float],
    chunks: list[bytes],
) -> bytes:
    """What a contributor signs: the aggregation, the context, the weights, the digest of the
    task its input is for (`task_digest`: the same model and settings for every contributor)
    and its chunks."""
    hashed = hashlib.blake2b(digest_size=32)
    for chunk in chunks:
        hashed.update(len(chunk).to_bytes(8, "little") + chunk)
    body = json.dumps(
        {
            "context": session["digest"],
            "weights": sorted(weights.items()),
            "task": session["task"].hex(),
        }
    ).encode()
    return b"|".join((b"fedsilo/ckks-input", _label(message, ctx), body, hashed.digest()))


def _weights(raw: Mapping[str, float]) -> dict[str, float]:
    return {silo: float(weight) for silo, weight in raw.items()}


def _check_weights(
    weights: Mapping[str, float],
    ctx: SiloContext,
    me: str | None,
    members: list[str] | None = None,
) -> None:
    secure = ctx.secure_aggregation
    chosen = list(weights) if members is None else members
    floor = secure.weight_floor(len(chosen))
    problem = weight_problem(weights, me, chosen, secure.min_group, floor, ctx.roster)
    if problem:
        raise CkksError(f"refusing the weights: {problem}")


def _label(message: TaskMessage, ctx: SiloContext) -> bytes:
    return aggregation_label(ctx.deployment, message.round, message.phase)


def _parameters(ctx: SiloContext) -> CkksParameters:
    return CkksParameters.of(ctx.secure_aggregation.ckks)


def _identity(ctx: SiloContext) -> SigningKey:
    if ctx.identity is None:
        raise CkksError("CKKS aggregation needs this silo's signing identity")
    return ctx.identity


def _sealing_key(ctx: SiloContext) -> PrivateKey:
    if ctx.sealing_key is None:
        raise CkksError("CKKS aggregation needs this silo's sealing key")
    return ctx.sealing_key


def _contexts(ctx: SiloContext) -> dict[str, ts.Context]:
    return ctx.store.ckks_contexts


def _session(message: TaskMessage, ctx: SiloContext, needs: str) -> dict[str, Any]:
    session = find_session(ctx, "ckks", message, needs)
    if session is None or session[needs] not in _contexts(ctx):
        raise CkksError(
            f"{message.kind} arrived out of order: this silo has not joined aggregation "
            f"{session_id(message)!r}"
        )
    return session
