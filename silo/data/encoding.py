"""Validation and row-wise encoding of a raw table: features (numeric columns as floats,
booleans as 0/1, declared categoricals one-hot, missing-value markers as NaN), the target (class
codes from the whole source's sorted label set, or regression targets), the natural-partition
column, the split column and the domain column. With `missing: drop` the rows missing a feature
value are dropped first. A data plug-in's labels come beside its table, and a task plug-in's
targets (float, (n,) or (n, k); survival's (time, event)) are kept as they are. No statistics:
the same at every silo. Rows the source gives already encoded (molecular graphs) are taken as
they are: no column of theirs is numeric (none is imputed or standardised)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import pandas as pd
import torch

from fedsilo.policies.data import (
    SPLIT_VALUES,
    SURVIVAL,
    DataConfig,
    NaturalPartition,
    Partition,
    ScaffoldPartition,
)
from fedsilo.silo.data.plugins import is_plugin_task, task_plugin
from fedsilo.silo.data.sources import SCAFFOLD_COLUMN, RawSource
from fedsilo.silo.errors import SECTION, DataError

# A csv/npz target is a classification label when it is not numeric, or when it is an integer
# with at most this many distinct values.
MAX_INFERRED_CLASSES = 20


@dataclass(frozen=True)
class Table:
    """The validated source: features encoded row by row, NaN where a value is missing."""

    x: np.ndarray  # (n, F) float64: numeric columns raw, categoricals one-hot
    numeric: np.ndarray  # (F,) bool: the columns each silo imputes and standardises
    feature_names: tuple[str, ...]
    input_shape: tuple[int, ...]
    y: np.ndarray  # class codes 0..C-1 (int64), regression or a task plug-in's targets (float64)
    task: str
    num_classes: int | None
    # the natural-partition column, or each molecule's scaffold for a scaffold partition
    groups: np.ndarray | None
    domains: tuple[str, ...] = ()  # with data.domain: its categories
    domain_codes: np.ndarray | None = None  # and each row's index into them
    outputs: int | None = None  # a task plug-in's output width for these targets
    splits: np.ndarray | None = None  # with data.split.column: each row's index in SPLIT_VALUES


def _columns_listing(frame: pd.DataFrame) -> str:
    return ", ".join(str(column) for column in frame.columns)


def _require_column(frame: pd.DataFrame, column: str, role: str, key: str, origin: str) -> None:
    """Refuse a column the data section names (at `key`) that the table lacks."""
    if column not in frame.columns:
        raise DataError(
            f"{SECTION}.{key}: {role} column '{column}' not found in {origin}; columns: "
            f"{_columns_listing(frame)}"
        )


def _is_number_dtype(series: pd.Series) -> bool:
    return pd.api.types.is_numeric_dtype(series) or pd.api.types.is_bool_dtype(series)


def _infer_task(target: pd.Series) -> str:
    if not pd.api.types.is_numeric_dtype(target) or pd.api.types.is_bool_dtype(target):
        return "classification"
    is_integer = pd.api.types.is_integer_dtype(target)
    if is_integer and target.nunique() <= MAX_INFERRED_CLASSES:
        return "classification"
    return "regression"


def task_reason(source: RawSource, config: DataConfig) -> str:
    """Where the data's task comes from, as `silo check` says it: the data section's `task`,
    the source's own (bundled sets, a data plug-in), or the rule applied to the target."""
    if config.task is not None:
        return f"set by {SECTION}.task"
    if source.task is not None:
        if config.source == "plugin":
            return "returned by the data plug-in"
        return f"source {config.source} is a {source.task} set"
    target = source.frame[source.dictionary.target]
    name = target.name
    if not pd.api.types.is_numeric_dtype(target) or pd.api.types.is_bool_dtype(target):
        return f"inferred: target '{name}' is not numeric"
    distinct = int(target.nunique())
    if pd.api.types.is_integer_dtype(target):
        if distinct <= MAX_INFERRED_CLASSES:
            return (
                f"inferred: target '{name}' holds whole numbers, {distinct} distinct values "
                f"(at most {MAX_INFERRED_CLASSES})"
            )
        return (
            f"inferred: target '{name}' holds whole numbers, {distinct} distinct values "
            f"(more than {MAX_INFERRED_CLASSES})"
        )
    return f"inferred: target '{name}' holds numbers with decimals"


