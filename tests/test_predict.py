"""A run's final model is self-describing and a site can use it: `fedsilo predict` applies it to
a CSV of the site's records with the site's own preprocessing, refuses a model that does not
fit the site's features, and a deployment's results are a simulation's (plus its history)."""

from __future__ import annotations

import json
from importlib.resources import files
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from click.testing import CliRunner

from fedsilo.models.card import CARD_KEY
from fedsilo.models.zoo import build_model, load_flat
from fedsilo.ops.cli import main
from fedsilo.ops.report import write_deployment_results
from fedsilo.ops.simulate import load_silos, simulate
from fedsilo.policies.loading import load_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.data.sources import HEART_CSV
from fedsilo.wire.tasks.tensor_names import MODEL
from fedsilo.wire.tensors import decode_tensors

SITE = "Cleveland"
POLICY = {
    "version": 1,
    "name": "heart-predict",
    "seed": 3,
    "rounds": 2,
    "algorithm": {"name": "fedavg"},
    "model": {"name": "mlp", "hidden": [8]},
    "training": {"epochs": 1, "batch_size": 32, "lr": 0.05},
    "participants": {"min_silos": 3},
    "compute": {"device": "cpu"},
    "data": {"source": "heart"},
}


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A short simulation's result folder."""
    root = tmp_path_factory.mktemp("run")
    (root / "policy.yaml").write_text(yaml.safe_dump(POLICY))
    out = root / "results"
    result = CliRunner().invoke(
        main, ["simulate", "--policy", str(root / "policy.yaml"), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    return out


def site_config(folder: Path, **source: object) -> Path:
    """A hospital's silo.yaml: its own section of the heart data."""
    path = folder / "silo.yaml"
    document = {"kit": "kit", "data": {"source": {"source": "heart", **source}, "select": SITE}}
    path.write_text(yaml.safe_dump(document))
    return path


def site_records(folder: Path) -> Path:
    """The site's records as it would export them to predict on: no label column."""
    with (files("fedsilo.silo") / HEART_CSV).open("rb") as handle:
        frame = pd.read_csv(handle)
    path = folder / "records.csv"
    frame[frame["dataset"] == SITE].drop(columns=["num"]).to_csv(path, index=False)
    return path


def predict(*args: str) -> tuple[int, str]:
    result = CliRunner().invoke(main, ["predict", *args])
    return result.exit_code, result.output


def test_the_final_model_carries_its_card(run: Path) -> None:
    _, header = decode_tensors((run / "final_model.safetensors").read_bytes())
    card = header[CARD_KEY]
    assert card["model"] == {"name": "mlp", "hidden": [8], "activation": "relu"}
    assert card["task"] == "classification" and card["num_classes"] == 2
    assert card["input_width"] == 23  # heart's features after one-hot encoding
    assert card["preprocessing"] == {"scaling": "local", "seed": 3}
    assert card["feature_names"] is None  # the coordinator never sees a site's columns
    assert card["spec"] == header["spec"] and card["fedsilo_version"]
    assert json.loads((run / "results.json").read_text())["model"] == card


def test_predict_gives_the_models_outputs_on_the_sites_own_preprocessed_rows(
    run: Path, tmp_path: Path
) -> None:
    out = tmp_path / "predictions.csv"
    code, output = predict(
        "--model", str(run / "final_model.safetensors"),
        "--config", str(site_config(tmp_path)),
        "--data", str(site_records(tmp_path)),
        "--out", str(out),
    )  # fmt: skip
    assert code == 0, output
    predictions = pd.read_csv(out)
    assert list(predictions.columns) == ["prediction", "probability_False", "probability_True"]

    # In process: the trained model on the rows the silo trained and tested on.
    policy = _policy(run)
    silo = next(d for d in load_silos(policy, None) if d.name == SITE)
    tensors, _ = decode_tensors((run / "final_model.safetensors").read_bytes())
    model = build_model(policy.model, silo.input_shape, 2, seed=0)
    load_flat(model, tensors[MODEL])
    rows = torch.cat([silo.x_train, silo.x_val, silo.x_test])
    with torch.no_grad():
        expected = model(rows).softmax(dim=1).numpy()
    got = predictions[["probability_False", "probability_True"]].to_numpy()
    assert len(got) == len(expected)
    order = np.lexsort(got.T), np.lexsort(expected.T)
    np.testing.assert_allclose(got[order[0]], expected[order[1]], rtol=1e-5, atol=1e-6)
    assert (predictions["prediction"] == np.where(got[:, 1] > got[:, 0], True, False)).all()


def test_a_model_that_does_not_fit_the_sites_features_is_refused(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "predictions.csv"
    code, output = predict(
        "--model", str(run / "final_model.safetensors"),
        "--config", str(site_config(tmp_path, drop_columns=["chol"])),
        "--data", str(site_records(tmp_path)),
        "--out", str(out),
    )  # fmt: skip
    assert code == 1
    assert "the model reads 23 features, but this site's data encodes to 22" in output
    assert "Traceback" not in output and not out.exists()


def test_a_file_without_a_card_and_an_existing_output_are_refused(
    run: Path, tmp_path: Path
) -> None:
    config, records = site_config(tmp_path), site_records(tmp_path)
    code, output = predict(
        "--model", str(records), "--config", str(config), "--data", str(records),
        "--out", str(tmp_path / "p.csv"),
    )  # fmt: skip
    assert code == 1 and "not a fedsilo model file" in output
    assert not (tmp_path / "p.csv").exists()
    mine = tmp_path / "mine.csv"
    mine.write_text("keep me")
    code, output = predict(
        "--model", str(run / "final_model.safetensors"), "--config", str(config),
        "--data", str(records), "--out", str(mine),
    )  # fmt: skip
    assert code == 1 and "--out" in output and mine.read_text() == "keep me"


def test_a_deployments_results_are_a_simulations_plus_its_history(
    run: Path, tmp_path: Path
) -> None:
    policy = _policy(run)
    result = simulate(policy, load_silos(policy, None))
    write_deployment_results(tmp_path / "deployed", policy, result.history)
    written = {p.name for p in (tmp_path / "deployed").iterdir()}
    assert written == {p.name for p in run.iterdir()} | {"history.json"}
    silos = pd.read_csv(tmp_path / "deployed" / "silos.csv")
    assert list(silos.columns) == list(pd.read_csv(run / "silos.csv").columns)
    assert silos["test"].tolist() == pd.read_csv(run / "silos.csv")["test"].tolist()
    document = json.loads((tmp_path / "deployed" / "results.json").read_text())
    assert document["model"]["algorithm"] == "fedavg"


def _policy(run: Path) -> Policy:
    return load_policy(run.parent / "policy.yaml")


def records_with_ids(folder: Path) -> Path:
    """The site's records with a leading `patient_id` column of IDs such as 00017."""
    records = pd.read_csv(site_records(folder))
    records.insert(0, "patient_id", [f"{i:05d}" for i in range(len(records))])
    path = folder / "records-with-ids.csv"
    records.to_csv(path, index=False)
    return path


def test_an_id_column_passes_through_beside_the_predictions_unseen_by_the_model(
    run: Path, tmp_path: Path
) -> None:
    model, config = str(run / "final_model.safetensors"), str(site_config(tmp_path))
    plain, with_ids = tmp_path / "plain.csv", tmp_path / "with-ids.csv"
    code, output = predict(
        "--model", model, "--config", config, "--data", str(site_records(tmp_path)),
        "--out", str(plain),
    )  # fmt: skip
    assert code == 0, output
    code, output = predict(
        "--model", model, "--config", config, "--data", str(records_with_ids(tmp_path)),
        "--out", str(with_ids), "--id-column", "patient_id",
    )  # fmt: skip
    assert code == 0, output
    got = pd.read_csv(with_ids, dtype={"patient_id": str})
    header = ["patient_id", "prediction", "probability_False", "probability_True"]
    assert list(got.columns) == header
    assert got["patient_id"].tolist() == [f"{i:05d}" for i in range(len(got))]  # as written
    pd.testing.assert_frame_equal(got.drop(columns=["patient_id"]), pd.read_csv(plain))


def test_a_missing_id_column_is_one_message_naming_it(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.csv"
    code, output = predict(
        "--model", str(run / "final_model.safetensors"), "--config", str(site_config(tmp_path)),
        "--data", str(site_records(tmp_path)), "--out", str(out), "--id-column", "mrn",
    )  # fmt: skip
    assert code == 1
    assert output.count("Error:") == 1 and "--id-column mrn" in output
    assert "has no column 'mrn'" in output
    assert "Traceback" not in output and not out.exists()


def test_an_id_column_the_model_reads_as_a_feature_is_refused(run: Path, tmp_path: Path) -> None:
    out = tmp_path / "p.csv"
    code, output = predict(
        "--model", str(run / "final_model.safetensors"), "--config", str(site_config(tmp_path)),
        "--data", str(site_records(tmp_path)), "--out", str(out), "--id-column", "age",
    )  # fmt: skip
    assert code == 1 and "'age' is one of the features" in output and not out.exists()
