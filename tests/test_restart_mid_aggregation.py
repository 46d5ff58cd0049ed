"""A coordinator killed in the middle of a secure aggregation and restarted from its state
store ends with the model of an uninterrupted run: at every step of a masked or CKKS round,
whether the silos had answered that step or not. The silos keep running (as deployed silos
do): each answers a task id it answered before with the same bytes (silo/answers.py) and an
advertise step again with the same public keys, so the restarted coordinator finishes the one
aggregation of the round that the silos already began; none of them ever takes a step of a
second aggregation of that round (silo/aggregation_log.py)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest
import torch

from fedsilo.coordinator.engine import RoundEngine, RunHistory
from fedsilo.coordinator.state import StateStore
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.transport import Delivery, InProcessTransport, Reply
from fedsilo.ops.sim_silos import ConsortiumKeys
from fedsilo.policies.schema import Policy
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import load_consortium
from fedsilo.wire.messages import TASK_STEPS, TaskResult
from tests.test_secure_aggregation import policy

MASKING_STEPS = ("secagg_share", "secagg_mask", "secagg_confirm", "secagg_unmask")
CKKS_STEPS = ("ckks_join", "ckks_encrypt", "ckks_confirm", "ckks_decrypt")
SMALL_CKKS = {"poly_modulus_degree": 4096, "coeff_mod_bit_sizes": [40, 20, 40]}
CKKS = {"method": "ckks", "ckks": {**SMALL_CKKS, "global_scale_bits": 20}}
ROUNDS = 3
KILLED_IN = 2
ALL = -1  # killed once every silo answered the step


class Killed(BaseException):
    """Stands in for SIGKILL: the coordinator stops where it is, saving nothing more."""


class KilledAt:
    """A transport that lets the coordinator die at the `answered`-th answer to the tasks of
    step `kind` in round `round_no` (0: before any is sent; ALL: after every answer came):
    the silos that got the step's tasks answered them, the coordinator recorded none."""

    def __init__(self, transport: InProcessTransport, kind: str, round_no: int, answered: int):
        self.transport, self.kind, self.round_no, self.answered = (
            transport, kind, round_no, answered,
        )  # fmt: skip

    def silos(self) -> list[str]:
        return self.transport.silos()

    def dispatch(self, deliveries: Iterable[Delivery], deadline: float) -> Iterator[Reply]:
        deliveries = list(deliveries)
        if not any(self._fatal(d) for d in deliveries):
            yield from self.transport.dispatch(deliveries, deadline)
            return
        if self.answered == 0:
            raise Killed(f"killed before sending {self.kind} of round {self.round_no}")
        replies = self.transport.dispatch(deliveries, deadline)
        if self.answered == ALL:
            list(replies)
            raise Killed(f"killed after every answer to {self.kind}")
        for number, reply in enumerate(replies, 1):
            if number == self.answered:
                raise Killed(f"killed after {number} answer(s) to {self.kind}")
            yield reply

    def _fatal(self, delivery: Delivery) -> bool:
        step = delivery.task_id.split("/")[-2]
        return step == TASK_STEPS[self.kind] and delivery.round == self.round_no

    def close(self) -> None:
        self.transport.close()


def silo_agents(p: Policy, folder: Path) -> dict[str, SiloAgent]:
    """`p`'s silos as deployed silos run: each keeps its state (answers, aggregation log) in
    a folder of its own under `folder`."""
    datasets = load_consortium(p.data, seed=p.seed)
    keys = ConsortiumKeys.generate(d.name for d in datasets)
    return {
        d.name: SiloAgent(d.name, d, p, keys=keys.of(d.name), state=folder / d.name)
        for d in datasets
    }


def engine(
    p: Policy, agents: dict[str, SiloAgent], store: StateStore, transport=None
) -> RoundEngine:
    transport = transport or InProcessTransport({n: a.handle_bytes for n, a in agents.items()})
    return RoundEngine(make_strategy(p), transport, p, sorted(agents), store=store)


def killed_and_restarted(
    p, folder: Path, kind: str, answered: int
) -> tuple[RunHistory, list[TaskResult]]:
    """`p` run with a coordinator killed at (`kind`, `answered`) of round KILLED_IN and
    restarted on the same state file, its silos running throughout; the restarted run's
    history, and every refusal a silo sent it."""
    agents = silo_agents(p, folder / "silos")
    with StateStore(folder / "state.db") as store, pytest.raises(Killed):
        inner = InProcessTransport({n: a.handle_bytes for n, a in agents.items()})
        engine(p, agents, store, KilledAt(inner, kind, KILLED_IN, answered)).run()
    refusals: list[TaskResult] = []

    def watched(endpoint):
        def answer(payload):
            reply = endpoint(payload)
            result = TaskResult.decode(reply)
            if result.status != "ok":
                refusals.append(result)
            return reply

        return answer

    transport = InProcessTransport({n: watched(a.handle_bytes) for n, a in agents.items()})
    with StateStore(folder / "state.db") as store:
        return engine(p, agents, store, transport).run(), refusals


def uninterrupted(p, folder: Path) -> RunHistory:
    agents = silo_agents(p, folder / "silos")
    with StateStore(folder / "state.db") as store:
        return engine(p, agents, store).run()


@pytest.fixture(scope="module")
def masked_reference(tmp_path_factory: pytest.TempPathFactory) -> RunHistory:
    return uninterrupted(policy("masking", rounds=ROUNDS), tmp_path_factory.mktemp("masked"))


@pytest.fixture(scope="module")
def ckks_reference(tmp_path_factory: pytest.TempPathFactory) -> RunHistory:
    return uninterrupted(policy(CKKS, rounds=ROUNDS), tmp_path_factory.mktemp("ckks"))


def assert_as_uninterrupted(resumed: RunHistory, reference: RunHistory) -> None:
    assert [r.status for r in resumed.records] == ["completed"] * ROUNDS
    for name, tensor in reference.state.tensors.items():
        assert torch.equal(resumed.state.tensors[name], tensor), name


@pytest.mark.parametrize("answered", [0, 1, ALL])
@pytest.mark.parametrize("kind", MASKING_STEPS)
def test_a_coordinator_killed_mid_masked_round_restarts_to_the_uninterrupted_model(
    kind: str, answered: int, tmp_path: Path, masked_reference: RunHistory
) -> None:
    resumed, refusals = killed_and_restarted(
        policy("masking", rounds=ROUNDS), tmp_path, kind, answered
    )
    assert refusals == []
    assert_as_uninterrupted(resumed, masked_reference)


@pytest.mark.parametrize("answered", [0, 1, ALL])
@pytest.mark.parametrize("kind", CKKS_STEPS)
def test_a_coordinator_killed_mid_ckks_round_restarts_to_the_uninterrupted_model(
    kind: str, answered: int, tmp_path: Path, ckks_reference: RunHistory
) -> None:
    resumed, refusals = killed_and_restarted(policy(CKKS, rounds=ROUNDS), tmp_path, kind, answered)
    assert refusals == []
    assert_as_uninterrupted(resumed, ckks_reference)