def _encode_target(
    target: pd.Series, task: str | None, origin: str
) -> tuple[np.ndarray, str, int | None]:
    """Class codes from the sorted label set of the whole source, or float targets."""
    name = target.name
    if target.isna().any():
        raise DataError(
            f"{SECTION}.target: target column '{name}' in {origin} has "
            f"{int(target.isna().sum())} missing values; every row needs a label"
        )
    task = task or _infer_task(target)
    if task == "classification":
        values = target.to_numpy()
        if not _is_number_dtype(target):
            values = values.astype(str)
        classes, codes = np.unique(values, return_inverse=True)
        if len(classes) < 2:
            raise DataError(
                f"{SECTION}.target: target column '{name}' in {origin} holds a single class "
                f"('{classes[0]}'); a classifier needs rows of at least two classes"
            )
        return codes.astype(np.int64), task, len(classes)
    if not _is_number_dtype(target):
        raise DataError(
            f"{SECTION}.task: target column '{name}' in {origin} is not numeric, so it cannot be "
            "a regression target"
        )
    y = target.to_numpy(dtype=np.float64)
    if np.isinf(y).any():
        raise DataError(f"{SECTION}.target: target column '{name}' in {origin} contains inf")
    return y, task, None


_BOOLEANS = {"true": 1.0, "false": 0.0}


def _as_booleans(series: pd.Series) -> np.ndarray | None:
    """0/1 (NaN where missing) when every present value is a bool or TRUE/FALSE, else None."""
    present = series.dropna()
    words = present.map(lambda value: str(value).lower())
    if present.empty or not words.isin(_BOOLEANS.keys()).all():
        return None
    return series.map(lambda value: _BOOLEANS[str(value).lower()], na_action="ignore").to_numpy(
        dtype=np.float64, na_value=np.nan
    )


def _parsed_numbers(series: pd.Series, origin: str) -> np.ndarray:
    numbers = pd.to_numeric(series, errors="coerce")
    unparsed = series.notna() & numbers.isna()
    if unparsed.any():
        raise DataError(
            f"column '{series.name}' in {origin} is not numeric (e.g. value "
            f"'{series[unparsed].iloc[0]}'); declare its categories under {SECTION}.categorical "
            f"(e.g. categorical: {{{series.name}: [...]}}) or drop it with {SECTION}.drop_columns"
        )
    return numbers.to_numpy(dtype=np.float64, na_value=np.nan)


def _numeric_column(series: pd.Series, origin: str) -> np.ndarray:
    """Numbers as floats, booleans as 0/1; NaN where missing; inf is refused."""
    if _is_number_dtype(series):
        values = series.to_numpy(dtype=np.float64, na_value=np.nan)
    else:
        booleans = _as_booleans(series)
        values = _parsed_numbers(series, origin) if booleans is None else booleans
    if np.isinf(values).any():
        raise DataError(
            f"column '{series.name}' in {origin} contains inf in {int(np.isinf(values).sum())} "
            f"rows; fix the export or drop the column with {SECTION}.drop_columns"
        )
    return values


def _category_label(value: object) -> str:
    """How a cell is compared with the declared categories: 2.0 reads as '2'."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return str(value)


def _one_hot(series: pd.Series, categories: Sequence[str], origin: str) -> np.ndarray:
    """One 0/1 column per declared category; a missing value is an all-zero row."""
    labels = series.map(_category_label, na_action="ignore")
    unknown = labels.dropna()[~labels.dropna().isin(categories)]
    if not unknown.empty:
        raise DataError(
            f"{SECTION}.categorical.{series.name}: column '{series.name}' in {origin} has value "
            f"'{unknown.iloc[0]}' "
            f"({len(unknown)} rows), not among its declared categories: {list(categories)}"
        )
    return np.stack(
        [(labels == category).to_numpy(dtype=np.float64) for category in categories], axis=1
    )


def _replace_markers(series: pd.Series, markers: Sequence[float]) -> pd.Series:
    return series.mask(series.isin(list(markers))) if markers else series


def _check_missing(series: pd.Series, config: DataConfig, origin: str) -> None:
    count = int(series.isna().sum())
    if count and config.missing == "error":
        raise DataError(
            f"column '{series.name}' in {origin} has missing values in {count} rows; set "
            f"{SECTION}.missing: impute to impute them locally at each silo, or drop the column "
            f"with {SECTION}.drop_columns"
        )


def _feature_columns(source: RawSource, config: DataConfig, partition: Partition) -> list[str]:
    frame = source.frame
    for column in config.drop_columns:
        _require_column(frame, column, "drop", "drop_columns", source.origin)
    excluded = {*source.dictionary.not_features, *config.drop_columns}
    if source.labels is None:
        excluded.add(source.dictionary.target)
    if isinstance(partition, NaturalPartition):
        excluded.add(partition.column)
    if config.split.column is not None:
        excluded.add(config.split.column)
    features = [str(column) for column in frame.columns if column not in excluded]
    if not features:
        raise DataError(f"{SECTION}.drop_columns: {source.origin} has no feature columns left")
    return features


def _markers(source: RawSource, config: DataConfig) -> dict[str, tuple[float, ...]]:
    """Each column's missing-value markers: the data dictionary's and the section's."""
    markers = {column: tuple(values) for column, values in source.dictionary.missing_values.items()}
    for column, extra in config.missing_values.items():
        markers[column] = (*markers.get(column, ()), *extra)
    for column in markers:
        _require_column(source.frame, column, "declared", "missing_values", source.origin)
    return markers


