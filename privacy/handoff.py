"""Daisy-chain hand-offs: a model packed for one recipient silo, signed by its sender, sealed
or in the clear.

`pack` writes the flat model as safetensors with its binding (deployment, round, phase and
recipient), its sender's name, its root (the digest of the model its lineage was adopted
from: a silo sends a hosted model into a secure sum only if it descends from the sum's
reference) and its holders (the members its sender knows held it, or a copy of it, before it,
latest first, as many as FedDC's `no_return_window`: the recipient seals it to none of them)
in the metadata, and signs those bytes with the sender's provisioned Ed25519
identity; `seal` puts them in a nacl `SealedBox` for the recipient's X25519
key, so the coordinator that relays them cannot read them. `unpack` checks the sender's
signature against the roster and the binding, so a model the coordinator made itself (anyone
can seal to a public key: the FedDC paper's appendix A.7 names this limit of sealed boxes),
an old hand-off replayed in another round or phase, one for another silo, or one from another
deployment is refused; `open_sealed` first opens the box with the recipient's private key.
The recipient learns who sent it, which the round's public seed tells it anyway (cyclic's
order and FedDC's permutations are drawn from it).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from nacl.exceptions import BadSignatureError, CryptoError
from nacl.public import PrivateKey, PublicKey, SealedBox
from nacl.signing import SigningKey, VerifyKey
from safetensors import SafetensorError
from safetensors.torch import load, save

from fedsilo.wire.tasks.tensor_names import MODEL
from fedsilo.wire.tensors import all_finite

BINDING, SENDER, ROOT, HOLDERS = "binding", "sender", "root", "holders"
SIGNATURE_BYTES = 64


class HandoffError(ValueError):
    """A hand-off that cannot be used: not signed by a member, not for this silo, round, phase
    or deployment, or malformed."""


@dataclass(frozen=True)
class Binding:
    """Where a hand-off belongs: one deployment's round and phase, and its recipient (None: a
    plain hand-off, which the sender packs without knowing who takes delivery)."""

    deployment: str
    round: int
    phase: str
    recipient: str | None

    @property
    def text(self) -> str:
        return f"{self.deployment}/r{self.round}/{self.phase}->{self.recipient or '*'}"


@dataclass(frozen=True)
class Handed:
    """A model a member handed on: the model, who sent it, its root, and the members its
    sender knew held it before (latest first)."""

    model: torch.Tensor
    sender: str
    root: bytes
    holders: tuple[str, ...] = ()


def pack(
    model: torch.Tensor,
    binding: Binding,
    sender: str,
    identity: SigningKey,
    root: bytes,
    holders: tuple[str, ...] = (),
) -> bytes:
    """The model, its binding, its sender, its root and its earlier `holders`, signed by the
    sender's identity."""
    if not all_finite(model):
        raise HandoffError("refusing to hand off a model with NaN or infinite values")
    metadata = {BINDING: binding.text, SENDER: sender, ROOT: root.hex()}
    body = save(
        {MODEL: model.detach().cpu().contiguous()},
        metadata=metadata | ({HOLDERS: json.dumps(list(holders))} if holders else {}),
    )
    return bytes(identity.sign(body))


def unpack(data: bytes, binding: Binding, roster: Mapping[str, VerifyKey]) -> Handed:
    """The model a member handed on under `binding`, with its sender and root."""
    signature, body = data[:SIGNATURE_BYTES], data[SIGNATURE_BYTES:]
    try:
        metadata = _metadata(body)
        tensors = load(body)
    except (SafetensorError, ValueError) as exc:  # json's errors are ValueErrors
        raise HandoffError(f"malformed hand-off: {exc}") from None
    sender = metadata.get(SENDER)
    if sender not in roster or sender == binding.recipient:
        raise HandoffError(f"the hand-off names {sender!r} as its sender, no other member")
    try:
        roster[sender].verify(body, signature)
    except (BadSignatureError, ValueError):
        raise HandoffError(f"the hand-off is not signed by {sender}'s identity") from None
    if metadata.get(BINDING) != binding.text:
        raise HandoffError(
            f"the hand-off is bound to {metadata.get(BINDING)!r}, not {binding.text!r}"
        )
    model = tensors.get(MODEL)
    if model is None or set(tensors) != {MODEL}:
        raise HandoffError(f"a hand-off holds exactly one tensor {MODEL!r}, not {sorted(tensors)}")
    if not all_finite(model):
        raise HandoffError("the handed-off model holds NaN or infinite values")
    try:
        root = bytes.fromhex(metadata.get(ROOT, ""))
    except ValueError:
        raise HandoffError("the hand-off's root is not hex") from None
    return Handed(model, sender, root, _holders(metadata.get(HOLDERS, "[]")))


def _holders(text: str) -> tuple[str, ...]:
    try:
        holders = json.loads(text)
    except ValueError:
        holders = None
    if not isinstance(holders, list) or not all(isinstance(h, str) for h in holders):
        raise HandoffError("the hand-off's holders are not a list of member names")
    return tuple(holders)


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
