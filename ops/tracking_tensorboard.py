"""The TensorBoard side of experiment tracking (ops/tracking.py): one folder of event files per
job under the `--track tensorboard:DIR` folder, written by torch's `SummaryWriter` (which needs
the tensorboard package), so `tensorboard --logdir DIR` shows every job as a run.

A deployment's job writes to `DIR/<job id>` (resumed after a restart, it adds to it); each
simulation is a run of its own: `DIR/<job id>`, or `DIR/<job id>.2`, `.3`, ... when that
folder is taken by an earlier run. The policy is a text summary (`parameters`, a table of its
flattened keys), each metric a scalar with the round as its step, the job's end a text summary
(`status`). TensorBoard keeps no files: the results are copied into the run's folder
(`artifacts/`, which TensorBoard does not read) and each plot is also shown as an image
(`plots/<name>`).
"""

from __future__ import annotations

import shutil
from collections.abc import Mapping, Sequence
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter

from fedsilo.ops.tracking import TrackedJob

ARTIFACTS = "artifacts"


class TensorBoardTracker:
    """A job's run: the event files `writer` writes in `folder`."""

    def __init__(self, writer: SummaryWriter, folder: Path) -> None:
        self.writer, self.folder = writer, folder

    @classmethod
    def open(cls, root: Path, job: TrackedJob) -> TensorBoardTracker:
        folder = root / job.id if job.resume else _unused(root, job.id)
        return cls(SummaryWriter(log_dir=str(folder)), folder)

    def log_params(self, params: Mapping[str, str]) -> None:
        rows = "\n".join(f"| {key} | {value} |" for key, value in params.items())
        self.writer.add_text("parameters", f"| key | value |\n|---|---|\n{rows}", 0)
        self.writer.flush()

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()  # a TensorBoard watching the folder shows the round now

    def log_artifacts(self, folder: Path, files: Sequence[Path]) -> None:
        from matplotlib.image import imread  # decodes the plots' PNG files

        for name in files:
            kept = self.folder / ARTIFACTS / name
            kept.parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(folder / name, kept)
            if name.suffix == ".png":
                plot = f"plots/{name.with_suffix('').as_posix()}"
                self.writer.add_image(plot, imread(kept), 0, dataformats="HWC")
        self.writer.flush()

    def end(self, status: str) -> None:
        self.writer.add_text("status", f"the job ended {status}", 0)
        self.writer.close()


def _unused(root: Path, name: str) -> Path:
    """`root/name`, or the first of `root/name.2`, `root/name.3`, ... that does not exist."""
    folder, number = root / name, 1
    while folder.exists():
        number += 1
        folder = root / f"{name}.{number}"
    return folder
