"""The consortium's signed roster: who its silos are (certificate fingerprint, verify key, sealing
public key) and which were revoked (with the reason), in a version that only grows, signed by
the operator's Ed25519 key (operator.key, the key that signs policies).

The signed text is the roster's canonical JSON (keys sorted, no spaces, UTF-8), so one roster
has one text; as for policies (privacy/policy_signing.py, PyNaCl) the signature covers those
exact bytes, and a text that is not canonical, whose JSON does not read as a roster, or whose
keys do not parse, is refused. Kept in the coordinator kit as `roster.json` ({"roster": text,
"signature": hex}), handed by the coordinator to every silo that joins a job, and checked there
(silo/roster_gate.py): the coordinator is never trusted with membership.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from nacl.encoding import HexEncoder
from nacl.public import PublicKey
from nacl.signing import SigningKey, VerifyKey
from pydantic import Field, ValidationError, field_validator

from fedsilo.policies.base import PolicyModel
from fedsilo.privacy.identity import parse_sealing_public_key, parse_verify_key
from fedsilo.privacy.policy_signing import PolicySignatureError, verify_policy
from fedsilo.wire.durable import write_atomically

ROSTER_FILE = "roster.json"
DEFAULT_REASON = "revoked by the operator"


class RosterError(ValueError):
    """A roster that is unsigned, tampered, of another consortium, older than one seen, or that
    does not read; the message says which."""


class RosterEntry(PolicyModel):
    """One silo as the roster knows it; its keys are hex, as in the kits."""

    certificate_fingerprint: str
    verify_key: str
    sealing_public_key: str

    @field_validator("verify_key")
    @classmethod
    def _verify_key_parses(cls, text: str) -> str:
        parse_verify_key(text, "verify_key")  # an IdentityError is a ValueError
        return text

    @field_validator("sealing_public_key")
    @classmethod
    def _sealing_key_parses(cls, text: str) -> str:
        parse_sealing_public_key(text, "sealing_public_key")
        return text

    @property
    def verify(self) -> VerifyKey:
        return parse_verify_key(self.verify_key, "verify_key")

    @property
    def sealing(self) -> PublicKey:
        return parse_sealing_public_key(self.sealing_public_key, "sealing_public_key")


class RosterDocument(PolicyModel):
    consortium: str
    version: int = Field(ge=1)
    silos: dict[str, RosterEntry]
    revoked: dict[str, str] = Field(default_factory=dict)  # silo -> why

    def canonical(self) -> str:
        return json.dumps(
            self.model_dump(), sort_keys=True, separators=(",", ":"), ensure_ascii=False
        )

    def following(
        self, silos: Mapping[str, RosterEntry], revoked: Mapping[str, str]
    ) -> RosterDocument:
        """The next version, with these members and revocations."""
        return RosterDocument(
            consortium=self.consortium,
            version=self.version + 1,
            silos=dict(silos),
            revoked=dict(revoked),
        )

    def revoking(self, silo: str, reason: str) -> RosterDocument:
        """The next version without member `silo`, revoked for `reason`."""
        if silo in self.revoked:
            raise RosterError(f"{silo}: already revoked in roster version {self.version}")
        if silo not in self.silos:
            raise RosterError(
                f"{silo}: not a member in roster version {self.version} "
                f"(members: {', '.join(sorted(self.silos)) or 'none'})"
            )
        members = {name: entry for name, entry in self.silos.items() if name != silo}
        return self.following(members, {**self.revoked, silo: reason})


@dataclass(frozen=True)
class SignedRoster:
    """A roster whose signature verified: its exact text, the signature and the document."""

    text: str
    signature: str
    document: RosterDocument

    @property
    def version(self) -> int:
        return self.document.version

    def to_json(self) -> dict[str, str]:
        return {"roster": self.text, "signature": self.signature}


def sign_roster(document: RosterDocument, operator_key: SigningKey) -> SignedRoster:
    text = document.canonical()
    signature = HexEncoder.encode(operator_key.sign(text.encode()).signature).decode("ascii")
    return SignedRoster(text, signature, document)


def verify_roster(
    text: str, signature: str, operator_verify_key: VerifyKey, consortium: str
) -> SignedRoster:
    """The roster if the operator signed exactly `text`, it is canonical and it is of
    `consortium`; else RosterError."""
    try:
        verify_policy(text.encode(), signature, operator_verify_key)
    except PolicySignatureError as exc:
        raise RosterError(str(exc).replace("policy", "roster", 2)) from None
    try:
        document = RosterDocument.model_validate(json.loads(text))
    except (json.JSONDecodeError, ValidationError) as exc:
        raise RosterError(f"the signed roster does not read: {exc}") from None
    if document.canonical() != text:
        raise RosterError("the signed roster is not in canonical form")
    if document.consortium != consortium:
        raise RosterError(
            f"the roster is of consortium {document.consortium!r}, not {consortium!r}"
        )
    return SignedRoster(text, signature, document)


def not_older(roster: SignedRoster, newest: SignedRoster | None) -> None:
    """RosterError when `roster` is older than `newest` (the newest seen), or another roster
    signed with the same version: a coordinator replaying an old one."""
    if newest is None:
        return
    if roster.version < newest.version:
        raise RosterError(
            f"roster version {roster.version} is older than version {newest.version} already "
            "seen: a rolled-back roster"
        )
    if roster.version == newest.version and roster.text != newest.text:
        raise RosterError(f"another roster was seen with the same version {roster.version}")


def read_roster_file(
    folder: Path, operator_verify_key: VerifyKey, consortium: str
) -> SignedRoster | None:
    """The verified roster in `folder`'s roster.json; None when there is none."""
    path = folder / ROSTER_FILE
    if not path.exists():
        return None
    try:
        stored = json.loads(path.read_text(encoding="utf-8"))
        text, signature = stored["roster"], stored["signature"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise RosterError(f"{path}: not a signed roster file: {exc}") from None
    if not isinstance(text, str) or not isinstance(signature, str):
        raise RosterError(f"{path}: roster and signature must be strings")
    try:
        return verify_roster(text, signature, operator_verify_key, consortium)
    except RosterError as exc:
        raise RosterError(f"{path}: {exc}") from None


def write_roster_file(folder: Path, roster: SignedRoster) -> Path:
    """Write `roster` to `folder`/roster.json whole or not at all."""
    path = folder / ROSTER_FILE
    write_atomically(path, [json.dumps(roster.to_json(), indent=2).encode() + b"\n"])
    return path
