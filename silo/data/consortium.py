"""`load_consortium`: the policy's `data:` section turned into one `SiloDataset` per silo,

  source -> raw table -> validation and encoding -> silos -> per silo: split, preprocess,
  label noise

each silo split and preprocessed on its own."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from fedsilo.policies.data import DataConfig
from fedsilo.silo.data.assignment import assign_silos
from fedsilo.silo.data.dataset import SiloDataset
from fedsilo.silo.data.encoding import Table, tabulate
from fedsilo.silo.data.label_noise import noisy_labels, noisy_silo_indices
from fedsilo.silo.data.scaling import fitted_standardiser
from fedsilo.silo.data.seeds import Purpose, rng_for
from fedsilo.silo.data.sources import read_source
from fedsilo.silo.data.splits import predefined_splits, split_positions, split_sizes
from fedsilo.silo.errors import DataError


def _features_tensor(x: np.ndarray, input_shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(x.astype(np.float32)).reshape(len(x), *input_shape)


def _labels_tensor(y: np.ndarray, task: str) -> torch.Tensor:
    dtype = np.int64 if task == "classification" else np.float32
    return torch.from_numpy(np.asarray(y, dtype=dtype))


def split_rows(
    name: str, rows: np.ndarray, index: int, table: Table, config: DataConfig, seed: int
) -> list[np.ndarray]:
    """The table rows of silo `name` (the `index`-th) in its train, val and test splits: as
    the split column says, or drawn at random in the section's fractions."""
    if table.splits is not None:
        return predefined_splits(name, rows, table.splits[rows], config)
    sizes = split_sizes(len(rows), config.split, name)
    labels = table.y[rows] if table.task == "classification" else None
    return [
        rows[positions]
        for positions in split_positions(labels, sizes, rng_for(seed, Purpose.SPLIT, index))
    ]


def _build_silo(
    name: str,
    rows: np.ndarray,
    index: int,
    table: Table,
    config: DataConfig,
    seed: int,
    noisy: bool,
) -> SiloDataset:
    splits = split_rows(name, rows, index, table, config, seed)
    standardiser = fitted_standardiser(table.x[splits[0]], table.numeric, config.scaling)
    xs = [
        _features_tensor(standardiser.transform(table.x[part]), table.input_shape)
        for part in splits
    ]
    ys = [table.y[part] for part in splits]
    if noisy:
        ys[0] = noisy_labels(ys[0], table, config, rng_for(seed, Purpose.LABEL_NOISE, index))
    y_train, y_val, y_test = (_labels_tensor(y, table.task) for y in ys)
    return SiloDataset(
        name=name,
        x_train=xs[0],
        y_train=y_train,
        x_val=xs[1],
        y_val=y_val,
        x_test=xs[2],
        y_test=y_test,
        task=table.task,
        num_classes=table.num_classes,
        feature_names=table.feature_names,
        input_shape=table.input_shape,
        outputs=table.outputs,
        domains=table.domains,
        domain_codes=(
            {}
            if table.domain_codes is None
            else {
                split: torch.from_numpy(table.domain_codes[part])
                for split, part in zip(("train", "val", "test"), splits, strict=True)
            }
        ),
    )


def load_consortium(
    config: DataConfig,
    seed: int,
    base_dir: Path | None = None,
    num_silos: int | None = None,
) -> list[SiloDataset]:
    """The silos the policy describes, each split and preprocessed on its own.

    `base_dir` resolves a relative `path` (the policy file's folder); `num_silos` overrides the
    partition's number of silos (the CLI's --silos). Raises DataError on any unusable input.
    """
    if num_silos is not None:
        try:
            config = config.with_silos(num_silos)
        except ValueError as error:
            raise DataError(str(error)) from error
    partition = config.resolved_partition()
    table = tabulate(read_source(config, base_dir), config, partition)
    assigned = assign_silos(table, partition, seed)
    noisy = noisy_silo_indices(table, config, len(assigned), seed)
    return [
        _build_silo(name, rows, index, table, config, seed, index in noisy)
        for index, (name, rows) in enumerate(assigned)
    ]
