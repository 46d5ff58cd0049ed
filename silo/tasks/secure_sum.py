"""The silo's side of pairwise-masked secure aggregation: four tasks per aggregation, in order
(Bonawitz et al. 2017; privacy/masking.py has the cryptography).

1. `secagg_advertise`: fresh key pairs for this aggregation, their public halves signed with
   the silo's identity; also the silo's training sample count (the weight a sample-weighted
   mean needs, released as the `train` task would release it).
2. `secagg_share`: check every advertised key's signature against the roster (a key the
   coordinator substituted is refused), draw a self-mask seed b, and share (masking key, b)
   t-of-n among the advertised silos, each share encrypted to its recipient.
3. `secagg_mask`: open the shares addressed to this silo, run the real task (`inner_kind`,
   e.g. `train`), and send its weighted update (result minus the model received), clipped,
   fixed-point encoded, plus the self-mask and the pairwise masks with every silo that shared.
4. `secagg_unmask`: given who sent masked inputs (the survivors), reveal the self-mask share of
   each survivor and the masking-key share of each silo that dropped after sharing, never
   both for one silo, and only once per aggregation: a silo declared dropped that turns up
   late cannot get its input unmasked, nor anyone else's.

The threshold t comes from the silo's own policy (`secure_aggregation.threshold`, else a
majority of the advertised silos), never from the task: a coordinator cannot lower it.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from fedsilo.privacy.accounting import Mechanism
from fedsilo.privacy.masking import (
    ADVERTISEMENT,
    REVEALED_KEY,
    REVEALED_SEED,
    SHARE_TO,
    Advertisement,
    FixedPoint,
    MaskingError,
    MaskingKeys,
    aggregation_label,
    decrypt_share,
    encrypt_share,
    mask,
    new_seed,
    silo_indices,
    split_secret,
)
from fedsilo.silo.reports import reports_mechanism
from fedsilo.silo.tasks.base import (
    SiloContext,
    find_session,
    inner_message,
    new_session,
    session_id,
    task_result,
    with_tensors,
)
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tensors import bytes_tensor


def advertise(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    if ctx.identity is None:
        raise MaskingError("secure aggregation needs this silo's signing identity")
    keys = MaskingKeys.generate()
    session = new_session(ctx, "secagg", message)
    session["keys"] = keys
    advert = keys.advertise(ctx.name, ctx.identity, _label(message, ctx))
    reports = ctx.reports(message.task_id, "train")
    ctx.released_count("train")
    return task_result(
        message,
        ctx,
        {ADVERTISEMENT: bytes_tensor(advert.to_bytes())},
        num_samples=reports.count(len(ctx.data.y_train)),
    )


def share(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    session = _session(message, ctx, "keys")
    adverts = _verified_advertisements(message, ctx, session["keys"])
    threshold = ctx.secure_aggregation.threshold_for(len(adverts))
    if len(adverts) < threshold:
        raise MaskingError(f"{len(adverts)} silos advertised keys; the threshold is {threshold}")
    seed = new_seed()
    keys: MaskingKeys = session["keys"]
    shares = split_secret(bytes(keys.masking) + seed, threshold, len(adverts))
    indices = silo_indices(list(adverts))
    session |= {"adverts": adverts, "seed": seed, "threshold": threshold, "indices": indices}
    session["received"] = {ctx.name: shares[indices[ctx.name] - 1]}
    sealed = {
        SHARE_TO + peer: bytes_tensor(
            encrypt_share(
                ctx.name,
                peer,
                shares[indices[peer] - 1],
                keys.encryption,
                advert.encryption_key,
            )
        )
        for peer, advert in adverts.items()
        if peer != ctx.name
    }
    return task_result(message, ctx, sealed)


def masked_input(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    from fedsilo.silo.tasks import TASK_HANDLERS

    session = _session(message, ctx, "seed")
    config = message.config
    sharers = set(config["shares"]) | {ctx.name}
    _check_members(sharers, session, "sent shares")
    if len(sharers) < session["threshold"]:
        raise MaskingError(
            f"{len(sharers)} silos shared their secrets; the threshold is {session['threshold']}"
        )
    keys: MaskingKeys = session["keys"]
    for sender, hex_share in config["shares"].items():
        advert: Advertisement = session["adverts"][sender]
        session["received"][sender] = decrypt_share(
            sender, ctx.name, bytes.fromhex(hex_share), keys.encryption, advert.encryption_key
        )
    session["sharers"] = sorted(sharers)
    inner = inner_message(message)
    result = TASK_HANDLERS[inner.kind](inner, ctx)
    encoding = FixedPoint.for_silos(ctx.secure_aggregation.bound, len(session["adverts"]))
    weight = float(config["weight"])
    label = _label(message, ctx)
    peers = {p: session["adverts"][p].masking_key for p in sharers if p != ctx.name}
    masked = {}
    for name in config["tensors"]:
        update = (result.tensors[name].double().cpu() - inner.tensors[name].double().cpu()).reshape(
            -1
        )
        encoded = encoding.encode(update.numpy(), weight)
        total = mask(encoded, ctx.name, session["seed"], keys.masking, peers, label)
        masked[name] = torch.from_numpy(total.view(np.int32))
    return with_tensors(message, ctx, result, masked)


def unmask(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    session = _session(message, ctx, "sharers")
    if session.get("unmasked"):
        raise MaskingError("this aggregation was already unmasked; a second request is refused")
    survivors = set(message.config["survivors"])
    _check_members(survivors, session, "survived", within="sharers")
    if ctx.name not in survivors:
        raise MaskingError(f"{ctx.name} is not among the survivors it is asked to unmask")
    if len(survivors) < session["threshold"]:
        raise MaskingError(
            f"{len(survivors)} survivors are fewer than the threshold {session['threshold']}"
        )
    session["unmasked"] = True
    block = len(session["received"][ctx.name]) // 2
    revealed = {}
    for silo in session["sharers"]:
        piece = session["received"][silo]
        if silo in survivors:
            revealed[REVEALED_SEED + silo] = bytes_tensor(piece[block:])
        else:
            revealed[REVEALED_KEY + silo] = bytes_tensor(piece[:block])
    for secret in ("keys", "seed", "received"):  # nothing left to reveal later
        session.pop(secret)
    return task_result(message, ctx, revealed)


def advertise_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    """Keys are public; the sample count is released as the train task would release it."""
    return [Mechanism.public(), *reports_mechanism(ctx.privacy, ctx.unreleased_counts("train"))]


def masked_input_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    """What the inner task releases (masking hides it from the coordinator, not from the sum)."""
    from fedsilo.silo.tasks import TASK_RELEASES

    inner = inner_message(message)
    return TASK_RELEASES[inner.kind](inner, ctx)


# -- session state -----------------------------------------------------------------------------


def _session(message: TaskMessage, ctx: SiloContext, needs: str) -> dict[str, Any]:
    session = find_session(ctx, "secagg", message, needs)
    if session is None:
        raise MaskingError(
            f"{message.kind} arrived out of order: this silo holds no {needs!r} for "
            f"aggregation {session_id(message)!r}"
        )
    return session


def _label(message: TaskMessage, ctx: SiloContext) -> bytes:
    return aggregation_label(ctx.deployment, message.round, message.phase)


def _verified_advertisements(
    message: TaskMessage, ctx: SiloContext, own: MaskingKeys
) -> dict[str, Advertisement]:
    label = _label(message, ctx)
    adverts = {}
    for silo, hex_advert in sorted(message.config["advertisements"].items()):
        if silo not in ctx.roster:
            raise MaskingError(f"{silo!r} is not a member of this consortium")
        advert = Advertisement.from_bytes(silo, bytes.fromhex(hex_advert))
        advert.verify(ctx.roster[silo], label)
        adverts[silo] = advert
    mine = adverts.get(ctx.name)
    if mine is None or bytes(mine.masking_key) != bytes(own.masking.public_key):
        raise MaskingError("the coordinator did not relay this silo's own keys unchanged")
    return adverts


def _check_members(
    silos: set[str], session: dict[str, Any], what: str, within: str = "adverts"
) -> None:
    outsiders = sorted(silos - set(session[within]))
    if outsiders:
        raise MaskingError(f"{outsiders} {what} but were not part of this aggregation")
