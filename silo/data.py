"""Dataset adapters, local preprocessing, splits and consortium assembly.

`load_consortium` turns the policy's `data:` section into one `SiloDataset` per silo:

  source -> raw table -> validation -> silos -> per silo: split, preprocess, label noise

Only facts of the schema cross silos: the columns, the fixed category lists of the data
dictionary, the missing-value markers and the label set. Every statistic (medians, means,
standard deviations) is fitted on a silo's own training rows and applied to its own
validation and test rows, as it would be at a real, separate site. With `data.scaling:
federated` the silo imputes here but leaves standardisation to the consortium's scaler
(silo/tasks/scaling.py), which is built from summed moments only.

All randomness comes from `np.random.SeedSequence([seed, purpose, ...])`, one purpose per use,
so a seed reproduces a consortium exactly and the uses do not disturb one another.
"""

from __future__ import annotations

import csv
import zipfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from enum import IntEnum
from importlib.resources import files
from pathlib import Path

import numpy as np
import pandas as pd
import torch

from fedsilo.policies.data import (
    KNOWN_TASKS,
    DataConfig,
    DirichletPartition,
    IidPartition,
    NaturalPartition,
    Partition,
    QuantitySkewPartition,
    ShardsPartition,
    SplitConfig,
)
from fedsilo.silo.partition import (
    add_label_noise,
    by_column,
    dirichlet_label_skew,
    flip_labels,
    iid,
    label_shards,
    noisy_silos,
    quantity_skew,
)

# A csv/npz target is a classification label when it is not numeric, or when it is an integer
# with at most this many distinct values.
MAX_INFERRED_CLASSES = 20


class DataError(ValueError):
    """Data that cannot make a consortium; the message names the file, column or silo."""


@dataclass(frozen=True)
class DataDictionary:
    """What a consortium agrees on about a table before any row is seen."""

    target: str
    categorical: Mapping[str, Sequence[str]] = field(default_factory=dict)
    missing_values: Mapping[str, Sequence[float]] = field(default_factory=dict)
    not_features: tuple[str, ...] = ()


# The bundled UCI heart-disease table (silo/datasets/heart/README.md). The target `num` (0-4)
# becomes the usual binary task num > 0. `dataset` names the hospital (the natural silo) and
# `id` the record; neither is a feature. fbs and exang are booleans (0/1); age, trestbps, chol,
# thalch, oldpeak and ca are numeric. A recorded 0 for chol or trestbps means "not measured".
HEART_DICTIONARY = DataDictionary(
    target="num",
    categorical={
        "sex": ("Male", "Female"),
        "cp": ("typical angina", "atypical angina", "non-anginal", "asymptomatic"),
        "restecg": ("normal", "st-t abnormality", "lv hypertrophy"),
        "slope": ("upsloping", "flat", "downsloping"),
        "thal": ("normal", "fixed defect", "reversable defect"),
    },
    missing_values={"chol": (0.0,), "trestbps": (0.0,)},
    not_features=("id", "dataset"),
)
HEART_CSV = "datasets/heart/heart_disease_uci.csv"
DIGITS_INTENSITIES = 16.0  # scikit-learn's 8x8 digits count 0..16 per pixel


class _Purpose(IntEnum):
    """The second word of every seed sequence: which use the random numbers are for."""

    PARTITION = 0
    SUBSAMPLE = 1
    SPLIT = 2
    NOISY_SILOS = 3
    LABEL_NOISE = 4


def _rng(seed: int, purpose: _Purpose, *more: int) -> np.random.Generator:
    return np.random.default_rng(np.random.SeedSequence([seed, int(purpose), *more]))


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

    @property
    def output_dim(self) -> int:
        return self.num_classes if self.num_classes is not None else 1


# ---------------------------------------------------------------------------------------------
# Sources: each adapter returns the raw table and what is known about it.


@dataclass(frozen=True)
class _RawSource:
    frame: pd.DataFrame
    dictionary: DataDictionary
    origin: str  # how messages name the source: a file path or the source name
    task: str | None = None  # known task, or None to infer from the target
    image_shape: tuple[int, ...] | None = None  # per-row shape when the rows are images


def _resolve_path(path: str, base_dir: Path | None) -> Path:
    resolved = Path(path).expanduser()
    if not resolved.is_absolute() and base_dir is not None:
        resolved = base_dir / resolved
    if not resolved.is_file():
        raise DataError(f"data file not found: {resolved}")
    return resolved


