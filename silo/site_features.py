"""A site's preprocessing outside a run, to apply a trained model to its new records
(`fedsilo predict`): the site's feature encoding (its silo.yaml data dictionary) and the
statistics fitted on its own training rows, the rows the run's seed drew for its silo, exactly
as the silo agent fitted them.

`data.scaling: federated` is refused: the consortium's scaler is applied by the silos during a
run and recorded nowhere, so it cannot be repeated here.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from fedsilo.policies.data import DataConfig, Partition
from fedsilo.silo.config import SiloData
from fedsilo.silo.data import DataError
from fedsilo.silo.data.assignment import assign_silos
from fedsilo.silo.data.consortium import split_rows
from fedsilo.silo.data.encoding import class_labels, encode_new_rows, feature_columns, tabulate
from fedsilo.silo.data.scaling import Standardiser, fitted_standardiser
from fedsilo.silo.data.sources import RawSource, read_source

# Sources whose records a site can hand over as a CSV of the same columns.
TABULAR_SOURCES = ("csv", "heart")


@dataclass(frozen=True)
class SiteFeatures:
    """How this site turns records into model inputs, fitted on its own training rows."""

    source: RawSource
    config: DataConfig
    partition: Partition
    standardiser: Standardiser
    feature_names: tuple[str, ...]
    input_shape: tuple[int, ...]
    task: str
    num_classes: int | None
    classes: tuple[str, ...]  # class labels in class-code order (empty for regression)

    def feature_columns(self) -> list[str]:
        """The site's columns that the model reads (before one-hot encoding)."""
        return feature_columns(self.source, self.config, self.partition)

    def encode(self, rows: pd.DataFrame, origin: str) -> torch.Tensor:
        """Model inputs for `rows`: encoded, imputed and scaled as the site's training rows."""
        x = self.standardiser.transform(
            encode_new_rows(self.source, self.config, self.partition, rows, origin)
        )
        return torch.from_numpy(x.astype(np.float32)).reshape(len(x), *self.input_shape)


def fit_site_features(data: SiloData, seed: int, base_dir: Path | None) -> SiteFeatures:
    """The site's preprocessing as its silo fitted it in a run seeded with `seed`."""
    config = data.source
    if config.source not in TABULAR_SOURCES:
        raise DataError(
            f"{data.section_key}.source: predict reads records of a {' or '.join(TABULAR_SOURCES)} "
            f"source, not {config.source!r}"
        )
    if config.scaling == "federated":
        raise DataError(
            f"{data.section_key}.scaling: federated scaling used the consortium's scaler, which no "
            "file records; predict repeats only local or no scaling"
        )
    site = data.load(seed, base_dir)  # validates the data and picks this site's silo
    partition = config.resolved_partition()
    source = read_source(config, base_dir)
    table = tabulate(source, config, partition)
    assigned = assign_silos(table, partition, seed)
    index = [name for name, _ in assigned].index(site.name)
    train = split_rows(site.name, assigned[index][1], index, table, config, seed)[0]
    return SiteFeatures(
        source=source,
        config=config,
        partition=partition,
        standardiser=fitted_standardiser(table.x[train], table.numeric, config.scaling),
        feature_names=table.feature_names,
        input_shape=table.input_shape,
        task=table.task,
        num_classes=table.num_classes,
        classes=class_labels(source) if table.task == "classification" else (),
    )
