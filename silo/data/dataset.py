"""What the data pipeline hands a silo: its `SiloDataset` (splits as tensors, task, schema,
domains), and `DataError`, the pipeline's one error for unusable input."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

# Stands, in a DataError's message, for the key path of the data section: `data` in a policy,
# `data.source` in a silo's silo.yaml; so a message names the key to change as the reader's
# file spells it.
SECTION = "<data>"


class DataError(ValueError):
    """Data that cannot make a consortium; the message names the file, column or silo, and the
    key to change (written `<data>.key`, rendered under `section`)."""

    def __init__(self, message: str, section: str = "data") -> None:
        self.template = message
        super().__init__(message.replace(SECTION, section))

    def within(self, section: str) -> DataError:
        """The same error naming keys as spelled under `section` (silo.yaml: `data.source`)."""
        return DataError(self.template, section)


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
