"""Cyclic weight transfer: each round's order is a seeded permutation of the silos that changes
from round to round and repeats on resume; one round is every silo's local steps in that order
on the model handed to it (the hand computation); hand-offs are sealed to their recipients, the
coordinator's outcome of every visit but the last holds no model, and the last holds only the
round's model; a hand-off that is not delivered abandons the round; a run resumed after a
coordinator stop equals the uninterrupted run; what it cannot run with is refused."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from nacl.public import PrivateKey

from fedsilo.coordinator.engine import RoundEngine, RunHistory
from fedsilo.coordinator.phases import PhaseOutcome
from fedsilo.coordinator.state import StateStore
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.strategies.base import RoundContext
from fedsilo.coordinator.strategies.cyclic import Cyclic
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.sim_silos import ConsortiumKeys
from fedsilo.policies.loading import PolicyError, parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.policies.seeding import derive_seed
from fedsilo.privacy.handoff import Binding, HandoffError, open_sealed, unpack
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.tasks.base import parameter_spec
from fedsilo.wire.messages import TaskMessage
from fedsilo.wire.tasks.tensor_names import HANDOFF, MODEL
from tests.test_feddc import Endpoint, failing
from tests.test_scaffold import full_gradient, silo_data

DATASETS = [silo_data("a", 0, 3), silo_data("b", 1, 5), silo_data("c", 2, 4)]
KEYS = ConsortiumKeys.generate(d.name for d in DATASETS)
SEALING = {name: PrivateKey(key) for name, key in KEYS.sealing.items()}
STEPS, LR = 2, 0.1


def policy(rounds: int = 2, **changes: object) -> Policy:
    document: dict = {
        "version": 1,
        "seed": 5,
        "rounds": rounds,
        "eval_every": rounds,
        "algorithm": {"name": "cyclic"},
        "channel": {"sealed_handoffs": True},
        "model": {"name": "linear"},
        "training": {"steps": STEPS, "batch_size": 8, "optimizer": "sgd", "lr": LR},
    }
    for key, value in changes.items():
        document[key] = {**document.get(key, {}), **value} if isinstance(value, dict) else value
    return parse_policy(document)


class Run:
    """A consortium of DATASETS with sealing keys behind an in-process transport that records
    every task (the coordinator's transcript) and every phase outcome the strategy gets."""

    def __init__(
        self,
        p: Policy,
        store: StateStore | None = None,
        wrap: Callable[[str, Endpoint], Endpoint] = lambda _, e: e,
    ) -> None:
        roster = KEYS.sealing_roster
        self.agents = {d.name: SiloAgent(d.name, d, p, keys=KEYS.of(d.name)) for d in DATASETS}
        self.tasks: list[TaskMessage] = []
        self.outcomes: list[PhaseOutcome] = []

        def recorded(name: str, endpoint: Endpoint) -> Endpoint:
            def answer(payload: bytes) -> bytes:
                self.tasks.append(TaskMessage.decode(payload))
                return endpoint(payload)

            return wrap(name, answer)

        transport = InProcessTransport(
            {n: recorded(n, a.handle_bytes) for n, a in self.agents.items()}
        )
        keys = {n: bytes(k) for n, k in roster.items()}
        self.engine = RoundEngine(
            make_strategy(p), transport, p, sorted(self.agents), store=store,
            handoff_keys=keys, policy_digest="pinned",
        )  # fmt: skip
        execute = self.engine.execute

        def observed(phase, *args, **kwargs):  # type: ignore[no-untyped-def]
            outcome = execute(phase, *args, **kwargs)
            self.outcomes.append(outcome)
            return outcome

        self.engine.execute = observed  # type: ignore[method-assign]
        self.history: RunHistory = self.engine.run()


def context(p: Policy, round_no: int) -> RoundContext:
    silos = tuple(d.name for d in DATASETS)
    return RoundContext(round_no, p.rounds, silos, p.seed, p.participants.min_silos)


def test_the_cycle_is_a_seeded_permutation_that_changes_per_round() -> None:
    p = policy(rounds=8)
    strategy = Cyclic(p)
    orders = [strategy.cycle(context(p, r)) for r in range(1, 9)]
    assert all(sorted(order) == ["a", "b", "c"] for order in orders)
    assert len(set(orders)) > 1  # a new order each round, not one fixed cycle
    assert orders == [Cyclic(p).cycle(context(p, r)) for r in range(1, 9)]  # from (seed, round)
    other = policy(rounds=8, seed=6)
    assert orders != [Cyclic(other).cycle(context(other, r)) for r in range(1, 9)]
    fixed = policy(rounds=8, algorithm={"deterministic_cycle": True})
    assert {Cyclic(fixed).cycle(context(fixed, r)) for r in range(1, 9)} == {("a", "b", "c")}


def test_a_run_visits_the_silos_in_the_rounds_cycle() -> None:
    p = policy(rounds=3)
    history = Run(p).history
    for record in history.records:
        visits = [next(iter(record.phases[f"visit_{k}"]["answered"])) for k in range(3)]
        assert tuple(visits) == Cyclic(p).cycle(context(p, record.round))


def initial_model(p: Policy) -> torch.Tensor:
    agent = SiloAgent("a", DATASETS[0], p)
    model = agent.context.new_model(seed=derive_seed(p.seed, "model-init"))
    return parameter_spec(model).flatten(dict(model.named_parameters())).detach()


def test_two_rounds_are_the_hand_computation() -> None:
    p = policy(rounds=2)
    x = initial_model(p)
    data = {d.name: d for d in DATASETS}
    for round_no in (1, 2):
        for silo in Cyclic(p).cycle(context(p, round_no)):
            for _ in range(STEPS):  # one batch holds every row: full gradient steps
                x = x - LR * full_gradient(x, data[silo])
    assert torch.allclose(Run(p).history.state.model, x, atol=1e-5)


def test_hand_offs_are_sealed_and_the_coordinator_gets_only_the_rounds_model() -> None:
    p = policy(rounds=1)
    run = Run(p)
    deliveries = [t for t in run.tasks if t.kind == "daisy_receive"]
    assert len(deliveries) == 2  # a -> b -> c: two hand-offs in a cycle of three
    for task in deliveries:
        blob = bytes(task.tensors[HANDOFF].numpy())
        bound = Binding("simulation", 1, task.phase, task.silo)
        with pytest.raises(HandoffError):
            unpack(blob, bound, KEYS.roster)  # the coordinator cannot read it
        for other, key in SEALING.items():
            if other != task.silo:
                with pytest.raises(HandoffError, match="does not open"):
                    open_sealed(blob, key)
        unpack(open_sealed(blob, SEALING[task.silo]), bound, KEYS.roster)
    visits = [o for o in run.outcomes if o.phase.startswith("visit_")]
    *handing_on, last = visits
    for outcome in handing_on:
        assert not outcome.tensors and not outcome.mean and len(outcome.routes) == 1
    ((silo, tensors),) = last.tensors.items()
    assert set(tensors) == {MODEL} and torch.equal(tensors[MODEL], run.history.state.model)
    assert silo == Cyclic(p).cycle(context(p, 1))[-1]


def test_a_hand_off_not_delivered_abandons_the_round() -> None:
    p = policy(rounds=1)
    second = Cyclic(p).cycle(context(p, 1))[1]
    run = Run(p, wrap=failing(second, "daisy_receive", round_no=1))
    record = run.history.records[0]
    assert record.status == "failed" and "did not reach" in record.error
    # the silo whose delivery failed never trains the stale model it hosts
    assert not [t for t in run.tasks if t.kind == "daisy_train" and t.silo == second]


def test_a_run_resumed_after_a_coordinator_stop_equals_the_uninterrupted_one(
    tmp_path: Path,
) -> None:
    p = policy(rounds=4)
    with StateStore(tmp_path / "state.db") as store:
        Run(p.model_copy(update={"rounds": 2}), store)
    with StateStore(tmp_path / "state.db") as store:
        resumed = Run(p, store)  # fresh agents: each round's first silo adopts its model
    with StateStore(tmp_path / "fresh.db") as store:
        uninterrupted = Run(p, store)
    assert torch.equal(resumed.history.state.model, uninterrupted.history.state.model)
    resumed_rounds = {t.round for t in resumed.tasks if t.kind == "daisy_train"}
    assert resumed_rounds == {3, 4}


@pytest.mark.parametrize(
    ("changes", "match"),
    [
        ({"channel": {"sealed_handoffs": False}}, "one silo's exact update"),
        ({"participants": {"min_silos": 2}}, "min_silos"),
        ({"secure_aggregation": "masking"}, "secure_aggregation"),
        ({"privacy": {"client_dp": {"noise_multiplier": 1.0, "clip": 1.0}}}, "client_dp"),
    ],
)
def test_what_cyclic_cannot_run_with_is_refused(changes: dict, match: str) -> None:
    with pytest.raises(PolicyError, match=match):
        policy(**changes)
