"""Pairwise masking for secure aggregation (Bonawitz et al. 2017, as SecAgg+ runs it): the
cryptography both ends share. The protocol's four steps live with their parties
(silo/tasks/secure_sum.py, coordinator/secure_sum.py); this module owns the pieces.

- `FixedPoint`: a weighted update, each coordinate clipped to [-bound, bound], times its
  weight w (the weights of a round sum to at most 1), rounded to a multiple of 2^-f and
  held in Z_{2^32}. A sum of such terms is at most bound * 2^f + n / 2 in magnitude, and f is
  the largest that keeps that below 2^31 for n silos: overflow cannot happen by construction.
- `MaskingKeys` / `Advertisement`: each silo's two X25519 key pairs for one aggregation (one
  to encrypt its shares to peers, one for pairwise mask agreement), advertised with an Ed25519
  signature by its provisioned identity over the aggregation's context. Peers verify it, so a
  coordinator that substitutes a key is caught (Flower's SecAgg+ relays keys unsigned).
- `advertisement_digest`: what names one silo's view of an aggregation (the label and every
  advertised key); shares are encrypted bound to it, so a share made under another view (a
  coordinator that relayed different key sets to different silos) does not open.
- `consistency_statement` / `signed_by`: Bonawitz et al.'s consistency check, extended to
  what the silos received. After the masked inputs, every survivor signs the label, its view,
  the weight vector, the survivor set and the digest of the task its input was for with its
  provisioned identity; a silo reveals shares only after verifying t signatures from
  survivors over exactly its own statement, and reveals a survivor's self-mask share only when
  that survivor signed the same statement (another survivor's input stays masked: its
  masking-key share is revealed as a dropped silo's is). Honest silos sign one statement per
  aggregation, so with 2t > n + c a coordinator cannot show two survivor sets (one with a
  silo, to get its seed, one without, to get its key) to t silos each, nor unmask the input of
  a silo it sent another model or other settings than the rest.
- `weight_problem`: the rule coordinator-chosen weights must follow (no key outside the
  aggregation, each finite and in [0, 1], summing to at most 1, and at least `min_group`
  silos of the sum carrying `min_weight` or more).
- `split_secret` (`shares_for`: at some indices only) / `combine_shares`: t-of-n Shamir
  sharing of 16-byte blocks over GF(2^128), block by block for longer secrets, in the field
  and share encoding of PyCryptodome's `Shamir` (x^128 + x^7 + x^2 + x + 1, 16-byte
  big-endian elements, indices 1..n), with a 4-bit windowed multiplication instead of its bit
  by bit one, and, where a share is evaluated at a silo's index (a small element), a shift
  per set bit of the index. Reconstruction takes the
  Lagrange coefficients at 0 of the shares' index set from a cache (an aggregation rebuilds
  every secret from the same survivors, and the next round usually from the same ones again),
  so each 16-byte block costs t multiplications. Like PyCryptodome's pure-Python field, this
  arithmetic is not constant-time: a silo's split runs on its own machine, and the
  coordinator's reconstruction handles only secrets the protocol lets it learn.
- `prg` / `KeyStreams`: mask streams in Z_{2^32}: AES-256's counter-mode keystream (run
  through OpenSSL's GCM, which is faster: see `_keystream`) under a key derived with
  HKDF-SHA256 from a seed (a self-mask seed, or a pairwise secret from X25519 agreement) and
  a context: `tensor_context`, the aggregation's label and the tensor's name, so the tensors
  of one masked input never share a mask (the difference of two would otherwise travel
  unmasked). `KeyStreams` reads several side by side a chunk at a time, so that the
  coordinator sums a chunk of the masked inputs and unmasks it while the chunk is in cache.
- `neighbourhood` / `graph_seed`: SecAgg+'s sparse graph (Bell et al. 2020), for a policy's
  `neighbours: k`: the Harary graph H(k, n) (a ring, each silo joined to the k/2 nearest on
  either side) over the roster in an order drawn from the deployment and the digest of the
  signed policy. Every silo computes it from what it already holds, before any key exists;
  nothing the coordinator relays or a colluding silo advertises can re-roll it.
- `mask_streams` and `unmask_terms`: y_u = x_u + PRG(b_u) + sum_v sign(u, v) PRG(s_uv), sign +1
  when u sorts before v, so pairwise masks cancel in a sum over silos; the coordinator removes the
  survivors' self-masks and the dropped silos' pairwise masks (with the survivors that masked
  with them: all of them on the complete graph, their neighbours on the sparse one) from
  reconstructed secrets.

Everything random (keys, self-mask seeds, Shamir coefficients) comes from the system's CSPRNG:
masks must not be reproducible by anyone else. The unmasked sum is exact in Z_{2^32}, so
results still repeat bit for bit.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers import Cipher, CipherContext, algorithms, modes
from cryptography.hazmat.primitives.kdf.hkdf import HKDF
from nacl.exceptions import BadSignatureError, CryptoError
from nacl.public import Box, PrivateKey, PublicKey
from nacl.signing import SigningKey, VerifyKey
from nacl.utils import random as random_bytes

KEY_BYTES = 32
SEED_BYTES = 32
BLOCK = 16  # Shamir shares 16-byte blocks
SIGNED_ADVERTISEMENT_BYTES = 2 * KEY_BYTES + 64

WEIGHT_SLACK = 1e-9  # rounding in weights that are shares of a total


def aggregation_label(deployment: str, round_no: int, phase: str) -> bytes:
    """What binds one aggregation's keys, shares and masks to it (both ends build the same)."""
    return f"{deployment}/r{round_no}/{phase}".encode()


