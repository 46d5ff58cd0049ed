"""CKKS secure aggregation core (privacy/ckks.py): contexts, their sealed distribution,
chunked encryption, the coordinator's sum, decryption and precision."""

from __future__ import annotations

import numpy as np
import pytest
import tenseal as ts
from nacl.exceptions import BadSignatureError, CryptoError
from nacl.public import PrivateKey, SealedBox
from nacl.signing import SigningKey

from fedsilo.privacy.ckks import (
    CkksError,
    CkksParameters,
    add_encrypted,
    decrypt,
    encrypt,
    load_public_context,
    load_secret_context,
    measure,
    new_secret_context,
    open_sealed_context,
    public_context,
    seal_context,
)

DEFAULTS = CkksParameters()
# At scale 2^40 a fresh ciphertext decrypts with an absolute error of about 1e-8 whatever the
# value (encryption noise over the scale); measured: 1.0e-8 for one vector of 100k values in
# [-1, 1] and 1.9e-8 for a sum of three. 1e-6 leaves a margin of 50.
TOLERANCE = 1e-6
# A small parameter set for contexts made only to be refused (Galois keys are cheap here).
SMALL = CkksParameters(
    poly_modulus_degree=4096, coeff_mod_bit_sizes=(40, 20, 40), global_scale_bits=20
)


@pytest.fixture(scope="module")
def secret_bytes() -> bytes:
    return new_secret_context(DEFAULTS)


@pytest.fixture(scope="module")
def secret(secret_bytes: bytes) -> ts.Context:
    return load_secret_context(secret_bytes, expected=DEFAULTS)


@pytest.fixture(scope="module")
def coordinator(secret_bytes: bytes) -> ts.Context:
    return load_public_context(public_context(secret_bytes), expected=DEFAULTS)


def updates(silos: int, length: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.uniform(-1.0, 1.0, length) for _ in range(silos)]


# -- the protocol end to end ----------------------------------------------------------------


def test_three_silos_encrypted_sum_decrypts_to_the_plaintext_sum(secret_bytes: bytes) -> None:
    holder = SigningKey.generate()
    silo_keys = [PrivateKey.generate() for _ in range(2)]
    # The key holder seals its context to the two other silos; the coordinator forwards it.
    sealed = [seal_context(secret_bytes, key.public_key, holder) for key in silo_keys]
    contexts = [load_secret_context(secret_bytes, expected=DEFAULTS)] + [
        load_secret_context(open_sealed_context(box, key, holder.verify_key), expected=DEFAULTS)
        for box, key in zip(sealed, silo_keys, strict=True)
    ]
    coordinator = load_public_context(public_context(secret_bytes), expected=DEFAULTS)

    plain = updates(3, 10_000)  # three chunks of 4096, 4096 and 1808 values
    encrypted = [encrypt(x, ctx) for x, ctx in zip(plain, contexts, strict=True)]
    total = add_encrypted(coordinator, encrypted)

    assert [len(chunks) for chunks in encrypted] == [3, 3, 3]
    for ctx in contexts:  # every silo decrypts the same aggregate
        result = decrypt(total, ctx, 10_000)
        assert result.dtype == np.float64
        assert np.abs(result - np.sum(plain, axis=0)).max() < TOLERANCE


def test_chunks_hold_slots_values_in_order_and_the_last_the_rest(secret: ts.Context) -> None:
    values = np.arange(10_000, dtype=np.float64) / 10_000
    chunks = encrypt(values, secret)
    sizes = [ts.ckks_vector_from(secret, chunk).size() for chunk in chunks]
    assert sizes == [DEFAULTS.slots, DEFAULTS.slots, 10_000 - 2 * DEFAULTS.slots]
    assert np.abs(decrypt(chunks, secret, 10_000) - values).max() < TOLERANCE
    assert encrypt(np.zeros(0), secret) == []
    assert decrypt([], secret, 0).shape == (0,)


def test_torch_tensors_encrypt_like_arrays(secret: ts.Context) -> None:
    torch = pytest.importorskip("torch")
    values = torch.linspace(-1, 1, 100, dtype=torch.float32)
    result = decrypt(encrypt(values, secret), secret, 100)
    assert np.abs(result - values.double().numpy()).max() < TOLERANCE