def _read_heart() -> _RawSource:
    with (files("fedsilo.silo") / HEART_CSV).open("rb") as handle:
        frame = pd.read_csv(handle)
    frame[HEART_DICTIONARY.target] = frame[HEART_DICTIONARY.target] > 0
    return _RawSource(frame, HEART_DICTIONARY, "the bundled heart data", KNOWN_TASKS["heart"])


def _read_sklearn(source: str) -> _RawSource:
    from sklearn import datasets  # only here: keeps every process's start-up ~1 s faster

    name = source.removeprefix("sklearn:")
    bunch = getattr(datasets, f"load_{name}")()
    frame = pd.DataFrame(bunch.data, columns=[str(column) for column in bunch.feature_names])
    if name == "digits":  # the data dictionary: pixel intensities 0..16, read as 0..1
        frame /= DIGITS_INTENSITIES
    frame["target"] = bunch.target
    image_shape = (1, *bunch.images.shape[1:]) if name == "digits" else None
    return _RawSource(frame, DataDictionary("target"), source, KNOWN_TASKS[source], image_shape)


def _read_csv(path: Path, config: DataConfig) -> _RawSource:
    try:
        _check_header(path)
        frame = pd.read_csv(path)
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as error:
        raise DataError(f"cannot read CSV file {path}: {error}") from error
    assert config.target is not None  # the policy requires it for csv
    dictionary = DataDictionary(config.target, config.categorical, config.missing_values)
    return _RawSource(frame, dictionary, str(path))


def _check_header(path: Path) -> None:
    """Refuse a header naming a column twice (pandas would silently rename it `a.1`)."""
    with path.open(newline="", encoding="utf-8") as handle:
        header = next(csv.reader(handle), [])
    repeated = sorted(name for name, count in Counter(header).items() if count > 1)
    if repeated:
        raise DataError(
            f"CSV file {path}: the header names column(s) {', '.join(map(repr, repeated))} "
            "twice; every column needs its own name"
        )


def _read_npz(path: Path) -> _RawSource:
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        raise DataError(f"cannot read npz file {path}: {error}") from error
    missing = [name for name in ("x", "y") if name not in arrays]
    if missing:
        raise DataError(
            f"npz file {path} lacks array(s) {', '.join(missing)}; it holds: "
            f"{', '.join(sorted(arrays)) or 'nothing'} (expected 'x' features and 'y' labels)"
        )
    x, y = arrays["x"], arrays["y"]
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y):
        raise DataError(
            f"npz file {path}: 'x' must have shape (n, ...) and 'y' shape (n,), got "
            f"{x.shape} and {y.shape}"
        )
    frame = pd.DataFrame(x.reshape(len(x), -1), columns=[f"x{i}" for i in range(x[0].size)])
    frame["y"] = y
    image_shape = tuple(x.shape[1:]) if x.ndim > 2 else None
    return _RawSource(frame, DataDictionary("y"), str(path), image_shape=image_shape)


def _read_source(config: DataConfig, base_dir: Path | None) -> _RawSource:
    if config.source == "heart":
        return _read_heart()
    if config.source == "csv":
        assert config.path is not None  # the policy requires it for csv
        return _read_csv(_resolve_path(config.path, base_dir), config)
    if config.source == "npz":
        assert config.path is not None  # the policy requires it for npz
        return _read_npz(_resolve_path(config.path, base_dir))
    return _read_sklearn(config.source)


# ---------------------------------------------------------------------------------------------
# Validation and row-wise encoding (no statistics: the same at every silo).


@dataclass(frozen=True)
class _Table:
    """The validated source: features encoded row by row, NaN where a value is missing."""

    x: np.ndarray  # (n, F) float64: numeric columns raw, categoricals one-hot
    numeric: np.ndarray  # (F,) bool: the columns each silo imputes and standardises
    feature_names: tuple[str, ...]
    input_shape: tuple[int, ...]
    y: np.ndarray  # class codes 0..C-1 (int64) or regression targets (float64)
    task: str
    num_classes: int | None
    groups: np.ndarray | None  # the natural-partition column, when there is one
    domains: tuple[str, ...] = ()  # with data.domain: its categories
    domain_codes: np.ndarray | None = None  # and each row's index into them


def _columns_listing(frame: pd.DataFrame) -> str:
    return ", ".join(str(column) for column in frame.columns)


