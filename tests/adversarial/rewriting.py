"""A deviating coordinator in this process: the real round engine (its secure aggregation, its
hand-offs, its task ids) speaking the real protocol to unmodified silo agents, each built by
the simulation's own builder from the signed policy (`ops/sim_silos.py: build_agent`), with a
hook that rewrites any task on its way to a silo and a record of every answer.

An attack is a rewrite (change what the honest engine would send) or a phase the test writes
itself, run with `engine.execute`; `ask` sends one hand-written task. What a test may then use
is what a coordinator holds: the answers.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

import numpy as np
import torch

from fedsilo.coordinator.engine import RoundEngine
from fedsilo.coordinator.phases import Identical, Phase, Task
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.strategies.base import RoundContext
from fedsilo.coordinator.transport import InProcessTransport
from fedsilo.ops.sim_silos import ConsortiumKeys, build_agent
from fedsilo.policies.loading import parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import SiloDataset, load_consortium
from fedsilo.wire.messages import SIMULATION, TaskMessage, TaskResult
from fedsilo.wire.tasks import InitTask, TaskConfig
from fedsilo.wire.tasks.tensor_names import MODEL
from fedsilo.wire.tensors import ParameterSpec

Rewrite = Callable[[TaskMessage], TaskMessage]


def policy(method: str = "masking", **overrides: object) -> Policy:
    """FedAvg of a linear model over three silos of breast-cancer rows, `method` secure
    aggregation, no DP; `overrides` replace top-level sections."""
    document: dict = {
        "version": 1,
        "seed": 5,
        "rounds": 3,
        "algorithm": {"name": "fedavg"},
        "model": {"name": "linear"},
        "training": {"epochs": 1, "batch_size": 32, "lr": 0.1},
        "participants": {"min_silos": 2, "phase_timeout_s": 60},
        "data": {"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": 3}},
        "secure_aggregation": {"method": method},
    }
    return parse_policy(document | overrides)


@dataclass(frozen=True)
class Answered:
    message: TaskMessage
    result: TaskResult


@dataclass
class Consortium:
    """The policy's silos, built as `fedsilo simulate` builds them, behind a rewriting hook."""

    policy: Policy
    rewrite: Rewrite = field(default=lambda message: message)
    datasets: dict[str, SiloDataset] = field(init=False)
    keys: ConsortiumKeys = field(init=False)
    agents: dict[str, SiloAgent] = field(init=False)
    answers: list[Answered] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        loaded = load_consortium(self.policy.data, seed=self.policy.seed)
        self.datasets = {d.name: d for d in loaded}
        self.keys = ConsortiumKeys.generate(self.datasets)
        self.agents = {
            name: build_agent(self.policy, name, data, torch.device("cpu"), self.keys)
            for name, data in self.datasets.items()
        }

    @property
    def silos(self) -> list[str]:
        return sorted(self.agents)

    def engine(self) -> RoundEngine:
        endpoints = {name: self._endpoint(name) for name in self.agents}
        return RoundEngine(
            make_strategy(self.policy),
            InProcessTransport(endpoints, max_parallel=1),
            self.policy,
            self.silos,
            handoff_keys={n: bytes(k) for n, k in self.keys.sealing_roster.items()},
        )

    def _endpoint(self, name: str) -> Callable[[object], bytes]:
        def call(payload: object) -> bytes:
            message = self.rewrite(TaskMessage.decode(payload))  # type: ignore[arg-type]
            return self.ask(message).encode()

        return call

    def ask(self, message: TaskMessage) -> TaskResult:
        """One task, encoded as the network carries it, to its silo; what the silo answered."""
        result = TaskResult.decode(self.agents[message.silo].handle_bytes(message.encode()))
        self.answers.append(Answered(message, result))
        return result

    def refusals(self, kind: str | None = None) -> dict[str, str]:
        """Each silo's last refusal (of a `kind` task, when given)."""
        return {
            a.message.silo: a.result.error or ""
            for a in self.answers
            if not a.result.ok and kind in (None, a.message.kind)
        }

    def answered(self, kind: str) -> dict[str, TaskResult]:
        """Each silo's last accepted answer to a `kind` task."""
        return {
            a.message.silo: a.result for a in self.answers if a.result.ok and a.message.kind == kind
        }

    def initial_model(self) -> tuple[torch.Tensor, ParameterSpec]:
        """Round 0's `init` phase, run honestly: the model every silo builds from the seed."""
        from fedsilo.policies.seeding import derive_seed

        config = InitTask(seed=derive_seed(self.policy.seed, "model-init"))
        phase = Phase("init", tuple(Task(s, config) for s in self.silos), Identical((MODEL,)))
        out = self.engine().execute(phase, 0)
        ((_, tensors),) = out.tensors.items()
        assert out.spec is not None
        return tensors[MODEL], out.spec

    def context(self, round_no: int = 1) -> RoundContext:
        return RoundContext(
            round=round_no,
            total_rounds=self.policy.rounds,
            silos=tuple(self.silos),
            seed=self.policy.seed,
            min_silos=self.policy.participants.min_silos,
        )

    def train_task(self, silo: str, model: torch.Tensor, spec: ParameterSpec, round_no: int = 1):
        """The honest strategy's train task for `silo` in round `round_no`."""
        return make_strategy(self.policy).train_task(silo, model, spec, self.context(round_no))

    def message(
        self,
        silo: str,
        config: TaskConfig,
        *,
        round_no: int = 1,
        phase: str = "train",
        tensors: Mapping[str, torch.Tensor] | None = None,
        spec: ParameterSpec | None = None,
        step: str | None = None,
    ) -> TaskMessage:
        """A task worded as the engine words it (its task id from deployment, round, phase,
        step and silo)."""
        prefix = f"{SIMULATION}/r{round_no}/{phase}" + (f"/{step}" if step else "")
        return TaskMessage(
            f"{prefix}/{silo}", round_no, phase, silo, config, dict(tensors or {}), spec
        )


def trained_alone(
    c: Consortium, silo: str, task: Task, round_no: int = 1, phase: str = "train"
) -> dict[str, torch.Tensor]:
    """What `silo` answers to the honest `task` under the same policy without secure
    aggregation (training is seeded by the task, so it is the update the silo would mask)."""
    plain = policy("none") if c.policy.secure_aggregation.enabled else c.policy
    plain = c.policy.model_copy(update={"secure_aggregation": plain.secure_aggregation})
    alone = Consortium(plain)
    answer = alone.ask(
        alone.message(silo, task.config, round_no=round_no, phase=phase, tensors=task.tensors,
                      spec=task.spec)
    )  # fmt: skip
    assert answer.ok, answer.error
    return dict(answer.tensors)


def close(estimate: np.ndarray, truth: np.ndarray, tolerance: float = 1e-3) -> bool:
    """Whether `estimate` is `truth` to the fixed-point precision of a masked sum."""
    scale = max(1.0, float(np.abs(truth).max()))
    same_shape = estimate.shape == truth.shape
    return same_shape and bool(np.abs(estimate - truth).max() < tolerance * scale)
