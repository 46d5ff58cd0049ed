"""Messages of the admin channel (operator -> coordinator, coordinator/admin_service.py):
one typed request and its reply, each a fedsilo safetensors message with a JSON header like the
control messages (wire/control.py); never pickle.

  request: {type: admin_request, protocol, fedsilo, command, args}, no tensors; `ARGUMENTS`
           lists each command's arguments and their types, and nothing else is accepted
  reply:   {type: admin_reply, protocol, fedsilo, ok, error, data}; the files of `results`
           travel as uint8 tensors named by their path relative to the job's results folder,
           which `AdminReply.decode` refuses unless it stays inside that folder (no absolute
           path, no `..`)
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import PurePosixPath
from typing import Any

import torch

from fedsilo.wire.messages import check_protocol, versions
from fedsilo.wire.payload import AnyPayload
from fedsilo.wire.tensors import (
    WireError,
    bytes_tensor,
    decode_tensors,
    encode_tensors,
    tensor_bytes,
)

SUBMIT, RETRY, LIST, STATUS, ABORT, LOGS, RESULTS, CONSORTIUM = (
    "submit",
    "retry",
    "list",
    "status",
    "abort",
    "logs",
    "results",
    "consortium",
)
# Each command's arguments: name -> the JSON types its value may have.
ARGUMENTS: dict[str, dict[str, tuple[type, ...]]] = {
    SUBMIT: {"policy": (str,), "signature": (str,)},
    RETRY: {"job": (str,), "attempt": (int,), "signature": (str,)},  # the attempt's signature
    LIST: {},
    STATUS: {"job": (str,)},
    ABORT: {"job": (str,)},
    LOGS: {"job": (str,), "tail": (int, type(None))},
    RESULTS: {"job": (str,)},
    CONSORTIUM: {},
}
ROSTER, INSTALL_ROSTER = "roster", "install_roster"  # the consortium's signed roster
ARGUMENTS[ROSTER] = {}
ARGUMENTS[INSTALL_ROSTER] = {"roster": (str,), "signature": (str,)}
# A job's log from byte `offset` on, whole lines only, and whether the job has ended
# (`fedsilo job logs --follow` asks again from the offset each reply gives until it has).
LOG_LINES = "log_lines"
ARGUMENTS[LOG_LINES] = {"job": (str,), "offset": (int,)}
# A job's cross-site validation matrix (`fedsilo job validate`), from the coordinator's state file.
VALIDATE = "validate"
ARGUMENTS[VALIDATE] = {"job": (str,)}
REQUEST, REPLY = "admin_request", "admin_reply"


@dataclass(frozen=True)
class AdminRequest:
    command: str
    args: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        _check_arguments(self.command, self.args)

    def encode(self) -> bytes:
        header = {"type": REQUEST, **versions(), "command": self.command}
        return encode_tensors({}, {**header, "args": dict(self.args)})

    @classmethod
    def decode(cls, payload: bytes | AnyPayload) -> AdminRequest:
        """The request in `payload`, or WireError naming what does not fit."""
        tensors, header = _decoded(payload, REQUEST)
        if tensors:
            raise WireError("an admin request carries no tensors")
        args = header.get("args")
        if not isinstance(args, dict):
            raise WireError("an admin request's args must be a JSON object")
        return cls(str(header.get("command")), args)


@dataclass(frozen=True)
class AdminReply:
    ok: bool
    error: str = ""
    data: Any = None
    files: Mapping[str, bytes] = field(default_factory=dict)

    def encode(self) -> bytes:
        tensors = {
            str(relative_path(name)): _file_tensor(content) for name, content in self.files.items()
        }
        header = {"type": REPLY, **versions(), "ok": self.ok}
        return encode_tensors(tensors, {**header, "error": self.error, "data": self.data})

    @classmethod
    def decode(cls, payload: bytes | AnyPayload) -> AdminReply:
        """The reply in `payload`, or WireError (also for a file path outside the folder)."""
        tensors, header = _decoded(payload, REPLY)
        if not isinstance(header.get("ok"), bool) or not isinstance(header.get("error"), str):
            raise WireError("an admin reply needs a boolean ok and a string error")
        files = {}
        for name, tensor in tensors.items():
            if tensor.dtype != torch.uint8 or tensor.dim() != 1:
                raise WireError(f"file {name!r} is not a 1-D uint8 tensor")
            files[str(relative_path(name))] = tensor_bytes(tensor)
        return cls(header["ok"], header["error"], header.get("data"), files)


def relative_path(name: str) -> PurePosixPath:
    """`name` as a path that stays inside the folder it is relative to, or WireError."""
    path = PurePosixPath(name)
    if not name or "\\" in name or "\x00" in name or path.is_absolute():
        raise WireError(f"file path {name!r} is not a relative path")
    if any(part in ("..", ".") for part in name.split("/")) or "" in name.split("/"):
        raise WireError(f"file path {name!r} leaves its folder or is not normalised")
    return path


def _check_arguments(command: str, args: Mapping[str, Any]) -> None:
    if command not in ARGUMENTS:
        raise WireError(f"unknown admin command {command!r}; one of {', '.join(ARGUMENTS)}")
    expected = ARGUMENTS[command]
    if set(args) != set(expected):
        raise WireError(
            f"admin command {command!r} takes arguments {sorted(expected)}, got {sorted(args)}"
        )
    for name, types in expected.items():
        value = args[name]
        if isinstance(value, bool) or not isinstance(value, types):
            raise WireError(f"admin command {command!r}: argument {name!r} has the wrong type")


def _decoded(payload: bytes | AnyPayload, kind: str) -> tuple[dict[str, torch.Tensor], dict]:
    tensors, header = decode_tensors(payload)
    check_protocol(header)
    if header.get("type") != kind:
        raise WireError(f"not an {kind.replace('_', ' ')}: {header.get('type')!r}")
    return tensors, header


def _file_tensor(content: bytes) -> torch.Tensor:
    return bytes_tensor(content) if content else torch.empty(0, dtype=torch.uint8)
