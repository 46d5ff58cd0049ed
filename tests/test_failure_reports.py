"""Failures are reported, not waited out (issue 19, item 6).

A silo that cannot prepare a job refuses the policy with the reason (one short line, never
data); the coordinator logs it and counts the silo as refused at once, so the join wait ends as
soon as every silo has answered, and the silo's waiting tasks fail with the reason. A task that
fails outside its handler is answered with an error result naming the task. None of it ends
the silo in a Python traceback.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from nacl.encoding import HexEncoder
from nacl.signing import SigningKey

from fedsilo.coordinator.hub import PostedTask, SiloHub
from fedsilo.coordinator.service import CoordinatorService, SignedPolicy
from fedsilo.coordinator.transport import Reply
from fedsilo.ops import silo_process
from fedsilo.ops.metrics import CoordinatorMetrics, SiloMetrics
from fedsilo.ops.provision import load_silo_kit
from fedsilo.privacy.ledger import LedgerError
from fedsilo.silo.client import (
    MAX_REASON_CHARS,
    PolicyRefused,
    SiloClient,
    SiloIdentity,
    failure_reason,
)
from fedsilo.silo.config import load_silo_config
from fedsilo.silo.data import DataError
from fedsilo.wire.control import ACCEPT, ACK, JOIN, POLICY, REFUSE, Control, decode_control
from fedsilo.wire.envelope import EnvelopeVerifier
from fedsilo.wire.messages import STATUS_ERROR, TaskMessage, TaskResult
from fedsilo.wire.tasks import EvaluateTask
from tests.deployment import policy_document, provision

SILOS = ("silo-0", "silo-1", "silo-2")
POLICY_TEXT = (
    Path(__file__).parents[1] / "policies" / "examples" / "heart-fedavg.yaml"
).read_text()


def service(hub: SiloHub) -> CoordinatorService:
    return CoordinatorService(
        "test-job",
        hub,
        EnvelopeVerifier("test-job", {}),
        SigningKey.generate(),
        SignedPolicy(POLICY_TEXT, "", "digest"),
        CoordinatorMetrics(deployment="test-job"),
        max_payload_bytes=1 << 20,
        poll_seconds=0.1,
    )


def refusal(reason: str) -> bytes:
    return Control(REFUSE, {"reason": reason}).encode()


# -- the coordinator's side --------------------------------------------------------------------


def test_a_refusal_ends_the_join_wait_at_once_and_the_coordinator_logs_its_reason(
    caplog: pytest.LogCaptureFixture,
) -> None:
    hub = SiloHub(list(SILOS))
    coordinator = service(hub)
    with ThreadPoolExecutor(1) as pool:
        started = time.monotonic()
        members = pool.submit(hub.wait_for_members, len(SILOS), 60)
        hub.accept("silo-0")
        hub.accept("silo-1")
        with caplog.at_level(logging.WARNING, logger="fedsilo.coordinator"):
            reason = "cannot work under this policy: data.source.path: data file not found"
            refused = refusal(reason)
            ack = decode_control(coordinator._answer("silo-2", refused, decode_control(refused)))
        assert members.result(timeout=10) == ["silo-0", "silo-1"]
    assert time.monotonic() - started < 5  # not the 60 s join timeout
    assert ack.type == ACK and ack.get("accepted")
    assert hub.refused == {"silo-2": reason}
    assert f"silo silo-2 refused the policy: {reason}" in caplog.text


def test_a_silo_that_refuses_mid_job_fails_its_waiting_and_later_tasks_with_its_reason() -> None:
    hub = SiloHub(list(SILOS))
    for silo in SILOS:
        hub.accept(silo)
    replies: queue.Queue[Reply] = queue.Queue()
    hub.post(PostedTask("silo-1", "r1/train/silo-1", 1, b"task"), replies)
    hub.refuse("silo-1", "cannot work under this policy: the device cuda is unavailable")
    hub.post(PostedTask("silo-1", "r2/train/silo-1", 2, b"task"), replies)
    failures = [replies.get(timeout=1), replies.get(timeout=1)]
    assert [r.task_id for r in failures] == ["r1/train/silo-1", "r2/train/silo-1"]
    assert all(r.payload is None for r in failures)
    assert all(
        r.failure == "refused: cannot work under this policy: the device cuda is unavailable"
        for r in failures
    )
    assert hub.next_task("silo-1", 0.01) is None  # nothing left queued for it


# -- the silo's side ---------------------------------------------------------------------------


@dataclass
class FakeCoordinator:
    """A connection answering like the coordinator: the signed policy for a join, an ack for
    anything else; it keeps every control message and result the silo sent."""

    operator: SigningKey = field(default_factory=SigningKey.generate)
    stop: threading.Event = field(default_factory=threading.Event)
    sent: list[tuple[str, bytes]] = field(default_factory=list)
    policy_fields: dict[str, object] = field(default_factory=dict)  # more of the POLICY's

    @property
    def identity(self) -> SiloIdentity:
        key = SigningKey.generate()
        return SiloIdentity("silo-0", "test-job", key, key.verify_key)

    def exchange(self, payload: bytes, label: str, round_no: int = 0) -> bytes:
        self.sent.append((label, payload))
        if label == JOIN:
            signature = HexEncoder.encode(self.operator.sign(POLICY_TEXT.encode()).signature)
            fields = {
                "deployment": "test-job",
                "policy": POLICY_TEXT,
                "signature": signature.decode(),
                **self.policy_fields,
            }
            return Control(POLICY, fields).encode()
        return Control(ACK, {"accepted": True, "reason": ""}).encode()

    def control(self, kind: str, fields: dict[str, object] | None = None) -> bytes:
        return Control(kind, fields or {}).encode()

    def refusal(self) -> str:
        (refused,) = [decode_control(p) for label, p in self.sent if label == REFUSE]
        return str(refused.get("reason"))


def client(coordinator: FakeCoordinator, start_agent) -> SiloClient:
    return SiloClient(
        coordinator,  # type: ignore[arg-type]
        coordinator.operator.verify_key,
        check_policy=lambda policy, digest: [],
        start_agent=start_agent,
    )


def failing(exc: Exception):
    def start_agent(policy, digest, attempt, roster):
        raise exc

    return start_agent


@pytest.mark.parametrize(
    ("raised", "reason"),
    [
        (DataError("data.source.path: data file not found: records.csv"), "data.source.path"),
        (RuntimeError("CUDA error: no CUDA-capable device is detected"), "RuntimeError: CUDA"),
        (KeyError("hidden"), "KeyError: 'hidden'"),
    ],
)
def test_a_silo_that_cannot_prepare_refuses_the_policy_with_the_reason_and_never_accepts(
    raised: Exception, reason: str
) -> None:
    coordinator = FakeCoordinator()
    with pytest.raises(PolicyRefused, match="refused the policy"):
        client(coordinator, failing(raised)).join()
    assert coordinator.refusal().startswith("cannot work under this policy: ")
    assert reason in coordinator.refusal()
    assert ACCEPT not in [label for label, _ in coordinator.sent]


def test_the_reason_sent_is_one_short_line() -> None:
    long = ValueError("column 'age': " + "x" * 1000 + "\nrow 17: 54,yes,130")
    reason = failure_reason(long)
    assert len(reason) <= MAX_REASON_CHARS and "\n" not in reason and "row 17" not in reason
    assert reason.startswith("column 'age': ")


@pytest.mark.parametrize(
    "raised",
    [
        FileNotFoundError(2, "No such file or directory", "/srv/hospital/exports/heart.csv"),
        DataError("data.path /srv/hospital/exports/heart.csv: no column 'age'"),
        ValueError(r"data.path C:\hospital\exports\heart.csv: no column 'age'"),
    ],
)
def test_a_refusal_names_a_file_on_the_site_by_its_name_only(raised: Exception) -> None:
    """Where a site keeps its data is its own: the coordinator learns the file's name."""
    coordinator = FakeCoordinator()
    with pytest.raises(PolicyRefused):
        client(coordinator, failing(raised)).join()
    assert "heart.csv" in coordinator.refusal()
    assert "hospital" not in coordinator.refusal() and "exports" not in coordinator.refusal()


