"""A request of one chunk crosses as one gRPC message (`ExchangeOne`, wire/framing.py): the silo's
connection sends it so, the coordinator's real service reads it through the same checks as a
streamed one (signature, sender, replay memory), and a message taken one way is refused when it
is replayed either way. A silo whose coordinator has no `ExchangeOne` (one from before it)
sends frames instead, and a request larger than a chunk is always streamed."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path

import grpc
import pytest

from fedsilo.ops.coordinator_process import server_certificate
from fedsilo.ops.provision import load_coordinator_kit, load_silo_kit
from fedsilo.ops.server_credentials import reloading_server_credentials
from fedsilo.ops.silo_process import silo_identity
from fedsilo.privacy.certificate_files import TlsFileWatch
from fedsilo.silo.channel import ChannelSettings
from fedsilo.silo.client import CoordinatorConnection
from fedsilo.silo.proxy import Route
from fedsilo.wire import framing
from fedsilo.wire.chunks import DEFAULT_CHUNK_BYTES
from fedsilo.wire.control import ACK, JOIN, POLICY, REFUSE, Control, decode_control
from fedsilo.wire.envelope import Envelope, seal
from fedsilo.wire.framing import SILO_SERVICE, exchange_call
from tests.adversarial.deviating import DeviatingCoordinator
from tests.deployment import (
    Consortium,
    policy_document,
    provision,
    send_as_silo,
    silo_credentials,
)

SILO = "silo-0"


@pytest.fixture
def consortium(tmp_path: Path) -> Consortium:
    return provision(tmp_path)


@pytest.fixture
def coordinator(consortium: Consortium) -> Iterator[DeviatingCoordinator]:
    with DeviatingCoordinator(consortium, consortium.write_policy(policy_document())) as served:
        yield served


@pytest.fixture
def whole_messages(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The number of frames of every request the coordinator read as one message."""
    read: list[int] = []
    frames_of = framing.frames_of

    def counted(message: bytes) -> Iterator[bytes | memoryview]:
        frames = list(frames_of(message))
        read.append(len(frames))
        return iter(frames)

    monkeypatch.setattr(framing, "frames_of", counted)
    return read


def connection(consortium: Consortium, address: str | None = None) -> CoordinatorConnection:
    """The silo's connection to its coordinator, as `fedsilo silo start` opens it."""
    kit = load_silo_kit(consortium.kits / "silos" / SILO)
    log = logging.getLogger("test")
    settings = ChannelSettings(
        address=address or kit.coordinator_address,
        tls=TlsFileWatch(
            kit.tls.ca_certificate, kit.tls.certificate, kit.tls.private_key, kit.name, log
        ),
        route=Route(None, "a test"),
        poll_seconds=0.5,
    )
    return CoordinatorConnection(settings, silo_identity(kit), threading.Event())


def sealed(consortium: Consortium, payload: bytes, task_id: str, signer: str = SILO) -> Envelope:
    """`payload` in an envelope signed with `signer`'s key, as `signer`."""
    kit = load_silo_kit(consortium.kits / "silos" / signer)
    return seal(
        payload,
        signing_key=kit.signing_key,
        sender=signer,
        deployment=kit.consortium,
        round=0,
        task_id=task_id,
    )


def test_a_silos_small_request_crosses_as_one_message(
    consortium: Consortium, coordinator: DeviatingCoordinator, whole_messages: list[int]
) -> None:
    silo = connection(consortium)
    try:
        reply = decode_control(silo.exchange(Control(JOIN).encode(), "join"))
    finally:
        silo.close()
    assert reply.type == POLICY
    assert whole_messages == [2], "the join did not cross as one message of its two frames"


def test_a_request_larger_than_a_chunk_is_streamed(
    consortium: Consortium, coordinator: DeviatingCoordinator, whole_messages: list[int]
) -> None:
    refusal = Control(REFUSE, {"reason": "x" * DEFAULT_CHUNK_BYTES}).encode()
    silo = connection(consortium)
    try:
        reply = decode_control(silo.exchange(refusal, "refuse"))
    finally:
        silo.close()
    assert (reply.type, reply.get("accepted")) == (ACK, True)
    assert whole_messages == []


@pytest.mark.parametrize(("first", "again"), [(True, True), (True, False), (False, True)])
def test_a_message_taken_one_way_is_refused_when_replayed_either_way(
    consortium: Consortium, coordinator: DeviatingCoordinator, first: bool, again: bool
) -> None:
    payload = Control(JOIN).encode()
    captured = sealed(consortium, payload, "join/captured")
    reply = send_as_silo(consortium, SILO, captured, payload, whole=first)
    assert decode_control(reply).type == POLICY
    with pytest.raises(grpc.RpcError) as refused:
        send_as_silo(consortium, SILO, captured, payload, whole=again)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "replay" in (refused.value.details() or "")


def test_a_message_sent_whole_with_another_silos_signature_is_refused(
    consortium: Consortium, coordinator: DeviatingCoordinator
) -> None:
    """silo-0's TLS identity sending a message signed as silo-1: the sender check holds for a
    message sent whole as for one streamed."""
    payload = Control(JOIN).encode()
    forged = sealed(consortium, payload, "join/forged", signer="silo-1")
    with pytest.raises(grpc.RpcError) as refused:
        send_as_silo(consortium, SILO, forged, payload, whole=True)
    assert refused.value.code() == grpc.StatusCode.PERMISSION_DENIED


def test_a_silo_sends_frames_to_a_coordinator_without_exchange_one(
    consortium: Consortium, coordinator: DeviatingCoordinator
) -> None:
    """A coordinator from before `ExchangeOne`: only `Exchange` served (here, a server that
    forwards it to the real one). The silo falls back to frames, and stays there."""
    kit = load_silo_kit(consortium.kits / "silos" / SILO)
    real = grpc.secure_channel(kit.coordinator_address, silo_credentials(kit))
    forwarded: list[int] = []

    def exchange(frames: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[bytes]:
        forwarded.append(1)
        yield from exchange_call(real)(frames, timeout=30)

    coordinator_kit = load_coordinator_kit(consortium.kits / "coordinator")
    old = grpc.server(futures.ThreadPoolExecutor(max_workers=4))
    old.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                SILO_SERVICE, {"Exchange": grpc.stream_stream_rpc_method_handler(exchange)}
            )
        ]
    )
    credentials = reloading_server_credentials(server_certificate(coordinator_kit))
    port = old.add_secure_port("127.0.0.1:0", credentials)
    old.start()
    silo = connection(consortium, f"127.0.0.1:{port}")
    try:
        first = decode_control(silo.exchange(Control(JOIN).encode(), "join"))
        second = decode_control(silo.exchange(Control(JOIN).encode(), "join"))
    finally:
        silo.close()
        old.stop(grace=None)
        real.close()
    assert first.type == second.type == POLICY
    assert forwarded == [1, 1]


def test_a_whole_message_beyond_grpcs_limit_is_refused_before_it_is_read(
    consortium: Consortium, coordinator: DeviatingCoordinator, whole_messages: list[int]
) -> None:
    """What the coordinator buffers of a message before its envelope is checked stays bounded
    sent whole as streamed: gRPC refuses a message over its 4 MiB limit unread."""
    payload = Control(REFUSE, {"reason": "x" * (5 << 20)}).encode()
    envelope = sealed(consortium, payload, "refuse/too-large")
    with pytest.raises(grpc.RpcError) as refused:
        send_as_silo(consortium, SILO, envelope, payload, whole=True)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert whole_messages == []
