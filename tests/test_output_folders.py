"""Nothing of the user's is deleted: `--out` refuses an existing file and a non-empty folder that
fedsilo did not write, replaces a folder of earlier fedsilo results only with `--overwrite` and
only while it holds nothing else, and a file that appears in it meanwhile is kept."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner, Result

from fedsilo.ops.cli import main
from fedsilo.ops.report import (
    MARKER,
    OutputFolderError,
    atomic_directory,
    check_output_folder,
)


def simulate(folder: Path, *options: str) -> Result:
    """`fedsilo simulate` of a two-round FedAvg on a small CSV in `folder`, into `folder/out`."""
    if not (folder / "policy.yaml").exists():
        x = np.random.default_rng(0).normal(size=(40, 2))
        rows = [f"{a},{b},{int(a > 0)}" for a, b in x]
        (folder / "records.csv").write_text("\n".join(["a,b,label", *rows]) + "\n")
        document = {
            "version": 1,
            "rounds": 2,
            "data": {
                "source": "csv",
                "path": "records.csv",
                "target": "label",
                "partition": {"kind": "iid", "silos": 2},
            },
        }
        (folder / "policy.yaml").write_text(yaml.safe_dump(document))
    policy = str(folder / "policy.yaml")
    return CliRunner().invoke(main, ["simulate", "--policy", policy, "--out", *options])


def refused(result: Result, *named: str) -> bool:
    return (
        result.exit_code == 1
        and "Traceback" not in result.output
        and all(text in result.output for text in named)
    )


def siblings(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir())


def test_a_folder_fedsilo_did_not_write_is_refused_and_left_whole(tmp_path: Path) -> None:
    out = tmp_path / "p"
    out.mkdir()
    (out / "notes.txt").write_text("a year of notes")
    result = simulate(tmp_path, str(out))
    assert refused(result, "--out", "did not write", "new or empty folder"), result.output
    assert siblings(out) == ["notes.txt"] and (out / "notes.txt").read_text() == "a year of notes"
    assert siblings(tmp_path) == ["p", "policy.yaml", "records.csv"]


def test_overwrite_does_not_apply_to_a_folder_fedsilo_did_not_write(tmp_path: Path) -> None:
    out = tmp_path / "p"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    assert refused(simulate(tmp_path, str(out), "--overwrite"), "did not write")
    assert (out / "notes.txt").read_text() == "mine"


def test_an_existing_file_is_refused_not_renamed(tmp_path: Path) -> None:
    out = tmp_path / "p"
    out.write_text("a file of the user's")
    assert refused(simulate(tmp_path, str(out)), "--out", "not a folder")
    assert out.read_text() == "a file of the user's"
    assert siblings(tmp_path) == ["p", "policy.yaml", "records.csv"]


def test_an_empty_folder_receives_the_results(tmp_path: Path) -> None:
    out = tmp_path / "p"
    out.mkdir()
    assert simulate(tmp_path, str(out)).exit_code == 0
    assert (out / "results.json").is_file() and (out / MARKER).is_file()


def test_earlier_results_are_replaced_only_with_overwrite_which_the_message_names(
    tmp_path: Path,
) -> None:
    out = tmp_path / "p"
    assert simulate(tmp_path, str(out)).exit_code == 0
    first = (out / "results.json").read_text()
    assert refused(simulate(tmp_path, str(out)), "--out", "--overwrite")
    assert (out / "results.json").read_text() == first
    assert simulate(tmp_path, str(out), "--overwrite").exit_code == 0
    assert (out / "results.json").is_file()
    assert siblings(tmp_path) == ["p", "policy.yaml", "records.csv"]


@pytest.mark.parametrize("change", ["added", "edited"])
def test_earlier_results_holding_a_file_of_the_users_are_not_overwritten(
    tmp_path: Path, change: str
) -> None:
    out = tmp_path / "p"
    assert simulate(tmp_path, str(out)).exit_code == 0
    target = out / ("notes.txt" if change == "added" else "silos.csv")
    target.write_text("the user's words")
    result = simulate(tmp_path, str(out), "--overwrite")
    assert refused(result, "--out", target.name, "did not write"), result.output
    assert target.read_text() == "the user's words"


def test_a_file_written_into_the_old_results_during_a_run_is_kept(tmp_path: Path) -> None:
    out = tmp_path / "p"
    with atomic_directory(out) as staging:
        (staging / "results.json").write_text("{}")
    with atomic_directory(out, overwrite=True) as staging:
        (staging / "results.json").write_text("{}")
        (out / "late.txt").write_text("written while the run went on")
    kept = [p for p in tmp_path.iterdir() if p.name.startswith("p.replaced-")]
    assert len(kept) == 1 and (kept[0] / "late.txt").read_text() == "written while the run went on"
    assert (out / "results.json").read_text() == "{}" and not (out / "late.txt").exists()


def test_a_failed_write_leaves_earlier_results_in_place(tmp_path: Path) -> None:
    out = tmp_path / "p"
    with atomic_directory(out) as staging:
        (staging / "results.json").write_text("first")
    with pytest.raises(RuntimeError), atomic_directory(out, overwrite=True) as staging:
        (staging / "results.json").write_text("second")
        raise RuntimeError("the run broke")
    assert (out / "results.json").read_text() == "first"
    assert siblings(tmp_path) == ["p"]


def test_an_out_below_a_file_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("x")
    with pytest.raises(OutputFolderError, match="blocker is not a folder"):
        check_output_folder(tmp_path / "blocker" / "deeper" / "out")
