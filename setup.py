"""The package list and package data of the `fedsilo` distribution, found in the tree when it is
built, so that a module, sub-package or data file added under one of the layers below ships
without an edit here (tests/test_packaging.py builds the wheel and checks it).

The repository's top-level folders are the layers of docs/architecture.md; each installs as a
sub-package of `fedsilo`, so no generic top-level name (`wire`, `ops`, ...) lands in a user's
site-packages. setuptools' own discovery (`[tool.setuptools.packages.find]`) cannot map several
top-level folders under one prefix, hence this file; everything else is in pyproject.toml.
"""

from __future__ import annotations

from pathlib import Path

from setuptools import find_packages, setup

HERE = Path(__file__).parent

# sub-package of `fedsilo` -> its folder in the repository (the layers, in import order)
LAYERS = {
    "": "fedsilo",
    "wire": "wire",
    "policies": "policies",
    "privacy": "privacy",
    "models": "models",
    "coordinator": "coordinator",
    "silo": "silo",
    "ops": "ops",
}
NOT_DATA = {".py", ".pyc", ".pyo"}


def _package(layer: str, sub: str = "") -> str:
    return ".".join(part for part in ("fedsilo", layer, sub) if part)


def packages_and_data() -> tuple[dict[str, str], list[str], dict[str, list[str]]]:
    """`package_dir`, `packages` and `package_data` for every layer: each Python package in its
    folder, and every other file under it (datasets, examples, templates, the .proto) as the
    data of the layer's top package."""
    package_dir: dict[str, str] = {}
    packages: list[str] = []
    package_data: dict[str, list[str]] = {}
    for layer, folder in LAYERS.items():
        top = _package(layer)
        package_dir[top] = folder
        packages += [top, *(_package(layer, sub) for sub in find_packages(HERE / folder))]
        root = HERE / folder
        package_data[top] = sorted(
            path.relative_to(root).as_posix()
            for path in root.rglob("*")
            if path.is_file()
            and path.suffix not in NOT_DATA
            and "__pycache__" not in path.relative_to(root).parts
        )
    return package_dir, packages, package_data


package_dir, packages, package_data = packages_and_data()
# include_package_data=False: package_data above is the whole list (MANIFEST.in adds nothing)
setup(
    package_dir=package_dir,
    packages=packages,
    package_data=package_data,
    include_package_data=False,
)
