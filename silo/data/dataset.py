"""What the data pipeline hands a silo: its `SiloDataset` (splits as tensors, task, schema,
domains); its one error for unusable input, `DataError`, is in silo/errors.py."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

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

    def with_train_rows_multiple_of(self, multiple: int, seed: int) -> SiloDataset:
        """This dataset trained on its training rows rounded down to a multiple of `multiple`:
        the rows dropped drawn by `seed` (the job's), the others kept in order. A training
        split smaller than `multiple` is a DataError: the site would train on nothing."""
        from fedsilo.silo.errors import DataError

        n = len(self.y_train)
        kept = n - n % multiple
        if kept == 0:
            raise DataError(
                f"train_rows_multiple: the training split has {n} rows, fewer than "
                f"{multiple}; lower train_rows_multiple or add rows"
            )
        if kept == n:
            return self
        generator = torch.Generator().manual_seed(seed)
        return self.with_train_rows(torch.randperm(n, generator=generator)[:kept].sort().values)

    def with_train_rows(self, rows: torch.Tensor) -> SiloDataset:
        """This dataset with its training split made of the training rows at `rows` (indices,
        repeats allowed), their domain codes with them; the other splits as they are."""
        codes = dict(self.domain_codes)
        if "train" in codes:
            codes["train"] = codes["train"][rows]
        return replace(
            self, x_train=self.x_train[rows], y_train=self.y_train[rows], domain_codes=codes
        )
