"""Packaged examples: the example policies and the monitoring files ship inside the package,
`fedsilo examples list` names each with one line, `fedsilo examples copy NAME` copies one out
and never overwrites, and `--policy example:NAME` works wherever a policy is read (signing
excepted: a signature cannot go beside a file inside the package)."""

import json
from importlib.resources import files
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from fedsilo.ops.cli import main
from fedsilo.policies import loading

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE_POLICIES = sorted((ROOT / "policies" / "examples").glob("*.yaml"))
DEPLOY_FILES = sorted((ROOT / "ops" / "deploy").iterdir())


def invoke(*args: str):
    return CliRunner().invoke(main, list(args), catch_exceptions=False)


def test_list_names_every_example_with_the_first_line_of_its_comment() -> None:
    result = invoke("examples", "list")
    assert result.exit_code == 0, result.output
    lines = result.output.splitlines()
    for path in EXAMPLE_POLICIES:
        first_comment = next(line for line in path.read_text().splitlines() if line[:1] == "#")
        description = first_comment.lstrip("#").strip()
        assert any(line.split() == [path.stem, *description.split()] for line in lines), path
    assert any(line.split()[:2] == ["prometheus", "Prometheus"] for line in lines)
    assert any(line.split()[0] == "grafana-dashboard" for line in lines if line.strip())


def test_copy_writes_the_packaged_bytes_into_the_current_folder(tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = invoke("examples", "copy", "heart-fedavg")
    assert result.exit_code == 0, result.output
    packaged = ROOT / "policies" / "examples" / "heart-fedavg.yaml"
    assert (tmp_path / "heart-fedavg.yaml").read_bytes() == packaged.read_bytes()


def test_copy_into_a_folder_or_to_a_file_name(tmp_path: Path) -> None:
    assert invoke("examples", "copy", "prometheus", "--out", str(tmp_path)).exit_code == 0
    assert (tmp_path / "prometheus.yml").read_bytes() == (
        ROOT / "ops" / "deploy" / "prometheus.yml"
    ).read_bytes()
    mine = tmp_path / "dashboard.json"
    assert invoke("examples", "copy", "grafana-dashboard", "--out", str(mine)).exit_code == 0
    assert mine.read_bytes() == (ROOT / "ops" / "deploy" / "grafana-dashboard.json").read_bytes()


@pytest.mark.parametrize("out", ["heart-fedavg.yaml", "."])
def test_copy_never_overwrites_a_file(tmp_path: Path, out: str) -> None:
    mine = tmp_path / "heart-fedavg.yaml"
    mine.write_text("my edits\n")
    result = invoke("examples", "copy", "heart-fedavg", "--out", str(tmp_path / out))
    assert result.exit_code == 1
    assert "already exists and is never overwritten" in result.output
    assert "Traceback" not in result.output
    assert mine.read_text() == "my edits\n"


def test_copy_into_a_missing_folder_is_refused_naming_it(tmp_path: Path) -> None:
    result = invoke("examples", "copy", "heart-fedavg", "--out", str(tmp_path / "no" / "p.yaml"))
    assert result.exit_code == 1
    assert f"folder {tmp_path / 'no'} does not exist" in result.output
    assert not (tmp_path / "no").exists()


def test_an_unknown_example_is_refused_with_the_close_names(tmp_path: Path) -> None:
    copied = invoke("examples", "copy", "heart-fedav", "--out", str(tmp_path / "p.yaml"))
    assert copied.exit_code == 1
    assert "no example named 'heart-fedav'; did you mean heart-fedavg" in copied.output
    assert not (tmp_path / "p.yaml").exists()
    validated = invoke("policy", "validate", "example:heart-fedav")
    assert validated.exit_code == 1
    assert "example:heart-fedav: no such example policy; did you mean heart-fedavg" in (
        validated.output
    )


def test_policy_validate_reads_a_packaged_example() -> None:
    result = invoke("policy", "validate", "example:heart-fedavg")
    assert result.exit_code == 0, result.output
    assert "policy 'heart-fedavg'" in result.output


def test_simulate_runs_a_packaged_example(tmp_path: Path, monkeypatch) -> None:
    """The packaged heart-fedavg cut to one round (the packaged folder stands in for a copy)."""
    short = tmp_path / "packaged"
    short.mkdir()
    document = yaml.safe_load((ROOT / "policies" / "examples" / "heart-fedavg.yaml").read_text())
    (short / "heart-fedavg.yaml").write_text(yaml.safe_dump({**document, "rounds": 1}))
    monkeypatch.setattr(loading, "example_folder", lambda: short)
    out = tmp_path / "out"
    result = invoke("simulate", "--policy", "example:heart-fedavg", "--out", str(out))
    assert result.exit_code == 0, result.output
    results = json.loads((out / "results.json").read_text())
    assert results["policy"]["name"] == "heart-fedavg" and len(results["history"]) == 1


def test_signing_a_packaged_example_asks_for_a_copy_first(tmp_path: Path) -> None:
    result = invoke("policy", "sign", "example:heart-fedavg", "--key", str(tmp_path / "k"))
    assert result.exit_code == 1
    assert "copy it first (`fedsilo examples copy heart-fedavg`)" in result.output
    assert not any(entry.name.endswith(".sig") for entry in loading.example_folder().iterdir())


def test_the_package_data_holds_every_example_and_deploy_file() -> None:
    """What importlib.resources reads (that the wheel holds them: tests/test_packaging.py)."""
    policies = files("fedsilo.policies") / "examples"
    deploy = files("fedsilo.ops") / "deploy"
    for path in EXAMPLE_POLICIES:
        assert (policies / path.name).read_bytes() == path.read_bytes()
    for path in DEPLOY_FILES:
        assert (deploy / path.name).read_bytes() == path.read_bytes()
    assert loading.example_names() == sorted(path.stem for path in EXAMPLE_POLICIES)


def test_an_example_reading_a_packaged_csv_runs_from_the_package_and_from_a_copy(
    tmp_path: Path, monkeypatch
) -> None:
    """flamby-heart-fedavg reads a CSV relative to the packaged examples: `example:NAME` reads
    it from there, and a copy elsewhere names the packaged file by its absolute path."""
    monkeypatch.chdir(tmp_path)
    result = invoke("examples", "copy", "flamby-heart-fedavg")
    assert result.exit_code == 0, result.output
    copied = yaml.safe_load((tmp_path / "flamby-heart-fedavg.yaml").read_text())
    packaged = (ROOT / "silo" / "datasets" / "flamby_heart" / "heart.csv").resolve()
    assert Path(copied["data"]["path"]) == packaged
    assert f"names the packaged file itself: {packaged}" in result.output
    for policy in ("example:flamby-heart-fedavg", str(tmp_path / "flamby-heart-fedavg.yaml")):
        assert invoke("policy", "validate", policy).exit_code == 0
    short = tmp_path / "short.yaml"
    short.write_text(yaml.safe_dump({**copied, "rounds": 1}))
    out = tmp_path / "out"
    assert invoke("simulate", "--policy", str(short), "--out", str(out)).exit_code == 0
