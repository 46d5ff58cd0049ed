"""The coordinator's state store: its schema, content-addressed checkpoints, participants and
audit, and a coordinator that restarts after a crash ending exactly where it would have."""

import hashlib
import sqlite3
import threading
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path

import pytest
import torch
from blake3 import blake3

from fedsilo.coordinator.engine import RoundEngine, RoundRecord, RunAborted, RunHistory
from fedsilo.coordinator.state import Checkpoints, SavedRound, StateError, StateStore, digest_policy
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.strategies.base import ServerState
from fedsilo.coordinator.transport import Delivery, InProcessTransport, Reply
from fedsilo.policies.loading import parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import SiloDataset
from fedsilo.wire.messages import SiloEndpoint, TaskMessage
from fedsilo.wire.tensors import ParameterSpec
from tests.fakes import constant_silo, silent_silo

DEPLOYMENT = "consortium-a"
POLICY_DIGEST = "1" * 64


@pytest.fixture
def store_path(tmp_path: Path) -> Path:
    return tmp_path / "coordinator.db"


@pytest.fixture
def store(store_path: Path):
    with StateStore(store_path) as opened:
        opened.open_deployment(DEPLOYMENT, POLICY_DIGEST, '{"seed": 0}')
        yield opened


def server_state(scale: float = 1.0) -> ServerState:
    model = torch.tensor([1 / 3, -0.0, 1e-40, float("nan")]) * scale
    return ServerState(
        {"model": model, "m": torch.zeros(4, dtype=torch.float64), "steps": torch.arange(3)},
        ParameterSpec.of({"layer.weight": torch.zeros(2, 1), "layer.bias": torch.zeros(2)}),
        {"lambda": [0.25, 0.75], "phase": "warm-up"},
    )


def bits(tensor: torch.Tensor) -> bytes:
    return tensor.numpy().tobytes()


def checkpoint_files(store_path: Path) -> list[Path]:
    return sorted(store_path.with_name("coordinator.checkpoints").glob("*.safetensors"))


# -- the file and its schema ---------------------------------------------------------------------


def test_a_new_state_file_has_the_documented_tables_and_schema_version(store_path: Path) -> None:
    StateStore(store_path).close()
    with sqlite3.connect(store_path) as db:
        tables = {
            name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type='table'")
        }
        versions = db.execute("SELECT version FROM schema_version").fetchall()
        (journal,) = db.execute("PRAGMA journal_mode").fetchone()
    db.close()
    assert tables == {
        "schema_version",
        "deployments",
        "rounds",
        "participants",
        "message_audit",
        "receipts",
    }
    assert versions == [(1,)] and journal == "wal"
    assert store_path.stat().st_mode & 0o077 == 0  # the consortium's state is the owner's only


def test_a_state_file_of_an_unknown_schema_version_is_refused(store_path: Path) -> None:
    StateStore(store_path).close()
    with sqlite3.connect(store_path) as db:
        db.execute("UPDATE schema_version SET version = 99")
    db.close()
    with pytest.raises(StateError, match=r"coordinator\.db holds state schema version \[99\]"):
        StateStore(store_path)


@pytest.mark.parametrize(
    ("content", "reason"),
    [(b"not a database at all" * 10, "not a readable SQLite state file"), (None, "not a fedsilo")],
)
def test_a_file_that_is_not_a_state_file_is_refused_by_name(
    store_path: Path, content: bytes | None, reason: str
) -> None:
    if content is None:
        with sqlite3.connect(store_path) as db:
            db.execute("CREATE TABLE patients (id INTEGER)")
        db.close()
    else:
        store_path.write_bytes(content)
    with pytest.raises(StateError, match=reason) as refused:
        StateStore(store_path)
    assert str(store_path) in str(refused.value)


def test_a_deployment_reopened_under_another_policy_is_refused_naming_both_digests(
    store_path: Path,
) -> None:
    with StateStore(store_path) as store:
        store.open_deployment(DEPLOYMENT, "a" * 64, "{}")
        store.open_deployment(DEPLOYMENT, "a" * 64, "{}")  # the same policy may come back
        with pytest.raises(StateError) as refused:
            store.open_deployment(DEPLOYMENT, "b" * 64, "{}")
    message = str(refused.value)
    assert str(store_path) in message and repr(DEPLOYMENT) in message
    assert "a" * 64 in message and "b" * 64 in message
    assert "this state belongs to another policy; use a new --state file" in message


