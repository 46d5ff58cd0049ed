"""Mixing versions: a silo, the operator's admin CLI and a coordinator work together exactly when
they speak the same protocol version (wire/messages.py `PROTOCOL_VERSION`), whatever their fedsilo
package versions. When they do not, the side that notices says so in one line naming both sides'
protocol and package versions and which side to upgrade: a coordinator refuses the message with
FAILED_PRECONDITION and that line (logged once per sender, however often it retries, and counted
as `fedsilo_rejected_messages_total{reason="protocol_version"}`); the silo or admin CLI prints
the line and exits with status 1, without retrying and without a traceback.

Another release is played by a real `fedsilo` process whose package and protocol versions are set
before its command line runs (`speaking`: `python -c` that sets them, then calls the CLI), so
the installed code carries no hook for it.
"""

from __future__ import annotations

import queue
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from click.testing import CliRunner

from fedsilo import __version__
from fedsilo.coordinator.hub import PostedTask
from fedsilo.coordinator.jobs import COMPLETED
from fedsilo.ops.cli import main
from fedsilo.ops.provision import load_silo_kit
from fedsilo.wire.admin import LIST, REPLY, AdminReply, AdminRequest
from fedsilo.wire.control import JOIN, Control
from fedsilo.wire.envelope import seal
from fedsilo.wire.messages import PROTOCOL_VERSION, version_mismatch
from fedsilo.wire.payload import as_payload
from fedsilo.wire.tensors import decode_tensors, encode_tensors
from tests.adversarial.deviating import DeviatingCoordinator
from tests.deployment import (
    Consortium,
    free_port,
    metric,
    policy_document,
    provision,
    send_as_silo,
    wait_for,
    wait_until_ended,
)
from tests.test_admin import AdminServer, FakeBackend

NEWER, OLDER = PROTOCOL_VERSION + 1, PROTOCOL_VERSION - 1
NEWER_RELEASE, OLDER_RELEASE = "0.3.0", "0.0.9"
UPGRADE_THE_COORDINATOR = (
    f"upgrade the coordinator to a fedsilo release that speaks protocol {NEWER}"
)
UPGRADE_THE_ADMIN_CLI = (
    f"upgrade the operator's admin CLI to fedsilo {__version__} (protocol {PROTOCOL_VERSION})"
)
JOIN_TIMEOUT_S = 8  # how long a job waits for a silo that never joins (the refused one)

# A `fedsilo` command of another release: argv is `-c SPEAKING <release> <protocol> ARGS...`.
SPEAKING = """\
import sys
import fedsilo.ops.openmp  # first, before torch loads, as the CLI does
import fedsilo
fedsilo.__version__ = sys.argv.pop(1)
import fedsilo.wire.messages
fedsilo.wire.messages.PROTOCOL_VERSION = int(sys.argv.pop(1))
from fedsilo.ops.cli import main
main()
"""


def speaking(protocol: int, release: str, *args: str) -> list[str]:
    """The argv of `fedsilo ARGS` as fedsilo `release` speaking `protocol` would run it."""
    return [sys.executable, "-c", SPEAKING, release, str(protocol), *args]


def silo_start(config: Path) -> tuple[str, ...]:
    return ("silo", "start", "--config", str(config), "--poll-seconds", "0.5")


def upgrade_lines(output: str) -> list[str]:
    return [line for line in output.splitlines() if "upgrade" in line]


def names_both_sides(line: str, protocol: int, release: str) -> bool:
    return all(
        part in line
        for part in (
            f"protocol {protocol} (fedsilo {release})",
            f"protocol {PROTOCOL_VERSION} (fedsilo {__version__})",
        )
    )


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Consortium, int]]:
    """`fedsilo coordinator serve` of this release, up, and the port of its /metrics."""
    consortium = provision(tmp_path_factory.mktemp("versions"))
    metrics_port = free_port()
    consortium.start_serve(
        "--metrics-port", str(metrics_port), "--join-timeout", str(JOIN_TIMEOUT_S)
    )
    consortium.wait_for_log("coordinator", "serving mTLS gRPC")
    yield consortium, metrics_port
    consortium.stop_all()


# What the line says


def test_a_coordinator_tells_a_newer_silo_to_upgrade_the_coordinator() -> None:
    header = {"type": JOIN, "protocol": NEWER, "fedsilo": NEWER_RELEASE}
    assert version_mismatch(header, "silo hungary", "coordinator") == (
        f"silo hungary speaks protocol {NEWER} (fedsilo {NEWER_RELEASE}); this coordinator "
        f"speaks protocol {PROTOCOL_VERSION} (fedsilo {__version__}): upgrade the coordinator "
        f"to a fedsilo release that speaks protocol {NEWER}"
    )


