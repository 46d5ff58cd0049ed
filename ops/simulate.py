"""A whole consortium simulated: the policy's data split into silos, one agent per silo, a
transport to them (in process, or Ray actors: ops/ray_backend.py), and the round engine running
the policy's strategy.

Under a DP policy every simulated silo keeps a privacy ledger, booked by the same agent code a
deployment's silo runs (`silo/agent.py`, `privacy/ledger.py`): the caps are enforced, each
round's record holds each silo's epsilon and ledger head, and the ledgers' bytes come back in
the result (`SimulationResult.ledgers`) for the results folder."""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Mapping, Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fedsilo.coordinator.engine import EngineObserver, RoundEngine, RunHistory
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.strategies.references import POOLED_SILO, Central
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.models.plugins import PluginError
from fedsilo.ops.backends import BACKENDS, IN_PROCESS, RAY
from fedsilo.ops.memory import keep_freed_memory
from fedsilo.ops.sim_silos import ConsortiumKeys, build_agent, read_ledgers
from fedsilo.ops.synthetic import snapshots_for
from fedsilo.policies.loading import PolicyError
from fedsilo.policies.model import PluginModel
from fedsilo.policies.schema import Policy
from fedsilo.silo.data import DataError, SiloDataset, load_consortium, pool
from fedsilo.silo.data.plugins import is_plugin_task, task_plugin
from fedsilo.silo.device import resolve_device
from fedsilo.silo.domains import check_domains
from fedsilo.silo.errors import DataNotHere, DpSgdError
from fedsilo.silo.evaluation import per_sample_loss_function
from fedsilo.silo.readiness import check_model_for
from fedsilo.wire.tasks import LossProbe


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
    """What `fedsilo.simulate` returns: the `policy` it ran, its `history` (a `RunHistory`:
    `history.records` is every round's record, `history.final` the final evaluation), the
    `silos` (size and label rate of each), the `task`, the `device`, the run's `seconds`, and
    `headline_metric` (the metric that selects: accuracy, rmse or a task plug-in's)."""

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


def check_consortium(
    policy: Policy, datasets: Sequence[SiloDataset], *, model: bool = True
) -> None:
    """What a deployment checks before a job, on the simulated consortium: the policy fits its
    number of silos and their names (quorum, algorithm, secure aggregation: the coordinator's
    check), its algorithm the data's task, and, with
    `model`, the model builds and trains on each silo's data (each silo's); a PolicyError,
    PluginError or DpSgdError naming the field."""
    tasks = {(d.task, d.num_classes) for d in datasets}
    problem = (
        policy.consortium_problem(len(datasets))
        or policy.secure_aggregation.roster_problem([d.name for d in datasets])
        or next(filter(None, (policy.algorithm.task_problem(*t) for t in sorted(tasks))), None)
        or next(filter(None, (_per_row_loss_problem(policy, t) for t, _ in sorted(tasks))), None)
    )
    if problem:
        raise PolicyError(problem)
    if not model:
        return
    for data in {(d.input_shape, d.output_dim): d for d in datasets}.values():
        try:
            parameters = check_model_for(policy, data)
        except (PluginError, DpSgdError):
            raise
        except ValueError as error:
            raise PolicyError(str(error)) from None
        problem = policy.algorithm.model_problem(policy, len(datasets), parameters)
        if problem:
            raise PolicyError(problem)


def _per_row_loss_problem(policy: Policy, task: str) -> str | None:
    """Why `policy` needs per-row losses `task` does not have (the survival task's Cox loss,
    a task plug-in without `per_sample_loss`), or None."""
    if policy.privacy.dp_sgd is not None:
        needs = "privacy.dp_sgd: DP-SGD clips each row's gradient, of that row's loss"
    elif policy.privacy.differentially_private:
        needs = (
            "privacy: under DP each loss a silo reports is a mean of per-row losses clipped to "
            "[0, loss_bound]"
        )
    elif any(rule.kind == LossProbe.KIND for rule in policy.algorithm.silo_contract(policy).rules):
        name = policy.algorithm.name
        needs = f"algorithm: {name} probes each silo's loss, a mean of per-row losses"
    else:
        return None
    try:
        per_sample_loss_function(task)
    except ValueError as error:
        return f"{needs}; {error}"
    return None


