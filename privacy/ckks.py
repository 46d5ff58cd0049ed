"""CKKS secure aggregation with TenSEAL: the cryptographic core (parameters, contexts, their
sealed distribution, chunked encryption, the coordinator's homomorphic sum, decryption).
The protocol's steps live with their parties; this module owns the pieces.

Who holds what. A designated key-holder silo generates the CKKS context with
`new_secret_context` (secret key and public key; no Galois keys, since sums need no rotations).
It seals the secret context to every other silo's X25519 key and signs it with its Ed25519
identity (`seal_context`); the coordinator forwards those bytes without being able to open them,
and a coordinator that substitutes a context of its own is caught by the signature
(`open_sealed_context`). The coordinator only ever holds the public context (`public_context`,
checked by `load_public_context`: no secret key, no Galois keys). Each silo encrypts its
weighted update in slot-sized chunks (`encrypt`) and signs them; a designated decryptor silo
checks the signed inputs the coordinator relays, adds them itself (`add_encrypted`) and decrypts
the total (`decrypt`), so it never decrypts a "sum" the coordinator made of one input. Compare
NVFLARE, whose provisioning admin generates one secret key and ships it in every client kit.

Collusion model. Every silo holds the same secret key, so the coordinator together with any one
silo can decrypt any single silo's update: the coordinator sees each silo's ciphertexts. Without
collusion the coordinator learns only sizes and timing; the decryptor receives every input
encrypted under a key it holds, so a curious decryptor can read them (masking has no such
party). A colluder is a decryption oracle for single updates. CKKS decryption is approximate,
and an exact decrypted value of a ciphertext the coordinator knows lets it solve for the secret
key (Li and Micciancio, Eurocrypt 2021): a decrypted aggregate that goes back to the coordinator
should be rounded or noised well above the precision error first. The ciphertexts are
authenticated by their silos' signatures (silo/tasks/ckks_sum.py), not by CKKS itself.

Precision. A fresh ciphertext at scale 2^40 (the default) decrypts with an absolute error of
about 1e-8 for values in [-1, 1] at degree 8192; sums add the errors. Values, and every sum of
them, must stay below `CkksSettings.max_abs_value` in magnitude: SEAL refuses larger values
at encryption, but a sum that crosses the bound wraps around silently.
"""

from __future__ import annotations

import functools
import hashlib
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import tenseal as ts
from nacl.public import PrivateKey, PublicKey, SealedBox
from nacl.signing import SigningKey, VerifyKey

from fedsilo.policies.secure_aggregation import CkksSettings, ckks_parameter_problem
from fedsilo.wire.tasks.tensor_names import CHUNK

if TYPE_CHECKING:
    import torch

FP32_BYTES = 4
CONTEXT_LABEL = b"fedsilo/ckks-secret-context|"


def chunk_name(index: int) -> str:
    return f"{CHUNK}{index:06d}"


def context_digest(public: bytes) -> str:
    """How the coordinator names the context it sums under: the digest of its public part."""
    return hashlib.sha256(public).hexdigest()


class CkksError(ValueError):
    """CKKS parameters, a context or ciphertexts that cannot be used; the message says why."""


# -- parameters -----------------------------------------------------------------------------


@dataclass(frozen=True)
class CkksParameters:
    """CKKS encryption parameters, as a policy states them.

    `coeff_mod_bit_sizes` lists the bit sizes of the coefficient modulus primes: the last is
    the special prime used only for key switching, the others form the modulus ciphertexts
    live under. Sums need no multiplications, so the inner primes only widen ciphertexts; the
    default (60, 40, 40, 60) is TenSEAL's usual choice and leaves room for a multiplication
    or two, (60, 60) gives ciphertexts about 2.5 times smaller at the same precision.
    """

    poly_modulus_degree: int = 8192
    coeff_mod_bit_sizes: tuple[int, ...] = (60, 40, 40, 60)
    global_scale_bits: int = 40

    def __post_init__(self) -> None:
        object.__setattr__(self, "coeff_mod_bit_sizes", tuple(self.coeff_mod_bit_sizes))
        problem = ckks_parameter_problem(
            self.poly_modulus_degree, self.coeff_mod_bit_sizes, self.global_scale_bits
        )
        if problem:
            raise CkksError(problem)

    @classmethod
    def of(cls, settings: CkksSettings) -> CkksParameters:
        """The parameters a policy's `secure_aggregation.ckks` section names."""
        return cls(
            settings.poly_modulus_degree, settings.coeff_mod_bit_sizes, settings.global_scale_bits
        )

    @property
    def slots(self) -> int:
        """Values one ciphertext holds: half the polynomial modulus degree."""
        return self.poly_modulus_degree // 2

    @property
    def global_scale(self) -> float:
        """The encoding scale, 2^global_scale_bits."""
        return 2.0**self.global_scale_bits


