"""Specifications of the `data:` policy section and of how silos get their data."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest
import torch
from pydantic import ValidationError

from fedsilo.policies.data import DataConfig, IidPartition
from fedsilo.silo.data import DataError, SiloDataset, load_consortium, pool

HEART_CSV = Path(__file__).parents[1] / "silo" / "datasets" / "heart" / "heart_disease_uci.csv"
HOSPITALS = {"Cleveland": 303, "Hungary": 294, "VA Long Beach": 200, "Switzerland": 123}


def config(**fields: Any) -> DataConfig:
    return DataConfig.model_validate(fields)


def sizes(silo: SiloDataset) -> tuple[int, int, int]:
    return len(silo.y_train), len(silo.y_val), len(silo.y_test)


def same_data(a: SiloDataset, b: SiloDataset) -> bool:
    pairs = [
        (a.x_train, b.x_train),
        (a.y_train, b.y_train),
        (a.x_val, b.x_val),
        (a.y_val, b.y_val),
        (a.x_test, b.x_test),
        (a.y_test, b.y_test),
    ]
    return all(torch.equal(x, y) for x, y in pairs)


def write_csv(tmp_path: Path, frame: pd.DataFrame, name: str = "data.csv") -> Path:
    path = tmp_path / name
    frame.to_csv(path, index=False)
    return path


def table(rows: int = 40, **extra: Any) -> pd.DataFrame:
    generator = np.random.default_rng(0)
    frame = pd.DataFrame(
        {
            "site": np.repeat(["north", "south"], rows // 2),
            "age": generator.normal(50, 10, rows),
            "label": np.tile([0, 1], rows // 2),
        }
    )
    return frame.assign(**extra)


def load_csv(tmp_path: Path, frame: pd.DataFrame, **fields: Any) -> list[SiloDataset]:
    path = write_csv(tmp_path, frame)
    fields = {"target": "label", **fields}
    return load_consortium(config(source="csv", path=str(path), **fields), seed=0)


@pytest.fixture(scope="module")
def heart() -> list[SiloDataset]:
    return load_consortium(DataConfig(), seed=0)


# the policy section --------------------------------------------------------------------------


def test_unknown_source_is_refused_with_a_close_match_and_the_allowed_list() -> None:
    with pytest.raises(ValidationError, match="unknown source 'hearts' \\(did you mean 'heart'"):
        config(source="hearts")
    with pytest.raises(ValidationError, match="allowed: heart, tcga_brca, sklearn:breast_cancer"):
        config(source="mnist")


def test_csv_and_npz_need_a_path_and_other_sources_refuse_one() -> None:
    with pytest.raises(ValidationError, match="source 'npz' needs a path"):
        config(source="npz")
    with pytest.raises(
        ValidationError, match="path applies to csv, npz and molecules:csv sources only"
    ):
        config(source="heart", path="x.csv")


def test_csv_needs_a_target_column() -> None:
    with pytest.raises(ValidationError, match="needs target"):
        config(source="csv", path="x.csv")


def test_split_fractions_must_sum_to_one_and_the_error_names_them() -> None:
    with pytest.raises(ValidationError, match="got 0.7 \\+ 0.2 \\+ 0.2"):
        config(split={"train": 0.7, "val": 0.2, "test": 0.2})


def test_unknown_partition_field_gets_a_did_you_mean_hint() -> None:
    with pytest.raises(ValidationError, match="did you mean 'alpha'"):
        config(partition={"kind": "dirichlet", "silos": 3, "alpah": 0.5})


def test_heart_imputes_missing_values_by_default_and_other_sources_refuse_them() -> None:
    assert DataConfig().missing == "impute"
    assert config(source="sklearn:wine").missing == "error"


def test_with_silos_resizes_the_default_partition() -> None:
    resized = config(source="sklearn:wine").with_silos(3)
    assert resized.partition == IidPartition(kind="iid", silos=3)


def test_with_silos_on_a_natural_partition_is_refused() -> None:
    with pytest.raises(ValueError, match="--silos does not apply to a natural partition"):
        DataConfig().with_silos(3)


# heart: the bundled four-hospital source -----------------------------------------------------


def test_heart_gives_one_silo_per_hospital_with_all_920_patients(
    heart: list[SiloDataset],
) -> None:
    assert {silo.name: sum(sizes(silo)) for silo in heart} == HOSPITALS


def test_heart_splits_each_hospital_8_1_1_within_rounding(heart: list[SiloDataset]) -> None:
    for silo in heart:
        n = sum(sizes(silo))
        for count, fraction in zip(sizes(silo), (0.8, 0.1, 0.1), strict=True):
            assert abs(count - fraction * n) <= 1


def test_heart_is_binary_classification_of_num_above_zero(heart: list[SiloDataset]) -> None:
    raw = pd.read_csv(HEART_CSV)
    positives = sum(int(torch.cat([s.y_train, s.y_val, s.y_test]).sum()) for s in heart)
    assert positives == int((raw["num"] > 0).sum())
    for silo in heart:
        assert (silo.task, silo.num_classes, silo.output_dim) == ("classification", 2, 2)
        assert silo.y_train.dtype == torch.int64
        assert silo.x_train.dtype == torch.float32


def test_heart_features_have_no_nan_and_one_hot_the_fixed_categories(
    heart: list[SiloDataset],
) -> None:
    silo = heart[0]
    assert "dataset" not in silo.feature_names and "id" not in silo.feature_names
    assert "cp=asymptomatic" in silo.feature_names and "fbs" in silo.feature_names
    assert silo.input_shape == (len(silo.feature_names),)
    for silo in heart:
        for x in (silo.x_train, silo.x_val, silo.x_test):
            assert not torch.isnan(x).any()


def test_heart_is_identical_for_the_same_seed_and_differs_for_another(
    heart: list[SiloDataset],
) -> None:
    again = load_consortium(DataConfig(), seed=0)
    other = load_consortium(DataConfig(), seed=1)
    assert all(same_data(a, b) for a, b in zip(heart, again, strict=True))
    assert not any(same_data(a, b) for a, b in zip(heart, other, strict=True))


def test_each_hospital_standardises_with_its_own_training_statistics(
    heart: list[SiloDataset],
) -> None:
    raw = pd.read_csv(HEART_CSV)
    age_means = raw.groupby("dataset")["age"].mean()
    # Hospitals differ in age by far more than rounding: pooled statistics could not centre each.
    assert age_means.max() - age_means.min() > 0.5 * raw["age"].std()
    for silo in heart:
        for column in ("age", "thalch", "oldpeak"):
            values = silo.x_train[:, silo.feature_names.index(column)].double()
            assert abs(values.mean().item()) < 1e-6
            assert abs(values.std(unbiased=False).item() - 1) < 1e-6


def test_a_column_missing_entirely_at_a_hospital_becomes_zero_there(
    heart: list[SiloDataset],
) -> None:
    # Switzerland recorded every cholesterol as 0, the heart dictionary's "not measured" marker.
    switzerland = next(silo for silo in heart if silo.name == "Switzerland")
    chol = switzerland.feature_names.index("chol")
    for x in (switzerland.x_train, switzerland.x_val, switzerland.x_test):
        assert torch.all(x[:, chol] == 0)


def test_pool_concatenates_every_silos_splits(heart: list[SiloDataset]) -> None:
    pooled = pool(heart)
    assert pooled.name == "pooled"
    assert sizes(pooled) == tuple(sum(s) for s in zip(*map(sizes, heart), strict=True))
    assert torch.equal(pooled.x_test[: len(heart[0].x_test)], heart[0].x_test)
    assert pooled.feature_names == heart[0].feature_names


def test_silos_override_does_not_apply_to_heart_hospitals() -> None:
    with pytest.raises(DataError, match="--silos does not apply to a natural partition"):
        load_consortium(DataConfig(), seed=0, num_silos=3)


def test_heart_can_be_resplit_without_the_hospital_becoming_a_feature() -> None:
    silos = load_consortium(config(partition={"kind": "iid", "silos": 3}), seed=0)
    assert [silo.name for silo in silos] == ["silo-0", "silo-1", "silo-2"]
    assert "dataset" not in silos[0].feature_names


# scikit-learn sources ------------------------------------------------------------------------


def test_breast_cancer_with_a_dirichlet_partition_keeps_the_full_label_set() -> None:
    partition = {"kind": "dirichlet", "silos": 5, "alpha": 0.5}
    silos = load_consortium(config(source="sklearn:breast_cancer", partition=partition), seed=0)
    assert len(silos) == 5
    assert sum(sum(sizes(silo)) for silo in silos) == 569
    assert all(silo.num_classes == 2 for silo in silos)


def test_digits_rows_are_single_channel_8x8_images() -> None:
    silos = load_consortium(config(source="sklearn:digits"), seed=0)
    assert len(silos) == 4
    for silo in silos:
        assert silo.input_shape == (1, 8, 8)
        assert silo.x_train.shape[1:] == (1, 8, 8)
        assert silo.num_classes == 10


def test_diabetes_is_regression_with_float_targets() -> None:
    silo = load_consortium(config(source="sklearn:diabetes"), seed=0)[0]
    assert (silo.task, silo.num_classes, silo.output_dim) == ("regression", None, 1)
    assert silo.y_train.dtype == torch.float32 and silo.y_train.ndim == 1


def test_num_silos_overrides_the_partition() -> None:
    silos = load_consortium(config(source="sklearn:wine"), seed=0, num_silos=3)
    assert len(silos) == 3


def test_quantity_skew_can_use_a_random_subset_of_the_rows() -> None:
    partition = {
        "kind": "quantity_skew",
        "silos": 3,
        "small_fraction": 0.4,
        "n_min": 10,
        "total": 100,
    }
    silos = load_consortium(config(source="sklearn:breast_cancer", partition=partition), seed=0)
    assert [sum(sizes(silo)) for silo in silos] == [10, 10, 80]


def test_label_noise_touches_only_training_labels_of_the_chosen_silos() -> None:
    clean = load_consortium(config(source="sklearn:digits"), seed=0)
    noise = {"silo_fraction": 0.5, "probability": 0.5}
    noisy = load_consortium(config(source="sklearn:digits", label_noise=noise), seed=0)
    changed = [not torch.equal(a.y_train, b.y_train) for a, b in zip(clean, noisy, strict=True)]
    assert sum(changed) == 2
    for a, b in zip(clean, noisy, strict=True):
        assert torch.equal(a.x_train, b.x_train)
        assert torch.equal(a.y_val, b.y_val) and torch.equal(a.y_test, b.y_test)


def test_regression_label_noise_adds_gaussian_noise_to_training_targets() -> None:
    clean = load_consortium(config(source="sklearn:diabetes"), seed=0)
    noise = {"silo_fraction": 0.25, "probability": 1.0, "std": 5.0}
    noisy = load_consortium(config(source="sklearn:diabetes", label_noise=noise), seed=0)
    deltas = [b.y_train - a.y_train for a, b in zip(clean, noisy, strict=True)]
    assert sum(bool(delta.abs().max() > 0) for delta in deltas) == 1
    assert 3.0 < max(delta.std().item() for delta in deltas) < 7.0


def test_a_dirichlet_partition_of_a_regression_task_is_refused() -> None:
    partition = {"kind": "dirichlet", "silos": 3, "alpha": 1.0}
    with pytest.raises(DataError, match="dirichlet partition skews class labels"):
        load_consortium(config(source="sklearn:diabetes", partition=partition), seed=0)


# csv and npz files ---------------------------------------------------------------------------


def test_csv_silos_follow_a_natural_column_and_infer_classification(tmp_path: Path) -> None:
    silos = load_csv(tmp_path, table(), partition={"kind": "natural", "column": "site"})
    assert [silo.name for silo in silos] == ["north", "south"]
    assert silos[0].feature_names == ("age",)
    assert (silos[0].task, silos[0].num_classes) == ("classification", 2)


def test_csv_float_target_is_inferred_as_regression(tmp_path: Path) -> None:
    frame = table().assign(label=np.linspace(0, 1, 40))
    silo = load_csv(tmp_path, frame, drop_columns=["site"])[0]
    assert silo.task == "regression" and silo.y_train.dtype == torch.float32


def test_csv_string_labels_map_to_sorted_class_codes(tmp_path: Path) -> None:
    frame = table().assign(label=np.tile(["yes", "no"], 20))
    silos = load_csv(tmp_path, frame, drop_columns=["site"], partition={"kind": "iid", "silos": 1})
    silo = silos[0]
    assert silo.num_classes == 2
    all_labels = torch.cat([silo.y_train, silo.y_val, silo.y_test])
    assert set(all_labels.tolist()) == {0, 1}


def test_csv_categoricals_one_hot_against_the_declared_list(tmp_path: Path) -> None:
    frame = table(smoker=["yes", "no", None, "no"] * 10)
    silo = load_csv(
        tmp_path,
        frame,
        categorical={"smoker": ["no", "yes", "former"]},
        missing="impute",
        partition={"kind": "natural", "column": "site"},
    )[0]
    assert silo.feature_names == ("age", "smoker=no", "smoker=yes", "smoker=former")
    block = torch.cat([silo.x_train, silo.x_val, silo.x_test])[:, 1:]
    assert set(block.sum(dim=1).tolist()) == {0.0, 1.0}
    assert torch.all(block[:, 2] == 0)


def test_csv_booleans_are_numbers(tmp_path: Path) -> None:
    frame = table(smoker=["TRUE", "FALSE", None, "FALSE"] * 10)
    silo = load_csv(
        tmp_path,
        frame,
        drop_columns=["site"],
        missing="impute",
        partition={"kind": "iid", "silos": 1},
    )[0]
    smoker = torch.cat([silo.x_train, silo.x_val, silo.x_test])[:, 1]
    assert silo.feature_names == ("age", "smoker")
    assert len(torch.unique(smoker)) == 2


def test_a_categorical_column_matches_its_categories_as_the_file_writes_them(
    tmp_path: Path,
) -> None:
    """TRUE/FALSE or 007 declared as categories match the cells as written (pandas alone
    would read a bool, printed True, or the number 7)."""
    frame = table(smoker=["TRUE", "FALSE", None, "FALSE"] * 10, ward=["007", "012"] * 20)
    silo = load_csv(
        tmp_path,
        frame,
        categorical={"smoker": ["FALSE", "TRUE"], "ward": ["007", "012"]},
        drop_columns=["site"],
        missing="impute",
        partition={"kind": "iid", "silos": 1},
    )[0]
    assert silo.feature_names == ("age", "smoker=FALSE", "smoker=TRUE", "ward=007", "ward=012")
    block = torch.cat([silo.x_train, silo.x_val, silo.x_test])[:, 3:]
    assert torch.all(block.sum(dim=1) == 1)


def test_a_silo_is_preprocessed_without_looking_at_other_silos(tmp_path: Path) -> None:
    partition = {"kind": "natural", "column": "site"}
    frame = table(rows=60)
    changed = frame.copy()
    changed.loc[changed["site"] == "south", "age"] *= 100
    north = load_csv(tmp_path, frame, partition=partition)[0]
    north_again = load_csv(tmp_path, changed, partition=partition)[0]
    assert same_data(north, north_again)


def test_val_and_test_rows_are_scaled_with_the_training_statistics(tmp_path: Path) -> None:
    frame = table(rows=100).assign(age=np.arange(100.0))
    silo = load_csv(tmp_path, frame, drop_columns=["site"], partition={"kind": "iid", "silos": 1})[
        0
    ]
    scaled = torch.cat([silo.x_train, silo.x_val, silo.x_test])[:, 0].double()
    # One affine map for every split: sorted scaled values are evenly spaced like 0..99.
    gaps = torch.diff(torch.sort(scaled).values)
    assert torch.allclose(gaps, gaps[0].expand_as(gaps))
    assert abs(silo.x_val[:, 0].double().mean().item()) > 1e-3


def test_relative_paths_resolve_against_the_policy_folder(tmp_path: Path) -> None:
    write_csv(tmp_path, table())
    data = config(source="csv", path="data.csv", target="label", drop_columns=["site"])
    assert len(load_consortium(data, seed=0, base_dir=tmp_path)) == 4


def test_npz_with_flat_features(tmp_path: Path) -> None:
    path = tmp_path / "data.npz"
    np.savez(path, x=np.random.default_rng(0).normal(size=(40, 3)), y=np.tile([0, 1, 2, 3], 10))
    silos = load_consortium(config(source="npz", path=str(path)), seed=0)
    assert silos[0].feature_names == ("x0", "x1", "x2")
    assert (silos[0].task, silos[0].num_classes, silos[0].input_shape) == (
        "classification",
        4,
        (3,),
    )


def test_npz_with_image_rows_keeps_their_shape(tmp_path: Path) -> None:
    path = tmp_path / "images.npz"
    np.savez(path, x=np.random.default_rng(0).random((40, 2, 4, 4)), y=np.linspace(0, 1, 40))
    silo = load_consortium(config(source="npz", path=str(path)), seed=0)[0]
    assert silo.input_shape == (2, 4, 4) and silo.x_train.shape[1:] == (2, 4, 4)
    assert silo.task == "regression"


# bad input -----------------------------------------------------------------------------------


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    missing = tmp_path / "absent.csv"
    with pytest.raises(DataError, match="data file not found: .*absent.csv"):
        load_consortium(config(source="csv", path=str(missing), target="label"), seed=0)


def test_a_missing_target_column_is_named_with_the_columns_there_are(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="target column 'outcome' not found .* site, age, label"):
        load_csv(tmp_path, table(), target="outcome")


def test_nan_features_are_refused_naming_column_and_rows_unless_imputed(tmp_path: Path) -> None:
    frame = table().assign(bp=[np.nan, 120.0, np.nan, 130.0] * 10)
    with pytest.raises(DataError, match="column 'bp' .* missing values in 20 rows"):
        load_csv(tmp_path, frame, drop_columns=["site"])
    silos = load_csv(tmp_path, frame, drop_columns=["site"], missing="impute")
    assert not any(torch.isnan(silo.x_train).any() for silo in silos)


def test_inf_features_are_always_refused_naming_the_column(tmp_path: Path) -> None:
    frame = table().assign(bp=[np.inf, 120.0] * 20)
    with pytest.raises(DataError, match="column 'bp' .* contains inf"):
        load_csv(tmp_path, frame, drop_columns=["site"], missing="impute")


def test_an_undeclared_text_column_is_refused_with_how_to_declare_it(tmp_path: Path) -> None:
    with pytest.raises(DataError, match="column 'site' .* not numeric .* data.categorical"):
        load_csv(tmp_path, table())


def test_an_unknown_category_value_is_refused_with_the_allowed_list(tmp_path: Path) -> None:
    frame = table(smoker=["yes", "no", "sometimes", "no"] * 10)
    with pytest.raises(DataError, match="'smoker' .* value 'sometimes' .* \\['no', 'yes'\\]"):
        load_csv(tmp_path, frame, drop_columns=["site"], categorical={"smoker": ["no", "yes"]})


def test_a_silo_too_small_to_split_is_named_with_its_size(tmp_path: Path) -> None:
    frame = table(rows=10).assign(site=["big"] * 8 + ["tiny"] * 2)
    with pytest.raises(DataError, match="silo 'tiny' has 2 rows"):
        load_csv(tmp_path, frame, partition={"kind": "natural", "column": "site"})
