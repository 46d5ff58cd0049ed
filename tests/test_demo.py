"""`fedsilo demo` runs a real four-hospital consortium of processes; `fedsilo status` reads
where it stands; `fedsilo silo init` writes a site's configuration and systemd unit."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from fedsilo.silo.config import load_silo_config

HOSPITALS = ("cleveland", "hungary", "switzerland", "va-long-beach")


def fedsilo(
    *args: str, timeout: float = 180, cwd: Path | None = None
) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "fedsilo", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        env={"COLUMNS": "200", "PATH": ""},
        cwd=cwd,
    )


@pytest.fixture(scope="module")
def demo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str]:
    parent = tmp_path_factory.mktemp("demo")
    result = fedsilo("demo", "--folder", "run", "--rounds", "2", cwd=parent)  # relative, as in make
    folder = parent / "run"
    assert result.returncode == 0, result.stdout + result.stderr
    return folder, result.stdout


def test_demo_prints_every_hospitals_metrics_and_where_things_are(demo) -> None:
    folder, output = demo
    assert "after round 2" in output
    assert all(name in output for name in HOSPITALS)
    for file in (
        "final_model.safetensors",
        "history.json",
        "metric_per_round.png",
        "final_per_silo.png",
    ):
        assert (folder / "results" / file).stat().st_size > 0
    assert f"{folder}/logs/" in output.replace("\n", "")


def test_demo_processes_all_ended(demo) -> None:
    folder, _ = demo
    ps = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True).stdout
    assert str(folder) not in ps


def test_status_shows_the_round_and_active_silos(demo) -> None:
    folder, _ = demo
    result = fedsilo(
        "status", "--kit", str(folder / "kits" / "coordinator"), "--state", str(folder / "state.db")
    )
    assert result.returncode == 0, result.stderr
    assert "round 2 of 2 (completed)" in result.stdout
    assert result.stdout.count("active") == len(HOSPITALS)


def test_status_of_a_missing_state_file_is_a_clear_error(demo, tmp_path: Path) -> None:
    folder, _ = demo
    result = fedsilo(
        "status",
        "--kit",
        str(folder / "kits" / "coordinator"),
        "--state",
        str(tmp_path / "none.db"),
    )
    assert result.returncode != 0 and "no state file" in result.stderr


def test_silo_init_writes_a_valid_config_and_a_systemd_unit(demo, tmp_path: Path) -> None:
    folder, _ = demo
    out = tmp_path / "site" / "silo.yaml"
    result = fedsilo(
        "silo",
        "init",
        "--kit",
        str(folder / "kits" / "silos" / "hungary"),
        "--out",
        str(out),
        "--select",
        "Hungary",
        "--metrics-port",
        "9465",
        "--allow-algorithm",
        "fedavg",
        "--epsilon-cap",
        "4",
        "--total-epsilon-cap",
        "10",
    )
    assert result.returncode == 0, result.stderr
    config = load_silo_config(out)
    assert config.data.select == "Hungary" and config.metrics_port == 9465
    assert config.rules.allowed_algorithms == ["fedavg"]
    assert (config.rules.epsilon_cap, config.rules.total_epsilon_cap) == (4.0, 10.0)
    unit = (out.parent / "fedsilo-silo-hungary.service").read_text()
    assert f"silo start --config {out}" in unit and "KillSignal=SIGTERM" in unit
    assert yaml.safe_load(out.read_text())["kit"] == str(folder / "kits" / "silos" / "hungary")


def test_silo_init_refuses_a_kit_that_is_not_a_silo_kit(demo, tmp_path: Path) -> None:
    folder, _ = demo
    result = fedsilo(
        "silo",
        "init",
        "--kit",
        str(folder / "kits" / "coordinator"),
        "--out",
        str(tmp_path / "s.yaml"),
    )
    assert (
        result.returncode != 0 and "Error" in result.stderr and not (tmp_path / "s.yaml").exists()
    )
