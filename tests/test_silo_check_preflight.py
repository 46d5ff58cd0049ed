"""`fedsilo silo check`, the pre-flight step the docs prescribe, tells the truth and never prints a
traceback: every `data.source` kind a silo.yaml accepts is loaded as the agent loads it (a data
plug-in, the shipped example's included, by calling its loader) and summarised with exit status
0; a plug-in that fails, and a `kit` that is no silo's kit (missing, not a kit, the
coordinator's or the operator's), are refused with one message naming what is wrong, exit
status 1."""

import shutil
import subprocess
import sys
from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml
from click.testing import CliRunner, Result

from fedsilo.ops.cli import main
from fedsilo.ops.provision import provision
from fedsilo.policies.consortium import EXAMPLE, parse_consortium
from fedsilo.policies.data import SOURCES
from fedsilo.silo.data import plugins as plugin_registry
from fedsilo.silo.data.plugins import DATASETS_GROUP, TASKS_GROUP
from tests.plugin_data_fixtures import COX_TASK

EXAMPLE_LOADER = "fedsilo_example_plugins.data:digits_16x16"  # installed in .venv
FIXTURES = "tests.plugin_data_fixtures"
FIXTURE_LOADERS = ("breast_cancer_dataset", "survival", "nan_x")
CSV = "age,smoker,outcome\n" + "".join(
    f"{30 + i},{'yes' if i % 3 else 'no'},{i % 2}\n" for i in range(40)
)
MOLECULES_CSV = "smiles,logp\n" + "".join(
    f"{smiles},{i / 10}\n" for i, smiles in enumerate(["CCO", "CCN", "c1ccccc1", "CC(=O)O"] * 10)
)


