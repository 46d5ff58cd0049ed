"""`fedsilo predict`: a run's final model applied at a site to a CSV of its records.

The model comes with its card (models/card.py); the site's preprocessing is its own (silo.yaml's
data section), fitted on its own training rows as its silo fitted them in the run
(silo/site_features.py). A model whose card does not fit the site's encoded features is
refused with one message saying what differs. One output row per input row: the predicted
class and each class's probability, or the predicted value; with `--id-column NAME`, first the
row's value of column NAME as the CSV holds it, which never reaches the model (a column the
model reads as a feature is refused).
"""

from __future__ import annotations

import csv
import os
import tempfile
from pathlib import Path

import click
import pandas as pd
import torch

from fedsilo.models.card import CARD_KEY, ModelCard, ModelCardError
from fedsilo.policies.loading import PolicyError
from fedsilo.silo.config import load_silo_config
from fedsilo.silo.data import DataError
from fedsilo.silo.data.sources import read_csv_as_written
from fedsilo.silo.evaluation import class_probabilities
from fedsilo.silo.site_features import SiteFeatures, fit_site_features
from fedsilo.wire.tasks.tensor_names import MODEL
from fedsilo.wire.tensors import WireError, decode_tensors

BATCH = 4096


def read_model(path: Path) -> tuple[ModelCard, torch.Tensor]:
    """The card and flat parameters of a `final_model.safetensors`."""
    try:
        tensors, header = decode_tensors(path.read_bytes())
    except OSError as error:
        raise ModelCardError(f"--model {path}: cannot read it: {error.strerror}") from None
    except WireError as error:
        raise ModelCardError(f"--model {path}: not a fedsilo model file: {error}") from None
    card = ModelCard.from_json(header.get(CARD_KEY), f"--model {path}")
    if MODEL not in tensors:
        raise ModelCardError(f"--model {path}: holds no {MODEL!r} tensor")
    return card, tensors[MODEL]


def predict_rows(
    card: ModelCard, flat: torch.Tensor, site: SiteFeatures, x: torch.Tensor
) -> torch.Tensor:
    """The model's outputs for the encoded rows `x`: class probabilities (n, C), or values (n,)."""
    try:
        model = card.check_fits(site.task, site.num_classes, site.input_shape, site.feature_names)
    except ModelCardError as error:
        raise ModelCardError(f"--model: {error}") from None
    model = card.load(model, flat)
    with torch.no_grad():
        outputs = torch.cat([model(x[i : i + BATCH]) for i in range(0, len(x), BATCH)])
    return class_probabilities(outputs) if card.task == "classification" else outputs.reshape(-1)


def write_predictions(
    out: Path, site: SiteFeatures, outputs: torch.Tensor, ids: pd.Series | None = None
) -> None:
    """The predictions CSV, written whole (temporary sibling, then renamed) or not at all;
    `ids`: a column of the input written first, row for row, under its own name."""
    if site.task == "classification":
        header = ["prediction", *(f"probability_{label}" for label in site.classes)]
        rows = [[site.classes[int(p.argmax())], *(f"{v:.6g}" for v in p.tolist())] for p in outputs]
    else:
        header, rows = ["prediction"], [[f"{v:.6g}"] for v in outputs.tolist()]
    if ids is not None:
        header = [str(ids.name), *header]
        rows = [["" if pd.isna(i) else i, *row] for i, row in zip(ids.tolist(), rows, strict=True)]
    handle, temporary = tempfile.mkstemp(prefix=f".{out.name}.", dir=out.parent)
    try:
        with os.fdopen(handle, "w", newline="") as stream:
            writer = csv.writer(stream)
            writer.writerow(header)
            writer.writerows(rows)
        os.link(temporary, out)  # fails, leaving `out` untouched, if it appeared meanwhile
    finally:
        os.unlink(temporary)


def predict(model: Path, config: Path, data: Path, out: Path, id_column: str | None = None) -> int:
    """Write `out` with one prediction per row of `data`, each after its `id_column` value
    when given; returns the number of rows."""
    if out.exists() or out.is_symlink():
        raise DataError(f"--out {out}: exists; fedsilo never overwrites it, choose a new file")
    if not out.parent.is_dir():
        raise DataError(f"--out {out}: folder {out.parent} does not exist")
    card, flat = read_model(model)
    if card.scaling == "federated":
        raise ModelCardError(
            f"--model {model}: trained on features scaled by the consortium's scaler "
            "(data.scaling: federated), which no file records; predict cannot repeat it"
        )
    silo = load_silo_config(config)
    site = fit_site_features(silo.data, card.seed, config.parent)
    try:
        as_text = [*silo.data.source.categorical, *([id_column] if id_column else [])]
        records = read_csv_as_written(data, dict.fromkeys(as_text))  # an ID "007" stays 007
    except (OSError, pd.errors.ParserError, pd.errors.EmptyDataError, UnicodeDecodeError) as error:
        raise DataError(f"--data {data}: cannot read it as CSV: {error}") from None
    ids = None
    if id_column is not None:
        ids = id_values(records, id_column, site, data)
        records = records.drop(columns=[id_column])  # never fed to the model
    outputs = predict_rows(card, flat, site, site.encode(records, f"--data {data}"))
    write_predictions(out, site, outputs, ids)
    return len(records)


def id_values(records: pd.DataFrame, column: str, site: SiteFeatures, data: Path) -> pd.Series:
    """The `--id-column` of `records`: refused when `data` lacks it, or when it is one of the
    features the model reads (the model would see it)."""
    if column not in records.columns:
        listing = ", ".join(str(c) for c in records.columns)
        raise DataError(
            f"--id-column {column}: --data {data} has no column '{column}'; its columns: {listing}"
        )
    if column in site.feature_columns():
        raise DataError(
            f"--id-column {column}: '{column}' is one of the features this site's model reads; "
            "an ID passed through must not be a feature: list it under data.drop_columns in "
            "silo.yaml and train again"
        )
    return records[column]


@click.command("predict")
@click.option(
    "--model",
    "model",
    required=True,
    type=click.Path(path_type=Path),
    help="A run's final_model.safetensors.",
)
@click.option(
    "--config",
    "config",
    required=True,
    type=click.Path(path_type=Path),
    help="This site's silo.yaml: its data dictionary and the rows its preprocessing is fitted on.",
)
@click.option(
    "--data",
    "data",
    required=True,
    type=click.Path(path_type=Path),
    help="A CSV of records with the site's feature columns (the label column may be absent).",
)
@click.option(
    "--out",
    "out",
    default=Path("predictions.csv"),
    show_default=True,
    type=click.Path(path_type=Path),
    help="Where the predictions go (a new file).",
)
@click.option(
    "--id-column",
    "id_column",
    metavar="NAME",
    help="A column of --data (a record ID) copied, as written, before each prediction; "
    "never given to the model.",
)
def predict_command(
    model: Path, config: Path, data: Path, out: Path, id_column: str | None
) -> None:
    """Apply a run's final model to a CSV of this site's records."""
    try:
        rows = predict(model, config, data, out, id_column)
    except (ModelCardError, DataError, PolicyError) as error:
        raise click.ClickException(str(error)) from None
    click.echo(f"{rows} predictions written to {out}")
