"""The policy's `secure_aggregation:` section: how the coordinator averages models while
learning only sums. `none` (the default): in the clear. `masking`: pairwise masks with t-of-n
recovery (privacy/masking.py). `ckks`: homomorphic sums under a key-holder silo's CKKS key
(privacy/ckks.py). Masking's `neighbours: k` swaps the complete graph of pairwise masks for
SecAgg+'s sparse k-regular one (Bell et al. 2020), with its thresholds (`share_threshold`,
`consistency_threshold`). Written as a bare method (`secure_aggregation: masking`) or as a mapping
with the method's settings. Also owns the rules CKKS parameters must follow (128-bit
security, SEAL's prime sizes), so a policy with bad parameters is refused when it is read.
"""

from __future__ import annotations

import math
from collections.abc import Collection
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from fedsilo.policies.base import PolicyModel

# SEAL's largest total coefficient modulus for 128-bit security, by polynomial modulus degree
# (HomomorphicEncryption.org standard). Degrees below 4096 leave no room for a useful scale.
MAX_COEFF_MODULUS_BITS = {4096: 109, 8192: 218, 16384: 438, 32768: 881}
MIN_PRIME_BITS = 20  # smaller primes congruent to 1 modulo 2 * degree are scarce or absent
MAX_PRIME_BITS = 60  # SEAL's limit for one prime
MIN_SCALE_BITS = 20
# Masking's 32-bit fixed point keeps bound * 2^f below 2^31: a bound above 2^16 would leave
# fewer than 15 fractional bits (worse than 3e-5 precision), and 1e300 none at all.
MAX_MASKING_BOUND = 2.0**16


def smallest_safe_threshold(silos: int) -> int:
    """The smallest t that keeps an active coordinator from rebuilding both secrets of one silo
    among `silos` (Bonawitz et al. 2017): it needs t seed shares from silos that saw the silo
    survive and t key shares from silos that saw it drop, and honest silos sign one survivor
    set only, so 2t > n + c for c colluding silos; with c < n/3, t >= floor(2n/3) + 1."""
    return 2 * silos // 3 + 1


def ckks_parameter_problem(degree: int, bits: tuple[int, ...], scale: int) -> str | None:
    """Why CKKS parameters cannot be used, or None when they can."""
    if degree not in MAX_COEFF_MODULUS_BITS:
        return (
            f"poly_modulus_degree must be one of {sorted(MAX_COEFF_MODULUS_BITS)} "
            f"(a power of two), not {degree}"
        )
    if len(bits) < 2:
        return (
            "coeff_mod_bit_sizes needs at least two primes (a data prime and the special "
            f"prime), not {list(bits)}"
        )
    if any(not MIN_PRIME_BITS <= b <= MAX_PRIME_BITS for b in bits):
        return (
            f"coeff_mod_bit_sizes: every prime must have {MIN_PRIME_BITS} to "
            f"{MAX_PRIME_BITS} bits, not {list(bits)}"
        )
    if sum(bits) > MAX_COEFF_MODULUS_BITS[degree]:
        return (
            f"coeff_mod_bit_sizes {list(bits)} total {sum(bits)} bits; 128-bit security "
            f"at poly_modulus_degree {degree} allows at most {MAX_COEFF_MODULUS_BITS[degree]}"
        )
    if not MIN_SCALE_BITS <= scale < bits[0]:
        return (
            f"global_scale_bits must be at least {MIN_SCALE_BITS} and below the first "
            f"prime's {bits[0]} bits, not {scale}"
        )
    inner = bits[1:-1]
    if inner and scale > min(inner):
        return (
            f"global_scale_bits {scale} exceeds the smallest inner coefficient prime "
            f"({min(inner)} bits in {list(bits)})"
        )
    return None


class CkksSettings(PolicyModel):
    """CKKS encryption parameters (privacy/ckks.py builds the scheme from these), checked for
    128-bit security when the policy is read."""

    # the polynomial modulus degree N: a ciphertext holds N/2 values, and larger N allows larger
    # coefficient moduli at 128-bit security but costs time and bandwidth (8192 by default)
    poly_modulus_degree: int = Field(
        default=8192, json_schema_extra={"enum": sorted(MAX_COEFF_MODULUS_BITS)}
    )
    # the bit sizes of the coefficient modulus primes, 20 to 60 bits each, at least two, their total
    # within 128-bit security for the degree (109, 218, 438 or 881 bits)
    coeff_mod_bit_sizes: tuple[int, ...] = (60, 40, 40, 60)
    # log2 of the scale values are encoded at: the precision of the encoded values; at least 20,
    # below the first prime's bits and no more than any inner prime's (40 by default)
    global_scale_bits: int = 40

    @model_validator(mode="after")
    def _usable(self) -> CkksSettings:
        problem = ckks_parameter_problem(
            self.poly_modulus_degree, self.coeff_mod_bit_sizes, self.global_scale_bits
        )
        if problem:
            raise ValueError(problem)
        return self

    @property
    def max_abs_value(self) -> float:
        """About the largest magnitude a value, or a sum of values, may reach in a fresh
        ciphertext: 2^(bits of the data modulus - scale bits - 1)."""
        return 2.0 ** (sum(self.coeff_mod_bit_sizes[:-1]) - self.global_scale_bits - 1)