def test_a_task_failing_outside_its_handler_is_answered_with_an_error_naming_the_task() -> None:
    coordinator = FakeCoordinator()
    task = TaskMessage("job/r1/evaluate/silo-0", 1, "evaluate", "silo-0", EvaluateTask())

    def booking_fails(payload: bytes) -> bytes:
        raise LedgerError("deployment 'job' is booked at delta None, this task asks 1e-05")

    client(coordinator, failing(AssertionError("not prepared again")))._answer(
        task.encode(), booking_fails
    )
    ((label, sent),) = coordinator.sent
    result = TaskResult.decode(sent)
    assert label == task.task_id
    assert (result.task_id, result.silo, result.status) == (task.task_id, "silo-0", STATUS_ERROR)
    assert result.error == "deployment 'job' is booked at delta None, this task asks 1e-05"


def test_a_sites_missing_data_file_becomes_the_refusal_text(tmp_path: Path) -> None:
    """The silo process's own preparation (`silo start`'s), with records.csv missing."""
    consortium = provision(tmp_path, SILOS)
    site = tmp_path / "site"
    site.mkdir()
    config_path = site / "silo.yaml"
    source = {"source": "csv", "path": "records.csv", "target": "outcome"}
    kit_path = str(consortium.kits / "silos" / "silo-0")
    config_path.write_text(
        yaml.safe_dump({"version": 1, "kit": kit_path, "data": {"source": source}})
    )
    config = load_silo_config(config_path)
    kit = load_silo_kit(config.kit_path(config_path))
    coordinator = FakeCoordinator()

    def start_agent(policy, digest, attempt, roster):
        return silo_process._start_agent(
            config, config_path, kit, policy, digest, attempt, SiloMetrics(), roster
        )

    with pytest.raises(PolicyRefused, match="records.csv"):
        client(coordinator, start_agent).join()
    assert "data.source.path" in coordinator.refusal()
    assert "records.csv" in coordinator.refusal()


