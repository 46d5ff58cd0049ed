"""Identities and signed policies: key files are private and never replaced, public keys travel
as hex, and a policy verifies only byte for byte under the operator's key."""

import hashlib
import os
from pathlib import Path

import pytest
from nacl.public import PrivateKey
from nacl.signing import SigningKey

from fedsilo.privacy.identity import (
    IdentityError,
    parse_sealing_public_key,
    parse_verify_key,
    public_key_hex,
    read_sealing_key,
    read_signing_key,
    write_private_key,
)
from fedsilo.privacy.policy_signing import (
    PolicySignatureError,
    policy_digest,
    sign_policy,
    verify_policy,
)

POLICY = b"version: 1\nname: heart\nrounds: 20\nalgorithm: {name: fedavg}\n"


def mode(path: Path) -> int:
    return path.stat().st_mode & 0o777


def test_a_signing_key_round_trips_through_a_0600_file(tmp_path: Path) -> None:
    key = SigningKey.generate()
    path = tmp_path / "signing.key"
    write_private_key(path, key)
    assert mode(path) == 0o600
    assert read_signing_key(path) == key


def test_a_sealing_key_round_trips_through_a_0600_file(tmp_path: Path) -> None:
    key = PrivateKey.generate()
    path = tmp_path / "sealing.key"
    write_private_key(path, key)
    assert mode(path) == 0o600
    assert bytes(read_sealing_key(path)) == bytes(key)


def test_a_key_file_is_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "signing.key"
    write_private_key(path, SigningKey.generate())
    before = path.read_bytes()
    with pytest.raises(IdentityError, match="already exists; refusing to overwrite"):
        write_private_key(path, SigningKey.generate())
    assert path.read_bytes() == before


def test_a_key_file_readable_by_others_is_refused_with_the_fix(tmp_path: Path) -> None:
    path = tmp_path / "signing.key"
    write_private_key(path, SigningKey.generate())
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError) as err:
        read_signing_key(path)
    assert str(path) in str(err.value)
    assert "mode 0644" in str(err.value)
    assert f"chmod 600 {path}" in str(err.value)


def test_a_missing_or_corrupt_key_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(IdentityError, match="key file not found"):
        read_signing_key(tmp_path / "absent.key")
    corrupt = tmp_path / "corrupt.key"
    corrupt.write_text("not hex\n")
    corrupt.chmod(0o600)
    with pytest.raises(IdentityError, match="corrupt.key: not a hex-encoded key"):
        read_sealing_key(corrupt)
    short = tmp_path / "short.key"
    short.write_text("abcd\n")
    short.chmod(0o600)
    with pytest.raises(IdentityError, match="a key has 32 bytes, got 2"):
        read_signing_key(short)


def test_public_keys_round_trip_as_hex() -> None:
    signing, sealing = SigningKey.generate(), PrivateKey.generate()
    verify_hex = public_key_hex(signing.verify_key)
    sealing_hex = public_key_hex(sealing.public_key)
    assert len(verify_hex) == len(sealing_hex) == 64
    assert parse_verify_key(verify_hex, "operator") == signing.verify_key
    assert bytes(parse_sealing_public_key(sealing_hex, "va")) == bytes(sealing.public_key)
    with pytest.raises(IdentityError, match="operator verify key: not a hex-encoded key"):
        parse_verify_key("zz" * 32, "operator verify key")


def test_policy_digest_is_blake2b_256_of_the_bytes() -> None:
    assert policy_digest(POLICY) == hashlib.blake2b(POLICY, digest_size=32).hexdigest()


def test_a_signed_policy_verifies_and_yields_its_digest(tmp_path: Path) -> None:
    operator = SigningKey.generate()
    policy = tmp_path / "heart.yaml"
    policy.write_bytes(POLICY)
    signature = sign_policy(policy, operator)
    assert signature == tmp_path / "heart.yaml.sig"
    digest = verify_policy(POLICY, signature.read_text(), operator.verify_key)
    assert digest == policy_digest(POLICY)


def test_one_changed_byte_is_rejected(tmp_path: Path) -> None:
    operator = SigningKey.generate()
    policy = tmp_path / "heart.yaml"
    policy.write_bytes(POLICY)
    signature_hex = sign_policy(policy, operator).read_text()
    tampered = POLICY.replace(b"rounds: 20", b"rounds: 21")
    with pytest.raises(PolicySignatureError, match="changed after it was signed"):
        verify_policy(tampered, signature_hex, operator.verify_key)


def test_a_policy_signed_by_another_key_is_rejected(tmp_path: Path) -> None:
    policy = tmp_path / "heart.yaml"
    policy.write_bytes(POLICY)
    signature_hex = sign_policy(policy, SigningKey.generate()).read_text()
    operator = SigningKey.generate().verify_key
    with pytest.raises(PolicySignatureError, match=public_key_hex(operator)):
        verify_policy(POLICY, signature_hex, operator)


def test_a_malformed_signature_is_named() -> None:
    operator = SigningKey.generate().verify_key
    with pytest.raises(PolicySignatureError, match="not hex-encoded"):
        verify_policy(POLICY, "xyz", operator)
    with pytest.raises(PolicySignatureError, match="has 3 bytes; an Ed25519 signature has 64"):
        verify_policy(POLICY, "abcdef", operator)


def test_re_signing_an_edited_policy_replaces_its_signature(tmp_path: Path) -> None:
    operator = SigningKey.generate()
    policy = tmp_path / "heart.yaml"
    policy.write_bytes(POLICY)
    sign_policy(policy, operator)
    policy.write_bytes(POLICY + b"seed: 3\n")
    signature = sign_policy(policy, operator)
    assert verify_policy(policy.read_bytes(), signature.read_text(), operator.verify_key)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["heart.yaml", "heart.yaml.sig"]
