"""Roster changes after provisioning: `fedsilo consortium add-silo` issues one more silo kit
from the same CA and operator key and enrols it in the coordinator kit's roster, touching no
other kit, and refusing a name or folder that exists with one message and nothing written; a
revoked silo is sent no more tasks and shows as revoked, never as a dropout; and
`fedsilo_silos_connected` counts only silos heard from lately (or busy with a task)."""

from __future__ import annotations

import hashlib
import queue
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from fedsilo.coordinator.engine import RoundEngine, RoundRecord
from fedsilo.coordinator.grpc_transport import GrpcTransport
from fedsilo.coordinator.hub import PostedTask, SiloHub
from fedsilo.coordinator.state import StateStore
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.ops.cli import main
from fedsilo.ops.coordinator_process import ConnectionGauge, revoke
from fedsilo.ops.metrics import CoordinatorMetrics
from fedsilo.ops.provision import load_coordinator_kit, load_silo_kit, provision
from fedsilo.ops.status import deployment_status
from fedsilo.policies.consortium import parse_consortium
from fedsilo.policies.loading import parse_policy
from fedsilo.privacy.certificates import certificate_fingerprint, verify_issued_by
from fedsilo.privacy.identity import public_key_hex
from fedsilo.wire.payload import as_payload
from tests import deployment
from tests.fakes import constant_silo

SILOS = ["cleveland", "hungary", "va"]
CONSORTIUM = {
    "consortium": "heart-consortium",
    "coordinator": {"address": "127.0.0.1:50051"},
    "silos": [{"name": name} for name in SILOS],
}


@pytest.fixture
def kits(tmp_path: Path) -> Path:
    (tmp_path / "consortium.yaml").write_text(yaml.safe_dump(CONSORTIUM))
    provision(parse_consortium(CONSORTIUM), tmp_path / "kits")
    return tmp_path / "kits"


