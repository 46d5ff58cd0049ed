"""Compute placement: turns the policy's `compute.device` into a torch device, with a reason.

`auto` takes cuda:0 when a CUDA device is visible and the CPU otherwise; an explicit `cuda` or
`cuda:N` that this machine cannot honour is refused with a `DeviceError` naming what is there.
"""

from __future__ import annotations

import torch

from fedsilo.policies.compute import ALLOWED_FORMS, DEVICE_PATTERN


class DeviceError(ValueError):
    """The requested compute device does not exist on this machine."""


def resolve_device(requested: str) -> tuple[torch.device, str]:
    """The device for `requested` and a one-line explanation of the choice."""
    if not DEVICE_PATTERN.fullmatch(requested):
        raise DeviceError(f"device '{requested}' is not one of the allowed forms: {ALLOWED_FORMS}")
    if requested == "cpu":
        return torch.device("cpu"), "cpu: as requested"
    if requested == "auto":
        return _auto()
    return _cuda(requested)


def _visible_cuda_devices() -> int:
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _auto() -> tuple[torch.device, str]:
    if _visible_cuda_devices() == 0:
        return torch.device("cpu"), "auto: no CUDA device visible, using cpu"
    return torch.device("cuda:0"), f"auto: using {_describe(0)}"


def _cuda(requested: str) -> tuple[torch.device, str]:
    index = int(requested.partition(":")[2] or 0)
    visible = _visible_cuda_devices()
    if visible == 0:
        raise DeviceError(
            f"compute.device: {requested} requested but no CUDA device visible; use device: cpu "
            "or auto"
        )
    if index >= visible:
        names = ", ".join(f"cuda:{i}" for i in range(visible))
        raise DeviceError(
            f"compute.device: {requested} requested but {visible} CUDA device(s) visible: {names}"
        )
    return torch.device(f"cuda:{index}"), f"{requested}: using {_describe(index)}"


def _describe(index: int) -> str:
    return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