def _require_column(frame: pd.DataFrame, column: str, role: str, origin: str) -> None:
    if column not in frame.columns:
        raise DataError(
            f"{role} column '{column}' not found in {origin}; columns: {_columns_listing(frame)}"
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


def _encode_target(
    target: pd.Series, task: str | None, origin: str
) -> tuple[np.ndarray, str, int | None]:
    """Class codes from the sorted label set of the whole source, or float targets."""
    name = target.name
    if target.isna().any():
        raise DataError(
            f"target column '{name}' in {origin} has {int(target.isna().sum())} missing values"
        )
    task = task or _infer_task(target)
    if task == "classification":
        values = target.to_numpy()
        if not _is_number_dtype(target):
            values = values.astype(str)
        classes, codes = np.unique(values, return_inverse=True)
        if len(classes) < 2:
            raise DataError(f"target column '{name}' in {origin} holds a single class")
        return codes.astype(np.int64), task, len(classes)
    if not _is_number_dtype(target):
        raise DataError(
            f"target column '{name}' in {origin} is not numeric, so it cannot be a regression "
            "target"
        )
    y = target.to_numpy(dtype=np.float64)
    if np.isinf(y).any():
        raise DataError(f"target column '{name}' in {origin} contains inf")
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
            f"'{series[unparsed].iloc[0]}'); declare its categories under data.categorical "
            f"(e.g. categorical: {{{series.name}: [...]}}) or drop it with data.drop_columns"
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
            f"column '{series.name}' in {origin} contains inf in {int(np.isinf(values).sum())} rows"
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
            f"column '{series.name}' in {origin} has value '{unknown.iloc[0]}' "
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
            "data.missing: impute to impute them locally at each silo, or drop the column"
        )


def _feature_columns(source: _RawSource, config: DataConfig, partition: Partition) -> list[str]:
    frame = source.frame
    for column in config.drop_columns:
        _require_column(frame, column, "drop", source.origin)
    excluded = {source.dictionary.target, *source.dictionary.not_features, *config.drop_columns}
    if isinstance(partition, NaturalPartition):
        excluded.add(partition.column)
    features = [str(column) for column in frame.columns if column not in excluded]
    if not features:
        raise DataError(f"{source.origin} has no feature columns left")
    return features


def _encode_features(
    source: _RawSource, features: list[str], config: DataConfig
) -> tuple[np.ndarray, np.ndarray, tuple[str, ...]]:
    dictionary = source.dictionary
    markers = dict(dictionary.missing_values)
    for column, extra in config.missing_values.items():
        markers[column] = (*markers.get(column, ()), *extra)
    for column in [*markers, *dictionary.categorical]:
        _require_column(source.frame, column, "declared", source.origin)
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


def _natural_groups(source: _RawSource, column: str) -> np.ndarray:
    _require_column(source.frame, column, "partition", source.origin)
    if column == source.dictionary.target:
        raise DataError(f"partition column '{column}' is the target; pick another column")
    values = source.frame[column]
    if values.isna().any():
        raise DataError(
            f"partition column '{column}' in {source.origin} has {int(values.isna().sum())} "
            "missing values; every row needs a silo"
        )
    return values.to_numpy()


def _tabulate(source: _RawSource, config: DataConfig, partition: Partition) -> _Table:
    target = source.dictionary.target
    _require_column(source.frame, target, "target", source.origin)
    if source.image_shape is not None and config.drop_columns:
        raise DataError(f"drop_columns does not apply to image rows ({source.origin})")
    features = _feature_columns(source, config, partition)
    x, numeric, names = _encode_features(source, features, config)
    y, task, num_classes = _encode_target(
        source.frame[target], config.task or source.task, source.origin
    )
    groups = None
    if isinstance(partition, NaturalPartition):
        groups = _natural_groups(source, partition.column)
    domains, codes = _domain_codes(source, config)
    return _Table(
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
    )


def _domain_codes(
    source: _RawSource, config: DataConfig
) -> tuple[tuple[str, ...], np.ndarray | None]:
    """`data.domain`'s declared categories and each row's index into them (none without)."""
    if config.domain is None:
        return (), None
    column = config.domain
    _require_column(source.frame, column, "domain", source.origin)
    categories = source.dictionary.categorical.get(column) or config.categorical.get(column)
    if not categories:
        raise DataError(f"domain column '{column}' in {source.origin} declares no categories")
    one_hot = _one_hot(source.frame[column], categories, source.origin)
    missing = int((one_hot.sum(axis=1) == 0).sum())
    if missing:
        raise DataError(
            f"domain column '{column}' in {source.origin} is missing in {missing} rows; every "
            "row needs a domain"
        )
    return tuple(categories), one_hot.argmax(axis=1).astype(np.int64)


# ---------------------------------------------------------------------------------------------
# Partition into silos.


