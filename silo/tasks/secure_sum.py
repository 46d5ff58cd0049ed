"""The silo's side of pairwise-masked secure aggregation: four tasks per aggregation, in order
(Bonawitz et al. 2017; privacy/masking.py has the cryptography).

1. `secagg_advertise`: fresh key pairs for this aggregation, their public halves signed with
   the silo's identity; also the silo's training sample count (the weight a sample-weighted
   mean needs, released as the `train` task would release it). Once per (deployment, round,
   phase), persisted (silo/aggregation_log.py): a second aggregation of the same round is
   refused, so no difference of two sums isolates one silo. Asked again before the keys'
   shares went out, the silo repeats the same advertisement (it is public), so a coordinator
   restarted in between can still run the aggregation.
2. `secagg_share`: check every other silo's advertised keys' signature against the roster (a
   key the coordinator substituted is refused; its own advertisement must come back byte for
   byte as it sent it) and that the group is at least the policy's
   `min_group`, draw a self-mask seed b, and share (masking key, b) t-of-n among the advertised
   silos, each share encrypted to its recipient and bound to this silo's view of the
   advertisement set.
3. `secagg_mask`: check the whole weight vector (`weights`, the same for every silo: see step
   4) against the policy's `min_group` and `min_weight`, open the shares addressed to this
   silo (made under the same view), run the real task (`inner_kind`, e.g. `train`), and send
   its update (result minus the model received) times its own weight, clipped, fixed-point
   encoded, plus the self-mask and the pairwise masks with every silo that shared.
4. `secagg_confirm`: given the survivors (who sent masked inputs), sign (label, view, weight
   vector, survivors, digest of the task it masked its input for: `task_digest`) with the
   silo's identity: Bonawitz et al.'s consistency check, extended to what the silos received.
   One statement per aggregation, persisted.
5. `secagg_unmask`: given the same survivors and the signatures the coordinator collected,
   verify at least t valid ones from survivors over exactly this silo's statement, then reveal
   the self-mask share of each survivor that signed it and the masking-key share of every
   other silo that shared (dropped after sharing, or a survivor without a valid signature over
   the same statement: its input stays masked and out of the sum, so a silo sent another model
   or other settings than the rest is never unmasked), never both for one silo, and only once
   per aggregation (persisted): a silo declared dropped that turns up late cannot get its
   input unmasked, nor anyone else's. With
   `advertise_next` (a round and a phase) the answer also carries step 1 for that aggregation,
   claimed and released as an advertise task's (one key set per aggregation, whichever task
   asks; none when that step was taken already); the keys wait in memory, beside the current
   aggregation, until their share step (at most `PENDING_SESSIONS` such key sets).

The threshold t comes from the silo's own policy, never from the task: the policy's
`secure_aggregation.threshold` raised to floor(2n/3) + 1 for the n advertised silos, the bound
that keeps an active coordinator from collecting both secrets of one silo.

With `secure_aggregation.neighbours: k` (SecAgg+'s sparse graph, Bell et al. 2020) the silo
computes its k neighbours itself, from its roster, the deployment and the signed policy's
digest (`neighbourhood`), never from the task; it shares its secrets with its neighbours only,
t of k (`share_threshold`), and masks pairwise with the neighbours whose shares reached it. It
refuses: a view holding fewer than t of its neighbours (step 2); shares from a silo that is not
its neighbour, or from fewer than t neighbours (step 3); and a survivor set keeping fewer than
t of the neighbours it masked with (steps 4 and 5: the others' keys would be rebuilt and their
masks with it removed). The consistency check still takes floor(2n/3) + 1 signatures of n.
"""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import torch
from nacl.public import Box
from nacl.signing import SigningKey

from fedsilo.privacy.accounting import Mechanism
from fedsilo.privacy.lineage import input_statement, reveal_statement
from fedsilo.privacy.masking import (
    Advertisement,
    FixedPoint,
    MaskingError,
    MaskingKeys,
    advertisement_digest,
    aggregation_label,
    confirm,
    consistency_statement,
    decrypt_share,
    encrypt_share,
    graph_seed,
    mask_streams,
    neighbourhood,
    new_seed,
    shares_for,
    signed_by,
    silo_indices,
    tensor_context,
    weight_problem,
)
from fedsilo.silo.aggregation_log import StepAlreadyTaken, aggregation_log
from fedsilo.silo.reports import reports_mechanism
from fedsilo.silo.tasks.base import (
    SiloContext,
    config_of,
    find_session,
    inner_message,
    new_session,
    protocol_answer,
    session_id,
    session_key,
    summable,
    task_digest,
    task_result,
    tensor_digests,
)
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tasks import MaskedInput, SecAggConfirm, SecAggShare, SecAggUnmask
from fedsilo.wire.tasks.tensor_names import (
    ADVERTISEMENT,
    CONFIRMATION,
    INPUT_SIGNATURE,
    REVEAL_SIGNATURE,
    REVEALED_KEY,
    REVEALED_SEED,
    SHARE_TO,
)
from fedsilo.wire.tensors import bytes_tensor, read_only