# -- contexts -------------------------------------------------------------------------------


def new_secret_context(params: CkksParameters | None = None) -> bytes:
    """A fresh CKKS context with its secret key, serialized: what the key-holder silo makes.

    No Galois keys are generated. TenSEAL makes relinearisation keys with every context (they
    cannot be skipped), but they are not serialized: sums need none, and a context loaded
    with its secret key regenerates them anyway.
    """
    context = _new_context(params or CkksParameters())
    return context.serialize(
        save_public_key=True, save_secret_key=True, save_galois_keys=False, save_relin_keys=False
    )


def public_context(secret_context: bytes) -> bytes:
    """The public part of a serialized context (parameters, scale and public key): what the
    coordinator holds. Without secret key, Galois keys and relinearisation keys."""
    context = load_secret_context(secret_context)
    return context.serialize(
        save_public_key=True, save_secret_key=False, save_galois_keys=False, save_relin_keys=False
    )


def load_public_context(data: bytes, expected: CkksParameters | None = None) -> ts.Context:
    """The coordinator's context. Refused if it holds a secret key or Galois keys, or, when
    `expected` is given, if its parameters or scale differ from the policy's."""
    context = _load_context(data, "public context")
    if context.has_secret_key():
        raise CkksError(
            "public context: holds a secret key; the coordinator must never receive one "
            "(send public_context(...) instead)"
        )
    if context.has_galois_keys():
        raise CkksError(
            "public context: holds Galois keys; sums need no rotations, so none are accepted"
        )
    if expected is not None:
        _check_parameters(context, expected, "public context")
    return context


def load_secret_context(data: bytes, expected: CkksParameters | None = None) -> ts.Context:
    """A silo's context, with the secret key. Refused without one, or, when `expected` is
    given, if its parameters or scale differ from the policy's."""
    context = _load_context(data, "secret context")
    if not context.has_secret_key():
        raise CkksError("secret context: holds no secret key, so it cannot decrypt")
    if expected is not None:
        _check_parameters(context, expected, "secret context")
    return context


def parameters_match(context: ts.Context, params: CkksParameters) -> bool:
    """Whether `context` was made with `params`: the same SEAL parameter set (degree and
    coefficient primes, compared by SEAL's parameter id) and the same global scale."""
    return (
        _scheme_is_ckks(context)
        and tuple(context.seal_context().data.key_parms_id()) == _reference_parms_id(params)
        and _global_scale(context) == params.global_scale
    )


# -- distribution of the secret context -----------------------------------------------------


def seal_context(secret_context: bytes, recipient: PublicKey, key_holder: SigningKey) -> bytes:
    """`secret_context` for `recipient` only, signed by the key holder's identity: sealed to
    the recipient's X25519 key (nacl `SealedBox`), so the coordinator that forwards it cannot
    read it, and signed with the key holder's Ed25519 key over the recipient's key, so the
    coordinator cannot substitute a context whose secret key it knows (a sealed box alone is
    anonymous)."""
    signed = key_holder.sign(_context_label(recipient) + secret_context)
    return bytes(SealedBox(recipient).encrypt(bytes(signed)))


def open_sealed_context(sealed: bytes, recipient: PrivateKey, key_holder: VerifyKey) -> bytes:
    """The secret context in `sealed`, checked to come from `key_holder` for `recipient`.

    Raises nacl's `CryptoError` when `sealed` does not open with `recipient`, and its subclass
    `BadSignatureError` when the key holder's signature does not verify. Load the result with
    `load_secret_context`.
    """
    signed = SealedBox(recipient).decrypt(sealed)
    plain = key_holder.verify(signed)
    label = _context_label(recipient.public_key)
    if not plain.startswith(label):
        raise CkksError("sealed context: signed for another recipient")
    return plain[len(label) :]


def _context_label(recipient: PublicKey) -> bytes:
    return CONTEXT_LABEL + bytes(recipient) + b"|"


# -- encryption, sums, decryption -----------------------------------------------------------


