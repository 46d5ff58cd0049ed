"""Source readers: the bundled heart and TCGA-BRCA tables, the bundled molecular sets and a
site's own CSV of SMILES (as graph rows, silo/data/molecules.py), scikit-learn's datasets, a CSV
or an npz file, or an installed data plug-in (silo/data/plugins.py), each read into a raw table
with what is known about it (its data dictionary, its task, its image shape)."""

from __future__ import annotations

import csv
import zipfile
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from importlib.resources import files
from pathlib import Path

import numpy as np
import pandas as pd

from fedsilo.policies.data import (
    KNOWN_TASKS,
    MOLECULAR_SOURCES,
    MOLECULE_CSV,
    PLUGIN_SOURCE,
    TCGA_SILO_COLUMN,
    TCGA_SPLIT_COLUMN,
    DataConfig,
)
from fedsilo.silo.data.plugins import load_plugin_data
from fedsilo.silo.errors import SECTION, DataError, DataNotHere


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
# The bundled TCGA-BRCA clinical table (silo/datasets/tcga_brca/README.md): the patients of the
# split file, each with its region (the natural silo, named as centers.csv names it) and its
# static split (train/test, from `fold2`); the 39 feature columns are brca.csv's, the targets
# (time, event) its T and E.
TCGA_FOLDER = "datasets/tcga_brca"
TCGA_DICTIONARY = DataDictionary(target="T", not_features=("pid", TCGA_SILO_COLUMN, "T", "E"))
# A molecular source's frame: each molecule's Bemis-Murcko scaffold (not a feature).
SCAFFOLD_COLUMN = "scaffold"
DIGITS_INTENSITIES = 16.0  # scikit-learn's 8x8 digits count 0..16 per pixel


@dataclass(frozen=True)
class RawSource:
    frame: pd.DataFrame
    dictionary: DataDictionary
    origin: str  # how messages name the source: a file path or the source name
    task: str | None = None  # known task, or None to infer from the target
    image_shape: tuple[int, ...] | None = None  # per-row shape when the rows are images
    # A plug-in's labels, kept beside the frame (they may be (n, k)), and its class count.
    labels: np.ndarray | None = None
    num_classes: int | None = None
    # Rows already encoded, image-shaped (molecular graphs): the features, in place of the
    # frame's columns (the frame then holds the target and the columns that are not features).
    encoded: np.ndarray | None = None


def _resolve_path(path: str, base_dir: Path | None) -> Path:
    resolved = Path(path).expanduser()
    if not resolved.is_absolute() and base_dir is not None:
        resolved = base_dir / resolved
    if not resolved.is_file():
        raise DataNotHere(f"{SECTION}.path: data file not found: {resolved}")
    return resolved


def _read_heart() -> RawSource:
    with (files("fedsilo.silo") / HEART_CSV).open("rb") as handle:
        frame = pd.read_csv(handle)
    frame[HEART_DICTIONARY.target] = frame[HEART_DICTIONARY.target] > 0
    return RawSource(frame, HEART_DICTIONARY, "the bundled heart data", KNOWN_TASKS["heart"])


def _read_tcga_brca() -> RawSource:
    folder = files("fedsilo.silo") / TCGA_FOLDER
    with (folder / "brca.csv").open("rb") as handle:
        patients = pd.read_csv(handle)
    with (folder / "train_test_split.csv").open("rb") as handle:
        folds = pd.read_csv(handle)
    with (folder / "centers.csv").open("rb") as handle:  # site codes are text, never NaN
        centers = pd.read_csv(handle, keep_default_na=False)
    frame = folds.merge(patients, on="pid", how="inner", validate="one_to_one")
    frame[TCGA_SPLIT_COLUMN] = frame["fold2"].str.split("_").str[0]
    regions = dict(zip(centers["TSS Code"], centers["Region"], strict=True))
    frame.insert(1, TCGA_SILO_COLUMN, frame["pid"].str[5:7].map(regions))
    frame = frame.drop(columns=["fold", "fold2"])
    labels = frame[["T", "E"]].to_numpy(dtype=np.float64)  # (time, event)
    return RawSource(
        frame,
        TCGA_DICTIONARY,
        "the bundled TCGA-BRCA data",
        KNOWN_TASKS["tcga_brca"],
        None,
        labels=labels,
    )


def _read_sklearn(source: str) -> RawSource:
    from sklearn import datasets  # only here: keeps every process's start-up ~1 s faster

    name = source.removeprefix("sklearn:")
    bunch = getattr(datasets, f"load_{name}")()
    frame = pd.DataFrame(bunch.data, columns=[str(column) for column in bunch.feature_names])
    if name == "digits":  # the data dictionary: pixel intensities 0..16, read as 0..1
        frame /= DIGITS_INTENSITIES
    frame["target"] = bunch.target
    image_shape = (1, *bunch.images.shape[1:]) if name == "digits" else None
    return RawSource(frame, DataDictionary("target"), source, KNOWN_TASKS[source], image_shape)


