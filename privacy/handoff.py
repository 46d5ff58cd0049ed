"""Daisy-chain hand-offs: a model packed for one recipient silo, sealed or in the clear.

`pack` writes the flat model as safetensors with a binding (deployment and round) in its
metadata; `seal` puts that in a nacl `SealedBox` for the recipient's X25519 key, so the
coordinator that relays it cannot read it and the recipient learns nothing of the sender
(a sealed box carries only an ephemeral key). `unpack` checks the binding, so an old hand-off
replayed in another round, or one from another deployment, is refused; `open_sealed` first
opens the box with the recipient's private key. A sealed box authenticates no sender: the
coordinator authenticates senders by their signed envelopes, and could inject a model of its
own (the FedDC paper's appendix A.7 discusses this limit; only DP protects the recipient's
view).
"""

from __future__ import annotations

import json

import torch
from nacl.exceptions import CryptoError
from nacl.public import PrivateKey, PublicKey, SealedBox
from safetensors import SafetensorError
from safetensors.torch import load, save

from fedsilo.wire.tasks.tensor_names import MODEL

BINDING = "binding"


class HandoffError(ValueError):
    """A hand-off that cannot be used: not for this silo, round or deployment, or malformed."""


def binding(deployment: str, round_no: int) -> str:
    return f"{deployment}/round {round_no}"


def pack(model: torch.Tensor, bound_to: str) -> bytes:
    if not bool(torch.isfinite(model).all()):
        raise HandoffError("refusing to hand off a model with NaN or infinite values")
    return save({MODEL: model.detach().cpu().contiguous()}, metadata={BINDING: bound_to})


def unpack(data: bytes, bound_to: str) -> torch.Tensor:
    try:
        tensors = load(data)
        found = _metadata(data).get(BINDING)
    except (SafetensorError, ValueError) as exc:  # json's errors are ValueErrors
        raise HandoffError(f"malformed hand-off: {exc}") from None
    if found != bound_to:
        raise HandoffError(f"the hand-off is bound to {found!r}, not {bound_to!r}")
    model = tensors.get(MODEL)
    if model is None or set(tensors) != {MODEL}:
        raise HandoffError(f"a hand-off holds exactly one tensor {MODEL!r}, not {sorted(tensors)}")
    if not bool(torch.isfinite(model).all()):
        raise HandoffError("the handed-off model holds NaN or infinite values")
    return model


def seal(packed: bytes, recipient: PublicKey) -> bytes:
    return bytes(SealedBox(recipient).encrypt(packed))


def open_sealed(sealed: bytes, recipient: PrivateKey) -> bytes:
    try:
        return SealedBox(recipient).decrypt(sealed)
    except CryptoError:
        raise HandoffError("the sealed hand-off does not open with this silo's key") from None


def _metadata(data: bytes) -> dict[str, str]:
    """The safetensors header's `__metadata__` (an 8-byte length, then JSON)."""
    length = int.from_bytes(data[:8], "little")
    header = json.loads(data[8 : 8 + length])
    return dict(header.get("__metadata__") or {})