@pytest.fixture(scope="module")
def kits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A provisioned consortium's kits (the example consortium.yaml): operator, coordinator,
    silos/cleveland, silos/hungary, silos/va."""
    folder = tmp_path_factory.mktemp("consortium")
    provision(parse_consortium(yaml.safe_load(EXAMPLE)), folder / "kits")
    return folder / "kits"


@pytest.fixture
def fixture_loaders(monkeypatch: pytest.MonkeyPatch) -> None:
    """tests/plugin_data_fixtures.py's loaders (and its Cox task) installed beside the site's
    real entry points."""
    real = plugin_registry.installed
    points = {
        DATASETS_GROUP: tuple(
            EntryPoint(name, f"{FIXTURES}:{name}", DATASETS_GROUP) for name in FIXTURE_LOADERS
        ),
        TASKS_GROUP: (EntryPoint("cox", COX_TASK, TASKS_GROUP),),
    }

    def installed(group: str) -> tuple[EntryPoint, ...]:
        return (*real(group), *points.get(group, ()))

    monkeypatch.setattr(plugin_registry, "installed", installed)


def write_site(folder: Path, kit: str | Path, data: dict[str, Any]) -> Path:
    """silo.yaml in `folder` (with its data files), pointing at `kit`; returns its path."""
    (folder / "records.csv").write_text(CSV)
    (folder / "molecules.csv").write_text(MOLECULES_CSV)
    rng = np.random.default_rng(0)
    np.savez(folder / "records.npz", x=rng.normal(size=(30, 3)), y=np.arange(30) % 3)
    config = folder / "silo.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "kit": str(kit), "data": data}))
    return config


def check(config: Path) -> Result:
    return CliRunner().invoke(main, ["silo", "check", "--config", str(config)])


def refused(result: Result, *expected: str) -> None:
    """Exit status 1, one error message holding each of `expected`, no traceback."""
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit), result.exception
    assert "Traceback" not in result.output
    message = result.output.strip()
    assert message.startswith("Error: ") and message.count("Error:") == 1, message
    for text in expected:
        assert text in message, message


# Every data.source kind a silo.yaml accepts, each as a site would write it, and a line of the
# summary that only a true load of that source prints.
ACCEPTED: dict[str, tuple[dict[str, Any], str]] = {
    "heart": ({"select": "Hungary"}, "dataset Hungary: 294 rows"),
    "tcga_brca": ({"select": "Northeast"}, "task: survival ("),
    "sklearn:breast_cancer": ({"select": "silo-0"}, "labels (2 classes)"),
    "sklearn:diabetes": ({"select": "silo-0"}, "task: regression ("),
    "sklearn:digits": ({"select": "silo-0"}, "labels (10 classes)"),
    "sklearn:wine": ({"select": "silo-0"}, "labels (3 classes)"),
    "molecules:esol": ({"select": "silo-0"}, "task: regression ("),
    "molecules:freesolv": ({"select": "silo-0"}, "task: regression ("),
    "molecules:lipophilicity": (
        {"select": "silo-0", "molecules": {"invalid": "drop"}},
        "task: regression (",
    ),
    "molecules:csv": ({"path": "molecules.csv", "target": "logp"}, "task: regression ("),
    "csv": (
        {"path": "records.csv", "target": "outcome", "categorical": {"smoker": ["no", "yes"]}},
        "records.csv: 40 rows, 3 columns",
    ),
    "npz": ({"path": "records.npz"}, "records.npz: 30 rows, 4 columns"),
    "plugin": (
        {"loader": EXAMPLE_LOADER, "args": {"rows": 200}},
        f"data plug-in '{EXAMPLE_LOADER}': 200 rows, 256 columns",
    ),
}


def test_the_table_covers_every_source_a_silo_yaml_accepts() -> None:
    assert set(ACCEPTED) == set(SOURCES)


@pytest.mark.parametrize("source", sorted(ACCEPTED))
def test_every_source_is_loaded_and_summarised(kits: Path, tmp_path: Path, source: str) -> None:
    keys, expected = ACCEPTED[source]
    result = check(write_site(tmp_path, kits / "silos" / "cleveland", {"source": source, **keys}))
    assert result.exit_code == 0, result.output
    assert "Traceback" not in result.output and "Error" not in result.output
    assert expected in result.output
    assert "splits: train " in result.output


@pytest.mark.parametrize(
    ("loader", "expected"),
    [
        (f"{FIXTURES}:breast_cancer_dataset", ["400 rows, 30 columns", "labels (2 classes)"]),
        (f"{FIXTURES}:survival", ["480 rows", f"task: {COX_TASK} (returned by the data plug-in)"]),
    ],
)
def test_plugin_loaders_of_every_shape_are_summarised(
    kits: Path, tmp_path: Path, fixture_loaders: None, loader: str, expected: list[str]
) -> None:
    config = write_site(tmp_path, kits / "silos" / "va", {"source": "plugin", "loader": loader})
    result = check(config)
    assert result.exit_code == 0, result.output
    for text in expected:
        assert text in result.output


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        (  # the loader's own code fails (here: an argument it does not take)
            {"loader": EXAMPLE_LOADER, "args": {"no_such_argument": 1}},
            ["data.loader", EXAMPLE_LOADER, "no_such_argument"],
        ),
        ({"loader": "not_installed.module:loader"}, ["data.loader", "not_installed.module"]),
        ({"loader": f"{FIXTURES}:nan_x"}, ["data.loader", "non-finite"]),
    ],
    ids=["loader-raises", "not-installed", "bad-rows"],
)
def test_a_failing_plugin_is_one_message_naming_the_loader(
    kits: Path, tmp_path: Path, fixture_loaders: None, data: dict, expected: list[str]
) -> None:
    config = write_site(tmp_path, kits / "silos" / "cleveland", {"source": "plugin", **data})
    refused(check(config), *expected)


def _not_a_kit(kits: Path, tmp_path: Path) -> Path:
    (tmp_path / "empty").mkdir()
    return tmp_path / "empty"


def _a_file(kits: Path, tmp_path: Path) -> Path:
    (tmp_path / "kit.tar").write_text("not a folder")
    return tmp_path / "kit.tar"


def _broken_kit_yaml(kits: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "broken"
    shutil.copytree(kits / "silos" / "cleveland", folder)
    (folder / "kit.yaml").write_text("role: silo\nname: [unclosed\n")
    return folder


def _kit_without_its_key(kits: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "keyless"
    shutil.copytree(kits / "silos" / "cleveland", folder)
    (folder / "client.key").unlink()
    return folder


# Each kind of bad kit: how to make it, and what the one message must name.
BAD_KITS = {
    "missing": (lambda kits, tmp: tmp / "no-such-kit", ["kit:", "no-such-kit", "not found"]),
    "relative-missing": (lambda kits, tmp: Path("kits/cleveland"), ["kit:", "kits/cleveland"]),
    "empty-folder": (_not_a_kit, ["kit:", "empty", "kit.yaml"]),
    "a-file": (_a_file, ["kit:", "kit.tar", "not found"]),
    "coordinator": (lambda kits, tmp: kits / "coordinator", ["kit:", "coordinator", "silo"]),
    "operator": (lambda kits, tmp: kits / "operator", ["kit:", "operator"]),
    "broken-kit-yaml": (_broken_kit_yaml, ["kit:", "broken"]),
    "missing-key": (_kit_without_its_key, ["kit:", "keyless"]),
}


@pytest.mark.parametrize("source", ["csv", "plugin"])
@pytest.mark.parametrize("bad", sorted(BAD_KITS))
def test_a_kit_that_is_no_silos_kit_is_refused(
    kits: Path, tmp_path: Path, bad: str, source: str
) -> None:
    make, expected = BAD_KITS[bad]
    keys = ACCEPTED[source][0]
    refused(
        check(write_site(tmp_path, make(kits, tmp_path), {"source": source, **keys})), *expected
    )


def test_the_reported_run_the_installed_cli_with_the_example_plugin(
    kits: Path, tmp_path: Path
) -> None:
    """The new user's run, as a process: the shipped example loader is summarised."""
    config = write_site(
        tmp_path, kits / "silos" / "hungary", {"source": "plugin", "loader": EXAMPLE_LOADER}
    )
    run = subprocess.run(
        [sys.executable, "-m", "fedsilo", "silo", "check", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    output = run.stdout + run.stderr
    assert run.returncode == 0, output
    assert "Traceback" not in output and "KeyError" not in output
    assert f"data plug-in '{EXAMPLE_LOADER}': 1797 rows, 256 columns" in output
    assert "labels (10 classes)" in output


@pytest.mark.parametrize(
    ("target", "keys", "expected"),
    [
        (
            "systolic",
            {},
            "task: regression (inferred: target 'systolic' holds numbers with decimals)",
        ),
        (
            "visits",
            {},
            "task: regression (inferred: target 'visits' holds whole numbers, 40 "
            "distinct values (more than 20))",
        ),
        (
            "stage",
            {},
            "task: classification (inferred: target 'stage' holds whole numbers, 3 "
            "distinct values (at most 20))",
        ),
        ("stage", {"task": "regression"}, "task: regression (set by data.task)"),
    ],
)
def test_silo_check_names_the_task_and_why(
    kits: Path, tmp_path: Path, target: str, keys: dict[str, Any], expected: str
) -> None:
    (tmp_path / "table.csv").write_text(
        "age,systolic,visits,stage\n"
        + "".join(f"{30 + i},{120 + i * 0.7:.1f},{i},{i % 3}\n" for i in range(40))
    )
    data = {"source": "csv", "path": "table.csv", "target": target, **keys}
    drop = [c for c in ("systolic", "visits", "stage") if c != target]
    config = write_site(tmp_path, kits / "silos" / "va", {**data, "drop_columns": drop})
    result = check(config)
    assert result.exit_code == 0, result.output
    assert expected in result.output


@pytest.mark.parametrize(
    ("data", "named"),
    [
        ({"source": "csv", "path": "gone.csv", "target": "outcome"}, "gone.csv"),
        ({"source": "plugin", "loader": "no_such_loader"}, "data.loader"),
    ],
)
def test_silo_start_refuses_at_start_data_that_every_job_would_fail_on(
    kits: Path, tmp_path: Path, data: dict[str, Any], named: str
) -> None:
    """Before it dials the coordinator (unreachable here: it would retry for ever), the agent
    reads its data as a job would, and stops with one message naming what is wrong."""
    config = tmp_path / "silo.yaml"
    config.write_text(yaml.safe_dump({"kit": str(kits / "silos" / "cleveland"), "data": data}))
    started = subprocess.run(
        [sys.executable, "-m", "fedsilo", "silo", "start", "--config", str(config)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert started.returncode == 1, started.stderr
    assert named in started.stderr and "Traceback" not in started.stderr, started.stderr
    assert "reaches the coordinator" not in started.stderr