def _partition_rows(table: _Table, partition: Partition, seed: int) -> list[np.ndarray]:
    rng = _rng(seed, _Purpose.PARTITION)
    n = len(table.y)
    if isinstance(partition, IidPartition):
        return iid(n, partition.silos, rng)
    if isinstance(partition, DirichletPartition):
        if table.task != "classification":
            raise DataError("a dirichlet partition skews class labels; this task is regression")
        return dirichlet_label_skew(
            table.y, partition.silos, partition.alpha, rng, partition.min_size
        )
    if isinstance(partition, ShardsPartition):
        if table.task != "classification":
            raise DataError("a shards partition deals label-sorted shards; this task is regression")
        return label_shards(table.y, partition.silos, partition.shards_per_silo, rng)
    assert isinstance(partition, QuantitySkewPartition)
    total = n if partition.total is None else partition.total
    if total > n:
        raise DataError(f"quantity_skew total={total} exceeds the source's {n} rows")
    rows = np.sort(_rng(seed, _Purpose.SUBSAMPLE).choice(n, size=total, replace=False))
    parts = quantity_skew(total, partition.silos, partition.small_fraction, partition.n_min, rng)
    return [rows[part] for part in parts]


def _assign_silos(table: _Table, partition: Partition, seed: int) -> list[tuple[str, np.ndarray]]:
    if isinstance(partition, NaturalPartition):
        assert table.groups is not None
        return list(by_column(table.groups).items())
    try:
        parts = _partition_rows(table, partition, seed)
    except DataError:
        raise
    except ValueError as error:
        raise DataError(f"cannot partition the data: {error}") from error
    return [(f"silo-{index}", rows) for index, rows in enumerate(parts)]


# ---------------------------------------------------------------------------------------------
# Per silo: split, then preprocessing fitted on the silo's own training rows.


def _split_sizes(n: int, split: SplitConfig, silo: str) -> list[int]:
    """Rows for train, val and test: proportional, at least one in each split asked for."""
    needed = 3 if split.val > 0 else 2
    if n < needed:
        raise DataError(
            f"silo '{silo}' has {n} rows; splitting it into train/val/test needs at least {needed}"
        )
    val = max(1, int(n * split.val + 0.5)) if split.val > 0 else 0  # rounded half up
    test = max(1, int(n * split.test + 0.5))
    while n - val - test < 1:
        if val >= test:
            val -= 1
        else:
            test -= 1
    return [n - val - test, val, test]


def _interleave(sizes: list[int]) -> np.ndarray:
    """A sequence of split indices (0, 1, 2) holding sizes[j] of each j, spread evenly so that
    any run of the sequence is close to proportional."""
    slots = np.concatenate([(np.arange(size) + 0.5) / size for size in sizes if size])
    splits = np.repeat(np.arange(len(sizes)), sizes)
    return splits[np.argsort(slots, kind="stable")]


def _can_stratify(labels: np.ndarray, sizes: list[int]) -> bool:
    """Every class present has enough rows to expect one in the smallest split."""
    _, counts = np.unique(labels, return_counts=True)
    smallest = min(size for size in sizes if size)
    return bool(counts.min() * smallest >= sum(sizes))


def _split_positions(
    labels: np.ndarray | None, sizes: list[int], rng: np.random.Generator
) -> list[np.ndarray]:
    """Positions (within the silo) of its train, val and test rows: shuffled, and stratified
    by label (rows grouped by class before the even interleave) when every class allows it."""
    order = rng.permutation(sum(sizes))
    if labels is not None and _can_stratify(labels, sizes):
        order = order[np.argsort(labels[order], kind="stable")]
    assignment = _interleave(sizes)
    return [np.sort(order[assignment == split]) for split in range(len(sizes))]


@dataclass(frozen=True)
class _Standardiser:
    """Median imputation and standardisation of the numeric columns, fitted on training rows.

    A column with no value at all in the training rows carries no information here: it becomes
    0 (the mean, after standardisation) in every split.
    """

    numeric: np.ndarray
    observed: np.ndarray
    median: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    fill_unobserved: bool = True

    @classmethod
    def fit(cls, train: np.ndarray, numeric: np.ndarray) -> _Standardiser:
        values = train[:, numeric]
        observed = (~np.isnan(values)).any(axis=0)
        median = np.full(values.shape[1], np.nan)
        mean = np.zeros(values.shape[1])
        std = np.ones(values.shape[1])
        if observed.any():
            seen = values[:, observed]
            median[observed] = np.nanmedian(seen, axis=0)
            imputed = np.where(np.isnan(seen), median[observed], seen)
            mean[observed] = imputed.mean(axis=0)
            spread = imputed.std(axis=0)
            std[observed] = np.where(spread > 0, spread, 1.0)
        return cls(numeric, observed, median, mean, std)

    def transform(self, x: np.ndarray) -> np.ndarray:
        values = x[:, self.numeric]
        imputed = np.where(np.isnan(values), self.median, values)
        scaled = (imputed - self.mean) / self.std
        if self.fill_unobserved:
            scaled[:, ~self.observed] = 0.0
        out = x.copy()
        out[:, self.numeric] = scaled
        return out


