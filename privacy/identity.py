"""Identities: Ed25519 signing keys and X25519 sealing keys, their key files and hex forms.

A private key file holds the raw 32 key bytes, hex-encoded, on one line. It is created with
mode 0600 and never overwritten; a key file that group or others can access is refused when
read, as ssh does. Public keys travel as hex strings (in kit files, in envelopes).
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path

from nacl.encoding import HexEncoder
from nacl.public import PrivateKey, PublicKey
from nacl.signing import SigningKey, VerifyKey

KEY_BYTES = 32
PRIVATE_FILE_MODE = 0o600


class IdentityError(ValueError):
    """A key or key file that cannot be used; the message names the file or the key's role."""


def write_secret_file(path: Path, content: bytes) -> None:
    """Create `path` with mode 0600 and write `content`; an existing file is never replaced."""
    try:
        descriptor = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, PRIVATE_FILE_MODE)
    except FileExistsError:
        raise IdentityError(f"{path}: already exists; refusing to overwrite a secret") from None
    try:
        with os.fdopen(descriptor, "wb") as handle:
            handle.write(content)
    except BaseException:
        path.unlink(missing_ok=True)
        raise


def write_private_key(path: Path, key: SigningKey | PrivateKey) -> None:
    """Write a signing or sealing private key to a new 0600 file, hex-encoded."""
    write_secret_file(path, key.encode(encoder=HexEncoder) + b"\n")


def read_secret_file(path: Path) -> bytes:
    """The bytes of a secret file that only its owner can access."""
    try:
        mode = path.stat().st_mode
    except FileNotFoundError:
        raise IdentityError(f"{path}: key file not found") from None
    if not stat.S_ISREG(mode):
        raise IdentityError(f"{path}: not a regular file")
    if mode & 0o077:
        raise IdentityError(
            f"{path}: private key is accessible by group or others "
            f"(mode {stat.S_IMODE(mode):04o}); run `chmod 600 {path}`"
        )
    return path.read_bytes()


def read_signing_key(path: Path) -> SigningKey:
    """The Ed25519 signing key stored in `path`."""
    return SigningKey(_read_key_bytes(path))


def read_sealing_key(path: Path) -> PrivateKey:
    """The X25519 sealing (decryption) key stored in `path`."""
    return PrivateKey(_read_key_bytes(path))


def noise_secret(key: SigningKey) -> bytes:
    """Key material for a party's noise draws, derived from its private signing key: it never
    leaves the party, and the same key gives the same noise (runs repeat bit for bit)."""
    return hashlib.blake2b(b"fedsilo/noise", key=key.encode()).digest()


def public_key_hex(key: VerifyKey | PublicKey) -> str:
    """The hex form of a public key, as written in kit files."""
    return key.encode(encoder=HexEncoder).decode("ascii")


def parse_verify_key(text: str, what: str) -> VerifyKey:
    """The Ed25519 verify key written as hex in `text`; `what` names it in errors."""
    return VerifyKey(_decode_hex_key(text, what))


def parse_sealing_public_key(text: str, what: str) -> PublicKey:
    """The X25519 public sealing key written as hex in `text`; `what` names it in errors."""
    return PublicKey(_decode_hex_key(text, what))


def _read_key_bytes(path: Path) -> bytes:
    try:
        text = read_secret_file(path).decode("ascii")
    except UnicodeDecodeError:
        raise IdentityError(f"{path}: not a hex-encoded key file") from None
    return _decode_hex_key(text, str(path))


def _decode_hex_key(text: str, what: str) -> bytes:
    try:
        raw = HexEncoder.decode(text.strip().encode("ascii"))
    except ValueError:  # non-ASCII, non-hex or odd-length text
        raise IdentityError(f"{what}: not a hex-encoded key") from None
    if len(raw) != KEY_BYTES:
        raise IdentityError(f"{what}: a key has {KEY_BYTES} bytes, got {len(raw)}")
    return raw