def consortium_report(policy: Policy, base_dir: Path | None) -> str:
    """What `policy validate` says of the consortium the data section makes on this machine:
    its silos, checked as `simulate` checks them (`check_consortium`: a PolicyError, DataError,
    PluginError or DpSgdError when they do not fit), or, where the data is not here (a site's
    own file, a data plug-in not installed here), that it was not checked."""
    try:
        datasets = load_silos(policy, base_dir)
    except DataNotHere as error:
        return f"data: not checked here ({error}); simulate and each silo check it where it is"
    # a plug-in network is checked where it is installed (ops/model_cli.py `plugin_report`)
    plugin = isinstance(policy.model, PluginModel)
    check_consortium(policy, datasets, model=not plugin)
    rows = sum(len(d.y_train) + len(d.y_val) + len(d.y_test) for d in datasets)
    model = "" if plugin else " and its model each silo's data"
    return (
        f"data: {len(datasets)} silos, {rows} rows, a {datasets[0].task} task; the policy fits "
        f"that consortium{model}"
    )


def simulate(
    policy: Policy,
    datasets: Sequence[SiloDataset] | None = None,
    observers: Sequence[EngineObserver] = (),
    backend: str = IN_PROCESS,
    address: str | None = None,
) -> SimulationResult:
    """Run `policy` on `datasets` (default: the silos its data section yields), every silo an
    agent of its own, and return the run. `backend`: the silos in this process (`inprocess`)
    or in Ray actors (`ray`, ops/ray_backend.py: on the cluster at `address`, else on a local
    instance, unless a Ray session is open already); the results are the same bit for bit."""
    if backend not in BACKENDS:
        raise ValueError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
    started = time.perf_counter()
    if datasets is None:
        datasets = load_silos(policy, None)
    check_consortium(policy, datasets)
    keys = ConsortiumKeys.generate(d.name for d in datasets)
    strategy = make_strategy(policy)
    silos = {d.name: d for d in datasets}
    if isinstance(strategy, Central):
        silos[POOLED_SILO] = pool(datasets)
    snapshots = snapshots_for(policy)
    with ExitStack() as stack:
        ledgers = (  # in this process; Ray's actors keep theirs in their own temporary folders
            Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="fedsilo-ledgers-")))
            if policy.privacy.differentially_private and backend != RAY
            else None
        )
        if backend == RAY:
            from fedsilo.ops.ray_backend import ray_session, start_silos

            ray = stack.enter_context(ray_session(address))
            transport, device_note = start_silos(ray, policy, silos, keys)
        else:
            keep_freed_memory()  # every silo's buffers come back each round (ops/memory.py)
            device, device_note = resolve_device(policy.compute.device)
            endpoints = {
                name: build_agent(policy, name, data, device, keys, ledgers).handle_bytes
                for name, data in silos.items()
            }
            transport = InProcessTransport(endpoints, max_parallel=min(4, os.cpu_count() or 1))
        stack.callback(transport.close)
        engine = RoundEngine(
            strategy,
            transport,
            policy,
            [d.name for d in datasets],
            [*observers, *([snapshots] if snapshots else [])],
            handoff_keys={name: bytes(key) for name, key in keys.sealing_roster.items()},
        )
        history = engine.run()
        booked = transport.ledgers() if backend == RAY else read_ledgers(ledgers)
    return SimulationResult(
        policy=policy,
        history=history,
        silos=tuple(SiloProfile.of(d) for d in datasets),
        task=datasets[0].task,
        device=device_note,
        seconds=time.perf_counter() - started,
        snapshots=snapshots.taken if snapshots else {},
        ledgers=booked,
    )
