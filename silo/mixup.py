"""Local mixup for DRFLM (docs/algorithms/drflm.md, "Mixup"): the draws and the maths of
training and evaluating on a silo's mixup distribution.

A batch of rows idx is paired with partners idx' drawn uniformly with replacement from the
same split (so (idx, idx') is uniform over all ordered pairs, j = l included), with a ratio
gamma ~ Beta(alpha, alpha) per row. Inputs mix linearly, x~ = gamma x[idx] + (1 - gamma)
x[idx'], and so do regression targets; a classification row's loss is
gamma CE(f(x~), y[idx]) + (1 - gamma) CE(f(x~), y[idx']) (soft targets). Mixing happens on the
inputs (`inputs`: the embedding g is the identity) or on the model's embedding (`embedding`): g is
every layer but the last (models/zoo.py `embedding_and_head`), both rows go through g, and the
last layer reads gamma g(x[idx]) + (1 - gamma) g(x[idx']), so gradients reach g through both.

Partners and ratios come from a `MixupDraws`, a numpy stream seeded by the task and apart from
the batch order's torch generator, so a mixup run visits the same batches idx as a plain run
with its seed, and repeats bit for bit. Nothing mixed leaves the silo.

Under DP the mixed losses go through the same clipping and noise as plain ones (DP-SGD clips
each mixed row's gradient, a loss report bounds each mixed row's loss) and are booked as the
plain mechanisms. That bound is per mixed row, not per record: a record also enters every row
whose partner it is (Binomial(rows, 1/n) of them), so its influence can exceed one row's bound
and the booked epsilon is then optimistic.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
from torch import Tensor, nn

from fedsilo.models.zoo import embedding_and_head
from fedsilo.silo.evaluation import per_sample_loss_function

_STREAM = 0x6D69_7875  # "mixu": keeps the mixup stream apart from other uses of the seed
MIXUP_ON = ("inputs", "embedding")


def mixup_on(on: str) -> str:
    """Where a task's mixup mixes (its `mixup_site`: `mixup_on`, default `inputs`); anything
    else is refused."""
    if on not in MIXUP_ON:
        raise ValueError(f"mixup_on must be one of {MIXUP_ON}, not {on!r}")
    return on


class MixupDraws:
    """Partners and ratios for successive batches of a split of `n` rows, from one seed."""

    def __init__(self, alpha: float, seed: int, n: int) -> None:
        alpha = float(alpha)
        if not 0 < alpha < float("inf"):
            raise ValueError(f"mixup_alpha must be a positive number, not {alpha}")
        self.alpha = alpha
        self.n = n
        self.rng = np.random.default_rng([seed, _STREAM])

    def draw(self, size: int) -> tuple[Tensor, Tensor]:
        """`size` partner rows (uniform over the split, with replacement) and as many
        Beta(alpha, alpha) ratios (float64), the next in the stream."""
        partners = torch.from_numpy(self.rng.integers(0, self.n, size=size))
        gamma = torch.from_numpy(self.rng.beta(self.alpha, self.alpha, size=size))
        return partners, gamma


def mixed_inputs(x: Tensor, partner_x: Tensor, gamma: Tensor) -> Tensor:
    """gamma x + (1 - gamma) x_partner, row by row (gamma broadcast over the feature dims)."""
    weight = gamma.to(x).reshape(-1, *([1] * (x.dim() - 1)))
    return weight * x + (1 - weight) * partner_x


def mixed_per_sample_loss(
    task: str, output: Tensor, y: Tensor, partner_y: Tensor, gamma: Tensor
) -> Tensor:
    """Each mixed row's loss (shape (rows,)): gamma CE(output, y) + (1 - gamma)
    CE(output, y_partner) for classification, the loss against gamma y + (1 - gamma) y_partner
    for regression."""
    if task not in ("classification", "regression"):
        raise ValueError(
            f"mixup (mixup_alpha) mixes class labels or regression targets; task plug-in "
            f"'{task}' has neither"
        )
    loss = per_sample_loss_function(task)
    gamma = gamma.to(output)
    if task == "classification":
        return gamma * loss(output, y) + (1 - gamma) * loss(output, partner_y)
    return loss(output, gamma * y.to(gamma) + (1 - gamma) * partner_y.to(gamma))


def mixed_losses(
    task: str,
    model: nn.Module,
    x: Tensor,
    y: Tensor,
    rows: Tensor,
    partners: Tensor,
    gamma: Tensor,
    on: str = "inputs",
) -> Tensor:
    """The mixed losses of `model` on rows `rows` of (x, y), each mixed with its partner, on
    the inputs or on the model's embedding (`on`)."""
    partners, gamma = partners.to(x.device), gamma.to(x.device)
    if on == "embedding":
        embed, head = embedding_and_head(model)
        output = head(mixed_inputs(embed(x[rows]), embed(x[partners]), gamma))
    else:
        output = model(mixed_inputs(x[rows], x[partners], gamma))
    return mixed_per_sample_loss(task, output, y[rows], y[partners], gamma)


def mixed_loss_of(
    task: str, model: nn.Module, x: Tensor, y: Tensor, draws: MixupDraws, on: str = "inputs"
) -> Callable[[Tensor], Tensor]:
    """The per-row mixed losses of a batch of row indices, with the next draw of partners and
    ratios for each batch: what a training step (plain or DP-SGD) minimises."""

    def losses(rows: Tensor) -> Tensor:
        partners, gamma = draws.draw(len(rows))
        return mixed_losses(task, model, x, y, rows, partners, gamma, on)

    return losses
