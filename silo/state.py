"""What a silo keeps between tasks that must outlive its process: named sets of tensors (e.g.
SuPerFed's local model, which never leaves the silo), versioned by the round that wrote them.

A task of round t reads the latest version written before round t, so a round the coordinator
runs again after a restart (it resumes from the last completed round) starts from the same
local state as the first time, and the run repeats bit for bit. Each version is a safetensors
file in the silo's state folder, one sub-folder per deployment, written atomically (a crash
leaves the previous version); the last `KEEP` versions of a name are kept. Without a folder
(simulations) the versions live in memory.
"""

from __future__ import annotations

import re
import threading
from collections.abc import Mapping
from pathlib import Path

import torch

from fedsilo.wire.durable import make_private_folder, write_atomically
from fedsilo.wire.messages import SIMULATION
from fedsilo.wire.tensors import decode_tensors, encode_payload, tensor_block

KEEP = 3
_NAME = re.compile(r"^[A-Za-z0-9_-]+$")
_VERSION = re.compile(r"^(?P<name>[A-Za-z0-9_-]+)\.r(?P<round>\d+)\.safetensors$")


class LocalState:
    """Versions of named tensor sets for one deployment, on disk under `folder` or in memory."""

    def __init__(self, folder: Path | None = None, deployment: str = SIMULATION) -> None:
        self.folder = None if folder is None else Path(folder) / _safe(deployment)
        self._memory: dict[tuple[str, int], dict[str, torch.Tensor]] = {}
        self._lock = threading.Lock()

    def latest(self, name: str, before_round: int) -> dict[str, torch.Tensor] | None:
        """The newest version of `name` written in a round before `before_round` (None: none)."""
        _check_name(name)
        with self._lock:
            rounds = [r for r in self._rounds(name) if r < before_round]
            if not rounds:
                return None
            return self._read(name, max(rounds))

    def save(self, name: str, round: int, tensors: Mapping[str, torch.Tensor]) -> None:
        """Keep `tensors` as `name`'s version of `round` (replacing one of the same round)."""
        _check_name(name)
        cpu = {key: t.detach().to("cpu", copy=True).contiguous() for key, t in tensors.items()}
        with self._lock:
            if self.folder is None:
                self._memory[(name, round)] = cpu
            else:
                make_private_folder(self.folder)
                payload = encode_payload(tensor_block(cpu), {"names": list(cpu)})
                write_atomically(self._path(name, round), payload.parts)
            for old in sorted(self._rounds(name))[:-KEEP]:
                self._drop(name, old)

    def _rounds(self, name: str) -> list[int]:
        if self.folder is None:
            return [r for (n, r) in self._memory if n == name]
        if not self.folder.is_dir():
            return []
        found = (_VERSION.match(path.name) for path in self.folder.iterdir())
        return [int(m["round"]) for m in found if m is not None and m["name"] == name]

    def _read(self, name: str, round: int) -> dict[str, torch.Tensor]:
        if self.folder is None:
            return {key: t.clone() for key, t in self._memory[(name, round)].items()}
        tensors, header = decode_tensors(self._path(name, round).read_bytes())
        return {key: tensors[key] for key in header["names"]}

    def _drop(self, name: str, round: int) -> None:
        if self.folder is None:
            del self._memory[(name, round)]
        else:
            self._path(name, round).unlink(missing_ok=True)

    def _path(self, name: str, round: int) -> Path:
        assert self.folder is not None
        return self.folder / f"{name}.r{round:06d}.safetensors"


def _check_name(name: str) -> None:
    if not _NAME.match(name):
        raise ValueError(f"local state names are letters, digits, '_' and '-', not {name!r}")


def _safe(deployment: str) -> str:
    """A folder name for a deployment: its letters, digits, '.', '_', '-' (others become '_')."""
    return re.sub(r"[^A-Za-z0-9._-]", "_", deployment) or "_"
