"""The policy's `compression:` section: each silo sends its training update (the trained model
less the model it was sent) quantized to 8 or 16 bits a value with stochastic rounding, one
float32 scale per parameter tensor or per block of consecutive values, and the coordinator
decodes it before the mean (wire/quantized.py). Absent (the default), models travel as they
are. Which algorithms can use it, and with which other sections, `problem` says; the schema
(policies/schema.py) refuses the rest in one message."""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal

from pydantic import Field, model_validator

from fedsilo.policies.base import PolicyModel
from fedsilo.wire.tasks import Quantization

if TYPE_CHECKING:
    from fedsilo.policies.schema import Policy

DEFAULT_BLOCK_SIZE = 256


class CompressionConfig(PolicyModel):
    """Update compression: `bits` a value (8: about 4x fewer bytes from each silo than float32,
    16: about 2x), stochastic rounding (unbiased: the decoded update's expectation is the
    update), and one scale per parameter tensor (`scale: tensor`) or per `block_size`
    consecutive values of one (`block`, the default: an outlier coarsens only its block)."""

    # the bits each value of a silo's update travels in: 8 (about 4x fewer bytes than float32) or
    # 16 (about 2x) (required)
    bits: Literal[8, 16]
    # which values share a scale (their largest magnitude over 127 or 32767): block (the default),
    # each block of block_size consecutive values of a parameter tensor; tensor, each parameter
    # tensor
    scale: Literal["tensor", "block"] = "block"
    # with scale block, how many consecutive values share a scale, at least 16; null (the
    # default): 256
    block_size: int | None = Field(default=None, ge=16)

    @model_validator(mode="after")
    def _blocks_only_with_block_scale(self) -> CompressionConfig:
        if self.block_size is not None and self.scale != "block":
            raise ValueError(
                f"compression.block_size: scale {self.scale!r} has one scale per parameter "
                "tensor, no blocks; drop block_size or set scale: block"
            )
        return self

    def on_the_wire(self) -> Quantization:
        """The section as a `train` task carries it."""
        if self.scale == "tensor":
            return Quantization(bits=self.bits)
        return Quantization(bits=self.bits, block_size=self.block_size or DEFAULT_BLOCK_SIZE)

    def problem(self, policy: Policy, capable: list[str]) -> str | None:
        """Why `policy` cannot compress its updates (`capable`: the algorithms that can), or
        None."""
        algorithm = policy.algorithm
        if not algorithm.compresses_updates:
            return (
                f"compression: {algorithm.name} does not send each silo's trained model to a "
                "weighted mean alone, which is what compression quantizes; use one of "
                f"{', '.join(capable)} or drop compression"
            )
        secure = policy.secure_aggregation
        if secure.enabled:
            return (
                "compression: the coordinator decodes each silo's quantized update, and under "
                f"secure_aggregation {secure.method} it sees only their sum; drop compression "
                "or secure_aggregation"
            )
        client_dp = policy.privacy.client_dp
        if client_dp is not None and client_dp.noise == "distributed":
            return (
                "compression: under privacy.client_dp with noise 'distributed' each silo would "
                "round its own share of the noise, and the shares would no longer sum to the "
                "round's Gaussian noise the published epsilon counts on; use noise 'central' "
                "or drop compression"
            )
        return None