# -- rounds and checkpoints ----------------------------------------------------------------------


def test_a_saved_state_loads_back_bit_exact_with_the_records_in_order(store: StateStore) -> None:
    state = server_state()
    store.save_round(DEPLOYMENT, 0, "setup", state, {"round": 0, "status": "setup"})
    store.save_round(DEPLOYMENT, 1, "completed", state, {"round": 1, "loss": 0.1 + 0.2})
    store.save_round(DEPLOYMENT, 2, "failed", state, {"round": 2, "error": "quorum"})

    saved = store.last_round(DEPLOYMENT)
    assert isinstance(saved, SavedRound) and (saved.round, saved.status) == (2, "failed")
    assert list(saved.state.tensors) == ["model", "m", "steps"]
    for name, tensor in state.tensors.items():
        loaded = saved.state.tensors[name]
        assert loaded.dtype == tensor.dtype and bits(loaded) == bits(tensor)
    assert saved.state.spec == state.spec and saved.state.extra == state.extra
    assert saved.records == [
        {"round": 1, "loss": 0.30000000000000004},
        {"round": 2, "error": "quorum"},
    ]


def test_a_deployment_without_saved_rounds_has_no_last_round(store: StateStore) -> None:
    assert store.last_round(DEPLOYMENT) is None


def test_checkpoints_are_named_by_the_hash_of_their_bytes_and_identical_states_stored_once(
    store: StateStore, store_path: Path
) -> None:
    store.save_round(DEPLOYMENT, 0, "setup", server_state(), {})
    store.save_round(DEPLOYMENT, 1, "failed", server_state(), {})  # the state did not change
    assert len(checkpoint_files(store_path)) == 1
    store.save_round(DEPLOYMENT, 2, "completed", server_state(scale=2.0), {})
    (file,) = checkpoint_files(store_path)
    assert file.stem == blake3(file.read_bytes()).hexdigest()
    assert file.stat().st_mode & 0o077 == 0
    assert not list(file.parent.glob(".*"))  # no temporary file is left behind


def test_only_each_deployments_latest_state_is_kept(store: StateStore, store_path: Path) -> None:
    """A deployment resumes from its latest state and nothing reads an earlier one, so a
    superseded checkpoint is deleted, unless another deployment resumes from the same bytes."""
    other = "another"
    store.open_deployment(other, "digest-of-another", "{}")
    store.save_round(DEPLOYMENT, 0, "setup", server_state(), {})
    store.save_round(other, 0, "setup", server_state(), {})  # the same bytes: one file
    store.save_round(DEPLOYMENT, 1, "completed", server_state(scale=2.0), {})
    assert len(checkpoint_files(store_path)) == 2  # the other deployment still resumes from it
    store.save_round(other, 1, "completed", server_state(scale=3.0), {})
    assert len(checkpoint_files(store_path)) == 2  # each deployment's latest
    for deployment, scale in ((DEPLOYMENT, 2.0), (other, 3.0)):
        saved = store.last_round(deployment)
        assert saved is not None
        expected = server_state(scale=scale).tensors["model"]
        assert bits(saved.state.tensors["model"]) == bits(expected)


def test_a_checkpoint_named_by_its_blake2b_as_older_state_files_name_them_still_loads(
    tmp_path: Path,
) -> None:
    checkpoints = Checkpoints(tmp_path)
    saved = checkpoints.save({"w": torch.arange(6.0)})
    data = checkpoints.path_of(saved).read_bytes()
    older = hashlib.blake2b(data, digest_size=32).hexdigest()
    checkpoints.path_of(older).write_bytes(data)
    assert torch.equal(checkpoints.load(older)["w"], torch.arange(6.0))
    checkpoints.path_of(older).write_bytes(data[:-1] + b"\x00")
    with pytest.raises(StateError, match="corrupted"):
        checkpoints.load(older)


