"""The policy's `compute:` section: where a silo runs its training (auto, cpu, cuda, cuda:N),
and what each silo asks of a Ray cluster when `fedsilo simulate --backend ray` runs it
(`resources`: CPUs, GPUs, memory; the in-process backend ignores them)."""

from __future__ import annotations

import re

from pydantic import Field, field_validator, model_validator

from fedsilo.policies.base import PolicyModel

DEVICE_PATTERN = re.compile(r"auto|cpu|cuda(:[0-9]+)?")
ALLOWED_FORMS = "auto, cpu, cuda or cuda:N (N a non-negative integer)"


class SiloResources(PolicyModel):
    """What one simulated silo reserves while it runs a task on a Ray cluster: `cpus` and
    `gpus` (fractions share a device), `memory_mb` (none: no reservation). `gpus` left out
    follows `device`: 0 for cpu, 1 for cuda and cuda:N, and for auto 1 when the cluster has a
    GPU, else 0."""

    # CPUs one simulated silo reserves on a Ray cluster while it runs a task; a fraction shares a
    # CPU (1 by default)
    cpus: float = Field(default=1.0, gt=0)
    # GPUs it reserves; a fraction shares a device; null (the default): follows device, 0 for cpu, 1
    # for cuda, and for auto 1 when the cluster has a GPU
    gpus: float | None = Field(default=None, ge=0)
    # memory it reserves, in megabytes; null (the default): no reservation
    memory_mb: int | None = Field(default=None, gt=0)


class ComputeConfig(PolicyModel):
    """Requested compute device; `auto` takes the first CUDA device if one is visible."""

    # where a silo trains: auto (the default, the first CUDA device if one is visible, else the
    # CPU), cpu, cuda or cuda:N (the N-th CUDA device)
    device: str = "auto"
    # what each silo asks of a Ray cluster under `fedsilo simulate --backend ray`; other backends
    # and deployments ignore it
    resources: SiloResources = SiloResources()

    @field_validator("device")
    @classmethod
    def _known_device_form(cls, value: str) -> str:
        if not DEVICE_PATTERN.fullmatch(value):
            raise ValueError(f"device '{value}' is not one of the allowed forms: {ALLOWED_FORMS}")
        return value

    @model_validator(mode="after")
    def _no_gpu_for_cpu(self) -> ComputeConfig:
        if self.device == "cpu" and self.resources.gpus:
            raise ValueError(
                f"resources.gpus is {self.resources.gpus:g} but device is cpu: "
                "give device: cuda (or auto), or leave resources.gpus out"
            )
        return self
