"""Faults in a real deployment: a silo and the coordinator killed mid-run, a silo revoked mid-run,
and what an attacker would send. A bad message is refused with a gRPC status naming the reason,
a coordinator log line and one more `fedsilo_rejected_messages_total{reason}`, and nothing of it
is applied; a certificate from another CA does not get past the TLS handshake."""

from __future__ import annotations

import json
import queue
import signal
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest
import torch

from fedsilo.coordinator.hub import PostedTask, SiloHub
from fedsilo.coordinator.transport import Reply
from fedsilo.ops.provision import SiloKit, load_silo_kit
from fedsilo.ops.simulate import load_silos, simulate
from fedsilo.policies.loading import parse_policy
from fedsilo.wire.control import ACK, JOIN, POLICY, PULL, Control, decode_control
from fedsilo.wire.envelope import EnvelopeVerifier, seal
from fedsilo.wire.framing import exchange_call, read_message, to_frames
from fedsilo.wire.tensors import decode_tensors
from tests.deployment import (
    SILOS,
    Consortium,
    free_port,
    job_metric,
    metric,
    policy_document,
    provision,
    wait_for,
)

# -- processes that die, and a silo that is revoked ---------------------------------------------


@pytest.fixture(scope="module")
def provisioned(tmp_path_factory: pytest.TempPathFactory) -> Consortium:
    return provision(tmp_path_factory.mktemp("consortium"))


@pytest.fixture
def consortium(provisioned: Consortium, tmp_path: Path) -> Iterator[Consortium]:
    running = provisioned.sharing_kits(tmp_path)
    yield running
    running.stop_all()


def test_a_silo_killed_mid_run_is_a_dropout_and_the_others_finish_the_run(
    consortium: Consortium,
) -> None:
    participants = {"min_silos": 2, "phase_timeout_s": 3}
    policy = consortium.write_policy(
        policy_document(rounds=4, eval_every=4, participants=participants)
    )
    metrics_port = free_port()
    # Lingering keeps /metrics up after the last round, however slowly this machine scrapes.
    consortium.start_coordinator(
        policy, "--metrics-port", str(metrics_port), "--linger-seconds", "120"
    )
    for silo in SILOS:
        consortium.start_silo(silo)

    # round 1 has ended (completed, or failed when a loaded machine misses the 3 s deadline
    # with every silo's first task): the deployment is running, and silo-2 is killed now
    consortium.wait_for_log("coordinator", "round 1/4 ", timeout=120, interval=0.02)
    consortium.kill("silo-2")
    wait_for(
        lambda: job_metric(metrics_port, "fedsilo_dropouts_total", silo="silo-2") >= 1,
        30,
        "a dropout of silo-2 in /metrics",
        consortium,
    )

    for silo in ("silo-0", "silo-1"):
        assert consortium.wait(silo, timeout=60) == 0, consortium.log(silo)
    consortium.wait_for_log("coordinator", "round 4/4 completed", timeout=60)
    consortium.processes["coordinator"].terminate()
    assert consortium.wait("coordinator", timeout=30) == 0, consortium.log("coordinator")
    log = consortium.log("coordinator")
    assert "'silo-2': 'no reply before the deadline'" in log


SUPERFED = {"name": "superfed", "start_fraction": 0.25, "ortho_nu": 1.0}  # mixing from round 3
# killed in stage A (the barycenter), resumed through stage B (FedAvg on the mapped records)
FEDDRO = {
    "name": "feddro",
    "release_point_clouds": True,
    "barycenter_rounds": 4,
    "support_points": 5,
}