def encrypt(values: np.ndarray | torch.Tensor, context: ts.Context) -> list[bytes]:
    """`values` (1-D, finite floats) as serialized `ckks_vector` chunks of `slots` values each,
    in order; the last chunk holds the rest. No values, no chunks."""
    array = _as_vector(values)
    slots = _slots(context)
    limit = _max_abs_value(context)
    if array.size and not np.isfinite(array).all():
        raise CkksError("values must be finite (found NaN or infinity)")
    if array.size and np.abs(array).max() > limit:
        raise CkksError(
            f"values reach {np.abs(array).max():.3g} in magnitude; these parameters hold at "
            f"most {limit:.3g}"
        )
    chunks = []
    for start in range(0, array.size, slots):
        try:
            chunks.append(ts.ckks_vector(context, array[start : start + slots]).serialize())
        except ValueError as error:  # SEAL's own bound on encoded values
            raise CkksError(f"values from index {start} cannot be encrypted: {error}") from None
    return chunks


def add_encrypted(context: ts.Context, summands: Sequence[Sequence[bytes]]) -> list[bytes]:
    """The chunk-wise homomorphic sum of several silos' chunk lists, serialized: what the
    decryptor computes from the signed inputs it checked (and the coordinator, with its public
    context, to refuse inputs that cannot be added). One chunk position at a time, so memory
    holds one sum and one summand, not every silo's update.

    Refused when there are no summands, when the lists differ in length or a chunk differs in
    size, or when a chunk is not a ciphertext for this context's parameters and scale.
    """
    if not summands:
        raise CkksError("nothing to add: no silos' chunk lists")
    counts = [len(chunks) for chunks in summands]
    if len(set(counts)) > 1:
        raise CkksError(f"summands have different numbers of chunks: {counts} (by position)")
    total: list[bytes] = []
    for index in range(counts[0]):
        acc = _load_vector(context, summands[0][index], f"summand 0, chunk {index}")
        for silo, chunks in enumerate(summands[1:], start=1):
            where = f"summand {silo}, chunk {index}"
            term = _load_vector(context, chunks[index], where)
            if term.size() != acc.size():
                raise CkksError(
                    f"{where}: holds {term.size()} values where summand 0 holds {acc.size()}"
                )
            try:
                acc.add_(term)
            except ValueError as error:  # e.g. a ciphertext made at another scale
                raise CkksError(f"{where}: cannot be added ({error})") from None
        total.append(acc.serialize())
    return total


def decrypt(chunks: Sequence[bytes], context: ts.Context, length: int) -> np.ndarray:
    """The `length` values held by `chunks`, as float64, decrypted with the secret `context`.
    Refused when the context has no secret key or the chunks hold another number of values."""
    if not context.has_secret_key():
        raise CkksError("decrypt: the context holds no secret key")
    parts = [
        np.asarray(_load_vector(context, chunk, f"chunk {i}").decrypt(), dtype=np.float64)
        for i, chunk in enumerate(chunks)
    ]
    result = np.concatenate(parts) if parts else np.zeros(0, dtype=np.float64)
    if result.size != length:
        raise CkksError(f"decrypt: the chunks hold {result.size} values, expected {length}")
    return result


# -- measurement ----------------------------------------------------------------------------


@dataclass(frozen=True)
class CkksMeasurement:
    """What CKKS aggregation costs at some parameters, measured on random values in [-1, 1]."""

    params: CkksParameters
    length: int
    silos: int
    encrypt_seconds: float  # one silo's encryption of `length` values
    add_seconds: float  # the coordinator's sum of `silos` updates
    decrypt_seconds: float
    ciphertext_bytes: int  # one silo's serialized chunks
    max_abs_error: float  # of the decrypted sum against the plaintext sum

    @property
    def bytes_per_value(self) -> float:
        return self.ciphertext_bytes / self.length

    @property
    def expansion_vs_fp32(self) -> float:
        """Ciphertext bytes over the bytes of the same values as float32."""
        return self.ciphertext_bytes / (FP32_BYTES * self.length)