def test_tensors_that_share_memory_are_saved_as_separate_entries(store: StateStore) -> None:
    model = torch.tensor([1.0, 2.0])  # Local's setup gives every silo the same initial tensor
    state = ServerState({"model/a": model, "model/b": model}, ParameterSpec.of({"w": model}))
    store.save_round(DEPLOYMENT, 0, "setup", state, {})
    loaded = store.last_round(DEPLOYMENT).state.tensors
    assert loaded["model/a"].tolist() == loaded["model/b"].tolist() == [1.0, 2.0]


def test_a_corrupted_checkpoint_is_detected_on_load_and_named(
    store: StateStore, store_path: Path
) -> None:
    store.save_round(DEPLOYMENT, 0, "setup", server_state(), {})
    (checkpoint,) = checkpoint_files(store_path)
    data = bytearray(checkpoint.read_bytes())
    data[-3] ^= 0x01  # one bit of one parameter
    checkpoint.write_bytes(bytes(data))
    with pytest.raises(StateError, match="is corrupted") as refused:
        store.last_round(DEPLOYMENT)
    assert str(checkpoint) in str(refused.value)


def test_a_checkpoint_corrupted_on_disk_is_rewritten_when_the_same_state_is_saved_again(
    store: StateStore, store_path: Path
) -> None:
    store.save_round(DEPLOYMENT, 0, "setup", server_state(), {})
    (checkpoint,) = checkpoint_files(store_path)
    checkpoint.write_bytes(b"\x00" * checkpoint.stat().st_size)
    store.save_round(DEPLOYMENT, 1, "failed", server_state(), {})
    assert bits(store.last_round(DEPLOYMENT).state.model) == bits(server_state().model)


def test_rounds_are_saved_in_order_and_once(store: StateStore) -> None:
    with pytest.raises(StateError, match="saves round 0 next, not 1"):
        store.save_round(DEPLOYMENT, 1, "completed", server_state(), {})
    store.save_round(DEPLOYMENT, 0, "setup", server_state(), {})
    with pytest.raises(StateError, match="another coordinator"):
        store.save_round(DEPLOYMENT, 0, "setup", server_state(), {})
    with pytest.raises(ValueError, match="only round 0 is the setup"):
        store.save_round(DEPLOYMENT, 1, "setup", server_state(), {})
    with pytest.raises(ValueError, match="unknown round status 'done'"):
        store.save_round(DEPLOYMENT, 1, "done", server_state(), {})


def test_rounds_of_an_unknown_deployment_are_refused(store: StateStore) -> None:
    with pytest.raises(StateError, match="unknown deployment 'elsewhere'"):
        store.save_round("elsewhere", 0, "setup", server_state(), {})


def test_a_saved_round_survives_closing_and_reopening_the_file(store_path: Path) -> None:
    with StateStore(store_path) as store:
        store.open_deployment(DEPLOYMENT, POLICY_DIGEST, "{}")
        store.save_round(DEPLOYMENT, 0, "setup", server_state(), {"round": 0})
    with StateStore(store_path) as reopened:
        assert reopened.last_round(DEPLOYMENT).round == 0


# -- participants and the message audit ----------------------------------------------------------


def test_participants_keep_their_latest_status_and_reason(store: StateStore) -> None:
    store.set_participant(DEPLOYMENT, "lyon", "active")
    store.set_participant(DEPLOYMENT, "basel", "active")
    store.set_participant(DEPLOYMENT, "lyon", "revoked", "certificate revoked")
    assert store.participants(DEPLOYMENT) == {
        "basel": ("active", ""),
        "lyon": ("revoked", "certificate revoked"),
    }
    with pytest.raises(ValueError, match="unknown participant status 'gone'"):
        store.set_participant(DEPLOYMENT, "lyon", "gone")


def test_the_audit_lists_every_message_in_the_order_recorded(store: StateStore) -> None:
    store.audit(DEPLOYMENT, 1, "to_silo", "lyon", "train", 1024, "d1")
    store.audit(DEPLOYMENT, 1, "from_silo", "lyon", "train", 2048, "d2")
    rows = store.audit_rows(DEPLOYMENT)
    columns = ("round", "direction", "silo", "kind", "bytes", "digest")
    assert [tuple(row[c] for c in columns) for row in rows] == [
        (1, "to_silo", "lyon", "train", 1024, "d1"),
        (1, "from_silo", "lyon", "train", 2048, "d2"),
    ]
    assert all(r["deployment_id"] == DEPLOYMENT and r["at"] for r in rows)
    with pytest.raises(ValueError, match="unknown message direction 'sideways'"):
        store.audit(DEPLOYMENT, 1, "sideways", "lyon", "train", 1, "d3")


