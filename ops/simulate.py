"""A whole consortium in one process: the policy's data split into silos, one agent per silo,
the in-process transport, and the round engine running the policy's strategy.

Under a DP policy every simulated silo keeps a privacy ledger, booked by the same agent code a
deployment's silo runs (`silo/agent.py`, `privacy/ledger.py`): the caps are enforced, each
round's record holds each silo's epsilon and ledger head, and the ledgers' bytes come back in
the result (`SimulationResult.ledgers`) for the results folder."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch
from nacl.public import PrivateKey
from nacl.signing import SigningKey

from fedsilo.coordinator.engine import EngineObserver, RoundEngine, RunHistory
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.strategies.references import POOLED_SILO, Central
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.synthetic import snapshots_for
from fedsilo.policies.schema import Policy
from fedsilo.privacy.ledger import PrivacyLedger
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import DataError, SiloDataset, load_consortium, pool
from fedsilo.silo.data.plugins import is_plugin_task, task_plugin
from fedsilo.silo.device import resolve_device
from fedsilo.silo.domains import check_domains
from fedsilo.silo.readiness import check_model_for


@dataclass(frozen=True)
class SiloProfile:
    """What the report says about a silo's data (sizes, and the label rate for binary tasks)."""

    name: str
    train: int
    val: int
    test: int
    positive_rate: float | None

    @classmethod
    def of(cls, data: SiloDataset) -> SiloProfile:
        rate = (
            float(data.y_train.float().mean())
            if data.num_classes == 2 and len(data.y_train)
            else None
        )
        return cls(data.name, len(data.y_train), len(data.y_val), len(data.y_test), rate)


@dataclass(frozen=True)
class SimulationResult:
    policy: Policy
    history: RunHistory
    silos: tuple[SiloProfile, ...]
    task: str
    device: str
    seconds: float
    # FedEvg: the synthetic set (points, labels) every `image_every` rounds, by round
    snapshots: Mapping[int, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # a DP policy: each silo's privacy ledger (JSONL bytes), by silo
    ledgers: Mapping[str, bytes] = field(default_factory=dict)

    @property
    def headline_metric(self) -> str:
        if is_plugin_task(self.task):  # a task plug-in names the metric that selects
            return task_plugin(self.task).selection
        return "accuracy" if self.task == "classification" else "rmse"


def load_silos(policy: Policy, base_dir: Path | None) -> list[SiloDataset]:
    datasets = load_consortium(policy.data, policy.seed, base_dir=base_dir)
    if any(d.name == POOLED_SILO for d in datasets):
        raise DataError(
            f"a silo may not be named {POOLED_SILO!r}: the central reference uses that name"
        )
    for data in datasets:
        try:
            check_domains(policy, data)
        except ValueError as error:
            raise DataError(str(error)) from error
    return datasets


def simulate(
    policy: Policy,
    datasets: Sequence[SiloDataset] | None = None,
    observers: Sequence[EngineObserver] = (),
) -> SimulationResult:
    """Run `policy` on `datasets` (default: the silos its data section yields) in one
    process, every silo an agent of its own (with a privacy ledger under a DP policy), and
    return the run."""
    if not policy.privacy.differentially_private:
        return _simulate(policy, datasets, observers, None)
    with tempfile.TemporaryDirectory(prefix="fedsilo-ledgers-") as folder:
        return _simulate(policy, datasets, observers, Path(folder))


def _simulate(
    policy: Policy,
    datasets: Sequence[SiloDataset] | None,
    observers: Sequence[EngineObserver],
    ledgers: Path | None,
) -> SimulationResult:
    """`ledgers`: the folder each silo's ledger (`<silo>.jsonl`) is booked in (None: none)."""
    started = time.perf_counter()
    if datasets is None:
        datasets = load_silos(policy, None)
    for data in {(d.input_shape, d.output_dim): d for d in datasets}.values():
        check_model_for(policy, data)  # what each silo of a deployment checks before it accepts
    device, device_note = resolve_device(policy.compute.device)

    # Simulated silos get fresh identities, known to each other: what provisioning gives a
    # deployment, and what secure aggregation's signed keys need.
    identities = {d.name: SigningKey.generate() for d in datasets}
    roster = {name: key.verify_key for name, key in identities.items()}
    sealing = {d.name: PrivateKey.generate() for d in datasets}
    sealing_roster = {name: key.public_key for name, key in sealing.items()}

    def agent(name: str, data: SiloDataset) -> SiloAgent:
        ledger = None if ledgers is None else PrivacyLedger(ledgers / f"{name}.jsonl")
        return SiloAgent(
            name,
            data,
            policy.model,
            device,
            privacy=policy.privacy,
            rounds=policy.rounds,
            ledger=ledger,
            deployment=policy.name,
            consortium=len(datasets),
            secure_aggregation=policy.silo_secure_aggregation,
            algorithm=policy.algorithm,
            identity=identities.get(name),
            roster=roster,
            sealing_key=sealing.get(name),
            sealing_roster=sealing_roster,
        )

    endpoints = {d.name: agent(d.name, d).handle_bytes for d in datasets}
    strategy = make_strategy(policy)
    if isinstance(strategy, Central):
        endpoints[POOLED_SILO] = agent(POOLED_SILO, pool(datasets)).handle_bytes
    transport = InProcessTransport(endpoints, max_parallel=min(4, os.cpu_count() or 1))
    snapshots = snapshots_for(policy)
    engine = RoundEngine(
        strategy,
        transport,
        policy,
        [d.name for d in datasets],
        [*observers, *([snapshots] if snapshots else [])],
        handoff_keys={name: bytes(key) for name, key in sealing_roster.items()},
    )
    try:
        history = engine.run()
    finally:
        transport.close()
    return SimulationResult(
        policy=policy,
        history=history,
        silos=tuple(SiloProfile.of(d) for d in datasets),
        task=datasets[0].task,
        device=device_note,
        seconds=time.perf_counter() - started,
        snapshots=snapshots.taken if snapshots else {},
        ledgers=(
            {p.stem: p.read_bytes() for p in sorted(ledgers.glob("*.jsonl"))} if ledgers else {}
        ),
    )