# -- what the coordinator holds -------------------------------------------------------------


def test_the_public_context_cannot_decrypt(secret: ts.Context, coordinator: ts.Context) -> None:
    chunks = encrypt(np.ones(10), secret)
    assert not coordinator.has_secret_key()
    with pytest.raises(CkksError, match="no secret key"):
        decrypt(chunks, coordinator, 10)
    with pytest.raises(ValueError, match="secret_key"):  # nor can TenSEAL itself
        ts.ckks_vector_from(coordinator, chunks[0]).decrypt()


def test_the_coordinator_refuses_a_context_with_a_secret_key(secret_bytes: bytes) -> None:
    with pytest.raises(CkksError, match="holds a secret key"):
        load_public_context(secret_bytes)


def test_the_coordinator_refuses_a_context_with_galois_keys() -> None:
    context = ts.context(
        ts.SCHEME_TYPE.CKKS, SMALL.poly_modulus_degree, coeff_mod_bit_sizes=[40, 20, 40]
    )
    context.global_scale = SMALL.global_scale
    context.generate_galois_keys()
    data = context.serialize(save_secret_key=False, save_galois_keys=True)
    with pytest.raises(CkksError, match="Galois keys"):
        load_public_context(data)


def test_a_silo_refuses_a_context_without_a_secret_key(secret_bytes: bytes) -> None:
    with pytest.raises(CkksError, match="no secret key"):
        load_secret_context(public_context(secret_bytes))


def test_new_contexts_carry_no_galois_or_relinearisation_keys(secret_bytes: bytes) -> None:
    public = ts.context_from(public_context(secret_bytes))
    assert not public.has_galois_keys() and not public.has_relin_keys()
    assert not ts.context_from(secret_bytes).has_galois_keys()


def test_contexts_made_with_other_parameters_are_refused(secret_bytes: bytes) -> None:
    other_scale = CkksParameters(global_scale_bits=30)
    with pytest.raises(CkksError, match="other parameters"):
        load_public_context(public_context(secret_bytes), expected=other_scale)
    with pytest.raises(CkksError, match="other parameters"):
        load_secret_context(new_secret_context(SMALL), expected=DEFAULTS)


def test_bytes_that_are_no_context_are_refused() -> None:
    with pytest.raises(CkksError, match="not a serialized TenSEAL context"):
        load_public_context(b"not a context")


# -- distribution of the secret context -----------------------------------------------------


def test_the_sealed_context_opens_only_for_its_recipient(secret_bytes: bytes) -> None:
    holder, recipient, other = SigningKey.generate(), PrivateKey.generate(), PrivateKey.generate()
    sealed = seal_context(secret_bytes, recipient.public_key, holder)
    assert open_sealed_context(sealed, recipient, holder.verify_key) == secret_bytes
    with pytest.raises(CryptoError):
        open_sealed_context(sealed, other, holder.verify_key)


def test_a_context_substituted_by_the_coordinator_is_refused(secret_bytes: bytes) -> None:
    holder, coordinator, recipient = (
        SigningKey.generate(),
        SigningKey.generate(),
        PrivateKey.generate(),
    )
    # The coordinator seals a context of its own (whose secret key it knows) to the silo.
    forged = seal_context(new_secret_context(DEFAULTS), recipient.public_key, coordinator)
    with pytest.raises(BadSignatureError):
        open_sealed_context(forged, recipient, holder.verify_key)


def test_a_context_signed_for_one_silo_is_refused_by_another(secret_bytes: bytes) -> None:
    holder, first, second = SigningKey.generate(), PrivateKey.generate(), PrivateKey.generate()
    signed = SealedBox(first).decrypt(seal_context(secret_bytes, first.public_key, holder))
    resealed = bytes(SealedBox(second.public_key).encrypt(signed))  # first passes it on
    with pytest.raises(CkksError, match="another recipient"):
        open_sealed_context(resealed, second, holder.verify_key)


# -- the coordinator's sum ------------------------------------------------------------------


