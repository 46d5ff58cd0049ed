"""The silo agent: receives task messages, runs the matching handler on local data, and
answers with a result. Any failure becomes an error result for that task; it never takes
the agent down or leaks a partial answer.

With a privacy ledger, the agent books every answer it sends. Before running a task it asks
what the task would release (`TASK_RELEASES`) and what epsilon the deployment would reach with
it; above the cap (the stricter of the policy's and the silo's own) it refuses with a
`budget_exhausted` result instead, and the coordinator retires the silo for the deployment.
An answer carries that epsilon and the ledger head before its booking (the anchor a privacy
officer audits against); it is booked, fsynced, before it is returned for sending.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path

import torch
from nacl.public import PrivateKey, PublicKey
from nacl.signing import SigningKey, VerifyKey

from fedsilo.policies.model import ModelConfig
from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.policies.secure_aggregation import SecureAggregationConfig
from fedsilo.privacy.accounting import Mechanism
from fedsilo.privacy.ledger import PrivacyLedger, payload_digest
from fedsilo.silo.data import SiloDataset
from fedsilo.silo.state import LocalState
from fedsilo.silo.tasks import TASK_HANDLERS, TASK_RELEASES
from fedsilo.silo.tasks.base import SiloContext
from fedsilo.wire.messages import (
    STATUS_BUDGET_EXHAUSTED,
    STATUS_ERROR,
    TaskMessage,
    TaskResult,
)
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
        secret: bytes = b"",
        ledger: PrivacyLedger | None = None,
        deployment: str = "simulation",
        epsilon_cap: float | None = None,
        consortium: int = 1,
        secure_aggregation: SecureAggregationConfig | None = None,
        identity: SigningKey | None = None,
        roster: Mapping[str, VerifyKey] | None = None,
        sealing_key: PrivateKey | None = None,
        sealing_roster: Mapping[str, PublicKey] | None = None,
        state: Path | None = None,
    ) -> None:
        """`policy_digest`: the policy this silo accepted; tasks under another are refused
        (None in simulations, where there is no signed policy). `privacy` and `rounds`: that
        policy's privacy section and length, the only source of this silo's DP parameters.
        `secret`: key material that seeds the silo's noise. `ledger`: where every answer of
        `deployment` is booked (None: nothing is booked, no budget is enforced);
        `epsilon_cap`: the silo's own cap, enforced beside the policy's. `consortium`: how many
        silos the deployment has (a round can ask no more to share its client-level noise).
        `secure_aggregation`: the policy's section; `identity` signs this silo's masking keys
        and `roster` (every member's verify key) checks its peers'. `sealing_key` opens what
        members seal to this silo (CKKS keys, daisy-chain hand-offs) and `sealing_roster` holds
        every member's public sealing key, as provisioning pinned it. `state`: the folder where
        the silo keeps what must outlive its process (SuPerFed's local model; None: memory)."""
        self.context = SiloContext(
            name,
            data,
            model_config,
            torch.device(device),
            privacy=privacy or PrivacyConfig(),
            rounds=rounds,
            secret=secret,
            consortium=consortium,
            deployment=deployment,
            secure_aggregation=secure_aggregation or SecureAggregationConfig(),
            identity=identity,
            roster=dict(roster or {}),
            sealing_key=sealing_key,
            sealing_roster=dict(sealing_roster or {}),
            state=LocalState(state, deployment),
        )
        self.policy_digest = policy_digest
        self.ledger = ledger
        self.deployment = deployment
        caps = [c for c in (self.context.privacy.epsilon_cap, epsilon_cap) if c is not None]
        self.epsilon_cap = min(caps) if caps else None

    @property
    def name(self) -> str:
        return self.context.name

    def handle(self, message: TaskMessage) -> TaskResult:
        return self.respond(message)[0]

    def respond(self, message: TaskMessage) -> tuple[TaskResult, bytes]:
        """Run `message` and return its result and the encoded answer, booked when there is a
        ledger: the encoded bytes are exactly what the ledger's digest covers."""
        started = time.perf_counter()
        problem = self._refusal(message)
        if problem is not None:
            return self._refuse(message, STATUS_ERROR, problem)
        try:
            releases = TASK_RELEASES[message.kind](message, self.context)
        except Exception as exc:  # e.g. a DP plan that cannot be calibrated
            return self._refuse(message, STATUS_ERROR, _describe(exc))
        epsilon = self._would_reach(releases)
        if self.epsilon_cap is not None and epsilon is not None and epsilon > self.epsilon_cap:
            return self._refuse(
                message,
                STATUS_BUDGET_EXHAUSTED,
                f"this task would bring epsilon to {epsilon:.4g}, above the cap "
                f"{self.epsilon_cap:g} for deployment {self.deployment!r}",
                epsilon=self._spent(),
            )
        try:
            result = TASK_HANDLERS[message.kind](message, self.context)
        except Exception as exc:  # reported to the coordinator as this task's failure
            return self._refuse(message, STATUS_ERROR, _describe(exc))
        result = replace(result, compute_seconds=time.perf_counter() - started, epsilon=epsilon)
        return self._send(message, result, releases)

    def handle_bytes(self, payload: bytes) -> bytes:
        try:
            message = TaskMessage.decode(payload)
        except WireError as exc:
            return TaskResult(
                "unknown", self.name, "unknown", STATUS_ERROR, error=str(exc)
            ).encode()
        return self.respond(message)[1]

    def _refusal(self, message: TaskMessage) -> str | None:
        if message.silo != self.name:
            return f"task is addressed to {message.silo!r}, this is {self.name!r}"
        if self.policy_digest is not None and message.policy_digest != self.policy_digest:
            return (
                f"task runs under policy {message.policy_digest[:12] or 'none'!r}; "
                f"this silo accepted {self.policy_digest[:12]!r} only"
            )
        if message.kind not in TASK_HANDLERS:
            return f"unknown task kind {message.kind!r}; known: {sorted(TASK_HANDLERS)}"
        return None

    def _send(
        self, message: TaskMessage, result: TaskResult, releases: list[Mechanism]
    ) -> tuple[TaskResult, bytes]:
        """Encode `result` with the ledger head, and book each of its releases."""
        if self.ledger is None:
            return result, result.encode()
        result = replace(result, ledger_head=self.ledger.head())
        encoded = result.encode()
        digest = payload_digest(encoded)
        privacy = self.context.privacy
        delta = privacy.delta if privacy.differentially_private else None
        for mechanism in releases:
            self.ledger.append(
                deployment=self.deployment,
                round=message.round,
                task_id=result.task_id,
                mechanism=mechanism,
                payload_digest=digest,
                delta=delta,
                accountant=privacy.accountant,
            )
        return result, encoded

    def _would_reach(self, releases: list[Mechanism]) -> float | None:
        if self.ledger is None or not self.context.privacy.differentially_private:
            return None
        privacy = self.context.privacy
        return self.ledger.would_reach(self.deployment, releases, privacy.delta, privacy.accountant)

    def _spent(self) -> float | None:
        return self.ledger.spent(self.deployment) if self.ledger is not None else None

    def _refuse(
        self, message: TaskMessage, status: str, why: str, epsilon: float | None = None
    ) -> tuple[TaskResult, bytes]:
        """Answer without running the task: nothing of the data leaves (a public release)."""
        refusal = TaskResult(
            message.task_id, self.name, message.kind, status, error=why, epsilon=epsilon
        )
        return self._send(message, refusal, [Mechanism.public()])


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"
