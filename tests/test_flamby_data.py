"""Specifications of FLamby's data in fedsilo: the corrected heart table's hospital counts,
predefined splits read from a column (`data.split.column`), `data.missing: drop`, the bundled
TCGA-BRCA source (six regions, static splits, (time, event) targets), FLamby's Fed-Heart-Disease
CSV, the one-logit `logistic` model, and the two FLamby example policies."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
import torch.nn.functional as F
from pydantic import ValidationError

from bench.flamby_heart_data import OUTPUT, flamby_heart
from fedsilo.models.zoo import build_model
from fedsilo.ops.simulate import load_silos, simulate
from fedsilo.policies.data import DataConfig
from fedsilo.policies.loading import load_policy
from fedsilo.policies.model import LogisticModel
from fedsilo.policies.schema import Policy
from fedsilo.silo.data import DataError, SiloDataset, load_consortium
from fedsilo.silo.evaluation import classification_metrics, loss_function
from fedsilo.silo.readiness import check_model_for

EXAMPLES = Path(__file__).resolve().parents[1] / "policies" / "examples"
TCGA_REGIONS = {  # README: train/test per region, in FLamby's region order 0..5
    "Northeast": (248, 63),
    "South": (156, 40),
    "West": (164, 42),
    "Midwest": (129, 33),
    "Europe": (129, 33),
    "Canada": (40, 11),
}
FLAMBY_HEART = {  # FLamby's Fed-Heart-Disease train/test per center
    "Cleveland": (199, 104),
    "Hungary": (172, 89),
    "Switzerland": (30, 16),
    "VA Long Beach": (85, 45),
}


def config(**fields: Any) -> DataConfig:
    return DataConfig.model_validate(fields)


def sizes(silo: SiloDataset) -> tuple[int, int, int]:
    return len(silo.y_train), len(silo.y_val), len(silo.y_test)


def csv_silos(tmp_path: Path, frame: pd.DataFrame, **fields: Any) -> list[SiloDataset]:
    path = tmp_path / "rows.csv"
    frame.to_csv(path, index=False)
    document = {"source": "csv", "path": str(path), "target": "label", **fields}
    return load_consortium(config(**document), seed=0)


def rows_with_splits() -> pd.DataFrame:
    return pd.DataFrame(
        {
            "age": [50.0, 61.0, 47.0, 70.0, 55.0, 66.0, 58.0, 49.0],
            "label": [0, 1, 0, 1, 0, 1, 0, 1],
            "fold": ["train", "train", "val", "test", "train", "test", "train", "train"],
        }
    )


# --- the corrected heart table ---------------------------------------------------------------


def test_the_bundled_heart_hospitals_have_uci_counts() -> None:
    silos = {silo.name: sum(sizes(silo)) for silo in load_consortium(DataConfig(), seed=0)}
    assert silos == {"Cleveland": 303, "Hungary": 294, "Switzerland": 123, "VA Long Beach": 200}


# --- predefined splits -----------------------------------------------------------------------


def test_each_row_goes_to_the_split_its_column_names(tmp_path: Path) -> None:
    [silo] = csv_silos(
        tmp_path,
        rows_with_splits(),
        partition={"kind": "iid", "silos": 1},
        split={"column": "fold"},
        scaling="none",
    )
    assert silo.x_train[:, 0].tolist() == [50.0, 61.0, 55.0, 58.0, 49.0]
    assert silo.x_val[:, 0].tolist() == [47.0]
    assert silo.x_test[:, 0].tolist() == [70.0, 66.0]
    assert silo.feature_names == ("age",)  # the split column is no feature


def test_a_split_value_other_than_train_val_test_is_refused_naming_it(tmp_path: Path) -> None:
    frame = rows_with_splits().assign(fold=["train"] * 6 + ["holdout", "test"])
    with pytest.raises(
        DataError, match=r"data.split.column: .*'fold'.* value 'holdout' \(1 rows\)"
    ):
        csv_silos(tmp_path, frame, partition={"kind": "iid", "silos": 1}, split={"column": "fold"})


def test_a_missing_split_column_is_refused(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="data.split.column: split column 'phase' not found"):
        csv_silos(tmp_path, rows_with_splits(), split={"column": "phase"}, drop_columns=["fold"])


def test_a_silo_without_test_rows_in_its_split_column_is_refused(tmp_path: Path) -> None:
    frame = rows_with_splits().assign(fold="train")
    with pytest.raises(DataError, match="silo 'silo-0' has no row whose column 'fold' says test"):
        csv_silos(tmp_path, frame, partition={"kind": "iid", "silos": 1}, split={"column": "fold"})


def test_a_split_column_excludes_fractions() -> None:
    with pytest.raises(ValidationError, match="column 'fold' gives each row's split; drop the"):
        config(split={"column": "fold", "train": 0.7})


def test_a_split_column_survives_a_dump_and_reload() -> None:
    data = config(source="tcga_brca")
    assert data.split.column == "split"
    assert DataConfig.model_validate(data.model_dump()) == data


# --- missing: drop ---------------------------------------------------------------------------


def test_missing_drop_drops_the_rows_missing_a_feature_value(tmp_path: Path) -> None:
    frame = rows_with_splits().assign(
        chol=[200.0, np.nan, 180.0, 0.0, 210.0, 190.0, 220.0, 230.0], note=[np.nan] * 8
    )
    [silo] = csv_silos(
        tmp_path,
        frame,
        partition={"kind": "iid", "silos": 1},
        split={"column": "fold"},
        missing="drop",
        missing_values={"chol": [0.0]},
        drop_columns=["note"],  # dropped first: its gaps drop no row
        scaling="none",
    )
    assert silo.x_train[:, 0].tolist() == [50.0, 55.0, 58.0, 49.0]  # 61 lacked chol
    assert silo.x_test[:, 0].tolist() == [66.0]  # 70 had chol 0, declared missing


def test_missing_drop_refuses_to_drop_every_row(tmp_path: Path) -> None:
    frame = rows_with_splits().assign(note=[np.nan] * 8)
    with pytest.raises(DataError, match="data.missing: every row .* misses a feature value"):
        csv_silos(tmp_path, frame, missing="drop")


def test_an_unknown_missing_policy_is_refused() -> None:
    with pytest.raises(ValidationError, match="'error', 'impute' or 'drop'"):
        config(missing="skip")


# --- TCGA-BRCA -------------------------------------------------------------------------------


def test_tcga_brca_is_six_regions_with_their_static_splits() -> None:
    silos = load_consortium(config(source="tcga_brca"), seed=0)
    assert {silo.name: (len(silo.y_train), len(silo.y_test)) for silo in silos} == TCGA_REGIONS
    assert [silo.name for silo in silos] == list(TCGA_REGIONS)
    for silo in silos:
        assert silo.task == "survival" and silo.output_dim == 1 and len(silo.y_val) == 0
        assert silo.input_shape == (39,) and silo.y_train.shape == (len(silo.y_train), 2)
        assert set(silo.y_train[:, 1].unique().tolist()) <= {0.0, 1.0}  # (time, event)
    assert sum(len(s.y_train) + len(s.y_test) for s in silos) == 1088


def test_tcga_brca_rows_are_the_split_files_patients_as_brca_csv_holds_them() -> None:
    [northeast, *_] = load_consortium(config(source="tcga_brca", scaling="none"), seed=0)
    folder = Path(__file__).resolve().parents[1] / "silo" / "datasets" / "tcga_brca"
    patients = pd.read_csv(folder / "brca.csv").set_index("pid")
    split = pd.read_csv(folder / "train_test_split.csv")
    first = split[split["fold2"] == "train_0"]["pid"].iloc[0]
    row = patients.loc[first]
    assert northeast.x_train[0].tolist() == pytest.approx(row.iloc[:39].tolist())
    assert northeast.y_train[0].tolist() == [row["T"], row["E"]]


def test_survival_is_refused_for_a_source_without_time_and_event() -> None:
    with pytest.raises(ValidationError, match="task survival reads .* not from 'csv'"):
        config(source="csv", path="x.csv", target="T", task="survival")


# --- FLamby's Fed-Heart-Disease CSV ----------------------------------------------------------


def test_the_flamby_heart_csv_is_what_the_script_makes_with_flambys_split_sizes() -> None:
    made = flamby_heart()
    assert made.equals(pd.read_csv(OUTPUT))
    counts = made.groupby(["center", "split"]).size().unstack()
    assert {c: (counts.at[c, "train"], counts.at[c, "test"]) for c in FLAMBY_HEART} == FLAMBY_HEART
    features = [column for column in made.columns if column not in ("center", "split", "target")]
    assert len(features) == 13 and features[-5:] == [
        "cp_2",
        "cp_3",
        "cp_4",
        "restecg_1",
        "restecg_2",
    ]


# --- the one-logit logistic model ------------------------------------------------------------


def test_logistic_is_one_logit_trained_with_binary_cross_entropy() -> None:
    model = build_model(LogisticModel(name="logistic"), (13,), 2, seed=0)
    x, y = torch.randn(6, 13), torch.tensor([0, 1, 1, 0, 1, 0])
    logits = model(x)
    assert logits.shape == (6, 1)
    expected = F.binary_cross_entropy_with_logits(logits[:, 0], y.float())
    assert torch.equal(loss_function("classification")(logits, y), expected)


def test_logistic_metrics_use_the_sigmoid_at_one_half() -> None:
    logits = torch.tensor([[2.0], [-1.0], [0.5], [-3.0]])
    metrics = classification_metrics(logits, torch.tensor([1, 0, 0, 1]))
    assert metrics["accuracy"] == 0.5
    assert metrics["auroc"] == 0.5  # ranks: positives 2.0 and -3.0 against 0.5 and -1.0
    positive = torch.sigmoid(logits[:, 0].double())
    bce = F.binary_cross_entropy(positive, torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.double))
    assert metrics["loss"] == pytest.approx(bce.item())


def test_logistic_is_refused_for_more_than_two_outputs() -> None:
    with pytest.raises(ValueError, match="model 'logistic' is for binary classification only"):
        build_model(LogisticModel(name="logistic"), (4,), 3, seed=0)


def test_logistic_is_refused_for_a_survival_task_naming_it() -> None:
    policy = load_policy(EXAMPLES / "flamby-tcga-brca-fedavg.yaml")
    policy = Policy.model_validate({**policy.model_dump(), "model": {"name": "logistic"}})
    [silo, *_] = load_consortium(policy.data, seed=0)
    with pytest.raises(
        ValueError,
        match="'logistic' is for binary classification only; this data is a survival task",
    ):
        check_model_for(policy, silo)


# --- the FLamby example policies -------------------------------------------------------------


@pytest.mark.parametrize("example", ["flamby-heart-fedavg", "flamby-tcga-brca-fedavg"])
def test_the_flamby_examples_simulate(example: str) -> None:
    policy = load_policy(EXAMPLES / f"{example}.yaml")
    short = Policy.model_validate(
        {
            **policy.model_dump(),
            "rounds": 2,
            "training": {**policy.training.model_dump(), "steps": 5},
        }
    )
    result = simulate(short, load_silos(short, EXAMPLES))
    last = result.history.records[-1]
    assert last.status == "completed"
    metric = result.headline_metric
    assert metric == ("accuracy" if "heart" in example else "c_index")
    assert all(0.0 <= silo[metric] <= 1.0 for silo in last.evaluation.values())
