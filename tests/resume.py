"""A run stopped after some rounds and resumed from its state store, beside the same run
uninterrupted: what the resume tests of stateful strategies compare."""

from __future__ import annotations

from pathlib import Path

import torch

from fedsilo.coordinator.engine import RoundEngine, RunHistory
from fedsilo.coordinator.state import StateStore
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.sim_silos import ConsortiumKeys, build_agent
from fedsilo.policies.schema import Policy
from fedsilo.silo.data import load_consortium


def resumed_and_uninterrupted(
    policy: Policy, folder: Path, stop_after: int
) -> tuple[RunHistory, RunHistory]:
    """The policy's run stopped after `stop_after` rounds and resumed (fresh agents, the same
    state file), and the same run in one go."""
    datasets = load_consortium(policy.data, seed=policy.seed)
    keys = ConsortiumKeys.generate(d.name for d in datasets)

    def engine(rounds: int, store: StateStore) -> RoundEngine:
        shorter = policy.model_copy(update={"rounds": rounds})
        agents = {
            d.name: build_agent(shorter, d.name, d, torch.device("cpu"), keys) for d in datasets
        }
        transport = InProcessTransport({n: a.handle_bytes for n, a in agents.items()})
        return RoundEngine(
            make_strategy(shorter), transport, shorter, sorted(agents), store=store,
            policy_digest="pinned",
        )  # fmt: skip

    with StateStore(folder / "state.db") as store:
        engine(stop_after, store).run()
    with StateStore(folder / "state.db") as store:
        resumed = engine(policy.rounds, store).run()
    with StateStore(folder / "fresh.db") as store:
        uninterrupted = engine(policy.rounds, store).run()
    return resumed, uninterrupted
