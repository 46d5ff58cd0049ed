"""Relative paths resolve as docs/data.md ("Relative paths") says: a policy's `data.path` from
the policy file's folder, silo.yaml's `data.path` from silo.yaml's folder, and a data plug-in's
`args` as written, so a relative path there from the current folder."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner

from fedsilo.ops.cli import main
from fedsilo.silo.config import load_silo_config
from fedsilo.silo.data import plugins as plugin_registry
from fedsilo.silo.data.plugins import DATASETS_GROUP, PluginData

DOCS = Path(__file__).resolve().parents[1] / "docs" / "data.md"
LOADER = f"{__name__}:rows_from_file"


def rows_from_file(path: str) -> PluginData:
    """A data plug-in reading a CSV of two features and a 0/1 label at `path`, as given."""
    table = np.loadtxt(path, delimiter=",", skiprows=1)
    return PluginData(
        table[:, :2].astype(np.float32), table[:, 2].astype(np.int64), "classification"
    )


def write_rows(folder: Path, rows: int) -> None:
    """rows.csv in `folder`: `rows` rows of two features and a label (both classes present)."""
    folder.mkdir(parents=True, exist_ok=True)
    lines = [f"{i % 7},{i % 5},{i % 2}" for i in range(rows)]
    (folder / "rows.csv").write_text("a,b,target\n" + "\n".join(lines) + "\n")


@pytest.fixture
def plugin(monkeypatch: pytest.MonkeyPatch) -> None:
    points = (EntryPoint("rows_from_file", LOADER, DATASETS_GROUP),)
    monkeypatch.setattr(
        plugin_registry, "installed", lambda group: points if group == DATASETS_GROUP else ()
    )


def test_the_docs_state_how_each_relative_path_resolves() -> None:
    text = DOCS.read_text()
    assert "## Relative paths" in text
    assert "read from the policy file's folder" in text
    assert "from silo.yaml's own folder" in text
    assert "from the folder the command (or the silo agent)" in text


def test_a_policys_data_path_is_read_from_the_policy_files_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    write_rows(tmp_path / "policies", 60)
    write_rows(tmp_path / "elsewhere", 90)  # the current folder's rows.csv is not read
    policy = {
        "version": 1, "name": "paths", "rounds": 1,
        "model": {"name": "linear"},
        "data": {
            "source": "csv", "path": "rows.csv", "target": "target",
            "partition": {"kind": "iid", "silos": 2},
        },
    }  # fmt: skip
    (tmp_path / "policies" / "policy.yaml").write_text(yaml.safe_dump(policy))
    monkeypatch.chdir(tmp_path / "elsewhere")
    result = CliRunner().invoke(main, ["policy", "validate", "../policies/policy.yaml"])
    assert result.exit_code == 0, result.output
    assert "2 silos, 60 rows" in result.output


def test_silo_yamls_data_path_is_read_from_its_folder_and_plugin_args_from_the_current_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, plugin: None
) -> None:
    site = tmp_path / "site"
    write_rows(site, 40)
    write_rows(tmp_path / "elsewhere", 70)
    (site / "silo.yaml").write_text(
        yaml.safe_dump(
            {"kit": "kit", "data": {"source": "csv", "path": "rows.csv", "target": "target"}}
        )
    )
    (site / "plugin.yaml").write_text(
        yaml.safe_dump(
            {
                "kit": "kit",
                "data": {"source": "plugin", "loader": LOADER, "args": {"path": "rows.csv"}},
            }
        )
    )
    monkeypatch.chdir(tmp_path / "elsewhere")

    def rows(config: Path) -> int:
        data = load_silo_config(config).load_data(config, seed=0)
        return len(data.y_train) + len(data.y_val) + len(data.y_test)

    assert rows(site / "silo.yaml") == 40  # silo.yaml's folder
    assert rows(site / "plugin.yaml") == 70  # the current folder: args are passed as written
