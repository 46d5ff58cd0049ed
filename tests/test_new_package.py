"""`fedsilo new` writes a plug-in package that runs as it is: installed by pip (offline, into a
throwaway folder on PYTHONPATH, as `pip install --target` makes one, so this test's virtual
environment is left as it was), its policy runs under `fedsilo simulate` in a process of its own
to finite metrics, its own tests pass, and its code is lint-clean. A NAME that makes no package
and an output folder that holds anything are refused with one message, nothing written."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner, Result

from fedsilo.ops.cli import main
from tests.test_bad_input import assert_refused, nothing_written

BIN = Path(sys.executable).parent


@dataclass(frozen=True)
class Generated:
    """A package `fedsilo new` wrote into `folder`, and the site folder it is installed in."""

    folder: Path
    site: Path

    def run(self, *command: str, cwd: Path) -> subprocess.CompletedProcess[str]:
        """`command` in a process that finds the installed package (and no other copy)."""
        paths = [str(self.site), os.environ.get("PYTHONPATH", "")]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, paths))}
        return subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True)


def new(*args: str) -> Result:
    return CliRunner().invoke(main, ["new", *args])


@pytest.fixture(scope="module")
def generated(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Generated]:
    """`fedsilo new mymodel` run in an empty folder, and `fedsilo new Visit-Counts --task --out
    visits`, both installed by one offline `pip install --target`."""
    root = tmp_path_factory.mktemp("new")
    site = root / "site-packages"
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(root)
        plain, task = new("mymodel"), new("Visit-Counts", "--task", "--out", "visits")
    for result in (plain, task):
        assert result.exit_code == 0, result.output
    assert "pip install -e mymodel" in plain.output
    assert "fedsilo simulate --policy mymodel/policy.yaml" in plain.output
    install = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-index"),
            *("--no-build-isolation", "--target", str(site), "./mymodel", "./visits"),
        ],
        cwd=root,
        capture_output=True,
        text=True,
    )
    assert install.returncode == 0, install.stderr
    return {
        "plain": Generated(root / "mymodel", site),
        "task": Generated(root / "visits", site),
    }


@pytest.mark.parametrize("variant", ["plain", "task"])
def test_the_generated_policy_runs_under_fedsilo_simulate_to_finite_metrics(
    generated: dict[str, Generated], variant: str
) -> None:
    package = generated[variant]
    policy, out = package.folder / "policy.yaml", package.folder.parent / f"runs-{variant}"
    simulated = package.run(
        *(sys.executable, "-m", "fedsilo", "simulate", "--policy", str(policy)),
        *("--out", str(out)),
        cwd=package.folder.parent,
    )
    assert simulated.returncode == 0, simulated.stdout + simulated.stderr
    results = json.loads((out / "results.json").read_text())
    rounds = yaml.safe_load(policy.read_text())["rounds"]
    assert results["failed_rounds"] == [] and results["history"][-1]["round"] == rounds
    final = results["final"]["per_silo"]
    assert sorted(final) == ["silo-0", "silo-1", "silo-2"]
    metric = "accuracy" if variant == "plain" else "mae"
    assert all(math.isfinite(metrics[metric]) for metrics in final.values()), final


@pytest.mark.parametrize("variant", ["plain", "task"])
def test_the_generated_packages_own_tests_pass(
    generated: dict[str, Generated], variant: str
) -> None:
    package = generated[variant]
    tests = package.run(
        sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", cwd=package.folder
    )
    assert tests.returncode == 0, tests.stdout + tests.stderr
    assert ("3 passed" if variant == "task" else "2 passed") in tests.stdout


def test_the_generated_code_is_lint_clean_and_formatted(generated: dict[str, Generated]) -> None:
    folders = [str(package.folder) for package in generated.values()]
    for check in (["check", "--no-cache"], ["format", "--check", "--no-cache"]):
        linted = subprocess.run([BIN / "ruff", *check, *folders], capture_output=True, text=True)
        assert linted.returncode == 0, linted.stdout + linted.stderr


def test_a_name_with_dashes_makes_a_lower_case_import_package(
    generated: dict[str, Generated],
) -> None:
    folder = generated["task"].folder
    assert (folder / "visit_counts" / "task.py").is_file()
    assert (folder / "tests" / "test_visit_counts.py").is_file()
    assert 'name = "Visit-Counts"' in (folder / "pyproject.toml").read_text()
    assert "loader: visit_counts.data:rows" in (folder / "policy.yaml").read_text()


def test_an_empty_output_folder_receives_the_package_even_the_current_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "empty").mkdir()
    monkeypatch.chdir(tmp_path / "empty")
    assert new("mymodel", "--out", ".").exit_code == 0
    assert nothing_written(  # nor any temporary folder left
        tmp_path / "empty", "README.md", "mymodel", "policy.yaml", "pyproject.toml", "tests"
    )
    assert (tmp_path / "empty" / "mymodel" / "models.py").is_file()
    assert nothing_written(tmp_path, "empty")


def test_an_output_folder_with_anything_in_it_is_refused_and_left_as_it_was(
    tmp_path: Path,
) -> None:
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("my notes")
    assert_refused(new("mymodel", "--out", str(tmp_path / "mine")), "--out", "not empty")
    assert nothing_written(tmp_path / "mine", "notes.txt")
    assert (tmp_path / "mine" / "notes.txt").read_text() == "my notes"
    (tmp_path / "a-file").write_text("mine too")
    assert_refused(new("mymodel", "--out", str(tmp_path / "a-file")), "--out", "not a folder")
    assert (tmp_path / "a-file").read_text() == "mine too"
    assert nothing_written(tmp_path, "mine", "a-file")


@pytest.mark.parametrize(
    ("name", "says"),
    [
        ("my model", "not a valid package name"),
        ("model-", "not a valid package name"),
        ("../model", "not a valid package name"),
        ("1model", "not a Python identifier"),
        ("class", "not a Python identifier"),
        ("json", "would shadow the module"),
    ],
)
def test_a_name_that_makes_no_new_package_is_refused_naming_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, says: str
) -> None:
    monkeypatch.chdir(tmp_path)
    assert_refused(new(name), f"NAME {name!r}", says)
    assert nothing_written(tmp_path)