@pytest.mark.parametrize(
    "algorithm",
    [{"name": "fedavg"}, SUPERFED, FEDDRO],
    ids=["fedavg", "superfed", "feddro"],
)
def test_a_coordinator_killed_mid_run_resumes_from_its_state_and_ends_with_the_same_model(
    consortium: Consortium, algorithm: dict
) -> None:
    """SuPerFed too: its silos keep their local models on disk by round, so the round the
    restarted coordinator runs again starts from the local models it started from the first
    time, and the personalised models end as in an uninterrupted run."""
    document = policy_document(rounds=8, eval_every=8, algorithm=algorithm)
    policy = consortium.write_policy(document)
    command = ("--metrics-port", str(free_port()), "--out", "results")
    consortium.start_coordinator(policy, *command)
    for silo in SILOS:
        consortium.start_silo(silo)

    consortium.wait_for_log("coordinator", "round 2/8 completed", timeout=120, interval=0.02)
    consortium.kill("coordinator")
    consortium.start_coordinator(policy, *command, name="restarted")  # the same command

    for silo in SILOS:
        assert consortium.wait(silo, timeout=120) == 0, consortium.log(silo)
        assert "coordinator unreachable (UNAVAILABLE); retrying" in consortium.log(silo)
        assert "joining again" in consortium.log(silo)
    assert consortium.wait("restarted", timeout=30) == 0, consortium.log("restarted")
    killed, restarted = consortium.log("coordinator"), consortium.log("restarted")
    assert "round 2/8 completed" in killed and "round 8/8" not in killed
    assert "round 1/8" not in restarted and "round 2/8" not in restarted
    assert "round 8/8 completed" in restarted and "dropped" not in restarted

    tensors, _ = decode_tensors(
        (consortium.root / "results" / "final_model.safetensors").read_bytes()
    )
    expected_policy = parse_policy(document)
    expected = simulate(expected_policy, load_silos(expected_policy, None)).history
    assert torch.equal(tensors["model"], expected.state.model)
    history = json.loads((consortium.root / "results" / "history.json").read_text())
    for silo, metrics in expected.final.evaluation.items():
        assert history["final"]["evaluation"][silo] == pytest.approx(metrics), silo


def test_a_silo_revoked_mid_run_is_refused_and_the_others_finish_without_waiting_for_it(
    consortium: Consortium,
) -> None:
    participants = {"min_silos": 2, "phase_timeout_s": 60}  # waiting it out would fail the test
    policy = consortium.write_policy(
        policy_document(rounds=3, eval_every=3, participants=participants)
    )
    metrics_port = free_port()
    consortium.start_coordinator(policy, "--metrics-port", str(metrics_port))
    consortium.start_silo("silo-2")
    consortium.wait_for_log("coordinator", "silo silo-2 accepted")
    consortium.send_signal("silo-2", signal.SIGSTOP)  # it holds its first task and never answers
    for silo in ("silo-0", "silo-1"):
        consortium.start_silo(silo)
    for silo in ("silo-0", "silo-1"):
        consortium.wait_for_log("coordinator", f"silo {silo} accepted")

    consortium.revoke("silo-2")
    wait_for(
        lambda: metric(metrics_port, "fedsilo_silo_status", silo="silo-2", status="revoked"),
        10,
        "silo-2 revoked in /metrics",
        consortium,
    )
    consortium.send_signal("silo-2", signal.SIGCONT)
    wait_for(
        lambda: metric(metrics_port, "fedsilo_rejected_messages_total", reason="revoked") >= 1,
        10,
        "a message refused as revoked in /metrics",
    )

    assert consortium.wait("silo-2", timeout=30) != 0
    assert "the coordinator refuses this silo: revoked" in consortium.log("silo-2")
    for silo in ("silo-0", "silo-1"):
        assert consortium.wait(silo, timeout=30) == 0, consortium.log(silo)
    assert consortium.wait("coordinator", timeout=30) == 0, consortium.log("coordinator")
    log = consortium.log("coordinator")
    assert "round 3/3 completed" in log and " failed in " not in log
    assert "rejected a message from silo-2: revoked: silo 'silo-2' is revoked" in log
    assert "dropped {'silo-2': 'revoked'}" in log


# -- the hub: whose results count -----------------------------------------------------------------


def accepting_hub() -> SiloHub:
    hub = SiloHub(list(SILOS))
    for silo in SILOS:
        hub.accept(silo)
    return hub


def test_a_result_for_another_silos_task_is_refused_and_that_task_still_waits() -> None:
    hub, replies = accepting_hub(), queue.Queue()
    hub.post(PostedTask("silo-1", "r1/train/silo-1", 1, b"task"), replies)

    assert not hub.deliver("silo-0", "r1/train/silo-1", b"forged")
    assert hub.deliver("silo-1", "r1/train/silo-1", b"genuine")
    assert replies.get_nowait() == Reply("silo-1", "r1/train/silo-1", b"genuine")


def test_revoking_a_silo_fails_its_waiting_and_later_tasks_at_once() -> None:
    hub, replies = accepting_hub(), queue.Queue()
    hub.post(PostedTask("silo-2", "r1/train/silo-2", 1, b"task"), replies)

    hub.revoke("silo-2")
    hub.post(PostedTask("silo-2", "r2/train/silo-2", 2, b"task"), replies)

    assert replies.get_nowait() == Reply("silo-2", "r1/train/silo-2", None, "revoked")
    assert replies.get_nowait() == Reply("silo-2", "r2/train/silo-2", None, "revoked")
    assert hub.next_task("silo-2", timeout_s=0) is None
    assert not hub.deliver("silo-2", "r1/train/silo-2", b"late")