def test_a_coordinator_tells_an_older_silo_to_upgrade_to_its_own_release() -> None:
    header = {"type": JOIN, "protocol": OLDER, "fedsilo": OLDER_RELEASE}
    assert version_mismatch(header, "silo hungary", "coordinator") == (
        f"silo hungary speaks protocol {OLDER} (fedsilo {OLDER_RELEASE}); this coordinator "
        f"speaks protocol {PROTOCOL_VERSION} (fedsilo {__version__}): upgrade silo hungary to "
        f"fedsilo {__version__} (protocol {PROTOCOL_VERSION})"
    )


def test_a_sender_that_names_no_release_is_fedsilo_0_1_0_or_older() -> None:
    header = {"type": JOIN, "protocol": OLDER}  # fedsilo 0.1.0 and older send no "fedsilo"
    line = version_mismatch(header, "silo hungary", "coordinator")
    assert line is not None
    assert f"silo hungary speaks protocol {OLDER} (fedsilo 0.1.0 or older);" in line


def test_a_silo_tells_of_a_newer_or_an_older_coordinator() -> None:
    coordinator = "the coordinator at 10.0.0.1:50051"
    newer = {"type": "task", "protocol": NEWER, "fedsilo": NEWER_RELEASE}
    assert version_mismatch(newer, coordinator, "silo") == (
        f"{coordinator} speaks protocol {NEWER} (fedsilo {NEWER_RELEASE}); this silo speaks "
        f"protocol {PROTOCOL_VERSION} (fedsilo {__version__}): upgrade the silo to a fedsilo "
        f"release that speaks protocol {NEWER}"
    )
    older = {"type": "idle", "protocol": OLDER, "fedsilo": OLDER_RELEASE}
    assert version_mismatch(older, coordinator, "silo") == (
        f"{coordinator} speaks protocol {OLDER} (fedsilo {OLDER_RELEASE}); this silo speaks "
        f"protocol {PROTOCOL_VERSION} (fedsilo {__version__}): upgrade {coordinator} to "
        f"fedsilo {__version__} (protocol {PROTOCOL_VERSION})"
    )


def test_any_release_of_the_same_protocol_is_no_mismatch() -> None:
    header = {"type": JOIN, "protocol": PROTOCOL_VERSION, "fedsilo": NEWER_RELEASE}
    assert version_mismatch(header, "silo hungary", "coordinator") is None


def test_every_join_and_admin_request_names_the_senders_protocol_and_release() -> None:
    for payload in (Control(JOIN).encode(), AdminRequest(LIST).encode()):
        _, header = decode_tensors(payload)
        assert (header["protocol"], header["fedsilo"]) == (PROTOCOL_VERSION, __version__)


def test_version_names_the_release_and_its_protocol() -> None:
    result = CliRunner().invoke(main, ["--version"])
    assert result.exit_code == 0
    assert result.output == f"fedsilo {__version__} (protocol {PROTOCOL_VERSION})\n"
    loaded = subprocess.run(
        [sys.executable, "-c", "import sys, fedsilo; print('torch' in sys.modules)"],
        capture_output=True,
        text=True,
        check=True,
    )
    assert loaded.stdout.strip() == "False"  # `import fedsilo` stays cheap


# Real processes