def measure(
    params: CkksParameters | None = None, length: int = 100_000, silos: int = 3, seed: int = 0
) -> CkksMeasurement:
    """Encrypt `silos` random vectors of `length` values under a throwaway context, add them as
    the coordinator would and decrypt: times, ciphertext size and precision error."""
    params = params or CkksParameters()
    if length < 1 or silos < 1:
        raise CkksError(f"measure: need length and silos of at least 1 ({length}, {silos})")
    secret_bytes = new_secret_context(params)
    secret = load_secret_context(secret_bytes)
    coordinator = load_public_context(public_context(secret_bytes), expected=params)
    rng = np.random.default_rng(seed)
    updates = [rng.uniform(-1.0, 1.0, length) for _ in range(silos)]
    start = time.perf_counter()
    encrypted = [encrypt(update, secret) for update in updates]
    encrypt_seconds = (time.perf_counter() - start) / silos
    start = time.perf_counter()
    total = add_encrypted(coordinator, encrypted)
    add_seconds = time.perf_counter() - start
    start = time.perf_counter()
    decrypted = decrypt(total, secret, length)
    decrypt_seconds = time.perf_counter() - start
    return CkksMeasurement(
        params=params,
        length=length,
        silos=silos,
        encrypt_seconds=encrypt_seconds,
        add_seconds=add_seconds,
        decrypt_seconds=decrypt_seconds,
        ciphertext_bytes=sum(len(chunk) for chunk in encrypted[0]),
        max_abs_error=float(np.abs(decrypted - np.sum(updates, axis=0)).max()),
    )


# -- helpers --------------------------------------------------------------------------------


def _new_context(params: CkksParameters) -> ts.Context:
    try:
        context = ts.context(
            ts.SCHEME_TYPE.CKKS,
            poly_modulus_degree=params.poly_modulus_degree,
            coeff_mod_bit_sizes=list(params.coeff_mod_bit_sizes),
        )
    except (ValueError, RuntimeError) as error:  # e.g. too few primes of a small bit size
        raise CkksError(f"SEAL refuses {params}: {error}") from None
    context.global_scale = params.global_scale
    return context


def _load_context(data: bytes, what: str) -> ts.Context:
    try:
        context = ts.context_from(bytes(data))
    except (ValueError, RuntimeError, TypeError) as error:
        raise CkksError(f"{what}: not a serialized TenSEAL context ({error})") from None
    if not _scheme_is_ckks(context):
        raise CkksError(f"{what}: not a CKKS context")
    if _global_scale(context) is None:
        raise CkksError(f"{what}: has no global scale")
    return context


def _check_parameters(context: ts.Context, expected: CkksParameters, what: str) -> None:
    if not parameters_match(context, expected):
        raise CkksError(
            f"{what}: made with other parameters than the policy's {expected} "
            f"(degree {_degree(context)}, scale 2^{math.log2(_global_scale(context)):g})"
        )


@functools.lru_cache(maxsize=8)
def _reference_parms_id(params: CkksParameters) -> tuple[int, ...]:
    """SEAL's id of the parameter set `params` makes (a hash of degree and primes; the primes
    are chosen deterministically from the bit sizes)."""
    return tuple(_new_context(params).seal_context().data.key_parms_id())


def _scheme_is_ckks(context: ts.Context) -> bool:
    parms = context.seal_context().data.key_context_data().parms()
    return parms.scheme() == ts.SCHEME_TYPE.CKKS.value


def _degree(context: ts.Context) -> int:
    return int(context.seal_context().data.key_context_data().parms().poly_modulus_degree())


def _slots(context: ts.Context) -> int:
    return _degree(context) // 2


def _global_scale(context: ts.Context) -> float | None:
    try:
        return float(context.global_scale)
    except ValueError:  # "no global scale"
        return None


def _max_abs_value(context: ts.Context) -> float:
    """2^(bits of the data modulus - scale bits - 1), read from the context."""
    data_bits = context.seal_context().data.first_context_data().total_coeff_modulus_bit_count()
    return 2.0 ** (data_bits - math.log2(context.global_scale) - 1)


def _load_vector(context: ts.Context, data: bytes, where: str) -> ts.CKKSVector:
    try:
        return ts.ckks_vector_from(context, bytes(data))
    except (ValueError, RuntimeError, TypeError) as error:
        raise CkksError(
            f"{where}: not a CKKS ciphertext for this context's parameters ({error})"
        ) from None


def _as_vector(values: np.ndarray | torch.Tensor) -> np.ndarray:
    if hasattr(values, "detach"):  # a torch tensor, without importing torch here
        values = values.detach().cpu().double().numpy()
    array = np.asarray(values)
    if array.ndim != 1:
        raise CkksError(f"values must be 1-D, not of shape {tuple(array.shape)}")
    if not (np.issubdtype(array.dtype, np.floating) or np.issubdtype(array.dtype, np.integer)):
        raise CkksError(f"values must be real numbers, not {array.dtype}")
    return array.astype(np.float64, copy=False)
