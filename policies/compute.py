"""The policy's `compute:` section: where a silo runs its training (auto, cpu, cuda, cuda:N)."""

from __future__ import annotations

import re

from pydantic import field_validator

from fedsilo.policies.base import PolicyModel

DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
ALLOWED_FORMS = "auto, cpu, cuda or cuda:N (N a non-negative integer)"


class ComputeConfig(PolicyModel):
    """Requested compute device; `auto` takes the first CUDA device if one is visible."""

    device: str = "auto"

    @field_validator("device")
    @classmethod
    def _known_device_form(cls, value: str) -> str:
        if not DEVICE_PATTERN.fullmatch(value):
            raise ValueError(f"device '{value}' is not one of the allowed forms: {ALLOWED_FORMS}")
        return value