def _read_csv(path: Path, config: DataConfig) -> RawSource:
    frame = _read_csv_file(path, dict.fromkeys(config.categorical, str))
    assert config.target is not None  # the policy requires it for csv
    dictionary = DataDictionary(config.target, config.categorical, config.missing_values)
    return RawSource(frame, dictionary, str(path))


def _read_csv_file(path: Path, text_columns: Mapping[str, type]) -> pd.DataFrame:
    """The CSV file at `path`, `text_columns` read as the text the file holds; DataError naming
    `data.path` when it cannot be read."""
    try:
        _check_header(path)
        return pd.read_csv(path, dtype=dict(text_columns))
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as error:
        raise DataError(f"{SECTION}.path: cannot read CSV file {path}: {error}") from error


def read_csv_as_written(path: Path, categorical: Mapping[str, object]) -> pd.DataFrame:
    """The CSV file, its categorical columns read as the text the file holds: `TRUE` stays
    `TRUE` (pandas would read a bool and print it `True`), `007` stays `007`, so a cell matches
    the category declared for it exactly as the export writes it."""
    return pd.read_csv(path, dtype=dict.fromkeys(categorical, str))


def _check_header(path: Path) -> None:
    """Refuse a header naming a column twice (pandas would silently rename it `a.1`)."""
    with path.open(newline="", encoding="utf-8") as handle:
        header = next(csv.reader(handle), [])
    repeated = sorted(name for name, count in Counter(header).items() if count > 1)
    if repeated:
        raise DataError(
            f"{SECTION}.path: CSV file {path}: the header names column(s) "
            f"{', '.join(map(repr, repeated))} twice; every column needs its own name"
        )


def _read_npz(path: Path) -> RawSource:
    try:
        with np.load(path, allow_pickle=False) as archive:
            arrays = {name: archive[name] for name in archive.files}
    except (OSError, ValueError, zipfile.BadZipFile) as error:
        raise DataError(f"{SECTION}.path: cannot read npz file {path}: {error}") from error
    missing = [name for name in ("x", "y") if name not in arrays]
    if missing:
        raise DataError(
            f"{SECTION}.path: npz file {path} lacks array(s) {', '.join(missing)}; it holds: "
            f"{', '.join(sorted(arrays)) or 'nothing'} (expected 'x' features and 'y' labels)"
        )
    x, y = arrays["x"], arrays["y"]
    if x.ndim < 2 or y.ndim != 1 or len(x) != len(y):
        raise DataError(
            f"{SECTION}.path: npz file {path}: 'x' must have shape (n, ...) and 'y' shape "
            f"(n,), got {x.shape} and {y.shape}"
        )
    frame = pd.DataFrame(x.reshape(len(x), -1), columns=[f"x{i}" for i in range(x[0].size)])
    frame["y"] = y
    image_shape = tuple(x.shape[1:]) if x.ndim > 2 else None
    return RawSource(frame, DataDictionary("y"), str(path), image_shape=image_shape)


def _read_plugin(config: DataConfig) -> RawSource:
    loaded = load_plugin_data(config)
    x = loaded.x
    frame = pd.DataFrame(x.reshape(len(x), -1), columns=list(loaded.feature_names))
    return RawSource(
        frame,
        DataDictionary("y"),
        f"data plug-in '{config.loader}'",
        loaded.task,
        tuple(x.shape[1:]) if x.ndim > 2 else None,
        labels=loaded.y,
        num_classes=loaded.num_classes,
    )


def _read_molecules(config: DataConfig, base_dir: Path | None) -> RawSource:
    # only here: RDKit's import costs every other process's start-up
    from fedsilo.silo.data.molecules import read_molecule_csv, read_molecules

    options = config.molecule_options()
    if config.source == MOLECULE_CSV:
        assert config.path is not None and config.target is not None  # the policy requires them
        path = _resolve_path(config.path, base_dir)
        frame = _read_csv_file(path, {options.smiles_column(): str})
        table, origin = read_molecule_csv(frame, str(path), config.target, options)
    else:
        table, origin = read_molecules(config.source, options)
    frame = pd.DataFrame({SCAFFOLD_COLUMN: table.scaffolds, "target": table.targets})
    return RawSource(
        frame,
        DataDictionary("target", not_features=(SCAFFOLD_COLUMN,)),
        origin,
        KNOWN_TASKS[config.source],
        tuple(table.graphs.shape[1:]),
        encoded=table.graphs,
    )


def read_source(config: DataConfig, base_dir: Path | None) -> RawSource:
    if config.source in MOLECULAR_SOURCES:
        return _read_molecules(config, base_dir)
    if config.source == PLUGIN_SOURCE:
        return _read_plugin(config)
    if config.source == "heart":
        return _read_heart()
    if config.source == "tcga_brca":
        return _read_tcga_brca()
    if config.source == "csv":
        assert config.path is not None  # the policy requires it for csv
        return _read_csv(_resolve_path(config.path, base_dir), config)
    if config.source == "npz":
        assert config.path is not None  # the policy requires it for npz
        return _read_npz(_resolve_path(config.path, base_dir))
    return _read_sklearn(config.source)
