"""A plug-in that fails is one message in `fedsilo policy validate` and `fedsilo simulate`,
naming the policy key and the plug-in, exit status 1, never a traceback: a data loader or a
model factory that raises, an entry point whose module cannot be imported, and (in
`simulate`, which needs them here) one that is not installed. Plug-ins are registered by
monkeypatching the entry point discovery, never installed."""

from __future__ import annotations

from importlib.metadata import EntryPoint
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from fedsilo.models import plugins as model_plugins
from fedsilo.ops.cli import main
from fedsilo.silo.data import plugins as data_plugins
from fedsilo.silo.data.plugins import DATASETS_GROUP
from tests.test_model_plugins import pinned, plugin_policy

FIXTURES = "tests.plugin_error_fixtures"
LOADER = f"{FIXTURES}:exploding_loader"
NET = f"{FIXTURES}:exploding_net"
BROKEN = "tests.no_such_module:loader"  # registered, but its module is not importable
TRAINING = {"epochs": 1, "batch_size": 32, "optimizer": "sgd", "lr": 0.05}


@pytest.fixture(autouse=True)
def installed(monkeypatch: pytest.MonkeyPatch) -> None:
    loaders = tuple(
        EntryPoint(value.rsplit(":", 1)[1], value, DATASETS_GROUP) for value in (LOADER, BROKEN)
    )
    monkeypatch.setattr(
        data_plugins, "installed", lambda group: loaders if group == DATASETS_GROUP else ()
    )
    factories = [
        EntryPoint(value.rsplit(":", 1)[1], value, model_plugins.GROUP)
        for value in (NET, "tests.no_such_module:net")
    ]
    monkeypatch.setattr(model_plugins, "installed_factories", lambda: factories)


def data_policy(loader: str) -> dict[str, Any]:
    return {
        "version": 1,
        "seed": 2,
        "rounds": 1,
        "algorithm": {"name": "fedavg"},
        "model": {"name": "linear"},
        "training": TRAINING,
        "data": {"source": "plugin", "loader": loader, "partition": {"kind": "iid", "silos": 2}},
    }


def model_policy(factory: str = NET, **args: Any) -> dict[str, Any]:
    model = pinned(NET)
    model["factory"], model["args"] = factory, args
    return plugin_policy(model, training=TRAINING)


def run(tmp_path: Path, command: str, document: dict[str, Any]) -> str:
    """`fedsilo policy validate FILE` or `fedsilo simulate --policy FILE`: exit status 1, one
    error line and no traceback; the line."""
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    args = (
        ["policy", "validate", str(path)]
        if command == "validate"
        else ["simulate", "--policy", str(path), "--out", str(tmp_path / "out")]
    )
    result = CliRunner().invoke(main, args, catch_exceptions=False)
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output
    errors = [line for line in result.output.splitlines() if line.startswith("Error: ")]
    assert len(errors) == 1, result.output
    return errors[0]


@pytest.mark.parametrize("command", ["validate", "simulate"])
def test_a_data_loader_that_raises_is_one_message_naming_the_key_and_the_loader(
    tmp_path: Path, command: str
) -> None:
    line = run(tmp_path, command, data_policy(LOADER))
    assert "data.loader" in line and LOADER in line
    assert "the hospital's export share is not mounted (RuntimeError)" in line


@pytest.mark.parametrize("command", ["validate", "simulate"])
def test_a_data_loader_whose_module_does_not_import_is_one_message(
    tmp_path: Path, command: str
) -> None:
    line = run(tmp_path, command, data_policy(BROKEN))
    assert "data.loader" in line and BROKEN in line and "tests.no_such_module" in line


@pytest.mark.parametrize("command", ["validate", "simulate"])
def test_a_model_factory_that_raises_is_one_message_naming_the_key_and_the_factory(
    tmp_path: Path, command: str
) -> None:
    line = run(tmp_path, command, model_policy(explode=True))
    assert "model.factory" in line and NET in line
    assert "RuntimeError: CUDA kernels of this layer are not built" in line


@pytest.mark.parametrize("command", ["validate", "simulate"])
def test_a_model_factory_whose_module_does_not_import_is_one_message(
    tmp_path: Path, command: str
) -> None:
    line = run(tmp_path, command, model_policy("tests.no_such_module:net"))
    assert "model.factory" in line and "tests.no_such_module:net" in line


def test_simulate_names_a_plugin_that_is_not_installed_here(tmp_path: Path) -> None:
    line = run(tmp_path, "simulate", data_policy(f"{FIXTURES}:not_registered"))
    assert "data.loader" in line and f"{FIXTURES}:not_registered" in line
    line = run(tmp_path, "simulate", model_policy(f"{FIXTURES}:not_registered"))
    assert "model.factory" in line and f"{FIXTURES}:not_registered" in line