def test_a_silo_process_missing_its_data_file_stops_at_start_naming_it(tmp_path: Path) -> None:
    """Real processes: both silos of a two-silo consortium lack their data file; each agent
    stops at start naming the file (no job could read it), and the coordinator's job fails at
    its join timeout naming both as gone."""
    consortium = provision(tmp_path, ("silo-0", "silo-1"))
    try:
        policy = consortium.write_policy(policy_document(rounds=1))
        consortium.start_coordinator(policy, "--heartbeat-window", "2", join_timeout_s=15)
        for silo in ("silo-0", "silo-1"):
            config = tmp_path / silo / "silo.yaml"
            config.parent.mkdir()
            source = {"source": "csv", "path": "records.csv", "target": "outcome"}
            kit = str(consortium.kits / "silos" / silo)
            config.write_text(
                yaml.safe_dump({"version": 1, "kit": kit, "data": {"source": source}})
            )
            consortium.start_silo(silo, config)
        for silo in ("silo-0", "silo-1"):
            assert consortium.wait(silo, timeout=60) == 1
            said = consortium.log(silo)
            assert "records.csv" in said and "Traceback" not in said, said
            assert "reaches the coordinator" not in said  # it never dialled
        assert consortium.wait("coordinator", timeout=90) == 1
        log = consortium.log("coordinator")
        assert "gone (no heartbeat for 2s): silo-0, silo-1" in log, log
        assert "Traceback" not in log
    finally:
        consortium.stop_all()
