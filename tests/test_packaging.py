"""What the wheel holds: every module, sub-package and data file of the repository's layers
(setup.py finds them when the wheel is built), so that none can be forgotten, and the console
scripts a user and a container's health check call. The wheel as installed outside the checkout
is checked by ci/check-wheel.sh."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import zipfile
from email.parser import Parser
from pathlib import Path

import pytest

import fedsilo

REPO = Path(__file__).resolve().parent.parent
LAYERS = ("fedsilo", "wire", "policies", "privacy", "models", "coordinator", "silo", "ops")
NOT_SHIPPED = {"tests", "bench"}  # top-level Python packages of the checkout alone


def build_wheel(source: Path, out: Path) -> zipfile.ZipFile:
    """`python -m build --wheel` of `source`, with this environment's setuptools (no download)."""
    subprocess.run(
        [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--outdir", str(out)],
        cwd=source,
        check=True,
        capture_output=True,
    )
    (wheel,) = out.glob("fedsilo-*.whl")
    return zipfile.ZipFile(wheel)


def tracked(*paths: str) -> list[str]:
    """The checkout's files under `paths`: committed, or new and not ignored."""
    return subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", *paths],
        cwd=REPO,
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split()


def installed_path(repository_path: str) -> str:
    """Where a file of a layer lands in site-packages: wire/x.py -> fedsilo/wire/x.py."""
    layer, rest = repository_path.split("/", 1)
    return f"fedsilo/{rest}" if layer == "fedsilo" else f"fedsilo/{layer}/{rest}"


@pytest.fixture(scope="module")
def source(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A copy of the checkout's tracked files that the build is built from."""
    root = tmp_path_factory.mktemp("source")
    for path in tracked(*LAYERS, "pyproject.toml", "setup.py", "README.md", "LICENSE"):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(REPO / path, root / path)
    return root


@pytest.fixture(scope="module")
def wheel(source: Path, tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    return build_wheel(source, tmp_path_factory.mktemp("dist"))


def test_the_wheel_holds_exactly_every_file_of_the_layers(wheel: zipfile.ZipFile) -> None:
    shipped = {name for name in wheel.namelist() if ".dist-info/" not in name}
    assert shipped == {installed_path(path) for path in tracked(*LAYERS)}


def test_every_top_level_package_of_the_checkout_is_a_layer_or_stays_in_the_checkout() -> None:
    packages = {path.parent.name for path in REPO.glob("*/__init__.py")}
    assert packages - NOT_SHIPPED == set(LAYERS), "a new top-level package: add it to setup.py"


def test_a_package_module_or_data_file_added_under_a_layer_ships_without_an_edit(
    source: Path, tmp_path: Path
) -> None:
    copy = tmp_path / "source"
    shutil.copytree(source, copy)
    added = {
        "silo/federated_widgets/__init__.py": "",
        "silo/federated_widgets/deep/__init__.py": "",
        "silo/federated_widgets/deep/module.py": "X = 1\n",
        "wire/new_codec.py": "",
        "policies/examples/new-example.yaml": "rounds: 1\n",
        "ops/templates/new_package/extra.txt.j2": "{{ name }}\n",
    }
    for path, text in added.items():
        (copy / path).parent.mkdir(parents=True, exist_ok=True)
        (copy / path).write_text(text)
    names = set(build_wheel(copy, tmp_path / "dist").namelist())
    assert {installed_path(path) for path in added} <= names


def test_the_wheel_declares_the_version_the_console_scripts_and_the_license(
    wheel: zipfile.ZipFile,
) -> None:
    version = fedsilo.__version__
    metadata = Parser().parsestr(wheel.read(f"fedsilo-{version}.dist-info/METADATA").decode())
    assert (metadata["Name"], metadata["Version"]) == ("fedsilo", version)
    assert metadata["License-Expression"] == "Apache-2.0"
    scripts = wheel.read(f"fedsilo-{version}.dist-info/entry_points.txt").decode()
    assert "fedsilo = fedsilo.ops.cli:main" in scripts
    assert "fedsilo-health = fedsilo.ops.health:main" in scripts
    assert f"fedsilo-{version}.dist-info/licenses/LICENSE" in wheel.namelist()


RELEASE_NAMED = re.compile(r"fedsilo[:-](\d+\.\d+\.\d+)\b|fedsilo (\d+\.\d+\.\d+) \(protocol")


def test_the_docs_and_deploy_files_name_the_release_of_this_checkout() -> None:
    """The image tag (`fedsilo:X.Y.Z`), the wheel's name and `--version`'s line in the README,
    docs/ and deploy/ follow fedsilo/__init__.py, so a release cannot leave one behind (the
    CHANGELOG names every release, on purpose)."""
    files = [REPO / "README.md", *(REPO / "docs").rglob("*.md"), *tracked("deploy")]
    stale = [
        f"{path}: {match.group(0)}"
        for path in map(lambda p: REPO / p, files)
        if path.is_file()
        for match in RELEASE_NAMED.finditer(path.read_text(errors="replace"))
        if fedsilo.__version__ not in match.groups()
    ]
    assert not stale, "\n".join(stale)
