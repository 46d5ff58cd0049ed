"""A silo agent that serves job after job reads the site's installed plug-ins afresh when a job
starts: a plug-in package installed while it runs is used from the next job on, without a
restart; a plug-in whose code changed on disk after the agent loaded it is refused, the refusal
naming it and saying the agent must restart.

The package is installed as pip installs one: its distribution's metadata (`.dist-info` with its
entry points) and its module, written into a folder on the silo processes' PYTHONPATH that does
not exist yet when they start (as `pip install --target` would make it); no network, no pip.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from importlib.metadata import EntryPoint, entry_points
from pathlib import Path

import pytest

from fedsilo.coordinator.jobs import COMPLETED
from fedsilo.models import plugins as model_plugins
from fedsilo.policies import plugin_loading
from fedsilo.silo.data.plugins import DATASETS_GROUP
from tests.deployment import Consortium, policy_document, provision
from tests.test_serve import participants, wait_until_ended

SILOS = ("silo-0", "silo-1")
LOADER = "late_rows:rows"
PLUGIN_DATA = {
    "source": "plugin",
    "loader": LOADER,
    "partition": {"kind": "iid", "silos": len(SILOS)},
}
MODULE = '''"""Rows of a data plug-in installed while the silo agents run."""

import numpy as np

from fedsilo.silo.data.plugins import PluginData


def rows(n: int = {rows}) -> PluginData:
    x = np.random.default_rng(0).normal(size=(n, 4))
    return PluginData(x=x, y=(x[:, 0] > 0).astype(int), task="classification", num_classes=2)
'''


def install(site: Path, version: str, rows: int) -> None:
    """The distribution `late-rows` at `version` in `site`: its metadata, its entry point in
    group fedsilo.datasets, and its module."""
    site.mkdir(exist_ok=True)
    for old in site.glob("late_rows-*.dist-info"):
        for file in old.iterdir():
            file.unlink()
        old.rmdir()
    metadata = site / f"late_rows-{version}.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: late-rows\nVersion: {version}\n"
    )
    (metadata / "entry_points.txt").write_text(f"[fedsilo.datasets]\nrows = {LOADER}\n")
    (site / "late_rows.py").write_text(MODULE.format(rows=rows))


@pytest.fixture
def consortium(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Consortium]:
    """Two silos whose PYTHONPATH names `site`, a folder that does not exist yet."""
    monkeypatch.setenv(
        "PYTHONPATH",
        os.pathsep.join(filter(None, [str(tmp_path / "site"), os.getenv("PYTHONPATH")])),
    )
    consortium = provision(tmp_path, SILOS)
    yield consortium
    consortium.stop_all()


def decisions(consortium: Consortium, silo: str) -> list[dict]:
    path = consortium.root / "sites" / silo / "accepted_policies.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_plugin_installed_while_the_agents_run_is_used_from_the_next_job_on(
    consortium: Consortium,
) -> None:
    consortium.start_serve()
    for silo in SILOS:
        consortium.start_silo(silo)
    builtin = policy_document(
        rounds=1,
        name="built-in",
        data={**policy_document()["data"], "partition": {"kind": "iid", "silos": 2}},
    )
    first = consortium.submit(consortium.write_policy(builtin, "built-in.yaml"))
    assert wait_until_ended(consortium, first).status == COMPLETED

    install(consortium.root / "site", "0.1", rows=120)
    for silo in SILOS:
        consortium.write_silo_config(silo, data=PLUGIN_DATA)
    plugin = policy_document(rounds=1, name="plug-in", data=PLUGIN_DATA)
    second = consortium.submit(consortium.write_policy(plugin, "plug-in.yaml"))
    ended = wait_until_ended(consortium, second)
    assert ended.status == COMPLETED, decisions(consortium, "silo-0")[-1]["broken_rules"]
    assert participants(consortium, second) == dict.fromkeys(SILOS, "active")
    assert all(consortium.processes[silo].poll() is None for silo in SILOS)


def test_a_plugin_changed_on_disk_after_the_agent_loaded_it_is_refused_until_a_restart(
    consortium: Consortium,
) -> None:
    install(consortium.root / "site", "0.1", rows=120)
    consortium.start_serve()
    for silo in SILOS:
        consortium.start_silo(silo, consortium.write_silo_config(silo, data=PLUGIN_DATA))
    plugin = policy_document(rounds=1, name="plug-in", data=PLUGIN_DATA)
    first = consortium.submit(consortium.write_policy(plugin, "plug-in.yaml"))
    assert wait_until_ended(consortium, first).status == COMPLETED

    install(consortium.root / "site", "0.2", rows=160)  # upgraded while the agents run
    module = consortium.root / "site" / "late_rows.py"  # modified a second later, for coarse clocks
    os.utime(module, ns=(module.stat().st_atime_ns, module.stat().st_mtime_ns + 10**9))
    again = policy_document(rounds=1, name="plug-in-upgraded", data=PLUGIN_DATA)
    second = consortium.submit(consortium.write_policy(again, "upgraded.yaml"))
    assert wait_until_ended(consortium, second).status != COMPLETED
    for silo in SILOS:
        refusal = decisions(consortium, silo)[-1]
        assert refusal["policy"] == "plug-in-upgraded" and not refusal["accepted"]
        assert refusal["broken_rules"] == [
            f"cannot work under this policy: data.source.loader: plug-in '{LOADER}' changed "
            "since this agent loaded it (late-rows 0.1 -> 0.2, module late_rows modified): "
            "restart the silo agent to use it"
        ]
        assert consortium.processes[silo].poll() is None

    for silo in SILOS:  # restarted, the agents load the new version
        consortium.kill(silo)
        consortium.start_silo(silo, consortium.root / "sites" / silo / "silo.yaml")
    third = consortium.submit(consortium.write_policy({**again, "seed": 8}, "restarted.yaml"))
    assert wait_until_ended(consortium, third).status == COMPLETED


@pytest.fixture
def site_packages(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A site-packages folder of this process's own (on sys.path, its `.pth` files read as
    start-up reads them), and a fresh record of the plug-ins loaded; the modules the test
    imports are forgotten after it."""
    folder = tmp_path / "site-packages"
    folder.mkdir()
    monkeypatch.setattr(sys, "path", [*sys.path, str(folder)])
    monkeypatch.setattr(plugin_loading, "site_folders", lambda: [str(folder)])
    monkeypatch.setattr(plugin_loading, "PLUGINS", plugin_loading.Plugins())
    before = set(sys.modules)
    yield folder
    for name in set(sys.modules) - before:
        del sys.modules[name]