def _features_tensor(x: np.ndarray, input_shape: tuple[int, ...]) -> torch.Tensor:
    return torch.from_numpy(x.astype(np.float32)).reshape(len(x), *input_shape)


def _labels_tensor(y: np.ndarray, task: str) -> torch.Tensor:
    dtype = np.int64 if task == "classification" else np.float32
    return torch.from_numpy(np.asarray(y, dtype=dtype))


def _noisy_labels(
    y: np.ndarray, table: _Table, config: DataConfig, rng: np.random.Generator
) -> np.ndarray:
    noise = config.label_noise
    assert noise is not None
    if table.task == "classification":
        assert table.num_classes is not None
        return flip_labels(y, table.num_classes, noise.probability, rng)
    return add_label_noise(y, noise.probability, noise.std, rng)


def _build_silo(
    name: str,
    rows: np.ndarray,
    index: int,
    table: _Table,
    config: DataConfig,
    seed: int,
    noisy: bool,
) -> SiloDataset:
    sizes = _split_sizes(len(rows), config.split, name)
    labels = table.y[rows] if table.task == "classification" else None
    splits = [
        rows[positions]
        for positions in _split_positions(labels, sizes, _rng(seed, _Purpose.SPLIT, index))
    ]
    standardiser = _Standardiser.fit(table.x[splits[0]], table.numeric)
    if config.scaling == "none":  # impute only: features as the source gives them
        standardiser = replace(
            standardiser,
            mean=np.zeros_like(standardiser.mean),
            std=np.ones_like(standardiser.std),
        )
    elif config.scaling == "federated":  # impute only; the consortium's scaler comes later
        # Columns this silo never observed stay NaN: the federated scaler fills them with the
        # consortium mean, and the silo's moments leave them out.
        standardiser = replace(
            standardiser,
            mean=np.zeros_like(standardiser.mean),
            std=np.ones_like(standardiser.std),
            fill_unobserved=False,
        )
    xs = [
        _features_tensor(standardiser.transform(table.x[part]), table.input_shape)
        for part in splits
    ]
    ys = [table.y[part] for part in splits]
    if noisy:
        ys[0] = _noisy_labels(ys[0], table, config, _rng(seed, _Purpose.LABEL_NOISE, index))
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


# ---------------------------------------------------------------------------------------------
# The consortium.


def _noisy_silo_indices(config: DataConfig, silos: int, seed: int) -> set[int]:
    if config.label_noise is None:
        return set()
    chosen = noisy_silos(silos, config.label_noise.silo_fraction, _rng(seed, _Purpose.NOISY_SILOS))
    return {int(index) for index in chosen}


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
    table = _tabulate(_read_source(config, base_dir), config, partition)
    assigned = _assign_silos(table, partition, seed)
    noisy = _noisy_silo_indices(config, len(assigned), seed)
    return [
        _build_silo(name, rows, index, table, config, seed, index in noisy)
        for index, (name, rows) in enumerate(assigned)
    ]


def pool(silos: Sequence[SiloDataset], name: str = "pooled") -> SiloDataset:
    """The union of the silos' (already locally preprocessed) splits: what the `central`
    reference trains on."""
    if not silos:
        raise ValueError("cannot pool an empty list of silos")
    first = silos[0]
    for silo in silos[1:]:
        schema = (silo.task, silo.num_classes, silo.feature_names, silo.input_shape, silo.domains)
        if schema != (
            first.task,
            first.num_classes,
            first.feature_names,
            first.input_shape,
            first.domains,
        ):
            raise ValueError(f"silo '{silo.name}' does not share the schema of '{first.name}'")
    return SiloDataset(
        name=name,
        x_train=torch.cat([silo.x_train for silo in silos]),
        y_train=torch.cat([silo.y_train for silo in silos]),
        x_val=torch.cat([silo.x_val for silo in silos]),
        y_val=torch.cat([silo.y_val for silo in silos]),
        x_test=torch.cat([silo.x_test for silo in silos]),
        y_test=torch.cat([silo.y_test for silo in silos]),
        task=first.task,
        num_classes=first.num_classes,
        feature_names=first.feature_names,
        input_shape=first.input_shape,
        domains=first.domains,
        domain_codes={
            split: torch.cat([silo.domain_codes[split] for silo in silos])
            for split in first.domain_codes
        },
    )
