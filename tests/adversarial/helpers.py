"""Shared pieces of the deviating-coordinator tests: real, unmodified silo agents built from a
DP policy, with a ledger, a state folder and a provisioned identity, and the tasks their
contract asks for, sent the way a coordinator would send them (in process, through
`SiloAgent.respond`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from nacl.signing import SigningKey

from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.policies.schema import Policy
from fedsilo.privacy.ledger import PrivacyLedger
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.tasks.base import SiloKeys
from fedsilo.wire.messages import TaskMessage, TaskResult
from tests.silos import honest, policy_with
from tests.test_dp_training import LINEAR
from tests.test_tasks import separable

DEPLOYMENT = "consortium"
JOB = "ab" * 32  # the digest of the signed policy the silo accepted
DP = {"delta": 1e-5, "dp_sgd": {"noise_multiplier": 1.0}}
ROUNDS = 10
# Each round: 2 epochs of SGD at 0.5 in batches of 16.
TRAINING = {"epochs": 2, "batch_size": 16, "lr": 0.5}


def dp_policy(**privacy: object) -> Policy:
    """`ROUNDS` rounds of FedAvg of a linear model, `TRAINING` locally, with DP-SGD (`DP`, the
    `privacy` sections given replacing its own)."""
    section = PrivacyConfig.model_validate({**DP, **privacy})
    return policy_with(rounds=ROUNDS, model=LINEAR, training=TRAINING, privacy=section)


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

    def agent(self, job: str = JOB, policy: Policy | None = None, **privacy: object) -> SiloAgent:
        """A silo agent started on this site's files, under the policy digest `job`: its policy
        `policy`, or `dp_policy(**privacy)`."""
        self.folder.mkdir(parents=True, exist_ok=True)
        return SiloAgent(
            self.name,
            separable(),
            policy or dp_policy(**privacy),
            policy_digest=job,
            secret=bytes(self.identity),
            ledger=PrivacyLedger(self.ledger_path),
            deployment=DEPLOYMENT,
            keys=SiloKeys(identity=self.identity, roster={self.name: self.identity.verify_key}),
            state=self.state_path,
        )


def task(
    agent: SiloAgent, phase: str, model: TaskResult | None = None, *, round: int = 1
) -> TaskMessage:
    """The task the silo's contract asks for at (`round`, `phase`), as the coordinator builds it
    (`<deployment>/r<k>/<phase>/<silo>`), carrying `model`."""
    tensors, spec = (model.tensors, model.spec) if model else (None, None)
    return honest(agent, phase, round, tensors, spec)


def initial_model(agent: SiloAgent) -> TaskResult:
    return agent.respond(task(agent, "init", round=0))[0]


def train(agent: SiloAgent, model: TaskResult, round: int = 1) -> tuple[TaskResult, bytes]:
    """The silo's result to round `round`'s train task from `model`, and the bytes of its
    encoded answer."""
    result, answer = agent.respond(task(agent, "train", model, round=round))
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
