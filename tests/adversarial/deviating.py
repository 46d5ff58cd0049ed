"""A deviating coordinator over real processes: the real `CoordinatorService` and `SiloHub`,
served over mutual-TLS gRPC from the test process for a consortium provisioned by
tests/deployment.py, whose tasks the test writes by hand instead of a round engine.

Unmodified silos run as real `fedsilo silo start` processes: they join, check the operator's
signature on the policy, accept it, and then answer whatever task is posted to them, exactly
as they would answer an honest coordinator. The test reads back the bytes each silo answered.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import torch

from fedsilo.coordinator.hub import PostedTask, SiloHub
from fedsilo.coordinator.service import CoordinatorService
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.strategies.base import RoundContext
from fedsilo.coordinator.transport import Reply
from fedsilo.ops.coordinator_process import grpc_server, server_certificate, signed_policy
from fedsilo.ops.job_id import job_id
from fedsilo.ops.metrics import CoordinatorMetrics
from fedsilo.ops.provision import load_coordinator_kit
from fedsilo.policies.algorithms.contract import init_config
from fedsilo.policies.loading import parse_policy_text
from fedsilo.wire.envelope import EnvelopeVerifier
from fedsilo.wire.messages import TASK_STEPS, TaskMessage, TaskResult
from fedsilo.wire.messages import task_id as wire_task_id
from fedsilo.wire.payload import as_payload
from fedsilo.wire.tasks import TaskConfig
from fedsilo.wire.tensors import ParameterSpec
from tests.deployment import Consortium


@dataclass(frozen=True)
class Answer:
    """What a silo sent back for a task: the exact payload bytes, and their decoding."""

    raw: bytes
    result: TaskResult


class DeviatingCoordinator:
    """Serves the consortium's coordinator address with the real service; `ask` posts one
    hand-crafted task to one silo and waits for its answer."""

    def __init__(self, consortium: Consortium, policy: Path) -> None:
        kit = load_coordinator_kit(consortium.kits / "coordinator")
        self.signed = signed_policy(policy, kit)
        self.policy = parse_policy_text(self.signed.text)
        self.deployment = kit.consortium
        self.job = job_id(self.policy.name, self.signed.digest)  # what the silos' task ids name
        self.hub = SiloHub(sorted(kit.silos))
        verifier = EnvelopeVerifier(
            self.deployment, {name: silo.verify_key for name, silo in kit.silos.items()}
        )
        service = CoordinatorService(
            self.deployment,
            self.hub,
            verifier,
            kit.signing_key,
            self.signed,
            CoordinatorMetrics(deployment=self.deployment),
            max_payload_bytes=1 << 30,
            poll_seconds=0.5,
        )
        self.server = grpc_server(kit, service, workers=16, certificate=server_certificate(kit))
        self.server.start()

    def __enter__(self) -> DeviatingCoordinator:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.hub.finish()
        self.server.stop(grace=0.5).wait()

    def wait_until_accepted(self, silo: str, consortium: Consortium, timeout_s: float = 90) -> None:
        """Wait for `silo` to accept the policy (failing at once if a process failed)."""
        deadline = time.monotonic() + timeout_s
        while silo not in self.hub.accepted:
            consortium.check_running()
            if silo in self.hub.refused:
                raise AssertionError(f"{silo} refused the policy: {self.hub.refused[silo]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{silo} did not accept the policy:\n{consortium.log(silo)}")
            time.sleep(0.1)

    def task(
        self,
        silo: str,
        config: TaskConfig,
        *,
        round_no: int = 1,
        phase: str = "train",
        tensors: Mapping[str, torch.Tensor] | None = None,
        spec: ParameterSpec | None = None,
        task_id: str | None = None,
    ) -> TaskMessage:
        """A task as the honest engine would word it, under the signed policy's digest."""
        step = TASK_STEPS.get(config.KIND)
        return TaskMessage(
            task_id or wire_task_id(self.job, round_no, phase, step, silo),
            round_no,
            phase,
            silo,
            config,
            dict(tensors or {}),
            spec,
            policy_digest=self.signed.digest,
        )

    def initial_model(self, silo: str) -> TaskResult:
        """Setup's `init` task, as the honest engine words it: the model of the policy's seed."""
        message = self.task(silo, init_config(self.policy), round_no=0, phase="init")
        answer = self.ask(message).result
        assert answer.ok, answer.error
        return answer

    def train_task(
        self, silo: str, initial: TaskResult, round_no: int = 1, task_id: str | None = None
    ) -> TaskMessage:
        """A plain `train` task from `initial`'s model, with the policy's training settings."""
        context = RoundContext(
            round=round_no,
            total_rounds=self.policy.rounds,
            silos=tuple(sorted(self.hub.roster)),
            seed=self.policy.seed,
            min_silos=self.policy.participants.min_silos,
        )
        assert initial.spec is not None
        honest = make_strategy(self.policy).train_task(
            silo, initial.tensors["model"], initial.spec, context
        )
        return self.task(
            silo,
            honest.config,
            round_no=round_no,
            tensors=honest.tensors,
            spec=honest.spec,
            task_id=task_id,
        )

    def ask(self, message: TaskMessage, timeout_s: float = 90) -> Answer:
        """Post `message` to its silo's next poll and return what the silo answered."""
        replies: queue.Queue[Reply] = queue.Queue()
        self.hub.post(
            PostedTask(message.silo, message.task_id, message.round, as_payload(message.encode())),
            replies,
        )
        try:
            reply = replies.get(timeout=timeout_s)
        except queue.Empty:
            self.hub.withdraw({message.task_id})
            raise AssertionError(f"{message.silo} did not answer {message.task_id}") from None
        assert reply.payload is not None, f"{message.silo}: {reply.failure}"
        raw = as_payload(reply.payload).to_bytes()
        return Answer(raw, TaskResult.decode(raw))
