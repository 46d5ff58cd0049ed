"""The silo agent: receives task messages, runs the matching handler on local data, and
answers with a result. Any failure becomes an error result for that task; it never takes
the agent down or leaks a partial answer. A task whose config is not its kind's (an unknown
or mistyped key: wire/tasks/) is refused unrun, and booked like every refusal.

With a privacy ledger, the agent books every answer it sends. Before running a task it asks
what the task would release (`TASK_KINDS`) and what epsilon the job would reach with
it; above the cap (the stricter of the policy's and the silo's own) it refuses with a
`budget_exhausted` result instead, and the coordinator retires the silo for the job. The
ledger spans every job of the consortium (`deployment` is the job id, so each job is accounted
on its own); with `total_epsilon_cap` (the site rule `rules.total_epsilon_cap`) the agent also
refuses a task that would bring the silo's epsilon over all jobs above it.
An answer leaves as its parts, unjoined (`handle_bytes`).
An answer carries that epsilon and the ledger head before its booking; it is booked, fsynced,
before it is returned for sending, and with the silo's identity it carries a signed receipt of
its booking (`privacy/receipts.py`: the head after it), which the coordinator keeps for audits.

A task is checked against the silo's own algorithm contract (silo/contract_gate.py) and its
release gate before anything runs; a task id names one position of the algorithm, answered
once. No DP release is ever made twice from the same noise, and no position is answered twice:
with a ledger, a DP policy or a state folder, every answer to a task of the accepted job, a
refusal included, is kept (`AnswerStore`, in the state folder, written durably before it
leaves): the same task id gets the same bytes whatever the new message carries, and a task the
ledger booked (or the store answered) whose bytes are gone is refused; without any, the task
ids answered are kept in memory and a repeat is refused.
"""

from __future__ import annotations

import threading
import time
from collections import Counter
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch

from fedsilo.policies.schema import Policy
from fedsilo.privacy.accounting import Mechanism
from fedsilo.privacy.accounting import total as total_epsilon
from fedsilo.privacy.ledger import LedgerRecord, PrivacyLedger, payload_digest
from fedsilo.privacy.receipts import Receipt
from fedsilo.silo import contract_gate, lineage, release_gate
from fedsilo.silo.answers import FOLDER, AnswerStore
from fedsilo.silo.budget_plan import BudgetPlan, Caps, fmt, name, plan_job, refusal
from fedsilo.silo.data import SiloDataset
from fedsilo.silo.state import LocalState
from fedsilo.silo.tasks import TASK_KINDS
from fedsilo.silo.tasks.base import SiloContext, SiloKeys
from fedsilo.wire.messages import (
    SIMULATION,
    STATUS_BUDGET_EXHAUSTED,
    STATUS_ERROR,
    BadTaskConfig,
    TaskHeader,
    TaskMessage,
    TaskResult,
)
from fedsilo.wire.payload import AnyPayload, Payload
from fedsilo.wire.tensors import WireError, tensor_block