def test_chunk_lists_of_different_lengths_are_refused(
    secret: ts.Context, coordinator: ts.Context
) -> None:
    short, long = encrypt(np.ones(10), secret), encrypt(np.ones(5_000), secret)
    with pytest.raises(CkksError, match=r"different numbers of chunks: \[1, 2\]"):
        add_encrypted(coordinator, [short, long])


def test_chunks_of_different_sizes_are_refused(secret: ts.Context, coordinator: ts.Context) -> None:
    with pytest.raises(
        CkksError, match="summand 1, chunk 0: holds 5 values where summand 0 holds 10"
    ):
        add_encrypted(coordinator, [encrypt(np.ones(10), secret), encrypt(np.ones(5), secret)])


def test_chunks_that_are_no_ciphertext_for_the_context_are_refused(
    secret: ts.Context, coordinator: ts.Context
) -> None:
    good = encrypt(np.ones(10), secret)
    with pytest.raises(CkksError, match="summand 1, chunk 0: not a CKKS ciphertext"):
        add_encrypted(coordinator, [good, [b"garbage"]])
    foreign = encrypt(np.ones(10), load_secret_context(new_secret_context(SMALL)))
    with pytest.raises(CkksError, match="summand 1, chunk 0: not a CKKS ciphertext"):
        add_encrypted(coordinator, [good, foreign])
    with pytest.raises(CkksError, match="no silos"):
        add_encrypted(coordinator, [])


def test_decrypt_refuses_a_length_the_chunks_do_not_hold(secret: ts.Context) -> None:
    with pytest.raises(CkksError, match="hold 10 values, expected 11"):
        decrypt(encrypt(np.ones(10), secret), secret, 11)


def test_encrypt_refuses_what_it_cannot_encrypt(secret: ts.Context) -> None:
    with pytest.raises(CkksError, match="1-D"):
        encrypt(np.ones((2, 2)), secret)
    with pytest.raises(CkksError, match="finite"):
        encrypt(np.array([1.0, np.nan]), secret)
    small = load_secret_context(new_secret_context(CkksParameters(coeff_mod_bit_sizes=(60, 60))))
    with pytest.raises(CkksError, match="at most 5.24e\\+05"):  # 2^(60 - 40 - 1)
        encrypt(np.array([2.0**20]), small)


# -- parameters -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"poly_modulus_degree": 6000}, "poly_modulus_degree"),
        ({"poly_modulus_degree": 2048}, "poly_modulus_degree"),
        ({"coeff_mod_bit_sizes": (60,)}, "coeff_mod_bit_sizes"),
        ({"coeff_mod_bit_sizes": (61, 40, 61)}, "coeff_mod_bit_sizes"),
        ({"coeff_mod_bit_sizes": (60, 60, 60, 60)}, "coeff_mod_bit_sizes"),  # 240 > 218 bits
        ({"coeff_mod_bit_sizes": (60, 30, 30, 60)}, "global_scale_bits"),  # scale 40 > 30
        ({"global_scale_bits": 60}, "global_scale_bits"),
        ({"global_scale_bits": 10}, "global_scale_bits"),
    ],
)
def test_parameter_errors_name_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(CkksError, match=field):
        CkksParameters(**kwargs)


def test_default_parameters() -> None:
    assert DEFAULTS.slots == 4096
    assert DEFAULTS.global_scale == 2.0**40
    assert CkksParameters(coeff_mod_bit_sizes=[60, 60]).coeff_mod_bit_sizes == (60, 60)


# -- cost (printed, not asserted: run with -s to see it) ------------------------------------


def test_cost_at_the_defaults_is_measured() -> None:
    for params in (DEFAULTS, CkksParameters(coeff_mod_bit_sizes=(60, 60))):
        cost = measure(params, length=100_000, silos=3)
        print(
            f"\nCKKS {params.poly_modulus_degree} {params.coeff_mod_bit_sizes} "
            f"scale 2^{params.global_scale_bits}: "
            f"encrypt 100k floats {cost.encrypt_seconds:.3f} s, "
            f"sum of 3 {cost.add_seconds:.3f} s, decrypt {cost.decrypt_seconds:.3f} s, "
            f"{cost.bytes_per_value:.1f} B/value = {cost.expansion_vs_fp32:.1f}x fp32, "
            f"max abs error of the sum {cost.max_abs_error:.2e}"
        )