def write_distribution(folder: Path, name: str, version: str, entry_points: str) -> None:
    metadata = folder / f"{name}-{version}.dist-info"
    metadata.mkdir()
    (metadata / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    (metadata / "entry_points.txt").write_text(entry_points)


def test_an_editable_install_made_while_running_loads_once_the_plugins_are_read_afresh(
    site_packages: Path, tmp_path: Path
) -> None:
    """pip install -e: the distribution's metadata in site-packages, its code elsewhere, reached
    through a `.pth` file that start-up alone reads."""
    source = tmp_path / "checkout"
    (source / "late_editable").mkdir(parents=True)
    (source / "late_editable" / "__init__.py").write_text("def rows():\n    return 'rows'\n")
    write_distribution(
        site_packages, "late_editable", "0.1", "[fedsilo.datasets]\nrows = late_editable:rows\n"
    )
    (site_packages / "__editable__.late_editable-0.1.pth").write_text(f"{source}\n")

    (entry_point,) = installed(DATASETS_GROUP, "late_editable:rows")
    with pytest.raises(ModuleNotFoundError):
        plugin_loading.load_plugin(entry_point)
    assert plugin_loading.read_afresh() == {}
    assert plugin_loading.load_plugin(entry_point)() == "rows"


def test_a_model_factory_changed_on_disk_is_refused_from_the_next_job_naming_it(
    site_packages: Path,
) -> None:
    """A running job keeps the code it loaded; the next job (after `read_afresh`) is refused,
    naming the factory and the change; another plug-in package still loads."""
    write_distribution(
        site_packages,
        "late_nets",
        "1.0",
        "[fedsilo.models]\nnet = late_nets.nets:net\n[fedsilo.datasets]\nrows = late_rows2:rows\n",
    )
    (site_packages / "late_nets").mkdir()
    (site_packages / "late_nets" / "__init__.py").write_text("")
    nets = site_packages / "late_nets" / "nets.py"
    nets.write_text(
        "from torch import nn\n\ndef net(shape, outputs):\n    return nn.Linear(4, 2)\n"
    )
    (site_packages / "late_rows2.py").write_text("def rows():\n    return 'rows'\n")
    assert callable(model_plugins.load_factory("late_nets.nets:net"))

    nets.write_text(nets.read_text() + "\n# edited\n")
    os.utime(nets, ns=(nets.stat().st_atime_ns, nets.stat().st_mtime_ns + 10**9))
    assert callable(model_plugins.load_factory("late_nets.nets:net"))  # the running job's
    assert plugin_loading.read_afresh() == {"late_nets": "module late_nets.nets modified"}
    with pytest.raises(model_plugins.PluginError) as refused:
        model_plugins.load_factory("late_nets.nets:net")
    assert str(refused.value) == (
        "model factory 'late_nets.nets:net' changed since this agent loaded it (module "
        "late_nets.nets modified): restart the silo agent to use it"
    )
    (entry_point,) = installed(DATASETS_GROUP, "late_rows2:rows")
    assert plugin_loading.load_plugin(entry_point)() == "rows"


def installed(group: str, value: str) -> list[EntryPoint]:
    return [point for point in entry_points(group=group) if point.value == value]