def test_a_newer_silo_stops_with_one_line_and_the_coordinator_serves_the_others(
    served: tuple[Consortium, int],
) -> None:
    consortium, metrics_port = served
    config = consortium.write_silo_config("silo-0")
    consortium.spawn("silo-0", speaking(NEWER, NEWER_RELEASE, *silo_start(config)))
    # another release of the same protocol takes part: package versions may differ
    same = silo_start(consortium.write_silo_config("silo-1"))
    consortium.spawn("silo-1", speaking(PROTOCOL_VERSION, NEWER_RELEASE, *same))
    consortium.start_silo("silo-2")

    assert consortium.wait("silo-0", timeout=30) == 1
    consortium.processes.pop("silo-0")  # it ended as it should; the others must keep running
    told = consortium.log("silo-0")
    assert "Traceback" not in told
    (line,) = upgrade_lines(told)
    assert names_both_sides(line, NEWER, NEWER_RELEASE), line
    refusal = line.removeprefix("Error: ")

    # The silo's retries (here one more join, as a restarted agent sends) are refused alike,
    # counted each time, and logged once.
    payload = encode_tensors({}, {"type": JOIN, "protocol": NEWER, "fedsilo": NEWER_RELEASE})
    kit = load_silo_kit(consortium.kits / "silos" / "silo-0")
    envelope = seal(
        payload,
        signing_key=kit.signing_key,
        sender="silo-0",
        deployment=kit.consortium,
        round=0,
        task_id="join/again",
    )
    with pytest.raises(grpc.RpcError) as again:
        send_as_silo(consortium, "silo-0", envelope, payload)
    assert again.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert again.value.details() == refusal
    assert consortium.log("coordinator").count(refusal) == 1
    assert metric(metrics_port, "fedsilo_rejected_messages_total", reason="protocol_version") >= 2

    # The coordinator serves the silos of its protocol: a job runs with them to the end.
    wait_for(
        lambda: metric(metrics_port, "fedsilo_silos_connected") == 2,
        60,
        "silo-1 and silo-2 connected",
        consortium,
    )
    job = consortium.submit(consortium.write_policy(policy_document(rounds=1)))
    ended = wait_until_ended(consortium, job, JOIN_TIMEOUT_S + 40)
    assert ended.status == COMPLETED, ended.error


@pytest.mark.parametrize(
    ("protocol", "release", "upgrade"),
    [
        (NEWER, NEWER_RELEASE, UPGRADE_THE_COORDINATOR),
        (OLDER, OLDER_RELEASE, UPGRADE_THE_ADMIN_CLI),
    ],
)
def test_an_admin_cli_of_another_protocol_gets_one_line_and_exit_status_1(
    served: tuple[Consortium, int], protocol: int, release: str, upgrade: str
) -> None:
    consortium, _ = served
    kit = str(consortium.kits / "operator")
    listed = subprocess.run(
        speaking(protocol, release, "job", "list", "--kit", kit),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert listed.returncode == 1
    assert listed.stdout == ""
    assert listed.stderr.count("\n") == 1, listed.stderr
    assert names_both_sides(listed.stderr, protocol, release), listed.stderr
    assert listed.stderr.startswith("Error: the operator's admin CLI speaks")
    assert listed.stderr.rstrip().endswith(upgrade)


def test_a_silo_answered_in_another_protocol_stops_with_one_line(consortium: Consortium) -> None:
    with DeviatingCoordinator(consortium, consortium.write_policy(policy_document())) as served:
        consortium.start_silo("silo-0")
        served.wait_until_accepted("silo-0", consortium)
        newer = encode_tensors(
            {}, {"type": "task", "protocol": NEWER, "fedsilo": NEWER_RELEASE, "task_id": "x"}
        )
        served.hub.post(PostedTask("silo-0", "x", 1, as_payload(newer)), queue.Queue())
        assert consortium.wait("silo-0", timeout=30) == 1
    told = consortium.log("silo-0")
    assert "Traceback" not in told
    (line,) = upgrade_lines(told)
    assert names_both_sides(line, NEWER, NEWER_RELEASE), line
    assert line == (
        f"Error: the coordinator at 127.0.0.1:{consortium.port} speaks protocol {NEWER} "
        f"(fedsilo {NEWER_RELEASE}); this silo speaks protocol {PROTOCOL_VERSION} "
        f"(fedsilo {__version__}): upgrade the silo to a fedsilo release that speaks "
        f"protocol {NEWER}"
    )


def test_an_admin_cli_answered_in_another_protocol_says_so_in_one_line(
    consortium: Consortium, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    newer = {"type": REPLY, "protocol": NEWER, "fedsilo": NEWER_RELEASE, "ok": True, "error": ""}
    monkeypatch.setattr(AdminReply, "encode", lambda reply: encode_tensors({}, newer))
    coordinator = AdminServer(consortium, FakeBackend(), tmp_path / "state.db")
    coordinator.start()
    try:
        listed = CliRunner().invoke(
            main, ["job", "list", "--kit", str(consortium.kits / "operator")]
        )
    finally:
        coordinator.stop()
    assert listed.exit_code == 1
    assert listed.output == (
        f"Error: the coordinator at 127.0.0.1:{consortium.port} speaks protocol {NEWER} "
        f"(fedsilo {NEWER_RELEASE}); this admin CLI speaks protocol {PROTOCOL_VERSION} "
        f"(fedsilo {__version__}): upgrade the admin CLI to a fedsilo release that speaks "
        f"protocol {NEWER}\n"
    )