class SiloAgent:
    def __init__(
        self,
        name: str,
        data: SiloDataset,
        policy: Policy,
        *,
        device: torch.device | str = "cpu",
        policy_digest: str | None = None,
        secret: bytes = b"",
        ledger: PrivacyLedger | None = None,
        deployment: str = SIMULATION,
        epsilon_cap: float | None = None,
        total_epsilon_cap: float | None = None,
        keys: SiloKeys | None = None,
        state: Path | None = None,
    ) -> None:
        """The one way a silo is built, in simulations and deployments alike: from `policy`,
        the silo's own copy of the signed policy, the only source of its model, training,
        DP parameters, secure-aggregation rules and algorithm contract.

        `policy_digest`: the policy this silo accepted; tasks under another are refused (None
        in simulations, where there is no signed policy). `secret`: key material that seeds
        the silo's noise. `ledger`: where every answer of `deployment` (the job id) is booked
        (None: nothing is booked, no budget is enforced); `epsilon_cap`: the silo's own cap
        per job, enforced beside the policy's; `total_epsilon_cap`: the silo's cap over all
        jobs in the ledger. `keys`: its identity and the members' keys, as provisioning pinned
        them (their roster is the consortium it knows). `state`: the folder where the silo
        keeps what must outlive its process (SuPerFed's local model, its answers; None:
        memory)."""
        local_state = LocalState(state, deployment)
        self.context = SiloContext(
            name,
            data,
            policy,
            torch.device(device),
            state=local_state,
            secret=secret,
            deployment=deployment,
            job=policy_digest or "",
            keys=keys or SiloKeys(),
        )
        self.policy_digest = policy_digest
        self.ledger = ledger
        self.deployment = deployment
        caps = {  # the tighter cap binds; a refusal names its key
            key: cap
            for key, cap in (
                ("rules.epsilon_cap", epsilon_cap),
                ("privacy.epsilon_cap", self.context.privacy.epsilon_cap),
            )
            if cap is not None
        }
        self.cap_key = min(caps, key=caps.__getitem__) if caps else None
        self.epsilon_cap = caps[self.cap_key] if self.cap_key else None
        self.total_epsilon_cap = total_epsilon_cap
        folder = None if local_state.folder is None else local_state.folder / FOLDER
        keeps_answers = (
            ledger is not None or self.context.privacy.differentially_private or folder is not None
        )
        self.answers = AnswerStore(folder) if keeps_answers else None
        self._answered: set[str] = set()  # task ids answered, where no answer store keeps them
        self._lock = threading.Lock()  # one task at a time: checked, run, booked, kept

    @property
    def name(self) -> str:
        return self.context.name

    def budget_plan(self) -> BudgetPlan:
        """Every release this job books here when the silo takes part in every round
        (silo/budget_plan.py), from its own policy, rows and roster."""
        return plan_job(self.context)

    def budget_refusal(self, plan: BudgetPlan | None = None) -> str | None:
        """Why this silo cannot afford the job (its plan above its per-job cap, or above what
        is left of its cap over all jobs), with the numbers; None when it can. Asked before it
        accepts the job, so a job it cannot afford books nothing here."""
        caps = Caps(
            job=self.epsilon_cap,
            job_key=self.cap_key,
            total=self.total_epsilon_cap,
            spent_elsewhere=(
                self.ledger.spent_elsewhere(self.deployment) if self.ledger is not None else 0.0
            ),
        )
        return refusal(plan or self.budget_plan(), caps)

    def spent_against_plan(self, plan: BudgetPlan) -> str | None:
        """How what this job booked here differs from `plan`, naming each mechanism booked
        beyond it or planned and not booked (the silo sat out rounds, or the job ended
        early); None when the ledger holds exactly the plan's releases."""
        if self.ledger is None or plan.epsilon is None:
            return None
        booked = Counter(
            r.mechanism
            for r in self.ledger.records()
            if r.deployment == self.deployment and r.mechanism.kind != "public"
        )
        planned = Counter(m for m in plan.releases if m.kind != "public")
        if booked == planned:
            return None
        spent = self.ledger.spent(self.deployment)
        parts = [f"job {self.deployment} booked epsilon {fmt(spent)} against a plan of "
                 f"{fmt(plan.epsilon)}"]  # fmt: skip
        for label, extra in (
            ("booked beyond the plan", booked - planned),
            ("planned and not booked (rounds sat out, or the job ended early)", planned - booked),
        ):
            if extra:
                named = ", ".join(f"{count} x {name(m)}" for m, count in extra.items())
                parts.append(f"{label}: {named}")
        return "; ".join(parts)

    def handle(self, message: TaskMessage) -> TaskResult:
        return self.respond(message)[0]

    def respond(self, message: TaskMessage) -> tuple[TaskResult, Payload]:
        """Run `message` and return its result and the encoded answer, booked when there is a
        ledger (the digest booked covers the encoded answer without its receipt), or the
        answer already given to its task id."""
        with self._lock:
            return self._respond(message)

    def _respond(self, message: TaskMessage) -> tuple[TaskResult, Payload]:
        started = time.perf_counter()
        problem = self._misaddressed(message.header)
        if problem is not None:
            return self._refused_unrun(message.header, problem)
        given = self._given(message)
        if given is not None:
            return given
        problem = (
            contract_gate.refusal(message, self.context)
            or release_gate.refusal(message, self.context)
            or lineage.refusal(message, self.context)
        )
        if problem is not None:
            return self._refused_unrun(message.header, problem)
        try:
            releases = TASK_KINDS[message.kind].releases(message, self.context)
        except Exception as exc:  # e.g. a DP plan that cannot be calibrated
            return self._refuse(message.header, STATUS_ERROR, _describe(exc))
        try:
            epsilon = self._would_reach(releases)
        except Exception as exc:  # an accountant that cannot compute it (refused, never run)
            return self._refuse(message.header, STATUS_ERROR, _describe(exc))
        over = self._over_a_cap(epsilon)
        if over is not None:
            return self._refuse(
                message.header, STATUS_BUDGET_EXHAUSTED, over, epsilon=self._spent()
            )
        try:
            result = TASK_KINDS[message.kind].handler(message, self.context)
        except Exception as exc:  # reported to the coordinator as this task's failure
            return self._refuse(message.header, STATUS_ERROR, _describe(exc))
        result = replace(result, compute_seconds=time.perf_counter() - started, epsilon=epsilon)
        return self._send(message.header, result, releases, self.policy_digest)

    def handle_bytes(self, payload: bytes | AnyPayload) -> Payload:
        """The encoded answer to the encoded task `payload`, as the parts it is made of (a
        header, then the memory of the answer's tensors, which belong to the answer alone:
        `silo/tasks/base.py`), so neither the network nor an in-process engine pays for one
        more copy of the model; `to_bytes()` joins them."""
        try:
            message = TaskMessage.decode(payload)
        except BadTaskConfig as exc:  # a task it names, of an unknown kind or a bad config
            with self._lock:
                header = exc.header
                return self._refused_unrun(header, self._misaddressed(header) or str(exc))[1]
        except WireError as exc:
            unread = TaskResult("unknown", self.name, "unknown", STATUS_ERROR, error=str(exc))
            return Payload([unread.encode()])
        return self.respond(message)[1]

    def _misaddressed(self, header: TaskHeader) -> str | None:
        if header.silo != self.name:
            return f"task is addressed to {header.silo!r}, this is {self.name!r}"
        if self.policy_digest is not None and header.policy_digest != self.policy_digest:
            return (
                f"task runs under policy {header.policy_digest[:12] or 'none'!r}; "
                f"this silo accepted {self.policy_digest[:12]!r} only"
            )
        return None

    def _refused_unrun(self, header: TaskHeader, problem: str) -> tuple[TaskResult, Payload]:
        """A task refused before anything ran (misaddressed, unreadable, or against the silo's
        release gate): nothing of the data leaves, booked as a public release under the job
        the task names."""
        refusal = TaskResult(header.task_id, self.name, header.kind, STATUS_ERROR, error=problem)
        return self._send(
            header, refusal, [Mechanism.public()], header.policy_digest, counts_round=False
        )

    def _given(self, message: TaskMessage) -> tuple[TaskResult, Payload] | None:
        """The answer this task id already got (the same bytes), a refusal where that answer
        is gone (or no store keeps answers), or None for a task never answered: a task id
        names one position of the algorithm (contract_gate.py), answered once."""
        job, task = self.context.job, message.task_id
        if self.answers is None:
            if task not in self._answered:
                return None
            why = f"task {task} was answered already; this silo answers each task once"
            refusal = TaskResult(task, self.name, message.kind, STATUS_ERROR, error=why)
            return refusal, Payload([refusal.encode()])
        kept = self.answers.answer(job, task)
        if kept is not None:
            return TaskResult.decode(kept), kept
        booked = None
        if self.ledger is not None:
            booked = self.ledger.booking(self.deployment, self.policy_digest, task)
        if booked is None and not self.answers.answered(job, task):
            return None
        where = f" (ledger seq {booked.seq})" if booked is not None else ""
        why = (
            f"task {task} is already booked{where} and its answer is no longer kept; "
            "answering it again would release from the same noise a second time"
        )
        refusal = TaskResult(task, self.name, message.kind, STATUS_ERROR, error=why)
        return refusal, Payload([refusal.encode()])

    def _send(
        self,
        message: TaskHeader,
        result: TaskResult,
        releases: list[Mechanism],
        job: str | None,
        counts_round: bool = True,
    ) -> tuple[TaskResult, Payload]:
        """Book each of `result`'s releases under `job`, sign the receipt of the booking, and
        keep the answer when it answers a task of this silo's job (`counts_round` False: a
        refusal before the contract took the task, whose round moves no answer out of the
        store: silo/answers.py)."""
        block = tensor_block(result.tensors)  # the tensors' bytes, shared by both encodings
        if self.ledger is not None:
            result = replace(result, ledger_head=self.ledger.head())
            body = payload_digest(result.encode_payload(block))
            record = self._book(message, body, releases or [Mechanism.public()], job or None)
            result = replace(result, receipt=self._receipt(message, body, record))
        encoded = result.encode_payload(block)  # its parts: the header, then the tensors' memory
        if self.policy_digest is None or job == self.policy_digest:  # a task of this job
            if self.answers is not None:
                self.answers.keep(
                    self.context.job,
                    message.task_id,
                    message.round,
                    encoded,
                    counts_round=counts_round,
                )
            else:
                self._answered.add(message.task_id)
        return result, encoded

    def _book(
        self, message: TaskHeader, digest: str, releases: list[Mechanism], job: str | None
    ) -> LedgerRecord:
        assert self.ledger is not None
        privacy = self.context.privacy
        delta = privacy.delta if privacy.differentially_private else None
        records = [
            self.ledger.append(
                deployment=self.deployment,
                round=message.round,
                task_id=message.task_id,
                mechanism=mechanism,
                payload_digest=digest,
                delta=delta,
                accountant=privacy.accountant,
                job=job,
            )
            for mechanism in releases
        ]
        return records[-1]

    def _receipt(
        self, message: TaskHeader, digest: str, record: LedgerRecord
    ) -> dict[str, Any] | None:
        """The signed receipt of a booking (None without an identity to sign it)."""
        if self.context.identity is None:
            return None
        return (
            Receipt(
                silo=self.name,
                deployment=self.deployment,
                job=record.job or "",
                task_id=message.task_id,
                payload_digest=digest,
                seq=record.seq,
                ledger_head=record.hash,
                epsilon=record.epsilon_cumulative,
            )
            .signed(self.context.identity)
            .to_json()
        )

    def _would_reach(self, releases: list[Mechanism]) -> float | None:
        if self.ledger is None or not self.context.privacy.differentially_private:
            return None
        privacy = self.context.privacy
        return self.ledger.would_reach(self.deployment, releases, privacy.delta, privacy.accountant)

    def _over_a_cap(self, epsilon: float | None) -> str | None:
        """Which cap the job's epsilon after this task (`epsilon`) would break, or None."""
        if epsilon is None or self.ledger is None:
            return None
        if self.epsilon_cap is not None and epsilon > self.epsilon_cap:
            return (
                f"this task would bring epsilon to {epsilon:.4g}, above the cap "
                f"{self.epsilon_cap:g} for job {self.deployment!r} ({self.cap_key})"
            )
        if self.total_epsilon_cap is None:
            return None
        elsewhere = self.ledger.spent_elsewhere(self.deployment)
        total = total_epsilon([elsewhere, epsilon])
        if total > self.total_epsilon_cap:
            return (
                f"this task would bring this silo's epsilon over all jobs to {total:.4g} "
                f"({elsewhere:.4g} spent by earlier jobs), above rules.total_epsilon_cap "
                f"{self.total_epsilon_cap:g}"
            )
        return None

    def _spent(self) -> float | None:
        return self.ledger.spent(self.deployment) if self.ledger is not None else None

    def _refuse(
        self, message: TaskHeader, status: str, why: str, epsilon: float | None = None
    ) -> tuple[TaskResult, Payload]:
        """Answer without running the task: nothing of the data leaves (a public release)."""
        refusal = TaskResult(
            message.task_id, self.name, message.kind, status, error=why, epsilon=epsilon
        )
        return self._send(message, refusal, [Mechanism.public()], self.policy_digest)


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}"