def test_a_silo_revoked_while_the_coordinator_waits_for_members_is_no_longer_awaited() -> None:
    hub = SiloHub(list(SILOS))
    hub.accept("silo-0")
    hub.accept("silo-1")
    with ThreadPoolExecutor(max_workers=1) as pool:
        members = pool.submit(hub.wait_for_members, len(SILOS), 30)
        hub.revoke("silo-2")
        assert members.result(timeout=5) == ["silo-0", "silo-1"]


# -- messages an attacker sends, in process, to a coordinator waiting for its silos ---------------


@dataclass
class Coordinator:
    """A running coordinator process and what it exposes: its /metrics and its log."""

    consortium: Consortium
    metrics_port: int

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.consortium.port}"

    def log(self) -> str:
        return self.consortium.log("coordinator")

    def rejected(self, reason: str) -> float:
        return metric(self.metrics_port, "fedsilo_rejected_messages_total", reason=reason)

    def bytes_from(self, silo: str) -> float:
        return metric(self.metrics_port, "fedsilo_bytes_total", direction="from_silo", silo=silo)


@dataclass
class SiloChannel:
    """An in-process mTLS client holding one silo's kit: it sends genuine or doctored frames."""

    kit: SiloKit
    channel: grpc.Channel

    @classmethod
    def open(cls, kit_folder: Path, address: str, trusted_ca: Path | None = None) -> SiloChannel:
        """A channel to `address` with the kit's certificate, trusting `trusted_ca` (default:
        the kit's own CA) for the coordinator's certificate."""
        kit = load_silo_kit(kit_folder)
        credentials = grpc.ssl_channel_credentials(
            (trusted_ca or kit.tls.ca_certificate).read_bytes(),
            kit.tls.private_key.read_bytes(),
            kit.tls.certificate.read_bytes(),
        )
        return cls(kit, grpc.secure_channel(address, credentials))

    def frames(self, payload: bytes, label: str) -> list[bytes]:
        """A genuine message, serialized: a fresh envelope signed with the kit's key, then the
        chunks."""
        envelope = seal(
            payload,
            signing_key=self.kit.signing_key,
            sender=self.kit.name,
            deployment=self.kit.consortium,
            round=0,
            task_id=f"{label}/{uuid.uuid4().hex}",
        )
        return list(to_frames(envelope, payload))

    def send(self, frames: Iterable[bytes]) -> Control:
        """The coordinator's verified reply to `frames`; grpc.RpcError when it refuses them."""
        replies = exchange_call(self.channel)(iter(frames), timeout=10)
        coordinator = EnvelopeVerifier(
            self.kit.consortium, {"coordinator": self.kit.coordinator_verify_key}
        )
        return decode_control(read_message(replies, coordinator, max_bytes=1 << 20)[1])

    def send_raw(self, messages: list[bytes]) -> list[bytes]:
        """Bytes on the wire as gRPC messages, whether or not they parse as a Frame."""
        return list(exchange_call(self.channel)(iter(messages), timeout=10))


@pytest.fixture(scope="module")
def coordinator(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Coordinator]:
    """A coordinator that takes payloads of at most 1 MiB, waiting for silos to join."""
    consortium = provision(tmp_path_factory.mktemp("attacked"))
    metrics_port = free_port()
    consortium.start_coordinator(
        consortium.write_policy(policy_document()),
        "--metrics-port",
        str(metrics_port),
        "--max-payload-mb",
        "1",
        join_timeout_s=600,
    )
    try:
        consortium.wait_for_log("coordinator", "serving mTLS gRPC")
        yield Coordinator(consortium, metrics_port)
        consortium.processes["coordinator"].terminate()
        consortium.wait("coordinator", timeout=30)
    finally:
        consortium.stop_all()


@pytest.fixture(scope="module")
def silo(coordinator: Coordinator) -> Iterator[SiloChannel]:
    """silo-0 of the attacked consortium, speaking from this process."""
    kit_folder = coordinator.consortium.kits / "silos" / "silo-0"
    channel = SiloChannel.open(kit_folder, coordinator.address)
    yield channel
    channel.channel.close()


