"""The container image's entry point (deploy/container/entrypoint.sh), run here as the image runs
it: a container started wrongly gets one message and exit status 1 before fedsilo starts (no
command; a service without its state volume; a kit Secret that is not a kit), and a kit Secret
is staged with the owner-only modes fedsilo requires of private keys. ci/check-image.sh checks
the same in the built image."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

ENTRYPOINT = Path(__file__).resolve().parent.parent / "deploy" / "container" / "entrypoint.sh"


def entrypoint(*args: str, **env: str) -> subprocess.CompletedProcess:
    """The entry point with this environment's `fedsilo` first on the PATH."""
    path = f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}"
    return subprocess.run(
        ["sh", str(ENTRYPOINT), *args],
        env={"PATH": path, **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def refused(result: subprocess.CompletedProcess, said: str) -> None:
    assert result.returncode == 1, result
    assert said in result.stderr
    assert "Traceback" not in result.stderr + result.stdout


def test_no_command_names_the_commands_the_image_runs() -> None:
    result = entrypoint()
    refused(result, "fedsilo-entrypoint: no command given")
    assert "coordinator serve" in result.stderr and "silo start" in result.stderr


@pytest.mark.parametrize("command", [["coordinator", "serve"], ["silo", "start"]])
def test_a_service_without_a_state_volume_is_refused(command: list[str], tmp_path: Path) -> None:
    result = entrypoint(*command, "--help", FEDSILO_STATE_VOLUME=str(tmp_path))
    refused(result, f"{tmp_path} is not a volume")
    assert "privacy ledger" in result.stderr and "-v fedsilo-state:" in result.stderr


def test_a_service_on_a_mounted_state_volume_or_an_admin_command_runs_fedsilo(
    tmp_path: Path,
) -> None:
    on_a_mount = entrypoint("silo", "start", "--help", FEDSILO_STATE_VOLUME="/")
    assert on_a_mount.returncode == 0 and "--config" in on_a_mount.stdout
    admin = entrypoint("job", "list", "--help", FEDSILO_STATE_VOLUME=str(tmp_path))
    assert admin.returncode == 0 and "--kit" in admin.stdout


def test_a_kit_secret_is_staged_with_owner_only_modes(tmp_path: Path) -> None:
    secret = tmp_path / "kit-secret"
    (secret / "..data").mkdir(parents=True)  # a Secret volume: files are links into ..data/
    for name in ("kit.yaml", "client.key"):
        (secret / "..data" / name).write_text(name)
        (secret / name).symlink_to(Path("..data") / name)
        (secret / "..data" / name).chmod(0o440)
    staged = tmp_path / "run" / "kit"
    result = entrypoint("--version", FEDSILO_KIT_SECRET=str(secret), FEDSILO_KIT_STAGED=str(staged))
    assert result.returncode == 0, result.stderr
    assert sorted(path.name for path in staged.iterdir()) == ["client.key", "kit.yaml"]
    assert stat.S_IMODE(staged.stat().st_mode) == 0o700
    for path in staged.iterdir():
        assert not path.is_symlink() and stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.read_text() == path.name


def test_a_kit_secret_that_is_not_a_kit_is_refused(tmp_path: Path) -> None:
    refused(
        entrypoint("--version", FEDSILO_KIT_SECRET=str(tmp_path / "missing")),
        "is not a folder: mount the kit's Secret there",
    )
    (tmp_path / "secret").mkdir()
    (tmp_path / "secret" / "client.key").write_text("key")
    refused(
        entrypoint("--version", FEDSILO_KIT_SECRET=str(tmp_path / "secret")),
        "has no kit.yaml: make its Secret from every file of one kit folder",
    )


def test_a_service_starts_without_the_health_file_an_earlier_container_left(
    tmp_path: Path,
) -> None:
    left = tmp_path / "health.json"
    left.write_text('{"role": "silo", "pid": 1, "written_at": 0, "ready_at": 0}')
    admin = entrypoint("job", "list", "--help", FEDSILO_HEALTH_FILE=str(left))
    assert admin.returncode == 0 and left.exists()  # only a service's start removes it
    service = entrypoint(
        "silo", "start", "--help", FEDSILO_STATE_VOLUME="/", FEDSILO_HEALTH_FILE=str(left)
    )
    assert service.returncode == 0 and not left.exists()
