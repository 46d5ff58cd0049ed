"""What the data pipeline hands a silo: its `SiloDataset` (splits as tensors, task, schema,
domains); its one error for unusable input, `DataError`, is in silo/errors.py."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch


@dataclass(frozen=True, eq=False)
class SiloDataset:
    """One silo's data, split and preprocessed locally, ready for training."""

    name: str
    x_train: torch.Tensor
    y_train: torch.Tensor
    x_val: torch.Tensor
    y_val: torch.Tensor
    x_test: torch.Tensor
    y_test: torch.Tensor
    task: str
    num_classes: int | None
    feature_names: tuple[str, ...]
    input_shape: tuple[int, ...]
    # With `data.domain`: the domain names, and each split's rows' domain codes (int64, indices
    # into `domains`). Without: no domains (the silo is one domain).
    domains: tuple[str, ...] = ()
    domain_codes: Mapping[str, torch.Tensor] = field(default_factory=dict)
    # A task plug-in's output width (its `output_dim` of the source's targets); else None.
    outputs: int | None = None

    @property
    def output_dim(self) -> int:
        if self.outputs is not None:
            return self.outputs
        return self.num_classes if self.num_classes is not None else 1