def add_silo(kits: Path, name: str, operator: Path | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(
        main,
        [
            "consortium",
            "add-silo",
            name,
            "--ca-kit",
            str(operator or kits / "operator"),
            "--coordinator-kit",
            str(kits / "coordinator"),
            "--consortium",
            str(kits.parent / "consortium.yaml"),
            "--out",
            str(kits),
        ],
    )
    return result.exit_code, result.output


def fingerprints(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def test_add_silo_issues_a_kit_from_the_same_ca_and_touches_no_other_kit(kits: Path) -> None:
    before = fingerprints(kits)

    code, output = add_silo(kits, "zurich")

    assert code == 0, output
    new = load_silo_kit(kits / "silos" / "zurich")
    ca = (kits / "operator" / "ca.crt").read_bytes()
    assert verify_issued_by(new.tls.certificate.read_bytes(), ca)
    assert set(new.peers) == set(SILOS)
    after = fingerprints(kits)
    changed = {path for path in before if before[path] != after[path]}
    assert changed == {"coordinator/kit.yaml", "coordinator/roster.json"}
    assert all(path.startswith("silos/zurich/") for path in set(after) - set(before))
    assert "silos/zurich" in output and "coordinator" in output and "roster version 2" in output


def test_a_coordinator_started_afterwards_enrols_the_new_silo_by_its_real_keys(
    kits: Path,
) -> None:
    assert add_silo(kits, "zurich")[0] == 0

    coordinator = load_coordinator_kit(kits / "coordinator")
    new = load_silo_kit(kits / "silos" / "zurich")
    assert sorted(coordinator.silos) == sorted([*SILOS, "zurich"])
    enrolled = coordinator.silos["zurich"]
    assert enrolled.verify_key == new.signing_key.verify_key
    assert enrolled.sealing_public_key == new.sealing_key.public_key
    assert enrolled.certificate_fingerprint == certificate_fingerprint(
        new.tls.certificate.read_bytes()
    )
    assert public_key_hex(new.coordinator_verify_key) == public_key_hex(
        coordinator.coordinator_verify_key
    )
    assert new.coordinator_address == coordinator.address


@pytest.mark.parametrize("name", ["hungary", "HUNGARY"])
def test_an_enrolled_name_is_refused_and_nothing_is_written(kits: Path, name: str) -> None:
    before = fingerprints(kits)

    code, output = add_silo(kits, name)

    assert code == 1
    assert "already enrolled" in output and "Traceback" not in output
    assert fingerprints(kits) == before


def test_an_existing_kit_folder_is_never_replaced(kits: Path) -> None:
    (kits / "silos" / "zurich").mkdir()
    (kits / "silos" / "zurich" / "notes.txt").write_text("the site's own")
    before = fingerprints(kits)

    code, output = add_silo(kits, "zurich")

    assert code == 1
    assert "already exists" in output
    assert fingerprints(kits) == before


def test_a_ca_of_another_consortium_is_refused(kits: Path, tmp_path: Path) -> None:
    provision(parse_consortium(CONSORTIUM), tmp_path / "other")
    before = fingerprints(kits)

    code, output = add_silo(kits, "zurich", operator=tmp_path / "other" / "operator")

    assert code == 1
    assert "--ca-kit" in output and "operator key" in output
    assert fingerprints(kits) == before


def test_a_bad_name_is_refused_naming_it(kits: Path) -> None:
    code, output = add_silo(kits, "../escape")

    assert code == 1
    assert "NAME" in output and "not a valid name" in output
    assert not (kits / "escape").exists()


# -- a revoked silo is revoked, not a dropout ---------------------------------------------------


class HubSilos:
    """Scripted silos that long-poll a real `SiloHub`, as agents do over gRPC."""

    def __init__(self, hub: SiloHub, endpoints: dict[str, Callable[[bytes], bytes]]) -> None:
        self.hub, self.endpoints = hub, endpoints
        self.asked: dict[str, list[int]] = {silo: [] for silo in endpoints}
        self.threads = [threading.Thread(target=self._serve, args=(s,)) for s in endpoints]
        for silo in endpoints:
            hub.accept(silo)
        for thread in self.threads:
            thread.start()

    def _serve(self, silo: str) -> None:
        while not self.hub.finished.is_set():
            task = self.hub.next_task(silo, timeout_s=0.1)
            if task is not None:
                self.asked[silo].append(task.round)
                result = self.endpoints[silo](task.payload.to_bytes())
                self.hub.deliver(silo, task.task_id, as_payload(result))

    def stop(self) -> None:
        self.hub.finish()
        for thread in self.threads:
            thread.join()


class RevokeAfterRound:
    """The operator revokes `silo` consortium-wide once round `after` has ended."""

    def __init__(self, hub: SiloHub, state: Path, silo: str, after: int) -> None:
        self.hub, self.state, self.silo, self.after = hub, state, silo, after

    def on_round(self, record: RoundRecord, total_rounds: int) -> None:
        if record.round == self.after:
            revoke(self.state, "heart", self.silo, "left the consortium")
            self.hub.revoke(self.silo)  # what the coordinator's revocation watcher does


def test_a_revoked_silo_is_asked_no_more_and_shows_as_revoked_not_as_a_dropout(
    tmp_path: Path,
) -> None:
    endpoints = {f"s{i}": constant_silo(f"s{i}", [float(i)] * 3) for i in range(3)}
    policy = parse_policy(
        {
            "version": 1,
            "rounds": 4,
            "algorithm": {"name": "fedavg"},
            "participants": {"min_silos": 2, "phase_timeout_s": 10.0},
        }
    )
    state = tmp_path / "state.db"
    hub = SiloHub(sorted(endpoints))
    metrics = CoordinatorMetrics(deployment="heart-job")
    silos = HubSilos(hub, endpoints)
    try:
        with StateStore(state) as store:
            store.open_consortium("heart")
            history = RoundEngine(
                make_strategy(policy),
                GrpcTransport(hub),
                policy,
                sorted(endpoints),
                observers=[metrics, RevokeAfterRound(hub, state, "s2", after=1)],
                deployment="heart-job",
                store=store,
            ).run()
    finally:
        silos.stop()

    assert set(silos.asked["s2"]) == {0, 1}  # setup and round 1 (train, evaluate); never again
    assert [r.status for r in history.records] == ["completed"] * 4
    assert [r.revoked for r in history.records] == [None, ["s2"], ["s2"], ["s2"]]
    for record in history.records[1:]:  # its tasks fail at once: it still counts for quorums
        assert record.phases["train"]["dropped"] == {"s2": "revoked"}
    sample = metrics.registry.get_sample_value
    assert not sample("fedsilo_dropouts_total", {"silo": "s2", "deployment": "heart-job"})
    assert sample("fedsilo_silo_status", {"silo": "s2", "status": "revoked"}) == 1
    report = deployment_status(state, "heart")
    assert report.participants["s2"][0] == "revoked"
    assert "s2" not in report.dropouts


# -- fedsilo_silos_connected follows agents that leave --------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_silo_not_heard_from_for_the_window_is_no_longer_connected() -> None:
    clock = FakeClock()
    hub = SiloHub(["s0", "s1", "s2"], clock=clock, heartbeat_window_s=10.0)
    metrics = CoordinatorMetrics()
    gauge = ConnectionGauge(hub, metrics)
    for silo in ("s0", "s1", "s2"):
        hub.seen(silo)
    gauge.sync()
    assert metrics.registry.get_sample_value("fedsilo_silos_connected") == 3

    clock.now = 8.0
    hub.seen("s0")  # s0 and s1 keep heartbeating; s2's agent has exited
    hub.seen("s1")
    clock.now = 11.0
    gauge.sync()

    assert hub.connected() == ["s0", "s1"]
    assert metrics.registry.get_sample_value("fedsilo_silos_connected") == 2


def test_a_silo_busy_with_a_task_stays_connected_while_it_heartbeats_a_revoked_one_never() -> None:
    clock = FakeClock()
    hub = SiloHub(["s0", "s1"], clock=clock, heartbeat_window_s=10.0)
    for silo in ("s0", "s1"):
        hub.accept(silo)
        hub.seen(silo)
    hub.post(PostedTask("s0", "r1/train/s0", 1, as_payload(b"task")), queue.Queue())
    assert hub.next_task("s0", timeout_s=0) is not None  # s0 trains for a long time

    for clock.now in range(5, 3600, 5):
        hub.seen("s0")  # its heartbeats go on while it trains
    assert hub.connected() == ["s0"]
    hub.seen("s1")
    hub.revoke("s1")  # heard from just now, but revoked
    assert hub.connected() == ["s0"]


# -- the real thing: a coordinator started after add-silo runs a job with the new silo -----------


def test_a_coordinator_started_after_add_silo_admits_the_new_silo_to_its_job(
    tmp_path: Path,
) -> None:
    consortium = deployment.provision(tmp_path)
    consortium.add_silo("silo-3")
    document = deployment.policy_document(rounds=1)
    document["participants"]["min_silos"] = 4  # the job cannot run without the new silo
    document["data"]["partition"]["silos"] = 4
    policy = consortium.write_policy(document)
    try:
        consortium.start_coordinator(policy)
        for silo in ("silo-0", "silo-1", "silo-2", "silo-3"):
            consortium.start_silo(silo, consortium.write_silo_config(silo, data=document["data"]))
        assert consortium.wait("coordinator", timeout=60) == 0, consortium.log("coordinator")
    finally:
        consortium.stop_all()
    log = consortium.log("coordinator")
    assert "silo silo-3 accepted" in log and "round 1/1 completed" in log
