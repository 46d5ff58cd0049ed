"""Which top-level tasks a silo may run under its own policy's `secure_aggregation` method:
under `masking` or `ckks` nothing that is a model, an update or an input to a sum leaves the
silo in the clear, whatever task the coordinator sends (issue 17: a coordinator that sent
plain `train` tasks under a masking policy collected every silo's model).

Every task kind has one entry in `RELEASE_RULES`, a declarative table: what the kind sends
and hence when it may run. A kind missing from the table is refused (fail closed), so a new
handler must be classified before it can run under secure aggregation. Tasks wrapped inside
`secagg_mask` or `ckks_encrypt` are called by those handlers directly and never pass this
gate; the task the wrapper carries must be of a kind whose result the wrapper masks or
encrypts.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import Enum

from fedsilo.silo.tasks.base import SiloContext
from fedsilo.wire.messages import TaskMessage
from fedsilo.wire.tasks import DaisyReseal, DaisyTrain, EncryptedInput, MaskedInput


class Release(Enum):
    """What a task kind sends, as far as secure aggregation is concerned."""

    NOTHING_PRIVATE = "no model, update or sum input (public values, metrics, acknowledgements)"
    IN_THE_CLEAR = "a model, update or sum input in the clear"
    MASKED = "pairwise-masked protocol messages"
    ENCRYPTED = "CKKS protocol messages"
    SEALED_HANDOFF = "a model sealed to another member, or sent in the clear when told to"


RELEASE_RULES: Mapping[str, Release] = {
    "init": Release.NOTHING_PRIVATE,  # the seed's model, independent of the data
    "schema": Release.NOTHING_PRIVATE,
    "evaluate": Release.NOTHING_PRIVATE,  # metrics (noisy reports under DP)
    "loss": Release.NOTHING_PRIVATE,
    "standardise": Release.NOTHING_PRIVATE,
    "daisy_receive": Release.NOTHING_PRIVATE,
    "daisy_evaluate": Release.NOTHING_PRIVATE,
    "superfed_evaluate": Release.NOTHING_PRIVATE,
    "train": Release.IN_THE_CLEAR,
    "superfed_train": Release.IN_THE_CLEAR,
    "energy_signals": Release.IN_THE_CLEAR,  # s * g per synthetic point: a gradient
    "feature_moments": Release.IN_THE_CLEAR,  # exact sums of the silo's features
    "secagg_advertise": Release.MASKED,
    "secagg_share": Release.MASKED,
    "secagg_mask": Release.MASKED,
    "secagg_confirm": Release.MASKED,
    "secagg_unmask": Release.MASKED,
    "ckks_keygen": Release.ENCRYPTED,
    "ckks_join": Release.ENCRYPTED,
    "ckks_encrypt": Release.ENCRYPTED,
    "ckks_decrypt": Release.ENCRYPTED,
    "daisy_train": Release.SEALED_HANDOFF,
    "daisy_reseal": Release.SEALED_HANDOFF,
}

# What `secagg_mask` and `ckks_encrypt` may wrap: kinds whose result they mask or encrypt.
WRAPPABLE = frozenset({"train", "superfed_train", "energy_signals", "daisy_train"})
WRAPPERS = {"secagg_mask": "masking", "ckks_encrypt": "ckks"}
PROTOCOL_OF = {Release.MASKED: "masking", Release.ENCRYPTED: "ckks"}


def refusal(message: TaskMessage, ctx: SiloContext) -> str | None:
    """Why `message`, a top-level task, must be refused under the silo's own
    `secure_aggregation` policy, or None when it may run."""
    method = ctx.secure_aggregation.method
    rule = RELEASE_RULES.get(message.kind)
    if rule is None:
        return f"task kind {message.kind!r} has no release rule; refused under any policy"
    protocol = PROTOCOL_OF.get(rule)
    if protocol is not None and protocol != method:
        return (
            f"{message.kind} belongs to secure_aggregation {protocol}; this silo's policy "
            f"says {method}"
        )
    if message.kind in WRAPPERS:
        return _wrapped_refusal(message)
    if method == "none":
        return None
    if rule is Release.IN_THE_CLEAR:
        return (
            f"{message.kind} would send {rule.value}; this silo's policy says "
            f"secure_aggregation {method}, so it only sends it masked or encrypted"
        )
    if rule is Release.SEALED_HANDOFF:
        return _handoff_refusal(message, method)
    return None


def _wrapped_refusal(message: TaskMessage) -> str | None:
    config = message.config
    inner = config.inner.KIND if isinstance(config, MaskedInput | EncryptedInput) else None
    if inner not in WRAPPABLE:
        return (
            f"{message.kind} wraps {inner!r}; it masks or encrypts only the results of "
            f"{sorted(WRAPPABLE)}"
        )
    return None


def _handoff_refusal(message: TaskMessage, method: str) -> str | None:
    kind, config = message.kind, message.config
    if isinstance(config, DaisyTrain) and config.send:
        return (
            f"{kind} with send would send the model in the clear; under secure_aggregation "
            f"{method} it must arrive wrapped in the aggregation's protocol"
        )
    if isinstance(config, DaisyTrain) and config.handoff is None:
        return None  # trains the hosted model and keeps it: nothing leaves
    handoff = config.handoff if isinstance(config, DaisyTrain | DaisyReseal) else None
    if handoff is None or handoff.seal_to is None:
        return (
            f"{kind} would hand the model off unsealed (no handoff.seal_to); under "
            f"secure_aggregation {method} a hand-off is sealed to its recipient"
        )
    return None