def tensor_context(label: bytes, tensor: str) -> bytes:
    """The mask streams' context of `tensor` in the aggregation `label`: one stream per tensor."""
    return label + b"|tensor=" + tensor.encode()


class MaskingError(ValueError):
    """A step of secure aggregation that cannot go on; the message says what failed."""


# -- fixed point ----------------------------------------------------------------------------

# The finest encoding used, whatever the bound: 2^-64 is below every update float64 tells from 0
# next to its other coordinates, and a finer scale would overflow float64 (a bound of 1e-300
# asks for 2^1027).
MAX_FRACTION_BITS = 64


@dataclass(frozen=True)
class FixedPoint:
    """Weighted values in Z_{2^32}: round(w * clip(x, -bound, bound) * 2^fraction_bits)."""

    bound: float
    fraction_bits: int

    @classmethod
    def for_silos(cls, bound: float, silos: int) -> FixedPoint:
        """The finest encoding whose sum over `silos` weighted terms (weights summing to at
        most 1) cannot overflow: bound * 2^f + silos / 2 < 2^31."""
        if not (bound > 0 and math.isfinite(bound)) or silos < 1:
            raise MaskingError(f"need a positive bound and at least one silo ({bound}, {silos})")
        bits = min(math.floor(math.log2(2**31 - silos) - math.log2(bound)), MAX_FRACTION_BITS)
        while bound * 2.0**bits + silos / 2 >= 2**31:  # log2's rounding at the edge
            bits -= 1
        if bits < 1:
            raise MaskingError(f"bound {bound:g} leaves no fractional bits in 32-bit sums")
        return cls(bound, bits)

    @property
    def precision(self) -> float:
        """The spacing of representable values, 2^-fraction_bits."""
        return 2.0**-self.fraction_bits

    def encode(self, values: np.ndarray, weight: float, *, scratch: bool = False) -> np.ndarray:
        """`scratch`: `values` is a float64 buffer the caller gives up, clipped, scaled and
        rounded in place (saves a fresh buffer, whose page faults cost more than the work)."""
        if not 0.0 <= weight <= 1.0:
            raise MaskingError(f"a weight must lie in [0, 1], not {weight!r}")
        # one float64 buffer, scaled and rounded in place (a fresh one per step cost as much)
        values = np.asarray(values, dtype=np.float64)
        scaled = np.clip(values, -self.bound, self.bound, out=values if scratch else None)
        np.multiply(scaled, weight * 2.0**self.fraction_bits, out=scaled)
        np.rint(scaled, out=scaled)
        # |value| <= bound * 2^f < 2^31, so int32 holds it exactly; its bits are the value
        # modulo 2^32 (casting through int64 to uint32 did the same, 10x slower in numpy 2)
        return scaled.astype(np.int32).view(np.uint32)

    def decode(self, total: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
        """A sum of encoded terms (modulo 2^32) as float64 (written to `out` where given)."""
        return np.multiply(total.view(np.int32), self.precision, out=out, dtype=np.float64)


# -- keys and their signed advertisement -----------------------------------------------------


@dataclass(frozen=True)
class Advertisement:
    """A silo's public keys for one aggregation, signed by its identity over the context."""

    silo: str
    encryption_key: PublicKey  # peers encrypt their shares for this silo to it
    masking_key: PublicKey  # pairwise mask agreement
    signature: bytes

    def to_bytes(self) -> bytes:
        return bytes(self.encryption_key) + bytes(self.masking_key) + self.signature

    @classmethod
    def from_bytes(cls, silo: str, data: bytes) -> Advertisement:
        if len(data) != SIGNED_ADVERTISEMENT_BYTES:
            raise MaskingError(
                f"{silo}'s advertisement is {len(data)} bytes, not {SIGNED_ADVERTISEMENT_BYTES}"
            )
        return cls(
            silo,
            PublicKey(data[:KEY_BYTES]),
            PublicKey(data[KEY_BYTES : 2 * KEY_BYTES]),
            data[2 * KEY_BYTES :],
        )

    def verify(self, verify_key: VerifyKey, context: bytes) -> None:
        """Raise `MaskingError` unless the silo's identity signed these keys for `context`."""
        try:
            verify_key.verify(_signed_part(context, self), self.signature)
        except BadSignatureError:
            raise MaskingError(
                f"the keys advertised for {self.silo} are not signed by {self.silo}'s identity "
                "for this aggregation: refusing them (a substituted or replayed key)"
            ) from None


@dataclass(frozen=True)
class MaskingKeys:
    """One silo's private keys for one aggregation."""

    encryption: PrivateKey
    masking: PrivateKey

    @classmethod
    def generate(cls) -> MaskingKeys:
        return cls(PrivateKey.generate(), PrivateKey.generate())

    def advertise(self, silo: str, identity: SigningKey, context: bytes) -> Advertisement:
        unsigned = Advertisement(silo, self.encryption.public_key, self.masking.public_key, b"")
        signature = identity.sign(_signed_part(context, unsigned)).signature
        return Advertisement(silo, unsigned.encryption_key, unsigned.masking_key, signature)


def _signed_part(context: bytes, advertisement: Advertisement) -> bytes:
    return b"|".join(
        (
            b"fedsilo/secagg-keys",
            context,
            advertisement.silo.encode(),
            bytes(advertisement.encryption_key),
            bytes(advertisement.masking_key),
        )
    )


# -- Shamir shares and their encryption to peers --------------------------------------------


def split_secret(secret: bytes, threshold: int, parties: int) -> list[bytes]:
    """`parties` shares of `secret` (a multiple of 16 bytes), any `threshold` of which
    recover it; share i (0-based) belongs to the party with Shamir index i + 1."""
    if not 1 <= threshold <= parties:
        raise MaskingError(f"threshold {threshold} must lie in 1..{parties}")
    shares = shares_for(secret, threshold, range(1, parties + 1))
    return [shares[index] for index in range(1, parties + 1)]


def shares_for(secret: bytes, threshold: int, indices: Iterable[int]) -> dict[int, bytes]:
    """The shares of one t-of-n sharing of `secret` at the Shamir `indices` only (the sparse
    graph's holders: a silo and its neighbours, each at its index among the advertised)."""
    if len(secret) % BLOCK or not secret:
        raise MaskingError(f"a shared secret is a positive multiple of {BLOCK} bytes")
    wanted = sorted(set(indices))
    if threshold < 1 or not wanted or wanted[0] < 1:
        raise MaskingError(f"threshold {threshold} and Shamir indices {wanted} must be >= 1")
    shares = dict.fromkeys(wanted, b"")
    for start in range(0, len(secret), BLOCK):
        # p(x) = secret + c_1 x + ... + c_{t-1} x^{t-1}, the c_i from the CSPRNG
        coefficients = [_element(random_bytes(BLOCK)) for _ in range(threshold - 1)]
        constant = _element(secret[start : start + BLOCK])
        for index in wanted:
            value = 0
            for coefficient in coefficients:  # Horner's rule, highest degree first
                value = _gf_multiply_small(value ^ coefficient, index)
            shares[index] += (value ^ constant).to_bytes(BLOCK, "big")
    return shares


def combine_shares(shares: Mapping[int, bytes], threshold: int) -> bytes:
    """The secret from at least `threshold` shares, keyed by Shamir index (1-based)."""
    if len(shares) < threshold:
        raise MaskingError(f"{len(shares)} shares cannot recover a {threshold}-of-n secret")
    chosen = sorted(shares.items())[:threshold]
    length = len(chosen[0][1])
    if any(len(piece) != length for _, piece in chosen) or length % BLOCK:
        raise MaskingError("shares of one secret must have the same length")
    if any(index < 1 for index, _ in chosen):
        raise MaskingError("Shamir indices start at 1")
    tables = _lagrange_at_zero(tuple(index for index, _ in chosen))
    secret = bytearray()
    for start in range(0, length, BLOCK):
        value = 0
        for table, (_, piece) in zip(tables, chosen, strict=True):
            value ^= _gf_multiply(_element(piece[start : start + BLOCK]), table)
        secret += value.to_bytes(BLOCK, "big")
    return bytes(secret)


# GF(2^128) as PyCryptodome's Shamir has it: bit i of an int is the coefficient of x^i
_FIELD_BITS = 128
_FIELD_MASK = (1 << _FIELD_BITS) - 1


def _element(block: bytes) -> int:
    return int.from_bytes(block, "big")


@lru_cache(maxsize=1024)
def _window_table(a: int) -> tuple[int, ...]:
    """a times every polynomial of degree < 4, unreduced: the table `_gf_multiply` reads."""
    table = [0, a]
    for nibble in range(2, 16):
        table.append(table[nibble >> 1] << 1 if nibble % 2 == 0 else table[nibble - 1] ^ a)
    return tuple(table)


def _gf_multiply(b: int, table: tuple[int, ...]) -> int:
    """a * b in GF(2^128), `table` being `_window_table(a)`: b read 4 bits at a time, then
    the product reduced by x^128 = x^7 + x^2 + x + 1."""
    product = 0
    for shift in range(_FIELD_BITS - 4, -4, -4):
        product = (product << 4) ^ table[(b >> shift) & 15]
    return _reduced(product)


def _gf_multiply_small(b: int, index: int) -> int:
    """b * index in GF(2^128) for a Shamir index (a few bits): b shifted to each set bit of
    the index and XORed, then reduced; the same product as `_gf_multiply`, in a handful of
    steps instead of 32."""
    product = 0
    while index:
        lowest = index & -index
        product ^= b << (lowest.bit_length() - 1)
        index ^= lowest
    return _reduced(product)


def _reduced(product: int) -> int:
    """`product` (a polynomial of any degree) modulo x^128 + x^7 + x^2 + x + 1."""
    high = product >> _FIELD_BITS
    while high:
        product = (product & _FIELD_MASK) ^ high ^ (high << 1) ^ (high << 2) ^ (high << 7)
        high = product >> _FIELD_BITS
    return product


def _gf_inverse(a: int) -> int:
    """a^-1 in GF(2^128) (a != 0), by the extended Euclidean algorithm over GF(2)[x]."""
    u, v, g1, g2 = a, (1 << _FIELD_BITS) | 0x87, 1, 0
    while u != 1:
        shift = u.bit_length() - v.bit_length()
        if shift < 0:
            u, v, g1, g2, shift = v, u, g2, g1, -shift
        u ^= v << shift
        g1 ^= g2 << shift
    return g1


@lru_cache(maxsize=256)
def _lagrange_at_zero(indices: tuple[int, ...]) -> tuple[tuple[int, ...], ...]:
    """For each index x_j, the window table of l_j(0) = prod_{m != j} x_m / (x_j - x_m)
    (subtraction is addition, XOR, in characteristic 2): the secret is sum_j y_j l_j(0)."""
    tables = []
    for j, x_j in enumerate(indices):
        numerator, denominator = 1, 1
        for m, x_m in enumerate(indices):
            if m != j:
                numerator = _gf_multiply(numerator, _window_table(x_m))
                denominator = _gf_multiply(denominator, _window_table(x_j ^ x_m))
        tables.append(
            _window_table(_gf_multiply(_gf_inverse(denominator), _window_table(numerator)))
        )
    return tuple(tables)


def encrypt_share(sender: str, recipient: str, share: bytes, box: Box, view: bytes) -> bytes:
    """`share` for `recipient` only (X25519 + XSalsa20-Poly1305: `box` is the sender's private
    key with the recipient's public one), bound to both names and to the sender's view of the
    advertisement set (`advertisement_digest`)."""
    return bytes(box.encrypt(_share_label(sender, recipient, view) + share))


def decrypt_share(sender: str, recipient: str, ciphertext: bytes, box: Box, view: bytes) -> bytes:
    """The share `sender` made for `recipient`; `box`: the recipient's private key with the
    sender's public one (the same shared key as the sender's box: one box per peer serves
    both directions)."""
    try:
        plain = box.decrypt(ciphertext)
    except CryptoError:
        raise MaskingError(f"the share from {sender} does not open with {sender}'s key") from None
    label = _share_label(sender, recipient, view)
    if not plain.startswith(label):
        raise MaskingError(
            f"the share from {sender} was not made for {recipient} under the advertisement set "
            f"{recipient} saw: refusing it (the coordinator relayed different keys to each)"
        )
    return plain[len(label) :]


def _share_label(sender: str, recipient: str, view: bytes) -> bytes:
    return f"fedsilo/secagg-share|{sender}|{recipient}|".encode() + view + b"|"


def advertisement_digest(context: bytes, adverts: Mapping[str, Advertisement]) -> bytes:
    """The digest of one view of an aggregation: its label and every advertisement in it."""
    digest = hashlib.blake2b(b"fedsilo/secagg-view|" + context + b"|", digest_size=32)
    for silo, advert in sorted(adverts.items()):
        digest.update(silo.encode() + b"|" + advert.to_bytes())
    return digest.digest()


# -- the consistency check and the weights ----------------------------------------------------


def consistency_statement(
    context: bytes,
    view: bytes,
    weights: Mapping[str, float],
    survivors: Iterable[str],
    task: bytes,
) -> bytes:
    """What every survivor signs before any share is revealed: the aggregation, the view of its
    advertisements, the weight vector, the survivor set and the digest of the task it masked
    its input for (silo/tasks/base.py `task_digest`: the same model and settings for all)."""
    body = json.dumps({"weights": sorted(weights.items()), "survivors": sorted(survivors)})
    parts = (b"fedsilo/secagg-consistency", context, view, body.encode(), task.hex().encode())
    return b"|".join(parts)


def confirm(identity: SigningKey, statement: bytes) -> bytes:
    return identity.sign(statement).signature


def signed_by(
    statement: bytes, signatures: Mapping[str, bytes], roster: Mapping[str, VerifyKey]
) -> set[str]:
    """The silos among `signatures` whose signature is a valid one of `statement` by their
    identity in `roster`; a signature by anyone else, or over anything else, counts nothing."""
    valid = set()
    for silo, signature in signatures.items():
        if silo not in roster:
            continue
        try:
            roster[silo].verify(statement, signature)
        except (BadSignatureError, ValueError):
            continue
        valid.add(silo)
    return valid


def weight_problem(
    weights: Mapping[str, float],
    me: str | None,
    members: Iterable[str],
    min_group: int,
    min_weight: float,
    view: Collection[str],
) -> str | None:
    """Why a weight vector must be refused by `me` (a silo of the sum; None: one that only
    checks it, e.g. a decryptor) for a sum over `members`, or None. `view`: the silos a weight
    may name at all (those that advertised keys for the aggregation, or the consortium): a key
    for any other would let the vector's sum rule say nothing of the members' weights."""
    members = sorted(members)
    strangers = sorted(set(weights) - set(view))
    if strangers:
        return f"the weight vector names {strangers}, which are not in this aggregation"
    missing = [m for m in members if m not in weights]
    if missing:
        return f"the weight vector gives no weight to {missing}"
    values = [float(w) for w in weights.values()]
    if any(not (math.isfinite(w) and 0.0 <= w <= 1.0) for w in values):
        return f"weights must be finite and lie in [0, 1], not {sorted(weights.items())}"
    if math.fsum(values) > 1.0 + WEIGHT_SLACK:
        return "the weights sum to more than 1"
    values = [float(weights[m]) for m in members]
    if me is not None and me not in members:
        return f"{me} is not among the silos the weights are for"
    carrying = sum(1 for w in values if w >= min_weight)
    if carrying < min_group:
        return (
            f"only {carrying} of the {len(members)} silos in the sum carry a weight of at least "
            f"{min_weight:g} (secure_aggregation.min_weight); the policy needs "
            f"secure_aggregation.min_group {min_group} (weights that single out a silo)"
        )
    return None


def new_seed() -> bytes:
    """A self-mask seed from the system's CSPRNG."""
    return random_bytes(SEED_BYTES)


# -- masks -----------------------------------------------------------------------------------


def prg(seed: bytes, length: int, context: bytes) -> np.ndarray:
    """`length` pseudo-random elements of Z_{2^32} from `seed`, for `context`."""
    total = np.zeros(length, dtype=np.uint32)
    add_streams(total, [(seed, +1)], context)
    return total


STREAM_CHUNK_ELEMENTS = 1 << 16  # 256 KiB of each stream at a time: it stays in the core's cache


class KeyStreams:
    """Mask streams, (seed, sign) terms, read side by side a chunk at a time: `add_to(part)`
    adds the next len(part) elements of every stream, signed, to `part` (mod 2^32) in place.

    Each stream is AES-256's counter-mode keystream, continued from one call to the next,
    written a chunk at a time into one small buffer and added to that chunk of `part`: the
    caller's array is read and written once whatever the number of streams, and it can fill
    a chunk (sum inputs into it) just before its masks are added, while it is still in
    cache."""

    def __init__(self, terms: Sequence[tuple[bytes, int]], context: bytes, length: int) -> None:
        self._ciphers = [(_keystream(seed, context), sign) for seed, sign in terms]
        chunk = max(1, min(length, STREAM_CHUNK_ELEMENTS))  # small tensors, small buffers
        self._zeros = memoryview(bytes(4 * chunk))
        self._buffer = bytearray(4 * chunk + 15)  # update_into wants a block's slack

    def add_to(self, part: np.ndarray) -> None:
        chunk = len(self._zeros) // 4
        for start in range(0, len(part), chunk):
            piece = part[start : start + chunk]
            stream = np.frombuffer(self._buffer, dtype="<u4", count=len(piece))
            for encryptor, sign in self._ciphers:
                encryptor.update_into(self._zeros[: 4 * len(piece)], self._buffer)
                if sign > 0:
                    np.add(piece, stream, out=piece)
                else:
                    np.subtract(piece, stream, out=piece)


def add_streams(total: np.ndarray, terms: Sequence[tuple[bytes, int]], context: bytes) -> None:
    """total += sum of sign * PRG(seed) over `terms` (seed, sign), modulo 2^32, in place."""
    KeyStreams(terms, context, len(total)).add_to(total)


def _keystream(seed: bytes, context: bytes) -> CipherContext:
    """AES-256 in counter mode under a key derived from `seed` for `context`, run through
    OpenSSL's GCM: GCM encrypts with the counter-mode keystream from the block after its
    nonce's first, and its code (AES rounds stitched with the GHASH, which is computed and
    never used) is about 30 % faster here than OpenSSL's CTR. A key is never used twice (HKDF
    over a fresh seed and the context), so the fixed nonce is safe; a stream can run to GCM's
    limit of 2^32 - 2 blocks (64 GiB), far beyond any model. Changing it changes every mask:
    wire/messages.py's PROTOCOL_VERSION says which keystream a silo and a coordinator speak."""
    info = b"fedsilo/secagg-prg|" + context
    key = HKDF(hashes.SHA256(), 32, salt=None, info=info).derive(seed)
    return Cipher(algorithms.AES(key), modes.GCM(bytes(12))).encryptor()


def pairwise_seed(own: PrivateKey, theirs: PublicKey) -> bytes:
    """The secret two silos agree on (X25519, then HSalsa20), the same from either side."""
    return Box(own, theirs).shared_key()


def sign(me: str, other: str) -> int:
    """+1 when `me` sorts before `other`, else -1: the pair's masks cancel in a sum."""
    return 1 if me < other else -1


def mask_streams(
    length: int,
    me: str,
    self_seed: bytes,
    masking_key: PrivateKey,
    peers: Mapping[str, PublicKey],
    context: bytes,
) -> np.ndarray:
    """PRG(self seed) + sum over peers of sign * PRG(pairwise seed), mod 2^32: the mask a
    silo adds to its encoded input. It depends on no data, so a silo computes it while it
    trains (`silo/tasks/secure_sum.py`)."""
    total = np.zeros(length, dtype=np.uint32)
    pairwise = [
        (pairwise_seed(masking_key, key), sign(me, peer)) for peer, key in sorted(peers.items())
    ]
    add_streams(total, [(self_seed, +1), *pairwise], context)
    return total


def unmask_terms(
    self_seeds: Iterable[bytes],
    dropped_keys: Mapping[str, PrivateKey],
    survivors: Mapping[str, PublicKey],
    partners: Mapping[str, Collection[str]] | None = None,
) -> list[tuple[bytes, int]]:
    """What takes the survivors' sum of encoded values out of the sum of their masked inputs,
    as (seed, sign) terms for `KeyStreams`: each survivor's self-mask and each survivor's
    pairwise mask with every dropped silo (whose masking key was reconstructed from shares),
    negated; `partners`: the silos each dropped silo masked with (None: every survivor, the
    complete graph)."""
    terms = [(seed, -1) for seed in self_seeds]
    for dropped, key in sorted(dropped_keys.items()):
        for survivor, public in sorted(survivors.items()):
            if partners is not None and survivor not in partners[dropped]:
                continue
            # the survivor added sign(survivor, dropped) * stream: take it away
            terms.append((pairwise_seed(key, public), -sign(survivor, dropped)))
    return terms


def graph_seed(deployment: str, job: str) -> bytes:
    """What orders the roster on the sparse graph's ring: the deployment and the digest of the
    policy its operator signed (both fixed before any round; "" in a simulation)."""
    return hashlib.blake2b(f"fedsilo/secagg-graph|{deployment}|{job}".encode()).digest()


def neighbourhood(roster: Iterable[str], degree: int, seed: bytes) -> dict[str, frozenset[str]]:
    """Each silo's neighbours in the Harary graph H(`degree`, n) over `roster` (Bell et al.
    2020's k-regular graph): the silos in the order of their keyed hash under `seed`, on a
    ring, each joined to the degree/2 nearest on either side (`degree` even, below n - 1)."""
    members = sorted(set(roster))
    if degree % 2 or not 2 <= degree < len(members) - 1:
        raise MaskingError(
            f"a sparse graph of {len(members)} silos needs an even degree below "
            f"{len(members) - 1}, not {degree}"
        )
    ring = sorted(members, key=lambda s: hashlib.blake2b(s.encode(), key=seed[:64]).digest())
    n = len(ring)
    return {
        silo: frozenset(
            ring[(i + step) % n] for hop in range(1, degree // 2 + 1) for step in (hop, -hop)
        )
        for i, silo in enumerate(ring)
    }


def silo_indices(silos: Sequence[str]) -> dict[str, int]:
    """Shamir indices (1-based) of an aggregation's advertised silos, in sorted order."""
    return {silo: i + 1 for i, silo in enumerate(sorted(silos))}
