"""Durable files: a file replaced whole or not at all, and directory entries that survive a
power loss. The coordinator's checkpoints, the silos' privacy ledgers and their local state
write through here; so do the silos' kept answers, whole or not at all but without the fsyncs,
which the ledger's booking makes unnecessary (silo/answers.py)."""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable
from pathlib import Path


def fsync_folder(folder: Path) -> None:
    """Make a rename or a new entry in `folder` durable."""
    descriptor = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def make_private_folder(folder: Path) -> None:
    """Create `folder` (mode 0700, parents too) durably, if it is not there yet."""
    if not folder.exists():
        folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        fsync_folder(folder.parent)


def write_atomically(
    path: Path, parts: Iterable[bytes | memoryview], *, power_loss: bool = True
) -> None:
    """Write `parts` to `path` through a temporary file in the same folder and a rename, so a
    crash leaves either the old file or the whole new one, never a half. `power_loss`: the
    file and the rename are fsynced, so that this holds after a power loss too; without, it
    holds when the process dies (the kernel keeps what it was given), and what a power loss
    leaves of the file is for its reader to check."""
    descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=".", suffix=".partial")
    try:
        with os.fdopen(descriptor, "wb") as file:
            for part in parts:
                file.write(part)
            if power_loss:
                file.flush()
                os.fsync(file.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    if power_loss:
        fsync_folder(path.parent)