def refusal(coordinator: Coordinator, reason: str, send: Callable[[], object]) -> grpc.RpcError:
    """Run `send`, which must be refused; check that the coordinator counted and logged the
    refusal under `reason` and took nothing from silo-0."""
    count, taken, seen = (
        coordinator.rejected(reason),
        coordinator.bytes_from("silo-0"),
        len(coordinator.log()),
    )
    with pytest.raises(grpc.RpcError) as refused:
        send()
    line = f"rejected a message from silo-0: {reason}: "
    wait_for(lambda: line in coordinator.log()[seen:], 10, f"a log line {line!r}")
    wait_for(
        lambda: coordinator.rejected(reason) == count + 1, 10, f"one more {reason} in /metrics"
    )
    assert coordinator.bytes_from("silo-0") == taken
    return refused.value


def test_a_silo_certificate_from_another_ca_fails_the_tls_handshake(
    coordinator: Coordinator, silo: SiloChannel, tmp_path: Path
) -> None:
    other_ca = provision(tmp_path)  # the same silo names, its own CA
    impostor = SiloChannel.open(
        other_ca.kits / "silos" / "silo-0", coordinator.address, silo.kit.tls.ca_certificate
    )
    seen, taken = len(coordinator.log()), coordinator.bytes_from("silo-0")
    try:
        with pytest.raises(grpc.RpcError) as refused:
            impostor.send(impostor.frames(Control(JOIN).encode(), JOIN))
    finally:
        impostor.channel.close()

    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    wait_for(lambda: "Handshake failed" in coordinator.log()[seen:], 10, "a handshake log line")
    assert "CERTIFICATE_VERIFY_FAILED" in coordinator.log()[seen:]
    assert "joined" not in coordinator.log()[seen:]
    assert coordinator.bytes_from("silo-0") == taken
    assert silo.send(silo.frames(Control(JOIN).encode(), JOIN)).type == POLICY  # still serving


def test_a_replayed_envelope_is_answered_once_then_refused_as_a_replay(
    coordinator: Coordinator, silo: SiloChannel
) -> None:
    join = silo.frames(Control(JOIN).encode(), JOIN)
    assert silo.send(join).type == POLICY

    refused = refusal(coordinator, "replay", lambda: silo.send(join))

    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details().startswith("replay: ")


def test_a_flipped_payload_byte_is_refused_as_corrupted_and_uses_up_nothing(
    coordinator: Coordinator, silo: SiloChannel
) -> None:
    envelope, chunk = silo.frames(Control(PULL).encode(), PULL)
    flipped = bytearray(chunk)  # the frame: a tag, the chunk's length, then the chunk
    flipped[len(flipped) // 2] ^= 0x01

    refused = refusal(coordinator, "corrupted", lambda: silo.send([envelope, bytes(flipped)]))

    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details().startswith("corrupted: ")
    assert silo.send([envelope, chunk]).type == ACK  # the genuine message is still answered


def test_a_payload_over_the_limit_is_refused_on_its_envelope_before_any_chunk(
    coordinator: Coordinator, silo: SiloChannel
) -> None:
    envelope = silo.frames(bytes(2 << 20), "result")[0]  # announces 2 MiB; the limit is 1 MiB
    answered = threading.Event()

    def announcement_only() -> Iterator[bytes]:
        yield envelope
        answered.wait(timeout=10)  # no chunk ever follows: only the envelope can be refused

    try:
        refused = refusal(coordinator, "oversized", lambda: silo.send(announcement_only()))
    finally:
        answered.set()

    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details().startswith("oversized: ")
    assert "exceeds the limit of 1048576" in refused.details()


def test_bytes_that_are_not_a_frame_are_refused_and_the_coordinator_keeps_serving(
    coordinator: Coordinator, silo: SiloChannel
) -> None:
    refused = refusal(coordinator, "malformed", lambda: silo.send_raw([b"\xff\xfenot a Frame"]))

    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details().startswith("malformed: a frame that is not a fedsilo.v1.Frame")
    assert silo.send(silo.frames(Control(JOIN).encode(), JOIN)).type == POLICY


def test_a_message_starting_with_a_chunk_is_refused_as_malformed(
    coordinator: Coordinator, silo: SiloChannel
) -> None:
    _, chunk = silo.frames(Control(PULL).encode(), PULL)

    refused = refusal(coordinator, "malformed", lambda: silo.send([chunk]))

    assert refused.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert refused.details() == "malformed: a message must start with its envelope"
