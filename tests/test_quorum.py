"""Quorum is never lowered (issue 17, finding 4): a phase that aggregates needs
`participants.min_silos` answers whatever the number of tasks, retirements or revocations; a
consortium smaller than `min_silos` is refused before round 1 (exit status 1 from the CLI);
phases whose answers reach the strategy one by one keep working with fewer silos."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from fedsilo.coordinator.engine import RoundEngine, RoundRecord, RunAborted, RunHistory
from fedsilo.coordinator.grpc_transport import GrpcTransport
from fedsilo.coordinator.hub import SiloHub
from fedsilo.coordinator.phases import Phase, QuorumNotMet, Task, WeightedMean
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.strategies.base import ServerState
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.cli import main
from fedsilo.ops.coordinator_process import DeploymentError, require_a_completed_round
from fedsilo.ops.sim_silos import ConsortiumKeys, build_agent
from fedsilo.policies.loading import parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import load_consortium
from fedsilo.wire.messages import STATUS_BUDGET_EXHAUSTED, TaskMessage, TaskResult
from fedsilo.wire.payload import as_payload
from tests.deployment import policy_document, provision
from tests.fakes import SPEC, TRAIN, constant_silo

Endpoint = Callable[[bytes], bytes]


def masking_policy(silos: int, min_silos: int, rounds: int = 1) -> Policy:
    return parse_policy(
        {
            "version": 1,
            "seed": 3,
            "rounds": rounds,
            "algorithm": {"name": "fedavg"},
            "model": {"name": "linear"},
            "training": {"epochs": 1, "batch_size": 32, "lr": 0.1},
            "participants": {
                "min_silos": min_silos,
                "phase_timeout_s": 60,
                "max_consecutive_failed_rounds": 5,
            },
            "data": {
                "source": "sklearn:breast_cancer",
                "partition": {"kind": "iid", "silos": silos},
            },
            "secure_aggregation": "masking",
        }
    )


def real_agents(policy: Policy) -> dict[str, SiloAgent]:
    """The policy's silos, built from it as a simulation builds them, with the consortium's
    keys."""
    datasets = load_consortium(policy.data, seed=policy.seed)
    keys = ConsortiumKeys.generate(d.name for d in datasets)
    return {d.name: build_agent(policy, d.name, d, torch.device("cpu"), keys) for d in datasets}


def out_of_budget_after_init(name: str, endpoint: Endpoint) -> Endpoint:
    """A silo whose privacy budget cannot pay for anything but the initial model."""

    def answer(payload: bytes) -> bytes:
        task = TaskMessage.decode(payload)
        if task.kind == "init":
            return endpoint(payload)
        return TaskResult(
            task.task_id, name, task.kind, status=STATUS_BUDGET_EXHAUSTED, error="epsilon cap"
        ).encode()

    return answer


class CountingTransport(InProcessTransport):
    """An in-process transport that remembers every task it delivered."""

    def __init__(self, endpoints: dict[str, Endpoint]) -> None:
        super().__init__(endpoints)
        self.delivered: list[str] = []

    def dispatch(self, deliveries, deadline):  # type: ignore[no-untyped-def]
        listed = list(deliveries)
        self.delivered += [d.task_id for d in listed]
        return super().dispatch(listed, deadline)


def test_retired_silos_never_lower_the_masked_quorum_to_one_silos_model() -> None:
    policy = masking_policy(silos=3, min_silos=3, rounds=2)
    agents = real_agents(policy)
    endpoints = {
        name: agent.handle_bytes
        if name == "silo-0"
        else out_of_budget_after_init(name, agent.handle_bytes)
        for name, agent in agents.items()
    }
    engine = RoundEngine(
        make_strategy(policy), InProcessTransport(endpoints), policy, sorted(agents)
    )
    history = engine.run()
    assert set(history.records[0].retired or {}) == {"silo-1", "silo-2"}
    statuses = [r.status for r in history.records]
    assert statuses == ["failed", "failed"], (
        f"rounds {statuses}: with 2 of 3 silos retired, a 'secure sum' was applied "
        "from silo-0 alone"
    )
    assert "participants.min_silos is 3" in (history.records[1].error or "")


def test_a_masked_phase_asking_fewer_silos_than_min_silos_fails_before_anything_is_sent() -> None:
    policy = masking_policy(silos=3, min_silos=3)
    agents = real_agents(policy)
    transport = CountingTransport({n: a.handle_bytes for n, a in agents.items()})
    engine = RoundEngine(make_strategy(policy), transport, policy, sorted(agents))
    state, _ = engine._start()  # the initial model every silo built
    asked_before = len(transport.delivered)
    strategy = make_strategy(policy)
    task = strategy.train_task("silo-0", state.model, state.spec, engine._context(1))
    alone = Phase("train", (task,), aggregate=WeightedMean(("model",)))
    with pytest.raises(QuorumNotMet, match=r"asks 1 silo\(s\), its quorum is 3"):
        engine.execute(alone, round_no=1)
    assert len(transport.delivered) == asked_before


def test_a_phase_stating_a_lower_quorum_cannot_lower_an_aggregates_quorum() -> None:
    endpoints = {s: constant_silo(s, [1.0, 1, 1]) for s in ("a", "b", "c")}
    policy = parse_policy(
        {"version": 1, "rounds": 1, "participants": {"min_silos": 3, "phase_timeout_s": 5}}
    )
    engine = RoundEngine(make_strategy(policy), InProcessTransport(endpoints), policy, "abc")
    two = Phase(
        "train",
        tuple(Task(s, TRAIN, spec=SPEC) for s in "ab"),
        aggregate=WeightedMean(("model",)),
        quorum=1,
    )
    with pytest.raises(QuorumNotMet, match="its quorum is 3"):
        engine.execute(two, round_no=1)


def test_phases_answered_one_by_one_may_ask_fewer_silos_than_min_silos() -> None:
    """Evaluation, loss probes and the local training of silos outside a cohort: each answer
    reaches the strategy on its own anyway, so no quorum protects it."""
    endpoints = {s: constant_silo(s, [1.0, 1, 1]) for s in ("a", "b", "c")}
    policy = parse_policy(
        {"version": 1, "rounds": 1, "participants": {"min_silos": 3, "phase_timeout_s": 5}}
    )
    engine = RoundEngine(make_strategy(policy), InProcessTransport(endpoints), policy, "abc")
    outcome = engine.execute(Phase("local", (Task("a", TRAIN, spec=SPEC),)), round_no=1)
    assert outcome.answered == ("a",)


def test_fedavg_sampling_a_small_fraction_still_asks_min_silos_and_completes() -> None:
    endpoints = {s: constant_silo(s, [float(i)] * 3) for i, s in enumerate("abcde")}
    policy = parse_policy(
        {
            "version": 1,
            "rounds": 2,
            "algorithm": {"name": "fedavg", "client_fraction": 0.1},
            "participants": {"min_silos": 3, "phase_timeout_s": 5},
        }
    )
    history = RoundEngine(
        make_strategy(policy), InProcessTransport(endpoints), policy, "abcde"
    ).run()
    assert [r.status for r in history.records] == ["completed", "completed"]
    assert all(len(r.phases["train"]["answered"]) == 3 for r in history.records)


def test_a_consortium_smaller_than_min_silos_is_refused_before_round_1() -> None:
    policy = masking_policy(silos=3, min_silos=3)
    agents = dict(sorted(real_agents(policy).items())[:1])  # the others were never provisioned
    transport = CountingTransport({n: a.handle_bytes for n, a in agents.items()})
    engine = RoundEngine(make_strategy(policy), transport, policy, sorted(agents))
    with pytest.raises(RunAborted, match=r"participants.min_silos is 3, but the consortium has 1"):
        engine.run()
    assert transport.delivered == []


class HubSilos:
    """Silos answering through a real `SiloHub` (what the gRPC service feeds), in threads."""

    def __init__(self, hub: SiloHub, endpoints: dict[str, Endpoint]) -> None:
        self.hub, self.endpoints = hub, endpoints
        self.threads = [
            threading.Thread(target=self._serve, args=(s,), daemon=True) for s in endpoints
        ]
        for thread in self.threads:
            thread.start()

    def _serve(self, silo: str) -> None:
        while not self.hub.finished.is_set():
            task = self.hub.next_task(silo, 0.1)
            if task is not None:
                answer = self.endpoints[silo](as_payload(task.payload).to_bytes())
                self.hub.deliver(silo, task.task_id, as_payload(answer))


@pytest.fixture
def hub() -> Iterator[SiloHub]:
    hub = SiloHub(["a", "b", "c"])
    yield hub
    hub.finish()


def test_a_revoked_silo_never_lowers_the_quorum(hub: SiloHub) -> None:
    endpoints = {s: constant_silo(s, [float(i)] * 3) for i, s in enumerate("abc")}
    for silo in endpoints:
        hub.accept(silo)
    HubSilos(hub, endpoints)
    policy = parse_policy(
        {
            "version": 1,
            "rounds": 2,
            "participants": {
                "min_silos": 3,
                "phase_timeout_s": 5,
                "max_consecutive_failed_rounds": 5,
            },
        }
    )
    hub.revoke("c")
    history = RoundEngine(make_strategy(policy), GrpcTransport(hub), policy, "abc").run()
    assert [r.status for r in history.records] == ["failed", "failed"]
    assert history.records[0].phases["train"]["dropped"] == {"c": "revoked"}
    assert history.state.model.tolist() == [0.0, 0.0, 0.0]


def test_a_deployment_whose_every_round_failed_is_an_error_naming_the_last_failure() -> None:
    failed = RoundRecord(1, "failed", 0.1, error="phase 'train': quorum is 3")
    history = RunHistory([failed], ServerState({"model": torch.zeros(1)}, SPEC), failed)
    with pytest.raises(DeploymentError, match="every round failed.*quorum is 3"):
        require_a_completed_round(history)
    done = RoundRecord(2, "completed", 0.1)
    require_a_completed_round(RunHistory([failed, done], history.state, done))


def test_fedsilo_simulate_refuses_a_consortium_smaller_than_min_silos(tmp_path: Path) -> None:
    document = policy_document(participants={"min_silos": 4, "phase_timeout_s": 20})
    path = tmp_path / "p.yaml"
    path.write_text(yaml.safe_dump(document))
    result = CliRunner().invoke(
        main, ["simulate", "--policy", str(path), "--out", str(tmp_path / "out")]
    )
    assert result.exit_code == 1, result.output
    assert (
        "participants.min_silos: every phase needs 4 silos' answers and the consortium has 3"
        in (result.output)
    )
    assert "Traceback" not in result.output
    assert not (tmp_path / "out").exists()


def test_fedsilo_coordinator_start_refuses_a_roster_smaller_than_min_silos(tmp_path: Path) -> None:
    consortium = provision(tmp_path)  # three silos, for data the policy deals into four
    four = {"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": 4}}
    policy = consortium.write_policy(
        policy_document(participants={"min_silos": 4, "phase_timeout_s": 20}, data=four)
    )
    args = ["coordinator", "start", "--kit", str(consortium.kits / "coordinator")]
    args += ["--policy", str(policy), "--state", str(tmp_path / "state.db"), "--join-timeout", "5"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 1, result.output
    assert "participants.min_silos is 4" in result.output
    assert "Traceback" not in result.output
