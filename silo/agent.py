"""The silo agent: receives task messages, runs the matching handler on local data, and
answers with a result. Any failure becomes an error result for that task; it never takes
the agent down or leaks a partial answer."""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from fedsilo.policies.model import ModelConfig
from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.silo.data import SiloDataset
from fedsilo.silo.tasks import TASK_HANDLERS
from fedsilo.silo.tasks.base import SiloContext
from fedsilo.wire.messages import STATUS_ERROR, TaskMessage, TaskResult
from fedsilo.wire.tensors import WireError


class SiloAgent:
    def __init__(
        self,
        name: str,
        data: SiloDataset,
        model_config: ModelConfig,
        device: torch.device | str = "cpu",
        policy_digest: str | None = None,
        *,
        privacy: PrivacyConfig | None = None,
        rounds: int = 1,
    ) -> None:
        """`policy_digest`: the policy this silo accepted; tasks under another are refused
        (None in simulations, where there is no signed policy). `privacy` and `rounds`: that
        policy's privacy section and length, the only source of this silo's DP parameters."""
        self.context = SiloContext(
            name,
            data,
            model_config,
            torch.device(device),
            privacy=privacy or PrivacyConfig(),
            rounds=rounds,
        )
        self.policy_digest = policy_digest

    @property
    def name(self) -> str:
        return self.context.name

    def handle(self, message: TaskMessage) -> TaskResult:
        started = time.perf_counter()
        if message.silo != self.name:
            return self._refuse(
                message, f"task is addressed to {message.silo!r}, this is {self.name!r}"
            )
        if self.policy_digest is not None and message.policy_digest != self.policy_digest:
            return self._refuse(
                message,
                f"task runs under policy {message.policy_digest[:12] or 'none'!r}; "
                f"this silo accepted {self.policy_digest[:12]!r} only",
            )
        handler = TASK_HANDLERS.get(message.kind)
        if handler is None:
            return self._refuse(
                message, f"unknown task kind {message.kind!r}; known: {sorted(TASK_HANDLERS)}"
            )
        try:
            result = handler(message, self.context)
        except Exception as exc:  # reported to the coordinator as this task's failure
            return self._refuse(message, f"{type(exc).__name__}: {exc}")
        return replace(result, compute_seconds=time.perf_counter() - started)

    def handle_bytes(self, payload: bytes) -> bytes:
        try:
            message = TaskMessage.decode(payload)
        except WireError as exc:
            return TaskResult(
                "unknown", self.name, "unknown", STATUS_ERROR, error=str(exc)
            ).encode()
        return self.handle(message).encode()

    def _refuse(self, message: TaskMessage, why: str) -> TaskResult:
        return TaskResult(message.task_id, self.name, message.kind, STATUS_ERROR, error=why)