def _without_missing_rows(source: RawSource, features: list[str], config: DataConfig) -> RawSource:
    """`missing: drop`: the source without the rows missing a value of a feature column (a
    blank cell or a declared marker)."""
    markers = _markers(source, config)
    missing = np.zeros(len(source.frame), dtype=bool)
    for column in features:
        missing |= _replace_markers(source.frame[column], markers.get(column, ())).isna().to_numpy()
    if missing.all():
        raise DataError(
            f"{SECTION}.missing: every row of {source.origin} misses a feature value; dropping "
            f"them leaves no data (drop the emptiest columns with {SECTION}.drop_columns)"
        )
    kept = ~missing
    labels = None if source.labels is None else source.labels[kept]
    frame = source.frame[kept].reset_index(drop=True)
    return dataclasses.replace(source, frame=frame, labels=labels)


def _encode_features(
    source: RawSource, features: list[str], config: DataConfig
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    dictionary = source.dictionary
    markers = _markers(source, config)
    for column in dictionary.categorical:
        _require_column(source.frame, column, "declared", "categorical", source.origin)
    blocks: list[np.ndarray] = []
    numeric: list[bool] = []
    names: list[str] = []
    for column in features:
        series = _replace_markers(source.frame[column], markers.get(column, ()))
        _check_missing(series, config, source.origin)
        categories = dictionary.categorical.get(column)
        if categories is None:
            blocks.append(_numeric_column(series, source.origin)[:, None])
            numeric.append(True)
            names.append(column)
        else:
            blocks.append(_one_hot(series, categories, source.origin))
            numeric.extend([False] * len(categories))
            names.extend(f"{column}={category}" for category in categories)
    return np.concatenate(blocks, axis=1), np.array(numeric), tuple(names)


def _natural_groups(source: RawSource, column: str) -> np.ndarray:
    _require_column(source.frame, column, "partition", "partition.column", source.origin)
    if column == source.dictionary.target:
        raise DataError(
            f"{SECTION}.partition.column: partition column '{column}' is the target; pick "
            "another column"
        )
    values = source.frame[column]
    if values.isna().any():
        raise DataError(
            f"{SECTION}.partition.column: partition column '{column}' in {source.origin} has "
            f"{int(values.isna().sum())} missing values; every row needs a silo"
        )
    return values.to_numpy()


def _encode_labels(source: RawSource, config: DataConfig) -> tuple[np.ndarray, str, int | None]:
    """The target of the source: its frame's target column, or a plug-in's labels."""
    task = config.task or source.task
    if source.labels is None:
        return _encode_target(source.frame[source.dictionary.target], task, source.origin)
    if task == "classification" and source.num_classes is not None:
        return source.labels.astype(np.int64), task, source.num_classes
    assert task is not None  # a plug-in always says its task
    if is_plugin_task(task):
        return source.labels, task, None
    return _encode_target(pd.Series(source.labels, name="y"), task, source.origin)


def _split_codes(source: RawSource, config: DataConfig) -> np.ndarray | None:
    """With `split.column`: each row's split, as its index in SPLIT_VALUES; else None."""
    column = config.split.column
    if column is None:
        return None
    _require_column(source.frame, column, "split", "split.column", source.origin)
    values = source.frame[column]
    bad = values[~values.isin(SPLIT_VALUES)]
    if not bad.empty:
        raise DataError(
            f"{SECTION}.split.column: split column '{column}' in {source.origin} has value "
            f"'{bad.iloc[0]}' ({len(bad)} rows); each row's split must be one of "
            f"{', '.join(SPLIT_VALUES)}"
        )
    return values.map(SPLIT_VALUES.index).to_numpy(dtype=np.int64)


def _check_survival_targets(y: np.ndarray, origin: str) -> None:
    """Survival targets: (n, 2) rows of (time, event), times at least 0 (TCGA-BRCA records
    day 0 for some), events 0 or 1."""
    if y.ndim != 2 or y.shape[1] != 2:
        raise DataError(
            f"{SECTION}.task: task survival needs targets (time, event) of shape (n, 2); "
            f"{origin} gives shape {y.shape}"
        )
    if not (y[:, 0] >= 0).all() or not np.isin(y[:, 1], (0.0, 1.0)).all():
        raise DataError(
            f"{SECTION}.task: task survival needs times of at least 0 and events 0 or 1; "
            f"{origin} gives other values"
        )


def _plugin_outputs(y: np.ndarray, task: str) -> int | None:
    """A task plug-in's output width for the targets `y` (None for a built-in task)."""
    if not is_plugin_task(task):
        return None
    outputs = task_plugin(task).output_dim(torch.from_numpy(y))
    if not isinstance(outputs, int) or outputs < 1:
        raise DataError(f"{SECTION}.task: task plug-in '{task}' gives output_dim {outputs!r}")
    return outputs


def tabulate(source: RawSource, config: DataConfig, partition: Partition) -> Table:
    if source.labels is None:
        target = source.dictionary.target
        _require_column(source.frame, target, "target", "target", source.origin)
    if source.image_shape is not None and config.drop_columns:
        raise DataError(f"{SECTION}.drop_columns: does not apply to image rows ({source.origin})")
    if source.encoded is not None:
        x = source.encoded.reshape(len(source.encoded), -1)
        numeric = np.zeros(x.shape[1], dtype=bool)
        names = tuple(f"x{i}" for i in range(x.shape[1]))
    else:
        features = _feature_columns(source, config, partition)
        if config.missing == "drop":
            source = _without_missing_rows(source, features, config)
        x, numeric, names = _encode_features(source, features, config)
    y, task, num_classes = _encode_labels(source, config)
    if task == SURVIVAL:
        _check_survival_targets(y, source.origin)
    groups = None
    if isinstance(partition, NaturalPartition):
        groups = _natural_groups(source, partition.column)
    elif isinstance(partition, ScaffoldPartition):
        groups = source.frame[SCAFFOLD_COLUMN].to_numpy()
    domains, codes = _domain_codes(source, config)
    return Table(
        x,
        numeric,
        names,
        source.image_shape or (x.shape[1],),
        y,
        task,
        num_classes,
        groups,
        domains,
        codes,
        _plugin_outputs(y, task),
        _split_codes(source, config),
    )


def _domain_codes(
    source: RawSource, config: DataConfig
) -> tuple[tuple[str, ...], np.ndarray | None]:
    """`data.domain`'s declared categories and each row's index into them (none without)."""
    if config.domain is None:
        return (), None
    column = config.domain
    _require_column(source.frame, column, "domain", "domain", source.origin)
    categories = source.dictionary.categorical.get(column) or config.categorical.get(column)
    if not categories:
        raise DataError(
            f"{SECTION}.domain: domain column '{column}' in {source.origin} declares no categories"
        )
    one_hot = _one_hot(source.frame[column], categories, source.origin)
    missing = int((one_hot.sum(axis=1) == 0).sum())
    if missing:
        raise DataError(
            f"{SECTION}.domain: domain column '{column}' in {source.origin} is missing in "
            f"{missing} rows; every row needs a domain"
        )
    return tuple(categories), one_hot.argmax(axis=1).astype(np.int64)


def class_labels(source: RawSource) -> tuple[str, ...]:
    """The source's class labels in class-code order (the sorted label set `tabulate` codes)."""
    if source.labels is not None:
        return tuple(str(label) for label in range(source.num_classes or 0)) or tuple(
            str(label) for label in np.unique(source.labels)
        )
    target = source.frame[source.dictionary.target]
    values = target.dropna().to_numpy()
    if not _is_number_dtype(target):
        values = values.astype(str)
    return tuple(str(label) for label in np.unique(values))


def feature_columns(source: RawSource, config: DataConfig, partition: Partition) -> list[str]:
    """The columns of `source` that become features (before one-hot encoding)."""
    return _feature_columns(source, config, partition)


def encode_new_rows(
    source: RawSource, config: DataConfig, partition: Partition, rows: pd.DataFrame, origin: str
) -> np.ndarray:
    """The features of `rows` (records without labels, e.g. to predict on) encoded exactly as
    `source` encodes its own: its feature columns, category lists and missing-value markers."""
    features = _feature_columns(source, config, partition)
    absent = [column for column in features if column not in rows.columns]
    if absent:
        raise DataError(
            f"{origin} lacks the feature column(s) {', '.join(absent)} that this site's data "
            f"has; its columns: {_columns_listing(rows)}"
        )
    x, _, _ = _encode_features(RawSource(rows, source.dictionary, origin), features, config)
    return x