def test_threads_may_share_one_store(store: StateStore) -> None:
    def record(silo: str) -> None:
        for i in range(25):
            store.audit(DEPLOYMENT, i, "from_silo", silo, "train", i, f"{silo}-{i}")
            store.set_participant(DEPLOYMENT, silo, "active")

    workers = [threading.Thread(target=record, args=(f"s{k}",)) for k in range(8)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    assert len({row["digest"] for row in store.audit_rows(DEPLOYMENT)}) == 8 * 25
    assert len(store.participants(DEPLOYMENT)) == 8


# -- a restarted coordinator ---------------------------------------------------------------------


class Interrupted(Exception):
    """Stands in for kill -9: the coordinator stops between two rounds."""


class StopAfter:
    def __init__(self, round_no: int) -> None:
        self.round_no = round_no

    def on_round(self, record: RoundRecord, total_rounds: int) -> None:
        if record.round == self.round_no:
            raise Interrupted(f"coordinator killed after round {record.round}")


def silo_data(name: str, seed: int) -> SiloDataset:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(48, 4, generator=g)
    y = (x[:, 0] - 0.5 * x[:, 2] > 0).long()
    return SiloDataset(
        name, x[:32], y[:32], x[32:40], y[32:40], x[40:], y[40:], "classification", 2,
        ("f0", "f1", "f2", "f3"), (4,),
    )  # fmt: skip


def fedadam_policy(**overrides: object) -> Policy:
    return parse_policy(
        {
            "version": 1,
            "rounds": 5,
            "seed": 11,
            "algorithm": {"name": "fedadam", "client_fraction": 0.5, "server_lr": 0.05},
            "model": {"name": "mlp", "hidden": [4]},
            "training": {"epochs": 1, "batch_size": 8, "lr": 0.1},
            **overrides,
        }
    )


def agents(policy: Policy) -> dict[str, SiloEndpoint]:
    """A fresh consortium of four silo agents (silos keep nothing a resumed run needs)."""
    names = ("basel", "cleveland", "hungary", "long-beach")
    return {
        name: SiloAgent(name, silo_data(name, seed), policy, deployment=DEPLOYMENT).handle_bytes
        for seed, name in enumerate(names)
    }


def run_engine(
    policy: Policy,
    endpoints: dict[str, SiloEndpoint],
    store: StateStore | None = None,
    observers: Sequence[object] = (),
) -> RunHistory:
    transport = InProcessTransport(endpoints)
    engine = RoundEngine(
        make_strategy(policy), transport, policy, sorted(endpoints), observers, DEPLOYMENT, store
    )
    try:
        return engine.run()
    finally:
        transport.close()


def replayable(record: RoundRecord) -> dict:
    """A record without its wall-clock timings, which no two runs share."""
    return {k: v for k, v in record.to_json().items() if k not in ("seconds", "compute_seconds")}


def test_a_run_killed_after_round_two_and_resumed_ends_bit_identical_to_an_uninterrupted_one(
    store_path: Path,
) -> None:
    policy = fedadam_policy()
    uninterrupted = run_engine(policy, agents(policy))
    with StateStore(store_path) as store, pytest.raises(Interrupted):
        run_engine(policy, agents(policy), store, [StopAfter(2)])
    with StateStore(store_path) as store:
        assert store.last_round(DEPLOYMENT).round == 2
        resumed = run_engine(policy, agents(policy), store)

    for name, tensor in uninterrupted.state.tensors.items():  # the model and FedAdam's m and v
        assert bits(resumed.state.tensors[name]) == bits(tensor), name
    assert [replayable(r) for r in resumed.records] == [
        replayable(r) for r in uninterrupted.records
    ]
    sampled = [sorted(r.phases["train"]["answered"]) for r in uninterrupted.records]
    assert all(len(silos) == 2 for silos in sampled) and len(set(map(tuple, sampled))) > 1
    assert resumed.final.evaluation == uninterrupted.final.evaluation


def counting(endpoints: dict[str, SiloEndpoint], kinds: list[str]) -> dict[str, SiloEndpoint]:
    """The same silos, noting the kind of every task they are sent."""

    def wrap(endpoint: SiloEndpoint) -> SiloEndpoint:
        def counted(payload: bytes) -> bytes:
            kinds.append(TaskMessage.decode(payload).kind)
            return endpoint(payload)

        return counted

    return {name: wrap(endpoint) for name, endpoint in endpoints.items()}


def test_a_finished_run_resumed_again_runs_no_more_rounds_and_returns_the_same_result(
    store_path: Path,
) -> None:
    policy = fedadam_policy(rounds=3)
    with StateStore(store_path) as store:
        finished = run_engine(policy, agents(policy), store)
    kinds: list[str] = []
    with StateStore(store_path) as store:
        again = run_engine(policy, counting(agents(policy), kinds), store)
    assert kinds == []
    assert bits(again.state.model) == bits(finished.state.model)
    assert [replayable(r) for r in again.records] == [replayable(r) for r in finished.records]
    assert again.final.evaluation == finished.final.evaluation


class PowerLoss(Exception):
    """The coordinator dies while the silos train."""


class DiesAtFirstTraining(InProcessTransport):
    def dispatch(self, deliveries: Iterable[Delivery], deadline: float) -> Iterator[Reply]:
        deliveries = list(deliveries)
        if any(TaskMessage.decode(d.payload).kind == "train" for d in deliveries):
            raise PowerLoss("the coordinator lost power during round 1")
        return super().dispatch(deliveries, deadline)


def test_a_crash_before_round_one_finishes_resumes_from_the_saved_setup(
    store_path: Path,
) -> None:
    policy = fedadam_policy(rounds=2)
    uninterrupted = run_engine(policy, agents(policy))
    strategy = make_strategy(policy)
    with StateStore(store_path) as store, pytest.raises(PowerLoss):
        endpoints = agents(policy)
        RoundEngine(
            strategy,
            DiesAtFirstTraining(endpoints),
            policy,
            sorted(endpoints),
            (),
            DEPLOYMENT,
            store,
        ).run()
    kinds: list[str] = []
    with StateStore(store_path) as store:
        assert store.last_round(DEPLOYMENT).status == "setup"
        resumed = run_engine(policy, counting(agents(policy), kinds), store)
    assert "init" not in kinds
    assert bits(resumed.state.model) == bits(uninterrupted.state.model)


def test_failed_rounds_in_a_row_are_still_counted_after_a_restart(store_path: Path) -> None:
    policy = parse_policy(
        {
            "version": 1,
            "rounds": 10,
            "algorithm": {"name": "fedavg"},
            "participants": {
                "min_silos": 2,
                "phase_timeout_s": 0.2,
                "max_consecutive_failed_rounds": 3,
            },
        }
    )
    release = threading.Event()
    endpoints = {"a": constant_silo("a", [1.0, 1, 1]), "silent": silent_silo(release)}
    try:
        with StateStore(store_path) as store, pytest.raises(Interrupted):
            run_engine(policy, endpoints, store, [StopAfter(2)])
        with (
            StateStore(store_path) as store,
            pytest.raises(RunAborted, match="3 rounds in a row missed their quorum"),
        ):
            run_engine(policy, endpoints, store)
    finally:
        release.set()
    with StateStore(store_path) as store:
        saved = store.last_round(DEPLOYMENT)
    assert (saved.round, saved.status) == (3, "failed")
    assert saved.state.model.tolist() == [0.0, 0.0, 0.0]  # a failed round keeps the state


def test_a_store_refuses_to_resume_a_run_of_another_policy(store_path: Path) -> None:
    endpoints = {"a": constant_silo("a", [1.0, 2, 3])}
    policy = fedadam_policy(rounds=1)
    with StateStore(store_path) as store:
        run_engine(policy, endpoints, store)
        other = policy.with_overrides(seed=12)
        with pytest.raises(StateError, match=digest_policy(other)):
            run_engine(other, endpoints, store)
