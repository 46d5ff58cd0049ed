"""The services' health, as a container health check and Kubernetes probes read it
(`fedsilo-health`, ops/health.py): alive while the process rewrites its health file, ready while
the coordinator serves or a silo's coordinator answers its heartbeats, and one line saying why
not otherwise."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from fedsilo.ops.health import EVERY_S, Health, HealthError, HealthFile, main, read_health
from tests.deployment import SILOS, provision, wait_for

NOW = 1_000_000.0


def health(written_ago: float, ready_ago: float | None, role: str = "silo") -> Health:
    return Health(role, 7, NOW - written_ago, None if ready_ago is None else NOW - ready_ago)


def test_a_service_that_wrote_within_max_age_is_alive_and_ready_if_it_was_ready_then() -> None:
    assert health(5, 5).check(NOW, 60, ready=True) == "silo alive (pid 7, written 5 s ago), ready"
    assert health(5, None).check(NOW, 60, ready=False) == "silo alive (pid 7, written 5 s ago)"


def test_a_service_that_stopped_writing_is_not_alive() -> None:
    with pytest.raises(HealthError, match="last wrote its health 61 s ago.*stopped or stuck"):
        health(61, 1).check(NOW, 60, ready=False)


@pytest.mark.parametrize(
    ("role", "ready_ago", "said"),
    [
        ("silo", None, "the coordinator has not answered its heartbeats \\(last: never\\)"),
        ("silo", 90, "the coordinator has not answered its heartbeats \\(last: 90 s ago\\)"),
        ("coordinator", None, "its gRPC server is not serving"),
    ],
)
def test_an_alive_service_is_not_ready_until_it_was_ready_within_max_age(
    role: str, ready_ago: float | None, said: str
) -> None:
    with pytest.raises(HealthError, match=f"{role} alive .*but not ready: {said}"):
        health(1, ready_ago, role).check(NOW, 60, ready=True)


def test_no_health_file_or_another_file_is_one_message(tmp_path: Path) -> None:
    with pytest.raises(HealthError, match="no health file at .*not started yet"):
        read_health(tmp_path / "health.json")
    (tmp_path / "other.json").write_text('{"role": "silo"}')
    with pytest.raises(HealthError, match="not a fedsilo health file"):
        read_health(tmp_path / "other.json")


def test_the_file_is_rewritten_with_the_readiness_the_service_reports(tmp_path: Path) -> None:
    ready: list[float | None] = [None]
    writer = HealthFile(tmp_path / "state" / "health.json", "silo", lambda: ready[0]).start()
    try:
        first = read_health(writer.path)
        assert (first.role, first.ready_at) == ("silo", None)
        ready[0] = first.written_at
        wait_for(lambda: read_health(writer.path).ready_at is not None, 2 * EVERY_S, "ready")
    finally:
        writer.stop()
    assert read_health(writer.path).written_at > first.written_at


def test_the_command_exits_1_with_one_line_and_no_traceback(tmp_path: Path) -> None:
    path = tmp_path / "health.json"
    path.write_text(json.dumps({"role": "silo", "pid": 7, "written_at": 0, "ready_at": None}))
    result = CliRunner().invoke(main, ["--file", str(path)])
    assert result.exit_code == 1
    assert result.output.startswith("Error: silo (pid 7) last wrote its health")
    assert len(result.output.strip().splitlines()) == 1


def fedsilo_health(path: Path, *args: str) -> subprocess.CompletedProcess:
    """The console script as a probe runs it (the environment names the file)."""
    return subprocess.run(
        [str(Path(sys.executable).with_name("fedsilo-health")), *args],
        env={"FEDSILO_HEALTH_FILE": str(path)},
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_a_serving_coordinator_and_its_silo_agents_are_alive_and_ready(tmp_path: Path) -> None:
    consortium = provision(tmp_path)
    try:
        coordinator = tmp_path / "coordinator-health.json"
        consortium.start_serve("--health-file", str(coordinator))
        consortium.wait_for_log("coordinator", "serving mTLS gRPC")
        silo = tmp_path / "silo-health.json"
        consortium.start(
            SILOS[0],
            "silo",
            "start",
            "--config",
            str(consortium.write_silo_config(SILOS[0])),
            "--health-file",
            str(silo),
        )
        for path, role in ((coordinator, "coordinator"), (silo, "silo")):
            probe = wait_for(
                lambda path=path: fedsilo_health(path, "--ready").returncode == 0,
                60,
                f"{role} ready",
                consortium,
            )
            assert probe
            said = fedsilo_health(path, "--ready").stdout
            assert said.startswith(f"{role} alive (pid ") and said.strip().endswith(", ready")
        consortium.kill(SILOS[0])
        wait_for(
            lambda: fedsilo_health(silo, "--max-age", "1").returncode == 1, 10, "stale", consortium
        )
        assert "stopped or stuck" in fedsilo_health(silo, "--max-age", "1").stderr
    finally:
        consortium.stop_all()
