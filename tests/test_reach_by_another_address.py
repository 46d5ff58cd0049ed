"""A coordinator in a container or a pod listens on an interface of its own (`coordinator serve
--listen 0.0.0.0:50051`) while the silos dial the name its certificate is issued for, and the
operator reaches it through a published port, a port-forward or a tunnel (`--coordinator`,
FEDSILO_COORDINATOR_ADDRESS): the certificate is still checked for the kit's host, so a
coordinator of another name is refused. Real processes over mutual TLS."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner

from fedsilo.ops.cli import main
from tests.deployment import Consortium, provision

UNRESOLVABLE = "fedsilo-coordinator.invalid"  # RFC 6761: never resolves


def job_list(consortium: Consortium, *args: str, **env: str):
    return CliRunner().invoke(
        main, ["job", "list", "--kit", str(consortium.kits / "operator"), *args], env=env
    )


@pytest.fixture
def serving(tmp_path: Path):
    (tmp_path / "named").mkdir()
    consortium = provision(tmp_path / "named", host=UNRESOLVABLE)
    consortium.start_serve("--listen", f"127.0.0.1:{consortium.port}")
    consortium.wait_for_log("coordinator", f"serving mTLS gRPC on 127.0.0.1:{consortium.port}")
    yield consortium
    consortium.stop_all()


def test_the_operator_reaches_a_coordinator_listening_elsewhere_through_another_address(
    serving: Consortium,
) -> None:
    assert job_list(serving).exit_code == 1  # the kit's name does not resolve here
    through = f"127.0.0.1:{serving.port}"
    by_option = job_list(serving, "--coordinator", through)
    assert by_option.exit_code == 0, by_option.output
    assert "no jobs" in by_option.output.lower() or "job" in by_option.output.lower()
    by_environment = job_list(serving, FEDSILO_COORDINATOR_ADDRESS=through)
    assert by_environment.exit_code == 0, by_environment.output


def test_the_certificate_is_still_checked_for_the_kits_host(serving: Consortium) -> None:
    """The same CA, but a kit that names another host: the coordinator's certificate is not
    issued for it, so the channel is refused although the address answers."""
    kit = serving.kits / "operator" / "kit.yaml"
    kit.write_text(kit.read_text().replace(UNRESOLVABLE, "another-coordinator.invalid"))
    result = job_list(serving, "--coordinator", f"127.0.0.1:{serving.port}")
    assert result.exit_code == 1
    assert f"the coordinator at 127.0.0.1:{serving.port} is unreachable" in result.output


def test_a_malformed_address_is_one_message_naming_the_option(tmp_path: Path) -> None:
    consortium = provision(tmp_path)
    result = job_list(consortium, "--coordinator", "no-port")
    assert result.exit_code == 1
    assert result.output.startswith("Error: --coordinator: address 'no-port' is not host:port")
    listen = CliRunner().invoke(
        main,
        [
            "coordinator",
            "serve",
            "--kit",
            str(consortium.kits / "coordinator"),
            "--state",
            str(tmp_path / "s.db"),
            "--listen",
            "0.0.0.0",
        ],
    )
    assert listen.exit_code == 1
    assert listen.output.startswith("Error: --listen: address '0.0.0.0' is not host:port")
