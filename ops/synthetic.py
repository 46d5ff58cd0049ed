"""FedEvg's synthetic set as an operator gets it: a PNG grid of the points per class at the start
and every k rounds (`synthetic/round-NNNN.png`, one row per class), and the final set as
`synthetic.safetensors` (tensors `x` and `y`, loadable with the safetensors package) and
`synthetic.npz` (arrays `x` and `y`, with numpy, no pickle)."""

from __future__ import annotations

import io
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import torch

from fedsilo.coordinator.engine import RoundRecord
from fedsilo.coordinator.strategies.base import ServerState
from fedsilo.ops.plots import pyplot
from fedsilo.policies.schema import Policy
from fedsilo.wire.tasks.tensor_names import SYNTHETIC, SYNTHETIC_LABELS
from fedsilo.wire.tensors import encode_tensors


class SyntheticSnapshots:
    """An engine observer that keeps the synthetic set at setup (round 0), every `every` rounds
    and at the last."""

    def __init__(self, every: int, total_rounds: int) -> None:
        self.every, self.total = every, total_rounds
        self.taken: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def on_round(self, record: RoundRecord, total_rounds: int) -> None:
        """Nothing: the points come with the state (`on_state`)."""

    def on_state(self, round_no: int, state: ServerState) -> None:
        if SYNTHETIC not in state.tensors:
            return
        if round_no % self.every == 0 or round_no == self.total:
            x, y = state.tensors[SYNTHETIC], state.tensors[SYNTHETIC_LABELS]
            self.taken[round_no] = (x.detach().clone(), y.detach().clone())


def write_synthetic(
    folder: Path, state: ServerState, snapshots: Mapping[int, tuple[torch.Tensor, torch.Tensor]]
) -> None:
    """The final synthetic set (safetensors and NPZ) and a grid per snapshot; nothing for a
    state without a synthetic set."""
    if SYNTHETIC not in state.tensors:
        return
    x, y = state.tensors[SYNTHETIC].float(), state.tensors[SYNTHETIC_LABELS].long()
    (folder / "synthetic.safetensors").write_bytes(encode_tensors({"x": x, "y": y}, {}))
    buffer = io.BytesIO()
    np.savez(buffer, x=x.numpy(), y=y.numpy())
    (folder / "synthetic.npz").write_bytes(buffer.getvalue())
    grids = folder / "synthetic"
    grids.mkdir(exist_ok=True)
    for round_no, (points, labels) in sorted(snapshots.items()):
        save_grid(grids / f"round-{round_no:04d}.png", points, labels, f"after round {round_no}")


def save_grid(path: Path, x: torch.Tensor, y: torch.Tensor, title: str) -> None:
    """A PNG of the points: one row per class, each point an image (gray for one channel, RGB
    for three; other shapes as a strip of their values)."""
    plt = pyplot()
    classes = sorted(int(c) for c in torch.unique(y))
    per_class = max(int((y == c).sum()) for c in classes)
    fig, axes = plt.subplots(
        len(classes), per_class, figsize=(per_class * 0.6, len(classes) * 0.6), squeeze=False
    )
    for row, label in enumerate(classes):
        points = x[y == label]
        for col in range(per_class):
            ax = axes[row][col]
            ax.axis("off")
            if col < len(points):
                ax.imshow(_image(points[col]), cmap="gray", vmin=0.0, vmax=1.0)
        axes[row][0].text(-0.15, 0.5, str(label), transform=axes[row][0].transAxes,
                          fontsize=7, ha="right", va="center")  # fmt: skip
    fig.suptitle(title, fontsize=8)
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _image(point: torch.Tensor) -> np.ndarray:
    values = point.detach().float().clamp(0, 1).numpy()
    if values.ndim == 3 and values.shape[0] == 1:
        return values[0]
    if values.ndim == 3 and values.shape[0] == 3:
        return values.transpose(1, 2, 0)
    return values.reshape(1, -1)


def snapshots_for(policy: Policy) -> SyntheticSnapshots | None:
    """The snapshot observer a FedEvg policy's run needs (None for other algorithms)."""
    algorithm = policy.algorithm
    if algorithm.name != "fedevg":
        return None
    return SyntheticSnapshots(algorithm.image_every, policy.rounds)  # type: ignore[union-attr]
