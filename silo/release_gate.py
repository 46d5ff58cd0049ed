"""Which top-level tasks a silo may run under its own policy's `secure_aggregation` method: under
`masking` or `ckks` nothing that is a model, an update or an input to a sum leaves the silo in
the clear, whatever task the coordinator sends (issue 17: a coordinator that sent plain `train`
tasks under a masking policy collected every silo's model).

Every task kind declares what it sends (its config's `SENDS`, wire/tasks/release.py, where the
coordinator reads it too), and that decides when it may run. A kind missing from the silo's
registry (silo/tasks/__init__.py) is refused (fail closed), and a config declares what it sends
before its kind can run at all. Tasks
wrapped inside `secagg_mask` or `ckks_encrypt` are called by those handlers directly and never
pass this gate; the task the wrapper carries must be of a kind whose result the wrapper masks or
encrypts.
"""

from __future__ import annotations

from fedsilo.silo.tasks import TASK_KINDS
from fedsilo.silo.tasks.base import SiloContext
from fedsilo.wire.messages import TaskMessage
from fedsilo.wire.tasks import DaisyTrain, EncryptedInput, MaskedInput
from fedsilo.wire.tasks.release import Release

# What `secagg_mask` and `ckks_encrypt` may wrap: kinds whose result they mask or encrypt.
WRAPPABLE = frozenset(
    {"train", "superfed_train", "energy_signals", "daisy_train", "scaffold_train"}
    | {"feddro_train"}
)
WRAPPERS = {"secagg_mask": "masking", "ckks_encrypt": "ckks"}
PROTOCOL_OF = {Release.MASKED: "masking", Release.ENCRYPTED: "ckks"}


def refusal(message: TaskMessage, ctx: SiloContext) -> str | None:
    """Why `message`, a top-level task, must be refused under the silo's own
    `secure_aggregation` policy, or None when it may run."""
    method = ctx.secure_aggregation.method
    if message.kind not in TASK_KINDS:
        return f"task kind {message.kind!r} is unknown; refused under any policy"
    rule = message.config.SENDS
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
    handoff = config.handoff if isinstance(config, DaisyTrain) else None
    if handoff is None or handoff.seal_to is None:
        return (
            f"{kind} would hand the model off unsealed (no handoff.seal_to); under "
            f"secure_aggregation {method} a hand-off is sealed to its recipient"
        )
    return None
