"""Model factories of the entry point group `fedsilo.models`: a small residual CNN for images.

A factory is called as `factory(input_shape, output_dim, **args)`, where `input_shape` is one
input row's shape, (channels, height, width) for images, `output_dim` the number of classes (1
for regression) and `args` the policy's `model.args`. fedsilo seeds torch's global RNG for the
call, so build every parameter from it (PyTorch's default initialisation does).

`residual_cnn` normalises with GroupNorm, which DP-SGD (Opacus) can train.
`residual_cnn_batchnorm` is the counter-example: the same network with BatchNorm, which mixes
the rows of a batch, so a silo refuses it under `privacy.dp_sgd`, naming the first BatchNorm layer.
"""

from __future__ import annotations

from torch import Tensor, nn

GROUPS = 8  # GroupNorm's groups, or the largest divisor of the channels below it


def residual_cnn(
    input_shape: tuple[int, ...], output_dim: int, width: int = 16, blocks: int = 2
) -> nn.Module:
    """A 3x3 conv stem of `width` channels, `blocks` residual blocks, global average pooling and
    a linear head; GroupNorm after every convolution."""
    return ResidualCnn(input_shape, output_dim, width, blocks, norm="group")


def residual_cnn_batchnorm(
    input_shape: tuple[int, ...], output_dim: int, width: int = 16, blocks: int = 2
) -> nn.Module:
    """`residual_cnn` with BatchNorm instead of GroupNorm: trains without DP, refused under
    DP-SGD (the counter-example)."""
    return ResidualCnn(input_shape, output_dim, width, blocks, norm="batch")


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    groups = max(g for g in range(1, GROUPS + 1) if channels % g == 0)
    return nn.GroupNorm(groups, channels)


class ResidualBlock(nn.Module):
    """x + norm(conv(relu(norm(conv(x))))), then ReLU."""

    def __init__(self, channels: int, norm: str) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm1 = _norm(norm, channels)
        self.conv2 = nn.Conv2d(channels, channels, 3, padding=1, bias=False)
        self.norm2 = _norm(norm, channels)
        self.act = nn.ReLU()

    def forward(self, x: Tensor) -> Tensor:
        inner = self.act(self.norm1(self.conv1(x)))
        return self.act(x + self.norm2(self.conv2(inner)))


class ResidualCnn(nn.Module):
    def __init__(
        self, input_shape: tuple[int, ...], output_dim: int, width: int, blocks: int, norm: str
    ) -> None:
        super().__init__()
        if len(input_shape) != 3:
            raise ValueError(
                f"residual_cnn reads images of shape (channels, height, width), got {input_shape}"
            )
        if width < 1 or blocks < 0:
            raise ValueError(
                f"width must be at least 1 and blocks at least 0, got {width}, {blocks}"
            )
        self.stem = nn.Sequential(
            nn.Conv2d(input_shape[0], width, 3, padding=1, bias=False),
            _norm(norm, width),
            nn.ReLU(),
        )
        self.blocks = nn.Sequential(*(ResidualBlock(width, norm) for _ in range(blocks)))
        self.pool = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten())
        self.head = nn.Linear(width, output_dim)

    def forward(self, x: Tensor) -> Tensor:
        return self.head(self.pool(self.blocks(self.stem(x))))
