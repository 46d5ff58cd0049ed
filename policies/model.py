"""The policy's `model:` section: which network each silo trains, chosen by `name`.

`linear` is logistic regression for classification and linear regression for regression;
`mlp` is a fully connected network; `cnn` is a small convolutional network for images.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from fedsilo.policies.base import PolicyModel


class LinearModel(PolicyModel):
    """One linear layer on the flattened input."""

    name: Literal["linear"]


class MlpModel(PolicyModel):
    """Fully connected layers of the given widths, each followed by `activation`."""

    name: Literal["mlp"]
    hidden: list[Annotated[int, Field(ge=1)]] = Field(default=[64, 64], min_length=1)
    activation: Literal["relu", "tanh"] = "relu"


class CnnModel(PolicyModel):
    """1 to 3 conv3x3 + activation (+ GroupNorm) + max-pool blocks, then one hidden dense layer
    (`hidden: 0`: none, the last layer reads the flattened features). `norm: group` normalises
    each block with GroupNorm (8 groups, or as many as divide its channels), which DP-SGD
    supports and BatchNorm it would not."""

    name: Literal["cnn"]
    channels: list[Annotated[int, Field(ge=1)]] = Field(
        default=[16, 32], min_length=1, max_length=3
    )
    hidden: int = Field(default=64, ge=0)
    activation: Literal["relu", "silu"] = "relu"
    norm: Literal["none", "group"] = "none"


ModelConfig = Annotated[LinearModel | MlpModel | CnnModel, Field(discriminator="name")]
