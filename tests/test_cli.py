"""The `fedsilo` command line: useful output on success, one clear message and nothing written
on bad input."""

import json
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from fedsilo.ops.cli import main


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def write_policy(folder: Path, **sections) -> Path:
    document = {"version": 1, "name": "t", "rounds": 2, "algorithm": {"name": "fedavg"}, **sections}
    path = folder / "policy.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def write_csv(folder: Path, rows: int = 60, bad: str | None = None) -> Path:
    rng = np.random.default_rng(0)
    x = rng.normal(size=(rows, 3))
    if bad == "nan":
        x[5, 1] = np.nan
    if bad == "inf":
        x[7, 2] = np.inf
    y = (x[:, 0] > 0).astype(int)
    path = folder / "records.csv"
    lines = ["a,b,c,label", *(f"{r[0]},{r[1]},{r[2]},{t}" for r, t in zip(x, y, strict=True))]
    path.write_text("\n".join(lines) + "\n")
    return path


def csv_data(**extra) -> dict:
    return {
        "source": "csv",
        "path": "records.csv",
        "target": "label",
        "partition": {"kind": "iid", "silos": 3},
        **extra,
    }


def test_validate_says_what_the_policy_selects(tmp_path: Path) -> None:
    result = invoke("policy", "validate", str(write_policy(tmp_path)))
    assert result.exit_code == 0 and "algorithm fedavg" in result.output


def test_validate_names_the_typo_and_exits_non_zero(tmp_path: Path) -> None:
    result = invoke("policy", "validate", str(write_policy(tmp_path, training={"bach_size": 8})))
    assert result.exit_code != 0
    assert "training: unknown field 'bach_size' (did you mean 'batch_size'?)" in result.output


def test_simulate_writes_results_table_and_plots(tmp_path: Path) -> None:
    write_csv(tmp_path)
    out = tmp_path / "out"
    policy = write_policy(tmp_path, data=csv_data())
    result = invoke("simulate", "--policy", str(policy), "--out", str(out), "--compare", "local")
    assert result.exit_code == 0, result.output
    assert "test accuracy per silo" in result.output and "silo-0" in result.output
    for name in ("fedavg", "local"):
        for file in ("results.json", "silos.csv", "metric_per_round.png", "final_per_silo.png"):
            assert (out / name / file).stat().st_size > 0
    assert (out / "comparison.json").exists() and (out / "comparison_per_silo.png").exists()
    results = json.loads((out / "fedavg" / "results.json").read_text())
    assert len(results["history"]) == 2 and set(results["final"]["per_silo"]) == {
        "silo-0",
        "silo-1",
        "silo-2",
    }


def test_seed_and_silo_overrides_apply(tmp_path: Path) -> None:
    write_csv(tmp_path)
    out = tmp_path / "out"
    policy = write_policy(tmp_path, data=csv_data())
    assert (
        invoke(
            "simulate", "--policy", str(policy), "--out", str(out), "--silos", "2", "--seed", "5"
        ).exit_code
        == 0
    )
    results = json.loads((out / "results.json").read_text())
    assert results["policy"]["seed"] == 5 and [s["name"] for s in results["silos"]] == [
        "silo-0",
        "silo-1",
    ]


@pytest.mark.parametrize(
    ("data", "bad", "message"),
    [
        (csv_data(path="nowhere.csv"), None, "nowhere.csv"),
        (csv_data(target="outcome"), None, "outcome"),
        (csv_data(), "nan", "column 'b' in"),
        (csv_data(), "inf", "column 'c'"),
    ],
    ids=["missing-file", "missing-target", "nan-features", "inf-features"],
)
def test_bad_data_is_one_clear_message_and_nothing_is_written(tmp_path, data, bad, message) -> None:
    write_csv(tmp_path, bad=bad)
    out = tmp_path / "out"
    result = invoke(
        "simulate", "--policy", str(write_policy(tmp_path, data=data)), "--out", str(out)
    )
    assert result.exit_code != 0 and message in result.output
    assert "Traceback" not in result.output
    assert not out.exists() and list(tmp_path.glob(".out*")) == []


@pytest.mark.parametrize(
    ("sections", "message"),
    [
        ({"algorithm": {"name": "fedsgd"}}, "unknown value 'fedsgd'"),
        ({"rounds": -1}, "rounds: Input should be greater than or equal to 1"),
        ({"rounds": 2, "optimiser": "sgd"}, "unknown field 'optimiser'"),
    ],
)
def test_bad_policies_are_refused_before_anything_runs(tmp_path, sections, message) -> None:
    out = tmp_path / "out"
    result = invoke(
        "simulate", "--policy", str(write_policy(tmp_path, **sections)), "--out", str(out)
    )
    assert result.exit_code != 0 and message in result.output and not out.exists()


def test_silos_override_on_natural_partition_is_refused(tmp_path: Path) -> None:
    result = invoke("simulate", "--silos", "3", "--out", str(tmp_path / "out"))
    assert result.exit_code != 0 and "natural partition" in result.output


def test_a_rerun_with_overwrite_replaces_the_previous_results_whole(tmp_path: Path) -> None:
    write_csv(tmp_path)
    out = tmp_path / "out"
    policy = write_policy(tmp_path, data=csv_data())
    args = ("simulate", "--policy", str(policy), "--out", str(out))
    assert invoke(*args, "--compare", "local").exit_code == 0 and (out / "local").is_dir()
    assert invoke(*args, "--overwrite").exit_code == 0
    assert not (out / "local").exists() and (out / "results.json").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "policy.yaml", "records.csv"]


def test_algorithms_lists_every_strategy() -> None:
    output = invoke("algorithms").output
    assert all(
        name in output
        for name in ("fedavg", "fedprox", "fedadam", "fedyogi", "fedadagrad", "central", "local")
    )


def test_policy_validate_checks_every_file_it_is_given_and_fails_if_any_failed(
    tmp_path: Path,
) -> None:
    good = tmp_path / "good.yaml"
    good.write_text(yaml.safe_dump({"version": 1, "name": "good", "rounds": 2}))
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"version": 1, "name": "bad", "rounds": 0}))
    both = CliRunner().invoke(main, ["policy", "validate", str(good), str(bad), str(good)])
    assert both.exit_code == 1
    assert both.output.count(f"OK {good}") == 2
    assert f"Error: {bad}" in both.output and "rounds" in both.output
    assert both.output.strip().endswith("Error: 1 of 3 policies failed")
    assert "Traceback" not in both.output
    assert CliRunner().invoke(main, ["policy", "validate", str(good), str(good)]).exit_code == 0
