"""Signed deployment policies: the operator's Ed25519 signature over a policy file's exact bytes,
kept beside it as `<policy>.sig`, and the digest that names a verified policy.

Signing the bytes, not a parsed form, means a verifier needs no canonical YAML: one changed
byte (a comment, a space) and the signature no longer verifies.

A signed policy runs once; the operator may run it again after it failed, was refused or was
aborted by signing an *attempt* (`sign_attempt`: the policy's digest and the attempt's number,
under a label of its own, so an attempt's signature is never a policy's): a new attempt is a new
job with ids of its own, which only the operator, never the coordinator, can start.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

from nacl.encoding import HexEncoder
from nacl.exceptions import BadSignatureError
from nacl.signing import SigningKey, VerifyKey

from fedsilo.privacy.identity import public_key_hex

SIGNATURE_SUFFIX = ".sig"
SIGNATURE_BYTES = 64
# An attempt's statement ends in NUL, which no YAML file (so no policy) can hold; envelopes
# are signed under a label of their own (wire/envelope.py).
ATTEMPT_LABEL = b"fedsilo/policy-attempt|"


class PolicySignatureError(ValueError):
    """A policy whose signature is missing, malformed or does not verify."""


def policy_digest(policy_bytes: bytes) -> str:
    """BLAKE2b-256 (hex) of the policy's bytes: the name under which a policy is recorded."""
    return hashlib.blake2b(policy_bytes, digest_size=32).hexdigest()


def signature_path(policy_path: Path) -> Path:
    """Where the signature of `policy_path` is kept: `heart.yaml` -> `heart.yaml.sig`."""
    return policy_path.with_name(policy_path.name + SIGNATURE_SUFFIX)


def sign_policy(policy_path: Path, operator_key: SigningKey) -> Path:
    """Sign the policy file's bytes and write the hex signature beside it; return its path.

    Re-signing an edited policy replaces the old signature in one atomic rename.
    """
    signature = operator_key.sign(policy_path.read_bytes()).signature
    target = signature_path(policy_path)
    staging = target.with_name(f".{target.name}.{os.getpid()}.tmp")
    try:
        staging.write_text(HexEncoder.encode(signature).decode("ascii") + "\n")
        staging.replace(target)
    finally:
        staging.unlink(missing_ok=True)
    return target


def verify_policy(policy_bytes: bytes, signature_hex: str, operator_verify_key: VerifyKey) -> str:
    """The policy's digest if the operator signed exactly these bytes; else PolicySignatureError."""
    signature = _decode_signature(signature_hex)
    try:
        operator_verify_key.verify(policy_bytes, signature)
    except BadSignatureError:
        raise PolicySignatureError(
            "policy signature does not verify under operator key "
            f"{public_key_hex(operator_verify_key)}: the policy was changed after it was signed, "
            "or another key signed it"
        ) from None
    return policy_digest(policy_bytes)


def sign_attempt(operator_key: SigningKey, policy_digest: str, attempt: int) -> str:
    """The operator's signature (hex) of attempt `attempt` at the policy `policy_digest`."""
    return HexEncoder.encode(
        operator_key.sign(_attempt_statement(policy_digest, attempt)).signature
    ).decode("ascii")


def verify_attempt(
    policy_digest: str, attempt: int, signature_hex: str, operator_verify_key: VerifyKey
) -> None:
    """Raise PolicySignatureError unless the operator signed attempt `attempt` at the policy
    `policy_digest`."""
    signature = _decode_signature(signature_hex)
    try:
        operator_verify_key.verify(_attempt_statement(policy_digest, attempt), signature)
    except BadSignatureError:
        raise PolicySignatureError(
            f"attempt {attempt} at policy {policy_digest[:12]} is not signed by operator key "
            f"{public_key_hex(operator_verify_key)}"
        ) from None


def _attempt_statement(policy_digest: str, attempt: int) -> bytes:
    return ATTEMPT_LABEL + f"{policy_digest}|{attempt}".encode("ascii") + b"\x00"


def _decode_signature(signature_hex: str) -> bytes:
    try:
        signature = HexEncoder.decode(signature_hex.strip().encode("ascii"))
    except ValueError:  # non-ASCII, non-hex or odd-length text
        raise PolicySignatureError("policy signature is not hex-encoded") from None
    if len(signature) != SIGNATURE_BYTES:
        raise PolicySignatureError(
            f"policy signature has {len(signature)} bytes; an Ed25519 signature has "
            f"{SIGNATURE_BYTES}"
        )
    return signature
