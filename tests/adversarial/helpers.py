"""Shared pieces of the deviating-coordinator tests: real, unmodified silo agents with a DP
policy, a ledger, a state folder and a provisioned identity, and task messages crafted the way
a coordinator would send them (in process, through `SiloAgent.respond`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from nacl.signing import SigningKey

from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.privacy.ledger import PrivacyLedger
from fedsilo.silo.agent import SiloAgent
from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tasks import InitTask, TaskConfig
from tests.test_dp_training import LINEAR
from tests.test_tasks import separable, train_config

DEPLOYMENT = "consortium"
JOB = "ab" * 32  # the digest of the signed policy the silo accepted
DP = {"delta": 1e-5, "dp_sgd": {"noise_multiplier": 1.0}}


@dataclass(frozen=True)
class SiloSite:
    """What a hospital keeps on disk for its silo: identity, ledger file and state folder."""

    folder: Path
    name: str = "a"
    identity: SigningKey = SigningKey(b"\x07" * 32)

    @property
    def ledger_path(self) -> Path:
        return self.folder / "privacy-ledger.jsonl"

    @property
    def state_path(self) -> Path:
        return self.folder / "silo-state"

    def agent(self, job: str = JOB, **privacy: object) -> SiloAgent:
        """A silo agent started on this site's files, under the policy digest `job`."""
        self.folder.mkdir(parents=True, exist_ok=True)
        return SiloAgent(
            self.name,
            separable(),
            LINEAR,
            policy_digest=job,
            privacy=PrivacyConfig.model_validate({**DP, **privacy}),
            rounds=10,
            secret=bytes(self.identity),
            ledger=PrivacyLedger(self.ledger_path),
            deployment=DEPLOYMENT,
            identity=self.identity,
            roster={self.name: self.identity.verify_key},
            state=self.state_path,
        )


def task(
    agent: SiloAgent,
    config: TaskConfig,
    model: TaskResult | None = None,
    *,
    round: int = 1,
    task_id: str | None = None,
) -> TaskMessage:
    """A task as the coordinator builds it (`<deployment>/r<k>/<phase>/<silo>`)."""
    kind = config.KIND
    return TaskMessage(
        task_id or f"{DEPLOYMENT}/r{round}/{kind}/{agent.name}",
        round,
        kind,
        agent.name,
        config,
        dict(model.tensors) if model else {},
        model.spec if model else None,
        policy_digest=agent.policy_digest or "",
    )


def initial_model(agent: SiloAgent, seed: int = 0) -> TaskResult:
    return agent.respond(task(agent, InitTask(seed=seed), round=0))[0]


def train(agent: SiloAgent, model: TaskResult, **message: object) -> tuple[TaskResult, bytes]:
    """The silo's result and the bytes of its encoded answer."""
    result, answer = agent.respond(task(agent, train_config(epochs=2), model, **message))
    return result, answer.to_bytes()


def shifted(model: TaskResult, by: float) -> TaskResult:
    """`model` with every parameter moved by `by`: a different model under the same task id."""
    return TaskResult(
        model.task_id,
        model.silo,
        model.kind,
        tensors={"model": model.tensors["model"] + by},
        spec=model.spec,
    )


def update(trained: TaskResult, sent: TaskResult) -> torch.Tensor:
    return trained.tensors["model"].double() - sent.tensors["model"].double()