class SecureAggregationConfig(PolicyModel):
    """`bound`: each coordinate of a silo's update (its model minus the model it received)
    is clipped to [-bound, bound] before it is encoded (masking: 32-bit fixed point, whose
    precision follows from the bound and the silos of a round, so overflow cannot happen;
    CKKS: the bound must stay below what the parameters hold). `threshold` (masking): how
    many of a round's silos must stay to the end for the sum to be recovered (t of n); None:
    floor(2n/3) + 1 of the n silos that advertised keys, which is also the least a silo accepts
    (Bonawitz et al.'s bound for an active coordinator), whatever the policy says.
    `min_group`: the fewest silos whose inputs one secure sum may hold; a silo refuses a smaller
    aggregation (a sum of one input is that input). `min_weight`: the weights are the
    coordinator's (sample counts it was told, or a mixing schedule's), so at least `min_group`
    of the n silos in a sum must carry a weight of at least this; None: 1/(2n), half the
    uniform weight (honest sample-count FedAvg on the bundled four hospitals, smallest share
    123/920 = 0.134 against 1/8, passes). With k = `min_group` and f the floor, the most skewed
    allowed vector (target 1 - (k-1) f, k - 1 others f, the rest 0) lets the coordinator read
    the target's update up to an error of (k-1) f / (1 - (k-1) f) times the others' update size
    (at most (k-1) f bound / (1 - (k-1) f)): with the defaults, 1/(2n-1), 11% at n = 5.
    `neighbours` (masking): None, the default: every silo masks pairwise with every other and
    shares its secrets t-of-n with all of them. An even k: SecAgg+'s sparse graph (Bell et
    al. 2020), each silo masking with and sharing to its k neighbours only (privacy/masking.py
    `neighbourhood`), `threshold` then being t of those k (default floor(2k/3) + 1, also the
    least a silo accepts); the consistency check still needs floor(2n/3) + 1 signatures.
    `key_holder` (ckks): the silo that makes the CKKS keys; None: the first silo by name.
    `decryptor` (ckks): the silo that decrypts sums; None: the key holder when it took part,
    else the first survivor by name.
    `lineage` (masking): each silo derives every model it is sent from the policy's seed and the
    aggregates it verifies itself (privacy/lineage.py, docs/secure-aggregation.md); None, the
    default: on wherever it applies (masking, an algorithm of FedAvg's round, no client-level
    DP), `false` to turn it off, `true` to refuse a policy where it cannot apply."""

    # how models are summed without the coordinator seeing any one: none (the default, in the
    # clear), masking (pairwise masks with t-of-n recovery) or ckks (homomorphic encryption under a
    # key-holder silo's key). May be written alone: `secure_aggregation: masking`
    method: Literal["none", "masking", "ckks"] = "none"
    # each coordinate of a silo's update (its model minus the model it received) is clipped to
    # [-bound, bound] before it is encoded; at most 65536 under masking (64 by default)
    bound: float = Field(default=64.0, gt=0)
    # masking: how many of a round's silos must stay to the end for the sum to be recovered (t of
    # n); null (the default): floor(2n/3) + 1, which is also the least a silo accepts
    threshold: int | None = Field(default=None, ge=2)
    # the fewest silos whose inputs one secure sum may hold; a silo refuses a smaller aggregation,
    # since a sum of one input is that input (2 by default; at least participants.min_silos is
    # enforced)
    min_group: int = Field(default=2, ge=2)
    # the least weight at least min_group of a sum's n silos must carry, so the coordinator's
    # weights cannot single one silo out; null (the default): 1/(2n), half the uniform weight
    min_weight: float | None = Field(default=None, gt=0.0, le=0.5)
    # masking: an even k, each silo masking with and sharing its secrets with only k neighbours
    # (SecAgg+'s sparse graph), for large consortia; null (the default): every other silo
    neighbours: int | None = Field(default=None, ge=2)
    # ckks: the silo that makes the CKKS keys; null (the default): the first silo by name
    key_holder: str | None = None
    # ckks: the silo that decrypts sums; null (the default): the key holder when it took part, else
    # the first remaining silo by name
    decryptor: str | None = None
    # the CKKS encryption parameters, for method ckks
    ckks: CkksSettings = CkksSettings()
    # masking: each silo derives every model it is sent from the policy's seed and the sums it
    # verifies itself; null (the default): on wherever it applies, false: off, true: refuse a policy
    # where it cannot apply
    lineage: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _bare_method(cls, data: Any) -> Any:
        return {"method": data} if isinstance(data, str) else data

    @field_validator("bound")
    @classmethod
    def _finite_bound(cls, bound: float) -> float:
        if not math.isfinite(bound):
            raise ValueError(f"secure_aggregation.bound must be a finite number, not {bound}")
        return bound

    @model_validator(mode="after")
    def _fits_method(self) -> SecureAggregationConfig:
        if self.method == "masking" and self.bound > MAX_MASKING_BOUND:
            raise ValueError(
                f"secure_aggregation.bound {self.bound:g} leaves 32-bit masked sums no "
                f"precision; use at most {MAX_MASKING_BOUND:g} (updates are clipped to it)"
            )
        if self.method != "masking" and self.threshold is not None:
            raise ValueError("threshold: only masking recovers sums from t of n silos")
        if self.neighbours is not None:
            if self.method != "masking":
                raise ValueError("neighbours: only masking has a graph of pairwise masks")
            if self.neighbours % 2:
                raise ValueError(
                    f"secure_aggregation.neighbours must be even (k/2 on each side of the "
                    f"ring of the Harary graph), not {self.neighbours}"
                )
            if self.threshold is not None and self.threshold > self.neighbours:
                raise ValueError(
                    f"secure_aggregation.threshold {self.threshold} exceeds the "
                    f"{self.neighbours} neighbours a silo shares its secrets with"
                )
        if self.method != "ckks" and (self.key_holder or self.decryptor):
            raise ValueError("key_holder and decryptor: only ckks has keys to hold")
        if self.method == "ckks" and self.bound >= self.ckks.max_abs_value:
            raise ValueError(
                f"bound {self.bound:g}: these CKKS parameters hold values below "
                f"{self.ckks.max_abs_value:g}; lower the bound or widen coeff_mod_bit_sizes"
            )
        return self

    @property
    def enabled(self) -> bool:
        return self.method != "none"

    def threshold_for(self, advertised: int) -> int:
        """t for an aggregation among `advertised` silos: the policy's, raised to the bound an
        active coordinator requires (`smallest_safe_threshold`)."""
        return max(self.threshold or 0, smallest_safe_threshold(advertised))

    def share_threshold(self, advertised: int) -> int:
        """How many holders' shares rebuild one silo's secrets: `threshold_for` on the complete
        graph; with `neighbours: k`, the policy's t of k raised to floor(2k/3) + 1."""
        if self.neighbours is None:
            return self.threshold_for(advertised)
        return max(self.threshold or 0, smallest_safe_threshold(self.neighbours))

    def consistency_threshold(self, advertised: int) -> int:
        """How many survivors must sign one statement before any share is revealed (and so
        the fewest survivors an aggregation needs): `threshold_for` on the complete graph,
        floor(2n/3) + 1 of the n advertised silos on the sparse one, so that two survivor
        sets cannot both be signed by enough silos whatever the neighbourhoods."""
        if self.neighbours is None:
            return self.threshold_for(advertised)
        return smallest_safe_threshold(advertised)

    def weight_floor(self, silos: int) -> float:
        """The weight at least `min_group` of a sum's `silos` silos must carry."""
        return self.min_weight if self.min_weight is not None else 1 / (2 * silos)

    def roster_problem(self, members: Collection[str]) -> str | None:
        """Why the silos this section names (`key_holder`, `decryptor`) cannot serve a
        consortium of `members`, or None."""
        if not self.enabled:
            return None
        for key in ("key_holder", "decryptor"):
            named = getattr(self, key)
            if named is not None and named not in members:
                return (
                    f"secure_aggregation.{key}: {named!r} is not a silo of this consortium "
                    f"({', '.join(sorted(members))})"
                )
        return None

    def group_problem(self, silos: int) -> str | None:
        """Why this section cannot aggregate over `silos` silos (a simulation's partition, or a
        deployment's roster at coordinator start-up), or None when it can."""
        if not self.enabled:
            return None
        if silos < self.min_group:
            return (
                f"secure_aggregation.min_group: {self.min_group} silos at least, and the "
                f"consortium has {silos}"
            )
        if self.min_weight is not None and self.min_weight > 1 / silos:
            return (
                f"secure_aggregation.min_weight {self.min_weight:g} is above the uniform weight "
                f"1/{silos}: no weights of {silos} silos could pass it"
            )
        if self.neighbours is not None:
            if self.neighbours >= silos - 1:
                return (
                    f"secure_aggregation.neighbours {self.neighbours} of {silos} silos is the "
                    "complete graph or more; leave neighbours out"
                )
            if self.threshold is not None and self.threshold < smallest_safe_threshold(
                self.neighbours
            ):
                return (
                    f"secure_aggregation.threshold {self.threshold} of {self.neighbours} "
                    "neighbours lets a deviating coordinator rebuild one silo's secrets; use at "
                    f"least {smallest_safe_threshold(self.neighbours)} (floor(2k/3) + 1) or "
                    "leave it out"
                )
            return None
        if self.threshold is None:
            return None
        if self.threshold > silos:
            return (
                f"secure_aggregation.threshold {self.threshold} exceeds the {silos} silos "
                "of an aggregation, so no sum could ever be recovered"
            )
        safe = smallest_safe_threshold(silos)
        if self.threshold < safe:
            return (
                f"secure_aggregation.threshold {self.threshold} of {silos} silos lets a "
                f"deviating coordinator rebuild one silo's secrets; use at least {safe} "
                "(floor(2n/3) + 1, Bonawitz et al. 2017) or leave it out"
            )
        return None