log = logging.getLogger(__name__)

PENDING_SESSIONS = 8  # key sets advertised ahead and not yet shared, the most a silo keeps


def advertise(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    advert, count = _advertisement(message, ctx, message.round, message.phase)
    return task_result(message, ctx, {ADVERTISEMENT: bytes_tensor(advert)}, num_samples=count)


def _advertisement(
    message: TaskMessage, ctx: SiloContext, round_no: int, phase: str
) -> tuple[bytes, int]:
    """This silo's signed public keys for the aggregation of `phase` in round `round_no`, and
    its sample count, asked for by `message`: a fresh key set, its advertise step claimed
    durably first (one key set per aggregation, ever), or the same advertisement again, as long
    as this process remembers it (asked again by a coordinator restarted since: it is public,
    and every later step of the aggregation is taken once, so the restarted coordinator can
    only finish the aggregation the silos began)."""
    key = session_key(round_no, phase)
    advertised = ctx.store.advertised
    if key in advertised:
        _, advert, count = advertised[key]
        return advert, count
    label = aggregation_label(ctx.deployment, round_no, phase)
    aggregation_log(ctx).claim(label, "advertise")
    keys = MaskingKeys.generate()
    sessions = ctx.store.sessions.setdefault("secagg", {})
    session = new_session(ctx, "secagg", key, keep=_ahead(sessions, message.round))
    session |= {
        "round": round_no,
        "keys": keys,
        "advert": keys.advertise(ctx.name, _identity(ctx), label).to_bytes(),
        "count": ctx.reports(message.task_id, "train").count(len(ctx.data.y_train)),
    }
    ctx.released_count("train")
    recent = {k: v for k, v in advertised.items() if v[0] >= message.round - 1}
    ctx.store.advertised = recent | {key: (round_no, session["advert"], session["count"])}
    return session["advert"], session["count"]


def _ahead(sessions: dict[str, dict[str, Any]], now: int) -> list[str]:
    """The sessions a new one keeps, made during round `now`: key sets advertised ahead, for
    aggregations of round `now` or later, whose shares have not gone out (up to
    `PENDING_SESSIONS`, the newest): a round of two masked phases folds the keys of each for
    the next round's."""
    unshared = [key for key, s in sessions.items() if _unshared(s) and s["round"] >= now]
    return unshared[-PENDING_SESSIONS:]


def _unshared(session: dict[str, Any]) -> bool:
    """Keys advertised whose shares have not gone out (after sharing the session holds the
    self-mask seed, and after unmasking no keys at all)."""
    return "keys" in session and "seed" not in session


def share(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    session = _session(message, ctx, "keys")
    if "seed" in session:
        raise MaskingError("this silo already shared its secrets for this aggregation")
    adverts = _verified_advertisements(message, ctx, session["advert"])
    _check_group(len(adverts), "advertised keys", ctx)
    secure = ctx.secure_aggregation
    threshold = secure.share_threshold(len(adverts))
    neighbours = _neighbours(ctx)
    holders = set(adverts)
    if neighbours is not None:
        present = neighbours & holders
        if len(present) < threshold:
            raise MaskingError(
                f"only {len(present)} of this silo's {len(neighbours)} graph neighbours "
                f"({sorted(neighbours)}) are among the advertised keys; its policy needs "
                f"{threshold} (secure_aggregation.neighbours, threshold): refusing to share"
            )
        holders = present | {ctx.name}
    view = advertisement_digest(_label(message, ctx), adverts)
    seed = new_seed()
    keys: MaskingKeys = session["keys"]
    if threshold > len(holders):
        raise MaskingError(f"threshold {threshold} exceeds the {len(holders)} share holders")
    indices = silo_indices(list(adverts))
    shares = shares_for(bytes(keys.masking) + seed, threshold, (indices[h] for h in holders))
    session |= {
        "adverts": adverts,
        "seed": seed,
        "share_threshold": threshold,
        "threshold": secure.consistency_threshold(len(adverts)),
        "neighbours": neighbours,
        "view": view,
    }
    session["received"] = {ctx.name: shares[indices[ctx.name]]}
    # one X25519 agreement per peer, kept to open the peer's share to this silo too
    session["boxes"] = {
        peer: Box(keys.encryption, adverts[peer].encryption_key)
        for peer in sorted(holders)
        if peer != ctx.name
    }
    sealed = {
        SHARE_TO + peer: bytes_tensor(
            encrypt_share(ctx.name, peer, shares[indices[peer]], box, view)
        )
        for peer, box in session["boxes"].items()
    }
    return task_result(message, ctx, sealed)


def masked_input(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    from fedsilo.silo.tasks import TASK_KINDS

    session = _session(message, ctx, "seed")
    if "sharers" in session:
        raise MaskingError("this aggregation already has this silo's masked input")
    config = config_of(message, MaskedInput)
    sharers = set(config.shares) | {ctx.name}
    _check_members(sharers, session, "sent shares")
    weights = {silo: float(w) for silo, w in config.weights.items()}
    members = sharers
    if session["neighbours"] is None:
        _check_group(len(sharers), "shared their secrets", ctx, session["threshold"])
    else:
        members = _sparse_members(sharers, weights, session, ctx)
    _check_weights(weights, members, session, ctx)
    keys: MaskingKeys = session["keys"]
    for sender, hex_share in config.shares.items():
        box = session["boxes"].get(sender)
        if box is None:
            box = Box(keys.encryption, session["adverts"][sender].encryption_key)
        session["received"][sender] = decrypt_share(
            sender, ctx.name, bytes.fromhex(hex_share), box, session["view"]
        )
    session |= {"sharers": sorted(sharers), "weights": weights, "task": task_digest(message)}
    inner = inner_message(message)
    label = _label(message, ctx)
    peers = {p: session["adverts"][p].masking_key for p in sharers if p != ctx.name}
    # The masks depend on no data: their AES streams run on a second thread (they release the
    # GIL) while the silo trains, and are added once the update is encoded.
    received = {name: _as_numpy(read_only(inner.tensors, name)) for name in config.tensors}
    masks = {
        name: ctx.store.background.submit(
            mask_streams,
            len(received[name]),
            ctx.name,
            session["seed"],
            keys.masking,
            peers,
            tensor_context(label, name),
        )
        for name in config.tensors
    }
    result = summable(TASK_KINDS[inner.kind].handler(inner, ctx), config.tensors)
    encoding = FixedPoint.for_silos(ctx.secure_aggregation.bound, len(session["adverts"]))
    masked = {}
    for name in config.tensors:
        if result.tensors[name].numel() != len(received[name]):
            raise MaskingError(
                f"the {name!r} sent has {len(received[name])} values, the result "
                f"{result.tensors[name].numel()}: an update is taken only to a tensor of its shape"
            )
        # widened exactly, then subtracted in float64 (numpy's mixed-type subtraction
        # takes half of torch's time here)
        update = _as_numpy(result.tensors[name].detach()).astype(np.float64)
        np.subtract(update, received[name], out=update)
        encoded = encoding.encode(update, weights[ctx.name], scratch=True)
        np.add(encoded, masks[name].result(), out=encoded)  # mod 2^32
        masked[name] = torch.from_numpy(encoded.view(np.int32))
    # signed, so that every silo can check a sum holds its input unchanged (model lineage)
    statement = input_statement(label, ctx.name, peers, tensor_digests(masked))
    masked[INPUT_SIGNATURE] = bytes_tensor(_identity(ctx).sign(statement).signature)
    return protocol_answer(message, ctx, masked)


def _as_numpy(tensor: torch.Tensor) -> np.ndarray:
    """A tensor's elements, flat, for numpy: in place where numpy reads its type, else widened
    exactly to float64 (numpy reads neither of torch's half-precision types)."""
    flat = tensor.to("cpu").reshape(-1)
    if flat.dtype not in (torch.float32, torch.float64):
        flat = flat.to(torch.float64)
    return flat.numpy()


def _sparse_members(
    sharers: set[str], weights: dict[str, float], session: dict[str, Any], ctx: SiloContext
) -> set[str]:
    """On the sparse graph: refuse shares from silos that are not this silo's neighbours and
    fewer than t neighbours' shares (a coordinator that keeps its honest neighbours out would
    leave it masked only with colluders); the sum's members are those the weights name."""
    strangers = sorted(sharers - session["neighbours"] - {ctx.name})
    if strangers:
        raise MaskingError(
            f"shares from {strangers}, which are not this silo's graph neighbours "
            f"({sorted(session['neighbours'])}): refusing them (secure_aggregation.neighbours)"
        )
    if len(sharers) - 1 < session["share_threshold"]:
        raise MaskingError(
            f"only {len(sharers) - 1} of this silo's graph neighbours shared their secrets; "
            f"its policy needs {session['share_threshold']} (secure_aggregation.threshold)"
        )
    members = set(weights) | sharers
    _check_members(members, session, "carry weight")
    _check_group(len(members), "are in the sum", ctx, session["threshold"])
    return members


def confirm_survivors(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    """Sign this silo's consistency statement: one survivor set per aggregation, ever."""
    session = _session(message, ctx, "sharers")
    survivors = _survivors(message, ctx, session)
    aggregation_log(ctx).claim(_label(message, ctx), "confirm")
    session["confirmed"] = survivors
    signature = confirm(_identity(ctx), _statement(message, ctx, session, survivors))
    return task_result(message, ctx, {CONFIRMATION: bytes_tensor(signature)})


def unmask(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    session = _session(message, ctx, "sharers")
    if session.get("unmasked"):
        raise MaskingError("this aggregation was already unmasked; a second request is refused")
    survivors = _survivors(message, ctx, session)
    if session.get("confirmed") != survivors:
        raise MaskingError(
            "the survivors to unmask are not the set this silo confirmed: the consistency "
            "check fails, nothing is revealed"
        )
    config = config_of(message, SecAggUnmask)
    signatures = {
        silo: bytes.fromhex(hex_signature)
        for silo, hex_signature in config.signatures.items()
        if silo in survivors
    }
    statement = _statement(message, ctx, session, survivors)
    # it signed this very statement itself (`confirmed`), whether or not it is relayed back
    signers = signed_by(statement, signatures, ctx.roster) | {ctx.name}
    if len(signers) < session["threshold"]:
        raise MaskingError(
            f"the consistency check fails: {len(signers)} survivors signed this silo's view of "
            f"the aggregation, fewer than the threshold {session['threshold']}; nothing is "
            "revealed"
        )
    _check_survivors(signers, session, ctx)  # the inputs that will be unmasked
    aggregation_log(ctx).claim(_label(message, ctx), "unmask")
    session["unmasked"] = True
    block = len(session["received"][ctx.name]) // 2
    revealed = {}
    for silo in session["sharers"]:
        piece = session["received"][silo]
        if silo in signers:
            revealed[REVEALED_SEED + silo] = bytes_tensor(piece[block:])
        else:
            revealed[REVEALED_KEY + silo] = bytes_tensor(piece[:block])
    for secret in ("keys", "seed", "received"):  # nothing left to reveal later
        session.pop(secret)
    statement = reveal_statement(_label(message, ctx), ctx.name, tensor_digests(revealed))
    revealed[REVEAL_SIGNATURE] = bytes_tensor(_identity(ctx).sign(statement).signature)
    count, ahead = 0, config.advertise_next
    if ahead is not None:  # the next aggregation's advertise step, folded into this answer
        try:
            advert, count = _advertisement(message, ctx, ahead.round, ahead.phase)
            revealed[ADVERTISEMENT] = bytes_tensor(advert)
        except StepAlreadyTaken as taken:  # the shares are revealed all the same
            log.warning("no keys folded into the unmask answer of %s: %s", message.task_id, taken)
    return task_result(message, ctx, revealed, num_samples=count)


def advertise_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    """Keys are public; the sample count is released as the train task would release it."""
    return [Mechanism.public(), *reports_mechanism(ctx.privacy, ctx.unreleased_counts("train"))]


def unmask_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    """Shares are public; keys folded in for the next aggregation release what an advertise
    task releases."""
    if config_of(message, SecAggUnmask).advertise_next is None:
        return [Mechanism.public()]
    return advertise_releases(message, ctx)


def masked_input_releases(message: TaskMessage, ctx: SiloContext) -> list[Mechanism]:
    """What the inner task releases (masking hides it from the coordinator, not from the sum)."""
    from fedsilo.silo.tasks import TASK_KINDS

    inner = inner_message(message)
    return TASK_KINDS[inner.kind].releases(inner, ctx)


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


def _identity(ctx: SiloContext) -> SigningKey:
    if ctx.identity is None:
        raise MaskingError("secure aggregation needs this silo's signing identity")
    return ctx.identity


def _neighbours(ctx: SiloContext) -> frozenset[str] | None:
    """This silo's neighbours on the sparse graph over its roster (None: the complete graph),
    computed from its own policy and roster, never from anything the coordinator sends."""
    degree = ctx.secure_aggregation.neighbours
    if degree is None:
        return None
    return neighbourhood(ctx.roster, degree, graph_seed(ctx.deployment, ctx.job))[ctx.name]


def _check_group(size: int, what: str, ctx: SiloContext, threshold: int = 0) -> None:
    """Refuse a group smaller than the policy's `min_group` or than the threshold."""
    smallest = max(ctx.secure_aggregation.min_group, threshold)
    if size < smallest:
        raise MaskingError(
            f"{size} silos {what}; this silo's policy needs at least {smallest} "
            f"(secure_aggregation.min_group {ctx.secure_aggregation.min_group}, "
            f"threshold {threshold or 'n/a'})"
        )


def _check_weights(
    weights: dict[str, float], members: set[str], session: dict[str, Any], ctx: SiloContext
) -> None:
    secure = ctx.secure_aggregation
    floor = secure.weight_floor(len(members))
    view = session["adverts"]
    problem = weight_problem(weights, ctx.name, members, secure.min_group, floor, view)
    if problem:
        raise MaskingError(f"refusing the weights: {problem}")


def _survivors(message: TaskMessage, ctx: SiloContext, session: dict[str, Any]) -> list[str]:
    """The task's survivors, checked (`_check_survivors`)."""
    config = message.config
    if not isinstance(config, SecAggConfirm | SecAggUnmask):
        raise MaskingError(f"a {message.kind} task names no survivors")
    survivors = set(config.survivors)
    _check_survivors(survivors, session, ctx)
    return sorted(survivors)


def _check_survivors(survivors: set[str], session: dict[str, Any], ctx: SiloContext) -> None:
    """Silos whose inputs a sum would hold: sharers all, this silo among them, enough of them,
    enough of them carrying weight, and on the sparse graph enough of its own neighbours."""
    sparse = session["neighbours"] is not None
    _check_members(survivors, session, "survived", within="adverts" if sparse else "sharers")
    if ctx.name not in survivors:
        raise MaskingError(f"{ctx.name} is not among the survivors it is asked to unmask")
    if len(survivors) < session["threshold"]:
        raise MaskingError(
            f"{len(survivors)} survivors are fewer than the threshold {session['threshold']}"
        )
    _check_group(len(survivors), "survived", ctx, session["threshold"])
    _check_weights(session["weights"], survivors, session, ctx)
    partners = set(session["sharers"]) - {ctx.name}
    if sparse and len(partners & survivors) < session["share_threshold"]:
        raise MaskingError(
            f"only {len(partners & survivors)} of the {len(partners)} graph neighbours this "
            f"silo masked with are among the survivors; its policy needs "
            f"{session['share_threshold']}: with fewer, the masks hiding its input could be "
            "removed from its neighbours' rebuilt keys; nothing is signed or revealed"
        )


def _statement(
    message: TaskMessage, ctx: SiloContext, session: dict[str, Any], survivors: list[str]
) -> bytes:
    return consistency_statement(
        _label(message, ctx), session["view"], session["weights"], survivors, session["task"]
    )


def _verified_advertisements(
    message: TaskMessage, ctx: SiloContext, own: bytes
) -> dict[str, Advertisement]:
    """The relayed advertisements, each other silo's signature checked against the roster, and
    this silo's own the bytes it sent (`own`), exactly."""
    label = _label(message, ctx)
    adverts = {}
    for silo, hex_advert in sorted(config_of(message, SecAggShare).advertisements.items()):
        if silo not in ctx.roster:
            raise MaskingError(f"{silo!r} is not a member of this consortium")
        advert = Advertisement.from_bytes(silo, bytes.fromhex(hex_advert))
        if silo != ctx.name:
            advert.verify(ctx.roster[silo], label)
        adverts[silo] = advert
    mine = adverts.get(ctx.name)
    if mine is None or mine.to_bytes() != own:
        raise MaskingError("the coordinator did not relay this silo's own keys unchanged")
    return adverts


def _check_members(
    silos: set[str], session: dict[str, Any], what: str, within: str = "adverts"
) -> None:
    outsiders = sorted(silos - set(session[within]))
    if outsiders:
        raise MaskingError(f"{outsiders} {what} but were not part of this aggregation")
