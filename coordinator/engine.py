"""The round engine: drives a strategy's round scripts, dispatches each phase through a
transport, enforces the phase deadline and quorum, drops bad or late answers, aggregates when
the phase asks for it, and records what happened in every round.

A round whose phase misses its quorum is abandoned: the strategy's state stays as it was
before the round, the round is recorded as failed, and the run stops after
`max_consecutive_failed_rounds` such rounds in a row. Before each round a deployment short of
its quorum waits up to `participants.quorum_grace_s` for silos to come back (`wait_for_quorum`:
a restarted agent joins again), and ends naming the silos missing and why when they do not.

The quorum is never lowered below `participants.min_silos`: not by asking fewer silos, nor by
retirements or revocations. A consortium smaller than `min_silos` is refused before round 1; a
round with fewer active silos fails; a phase that aggregates (a weighted mean, plain or
secure) or hands models on needs `min_silos` answers, and one that asks fewer silos fails
before anything is sent. Only a phase whose answers reach the strategy one by one (evaluation,
loss probes, the local training of silos outside a round's cohort) may need fewer: the quorum
it states, else min(`min_silos`, silos asked); such answers are per-silo whatever the quorum.

A phase's `WeightedMean` says what it sums; the policy says how: in the clear, or with
`secure_aggregation` masked (secure_sum.py) or under CKKS (ckks_sum.py), each silo then sending
only its update to the mean's reference tensors, which the engine adds to the tasks. With
`privacy.client_dp` every weighted mean of a round is DP-FedAvg's (client_dp.py): equal weights,
clipped updates, the noise made whole, the round booked in the state's accounting. A weighted
mean with a robust rule (`algorithm.robust`) is combined by that rule in the clear once every
reply is in (robust_mean.py), never under secure aggregation or client-level DP.

A silo that answers `budget_exhausted` (its privacy budget cannot pay for the task) is a
dropout in that phase and is retired: no later round or evaluation of the deployment asks it
again. A silo whose task fails as revoked (the consortium revoked it) is sent no later task of
the deployment: each of its tasks fails at once as revoked, so it still counts against every
quorum, and each round lists it in `revoked`, which metrics and status show instead of a
dropout. Rounds record each silo's reported epsilon and ledger head (`privacy`), and, with
client-level DP, the epsilon of the model published after the round (`client_epsilon`); with a
mixing schedule, each silo's coefficient after the round (`mixing`).

With a `StateStore` the engine saves the setup and every finished round (its state and
record), and every silo's signed receipt of a booked release as it arrives; a run started
again on the same store goes on after the last saved round. Every random choice derives from
(seed, round, phase), so a resumed run ends exactly where an uninterrupted one would have.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Generator, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from itertools import takewhile
from typing import Any, Protocol, runtime_checkable

import torch

from fedsilo.coordinator.ckks_sum import CkksKeys, CkksMean
from fedsilo.coordinator.client_dp import ClientDpRound, published_epsilon
from fedsilo.coordinator.cross_site import CrossSite
from fedsilo.coordinator.folded_keys import FoldedKeys
from fedsilo.coordinator.hub import REVOKED
from fedsilo.coordinator.lineage import attached, kept
from fedsilo.coordinator.phases import (
    Identical,
    Phase,
    PhaseOutcome,
    QuorumNotMet,
    SiloReport,
    Task,
    WeightedMean,
)
from fedsilo.coordinator.replies import (
    Accepted,
    Dropout,
    accept,
    keep_receipts,
    reports_of,
)
from fedsilo.coordinator.robust_mean import robust_mean
from fedsilo.coordinator.routing import HandoffRouter
from fedsilo.coordinator.running_mean import RunningMean
from fedsilo.coordinator.secure_sum import MaskedMean
from fedsilo.coordinator.state import StateStore, digest_policy
from fedsilo.coordinator.strategies.base import (
    RoundContext,
    ServerState,
    Strategy,
    mixing_weights,
)
from fedsilo.coordinator.summary import summarize_metrics
from fedsilo.coordinator.transport import Delivery, Reply, Transport
from fedsilo.policies.schema import Policy
from fedsilo.policies.seeding import derive_rng
from fedsilo.privacy.lineage import state_tensors
from fedsilo.wire.messages import SIMULATION, TASK_STEPS, TaskMessage, task_id
from fedsilo.wire.payload import digest_of
from fedsilo.wire.tensors import LazyTensor, TensorBlocks

log = logging.getLogger("fedsilo.coordinator")


class RunAborted(RuntimeError):
    """The run cannot go on (setup failed, or too many rounds in a row missed their quorum)."""


@dataclass
class RoundRecord:
    """What one round did: its `status`, each phase's answers and dropouts (`phases`), each
    silo's test metrics (`evaluation`) and their cross-silo `summary` when it evaluated, and,
    by policy, each silo's epsilon (`privacy`), mixing coefficient (`mixing`) or, after the final
    evaluation, the cross-site matrix (`cross_site`). Round 0 is the setup."""

    round: int
    status: str  # "completed" | "failed"
    seconds: float
    phases: dict[str, dict[str, Any]] = field(default_factory=dict)
    compute_seconds: dict[str, dict[str, float]] = field(default_factory=dict)  # phase -> silo
    evaluation: dict[str, dict[str, float]] | None = None
    test_sizes: dict[str, int] | None = None
    summary: dict[str, dict[str, float]] | None = None
    error: str | None = None
    silos: list[str] | None = None  # setup only: the consortium the deployment started with
    retired: dict[str, str] | None = None  # silos retired in this round, and why
    revoked: list[str] | None = None  # silos revoked consortium-wide, not asked in this round
    privacy: dict[str, dict[str, Any]] | None = None  # silo -> epsilon, ledger head reported
    client_epsilon: float | None = None  # client-level DP: the published model's epsilon
    mixing: dict[str, float] | None = None  # mixing schedules: each silo's coefficient
    cross_site: dict[str, Any] | None = None  # the final evaluation's: coordinator/cross_site.py

    def to_json(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if v is not None}

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> RoundRecord:
        """The inverse of `to_json` (absent fields take their defaults)."""
        return cls(**data)


@dataclass
class RunHistory:
    """A run's rounds: `records` (every round's `RoundRecord` in order, setup first; results.json
    holds the same list under "rounds"), `final` (the last evaluation) and `state` (the final
    model and the strategy's state)."""

    records: list[RoundRecord]
    state: ServerState
    final: RoundRecord

    def to_json(self) -> dict[str, Any]:
        return {"rounds": [r.to_json() for r in self.records], "final": self.final.to_json()}

    @property
    def failed(self) -> list[RoundRecord]:
        """The rounds that failed (missed a quorum, or an aggregation did not finish): each
        left the model as it was, so none may go unnamed in a run's log and results."""
        return [r for r in self.records if r.round > 0 and r.status == "failed"]

    def failed_note(self) -> str | None:
        """One line naming the failed rounds and why, or None when every round completed."""
        failed = self.failed
        if not failed:
            return None
        rounds = len([r for r in self.records if r.round > 0])
        named = "; ".join(f"round {r.round}: {r.error}" for r in failed)
        return f"{len(failed)} of {rounds} rounds failed and left the model as it was ({named})"


QuorumWait = Callable[[Sequence[str], int, float], Mapping[str, str]]


class EngineObserver(Protocol):
    def on_round(self, record: RoundRecord, total_rounds: int) -> None: ...


@runtime_checkable
class StateObserver(Protocol):
    """An observer that also wants the state after each round (e.g. FedEvg's synthetic set)."""

    def on_state(self, round_no: int, state: ServerState) -> None: ...


class RoundEngine:
    def __init__(
        self,
        strategy: Strategy,
        transport: Transport,
        policy: Policy,
        silos: Sequence[str],
        observers: Sequence[EngineObserver] = (),
        deployment: str = SIMULATION,
        store: StateStore | None = None,
        policy_digest: str = "",
        secret: bytes = b"",
        handoff_keys: Mapping[str, bytes] | None = None,
        should_stop: Callable[[], str | None] = lambda: None,
        make_room: Callable[[int], object] = lambda nbytes: None,
        wait_for_quorum: QuorumWait = lambda silos, quorum, timeout_s: {},
    ) -> None:
        """`store`: where to save rounds and resume from (None: nothing is saved);
        `policy_digest`: what binds the store to this policy (default: `digest_policy`);
        `secret`: the coordinator's key material for noise no silo may predict (a simulation,
        with no one to hide it from, may leave it empty); `handoff_keys`: each member's X25519
        public key (from its provisioned identity), which sealed daisy-chain hand-offs need;
        `should_stop`: why the run must stop before its next round (None: go on), checked
        before each round and the final evaluation; a reason ends the run with `RunAborted`;
        `make_room`: called with a mean's size in bytes just before the engine allocates it
        (a service gives back there the memory its allocator keeps, `ops/memory.py`);
        `wait_for_quorum(silos, quorum, timeout_s)`: waits until `quorum` of `silos` can take
        part, or `timeout_s` passed, and returns the silos still missing then, each with why
        (a simulation's silos never go away: nothing is missing)."""
        if not silos:
            raise ValueError("a consortium needs at least one silo")
        self.strategy = strategy
        self.transport = transport
        self.policy = policy
        self.silos = tuple(silos)
        self.observers = tuple(observers)
        self.deployment = deployment
        self.store = store
        self.policy_digest = policy_digest or digest_policy(policy)
        self.retired: dict[str, str] = {}
        self.revoked: set[str] = set()
        self.secret = secret
        self.handoff_keys = dict(handoff_keys or {})
        self.should_stop = should_stop
        self.make_room = make_room
        self.wait_for_quorum = wait_for_quorum
        self.ckks_keys: CkksKeys | None = None  # made by the key holder at the first CKKS sum
        contract = self.policy.algorithm.silo_contract(self.policy)
        self.folded_keys = FoldedKeys(contract.next_aggregation)  # for the next masked mean
        # model lineage (coordinator/lineage.py): the state the tasks' model belongs to, and
        # the evidence of the round's lineage aggregation once it ran
        self.lineage = policy.uses_lineage
        self._lineage_state: Mapping[str, torch.Tensor] | None = None
        self._evidence: Mapping[str, torch.Tensor] | None = None
        self.cross_site = CrossSite.of(policy)  # None: the policy asks for no cross-site matrix

    # -- the run ----------------------------------------------------------------------------

    def run(self) -> RunHistory:
        min_silos = self.policy.participants.min_silos
        if len(self.silos) < min_silos:
            raise RunAborted(
                f"participants.min_silos is {min_silos}, but the consortium has "
                f"{len(self.silos)} silo(s) ({', '.join(self.silos)}): no round could reach "
                "its quorum; lower participants.min_silos or add silos"
            )
        problem = self.policy.algorithm.consortium_problem(self.policy, len(self.silos))
        if problem:
            raise RunAborted(problem)
        total = self.policy.rounds
        state, records = self._start()
        failures_in_a_row = sum(1 for _ in takewhile(_failed, reversed(records)))
        for round_no in range(records[-1].round + 1 if records else 1, total + 1):
            self._check_stop()
            self._await_quorum(round_no)
            record, state = self._run_round(state, round_no)
            failures_in_a_row = failures_in_a_row + 1 if _failed(record) else 0
            if record.status == "completed" and (
                round_no % self.policy.eval_every == 0 or round_no == total
            ):
                self._evaluate(state, round_no, record)
                if round_no == total:
                    self._validate_across_sites(state, record, trained=True)
            records.append(record)
            self._save(record, state)
            for observer in self.observers:
                observer.on_round(record, total)
                if isinstance(observer, StateObserver):
                    observer.on_state(round_no, state)
            if failures_in_a_row >= self.policy.participants.max_consecutive_failed_rounds:
                raise RunAborted(
                    f"{failures_in_a_row} rounds in a row missed their quorum; last: {record.error}"
                )
        final = next((r for r in reversed(records) if r.evaluation is not None), None)
        if final is None or final.round != records[-1].round:
            self._check_stop()
            final = RoundRecord(records[-1].round, "final", 0.0)
            self._evaluate(state, final.round, final)
            self._validate_across_sites(state, final, trained=records[-1].status == "completed")
        return RunHistory(records, replace(state, tensors=state_tensors(state.tensors)), final)

    def _await_quorum(self, round_no: int) -> None:
        """Give silos that went away `participants.quorum_grace_s` to come back before round
        `round_no`; end the run naming the ones still missing."""
        silos, quorum = self._context(round_no).silos, self.policy.participants.min_silos
        if len(silos) < quorum:
            return  # retirements: no wait can help, the round fails as short of its quorum
        grace = self.policy.participants.quorum_grace_s
        missing = self.wait_for_quorum(silos, quorum, grace)
        self._check_stop()
        if missing:
            named = "; ".join(f"{silo} ({why})" for silo, why in sorted(missing.items()))
            raise RunAborted(
                f"round {round_no}: {len(silos) - len(missing)} of {len(silos)} silos can take "
                f"part, participants.min_silos is {quorum}; waited {grace:g}s "
                f"(participants.quorum_grace_s) for the others to come back: {named}"
            )

    def _check_stop(self) -> None:
        reason = self.should_stop()
        if reason is not None:
            raise RunAborted(reason)

    def _start(self) -> tuple[ServerState, list[RoundRecord]]:
        """The state and records to go on from: the store's last saved round, or a new setup."""
        if self.store is not None:
            self.store.open_deployment(
                self.deployment, self.policy_digest, self.policy.model_dump_json()
            )
            saved = self.store.last_round(self.deployment)
            if saved is not None:
                self._keep_membership(saved.setup.get("silos") or list(self.silos))
                records = [RoundRecord.from_json(r) for r in saved.records]
                for record in records:
                    self.retired |= record.retired or {}
                    self.revoked |= set(record.revoked or ())
                return saved.state, records
        record = RoundRecord(0, "setup", 0.0, silos=list(self.silos))
        try:
            state = self._drive(self.strategy.setup(self._context(0)), 0, record)
        except QuorumNotMet as exc:
            raise RunAborted(f"setup failed: {exc}") from exc
        self._save(record, state)
        for observer in self.observers:
            if isinstance(observer, StateObserver):
                observer.on_state(0, state)
        return state, []

    def _keep_membership(self, started_with: list[str]) -> None:
        """A resumed deployment keeps the consortium it started with, so every round's random
        draws are those of an uninterrupted run; a member absent now is a dropout, not a
        different consortium."""
        if set(started_with) != set(self.silos):
            log.warning(
                "resuming with the consortium the deployment started with %s (now connected: %s)",
                sorted(started_with),
                sorted(self.silos),
            )
        self.silos = tuple(started_with)

    def _save(self, record: RoundRecord, state: ServerState) -> None:
        """Save a finished round (a failed one with the unchanged state) when there is a store."""
        if self.store is not None:
            self.store.save_round(
                self.deployment, record.round, record.status, state, record.to_json()
            )

    def _run_round(self, state: ServerState, round_no: int) -> tuple[RoundRecord, ServerState]:
        started = time.perf_counter()
        record = RoundRecord(round_no, "completed", 0.0)
        context = self._context(round_no)
        try:
            if len(context.silos) < context.min_silos:
                raise QuorumNotMet(
                    f"{len(context.silos)} silo(s) remain active, participants.min_silos is "
                    f"{context.min_silos} (retired: {sorted(self.retired) or 'none'})"
                )
            client_dp = ClientDpRound.of(self.policy, context)
            before, self._lineage_state, self._evidence = state, state.tensors, None
            state = self._drive(self.strategy.round(state, context), round_no, record, client_dp)
            if self.lineage:
                state = replace(state, tensors=kept(state.tensors, before.tensors, self._evidence))
            if client_dp is not None:
                state = client_dp.booked(state)
            record.client_epsilon = published_epsilon(state.extra)
            record.mixing = mixing_weights(state.extra)
        except QuorumNotMet as exc:
            record.status, record.error = "failed", str(exc)
        record.seconds = time.perf_counter() - started
        return record, state

    def _evaluate(self, state: ServerState, round_no: int, record: RoundRecord) -> None:
        self._lineage_state = state.tensors
        try:
            outcome = self._drive(
                self.strategy.evaluate(state, self._context(round_no)), round_no, record
            )
        except QuorumNotMet as exc:
            record.error = f"evaluation: {exc}"
            return
        record.evaluation = {s: dict(r.metrics) for s, r in outcome.reports.items()}
        record.test_sizes = {s: r.num_samples for s, r in outcome.reports.items()}
        summaries = summarize_metrics(record.evaluation, record.test_sizes, {})
        record.summary = {name: summary.as_dict() for name, summary in summaries.items()}

    def _validate_across_sites(
        self, state: ServerState, record: RoundRecord, trained: bool
    ) -> None:
        """After the final evaluation (in `record`), when the policy asks: every model held in
        the clear on every silo's test split (coordinator/cross_site.py), kept in `record`."""
        if self.cross_site is None or record.evaluation is None:
            return
        global_model = self.strategy.global_model(state)
        models, note = self.cross_site.models(global_model, self.silos, trained)
        script = self.strategy.cross_site(models, state, self._context(record.round))
        outcomes = self._drive(script, record.round, record)
        record.cross_site = self.cross_site.matrix(outcomes, note).to_json()

    def _context(self, round_no: int) -> RoundContext:
        return RoundContext(
            round=round_no,
            total_rounds=self.policy.rounds,
            silos=tuple(s for s in self.silos if s not in self.retired),
            seed=self.policy.seed,
            min_silos=self.policy.participants.min_silos,
            secret=self.secret,
        )

    def _drive(
        self,
        script: Generator[Phase, PhaseOutcome, Any],
        round_no: int,
        record: RoundRecord,
        client_dp: ClientDpRound | None = None,
    ) -> Any:
        """Run one script (setup, a round, an evaluation) to its end, executing every phase it
        yields; `client_dp`: a round's, which its weighted means run under."""
        try:
            phase = next(script)
            while True:
                try:
                    outcome = self.execute(phase, round_no, record, client_dp)
                except QuorumNotMet as missed:
                    _record_phase(record, phase.name, missed.answered, missed.dropped)
                    raise
                _record_phase(record, phase.name, outcome.reports, outcome.dropped)
                phase = script.send(outcome)
        except StopIteration as done:
            return done.value
        finally:
            script.close()

    def _retire(self, silo: str, reason: str, record: RoundRecord | None) -> None:
        """Leave `silo` out of the rest of the deployment: its privacy budget is spent."""
        if silo in self.retired:
            return
        self.retired[silo] = reason
        log.warning("silo %s is retired from deployment %s: %s", silo, self.deployment, reason)
        if record is not None:
            record.retired = {**(record.retired or {}), silo: reason}
        if self.store is not None:
            self.store.set_participant(self.deployment, silo, "retired", reason)

    def _revoke(self, silo: str, record: RoundRecord | None) -> None:
        """Send `silo` no later task: the consortium revoked it. The round lists it as revoked."""
        if record is not None:
            record.revoked = sorted({*(record.revoked or ()), silo})
        if silo in self.revoked:
            return
        self.revoked.add(silo)
        log.warning("silo %s is revoked: job %s sends it no more tasks", silo, self.deployment)
        if self.store is not None:
            self.store.set_participant(self.deployment, silo, REVOKED, "revoked consortium-wide")

    # -- one phase --------------------------------------------------------------------------

    def execute(
        self,
        phase: Phase,
        round_no: int,
        record: RoundRecord | None = None,
        client_dp: ClientDpRound | None = None,
    ) -> PhaseOutcome:
        """Run `phase`: its tasks dispatched, its answers checked, its aggregate taken (a weighted
        mean in the clear or by the policy's secure aggregation, under `client_dp` if given)."""
        robust = isinstance(phase.aggregate, WeightedMean) and phase.aggregate.robust is not None
        if robust and (client_dp is not None or self.policy.secure_aggregation.enabled):
            raise ValueError(
                f"phase {phase.name!r} asks for a robust rule, which needs each silo's update in "
                "the clear: not under secure aggregation or client-level DP"
            )
        if client_dp is not None and isinstance(phase.aggregate, WeightedMean):
            phase = client_dp.phase(phase)
            return client_dp.noised(phase, self._execute(phase, round_no, record))
        return self._execute(phase, round_no, record)

    def _execute(self, phase: Phase, round_no: int, record: RoundRecord | None) -> PhaseOutcome:
        if self.lineage and self._lineage_state is not None:
            phase = attached(phase, self._lineage_state)
        silos = [task.silo for task in phase.tasks]
        if len(set(silos)) != len(silos):
            raise ValueError(f"phase {phase.name!r} gives one silo two tasks; fold them into one")
        quorum = self._quorum(phase)
        if len(phase.tasks) < quorum:
            raise QuorumNotMet(
                f"phase {phase.name!r} asks {len(phase.tasks)} silo(s), its quorum is {quorum} "
                f"(participants.min_silos {self.policy.participants.min_silos}): nothing was sent",
                phase.name,
            )
        if phase.route is not None:
            router = HandoffRouter(
                lambda step, tasks: self.collect(phase.name, tasks, round_no, None, record),
                quorum,
                self.handoff_keys if self.policy.channel.sealed_handoffs else None,
                derive_rng(self.policy.seed, "reroute", round_no, phase.name),
            )
            return router.run(phase)
        secure = self.policy.secure_aggregation
        if isinstance(phase.aggregate, WeightedMean) and secure.enabled:

            def collect(
                step: str, tasks: Sequence[Task], aggregate: WeightedMean | None = None
            ) -> tuple[dict[str, Accepted], dict[str, str]]:
                return self.collect(phase.name, tasks, round_no, aggregate, record)

            if secure.method == "ckks":
                ckks = CkksMean(collect, secure, self.silos, quorum, self.ckks_keys)
                try:
                    return ckks.run(phase)
                finally:
                    self.ckks_keys = ckks.keys
            masked = MaskedMean(
                collect,
                secure,
                self.deployment,
                round_no,
                quorum,
                self.folded_keys,
                self.lineage,
                len(self._context(round_no).silos),
            )
            outcome = masked.run(phase)
            if outcome.evidence is not None:
                self._evidence = outcome.evidence
            return outcome
        running = (
            RunningMean(phase.aggregate, [t.silo for t in phase.tasks])
            if isinstance(phase.aggregate, WeightedMean) and phase.aggregate.robust is None
            else None
        )
        results, dropped = self.collect(
            phase.name, phase.tasks, round_no, phase.aggregate, record, running=running
        )
        if self.cross_site is not None:
            self.cross_site.keep(phase.name, round_no, results)
        if len(results) < quorum:
            reasons = "; ".join(f"{s}: {why}" for s, why in sorted(dropped.items()))
            raise QuorumNotMet(
                f"phase {phase.name!r}: {len(results)} of {len(phase.tasks)} silos answered, "
                f"quorum is {quorum} ({reasons})",
                phase.name,
                reports_of(results),
                dropped,
            )
        reports = reports_of(results)
        spec = next(
            (a.result.spec for _, a in sorted(results.items()) if a.result.spec is not None), None
        )
        if phase.aggregate is None:
            tensors = {s: dict(a.result.tensors) for s, a in sorted(results.items())}
            return PhaseOutcome(phase.name, reports, dropped, tensors=tensors, spec=spec)
        if isinstance(phase.aggregate, Identical):
            names = phase.aggregate.tensors
            first = min(results)
            copy = {first: {n: results[first].lazy[n].load() for n in names}}
            digests = {s: _digest(a.lazy, names) for s, a in sorted(results.items())}
            return PhaseOutcome(
                phase.name, reports, dropped, tensors=copy, spec=spec, digests=digests
            )
        first = results[min(results)].lazy
        self.make_room(
            sum(first[n].numel * first[n].dtype.itemsize for n in phase.aggregate.tensors)
        )
        mean, total = (
            running.mean(results)
            if running is not None
            else robust_mean(phase.aggregate, phase.tasks, results)
        )
        if total <= 0:
            raise QuorumNotMet(
                f"phase {phase.name!r}: the answering silos carry zero total weight",
                phase.name,
                reports,
                dropped,
            )
        return PhaseOutcome(phase.name, reports, dropped, mean=mean, total_weight=total, spec=spec)

    def _quorum(self, phase: Phase) -> int:
        """The answers `phase` needs: at least `min_silos` when it aggregates or hands models
        on, whatever it states or asks; otherwise what it states, else min(`min_silos`, asked)."""
        min_silos = self.policy.participants.min_silos
        if isinstance(phase.aggregate, WeightedMean) or phase.route is not None:
            return max(min_silos, phase.quorum or 0)
        return phase.quorum if phase.quorum is not None else min(min_silos, len(phase.tasks))

    def collect(
        self,
        phase: str,
        tasks: Sequence[Task],
        round_no: int,
        aggregate: WeightedMean | Identical | None,
        record: RoundRecord | None,
        running: RunningMean | None = None,
    ) -> tuple[dict[str, Accepted], dict[str, str]]:
        """Dispatch `tasks` (of `phase`, or of one step of it: each task's id names the step its
        kind is, `TASK_STEPS`) and check every reply as it arrives (feeding `running`, the
        phase's mean, if given): the accepted results, and each other silo's reason for
        dropping out."""
        messages = {
            task.silo: TaskMessage(
                task_id=task_id(
                    self.deployment, round_no, phase, TASK_STEPS.get(task.kind), task.silo
                ),
                round=round_no,
                phase=phase,
                silo=task.silo,
                config=task.config,
                tensors=task.tensors,
                spec=task.spec,
                policy_digest=self.policy_digest,
            )
            for task in tasks
        }
        deadline = time.monotonic() + self.policy.participants.phase_timeout_s
        sent = {silo: m for silo, m in messages.items() if silo not in self.revoked}
        checked: dict[str, Reply | Accepted | Dropout] = {}  # a failed reply, or one checked
        for reply in self.transport.dispatch(_deliveries(sent, round_no), deadline):
            if reply.silo not in sent or reply.silo in checked:
                continue
            if reply.failure is not None or reply.payload is None:
                checked[reply.silo] = reply
            else:  # checked as it arrives, while other silos still work
                checked[reply.silo] = accept(reply.payload, sent[reply.silo], aggregate)
            if running is not None:
                fate = checked[reply.silo]
                if isinstance(fate, Accepted):
                    running.accepted(reply.silo, fate)
                else:
                    running.dropped(reply.silo)

        results: dict[str, Accepted] = {}
        dropped: dict[str, str] = {}
        answered = {
            s: checked[s] for s in messages if isinstance(checked.get(s), Accepted | Dropout)
        }
        keep_receipts(self.store, self.deployment, answered)
        for silo, message in messages.items():
            fate = (
                checked.get(silo) if silo in sent else Reply(silo, message.task_id, None, REVOKED)
            )
            if fate is None:
                dropped[silo] = "no reply before the deadline"
            elif isinstance(fate, Reply):
                dropped[silo] = fate.failure or "empty reply"
                if fate.failure == REVOKED:
                    self._revoke(silo, record)
            elif isinstance(fate, Dropout):
                dropped[silo] = fate.reason
                if fate.retire:
                    self._retire(silo, fate.reason, record)
            else:
                results[silo] = fate
        return results, dropped


def _record_phase(
    record: RoundRecord, phase: str, answered: Mapping[str, SiloReport], dropped: Mapping[str, str]
) -> None:
    record.phases[phase] = {
        "answered": {s: {"num_samples": r.num_samples, **r.metrics} for s, r in answered.items()},
        "dropped": dict(dropped),
    }
    record.compute_seconds[phase] = {s: r.compute_seconds for s, r in answered.items()}
    for silo, report in answered.items():
        if report.ledger_head is not None:
            record.privacy = record.privacy or {}
            record.privacy[silo] = {"epsilon": report.epsilon, "ledger_head": report.ledger_head}


def _failed(record: RoundRecord) -> bool:
    return record.status == "failed"


def _deliveries(messages: Mapping[str, TaskMessage], round_no: int) -> Iterator[Delivery]:
    """Each task encoded as the transport takes it; silos given the same tensors share one
    encoding of them, which lives only until the last of those silos has it."""
    blocks = TensorBlocks()
    for silo, message in messages.items():
        yield Delivery(silo, message.task_id, message.encode_payload(blocks), round_no)


def _digest(tensors: Mapping[str, LazyTensor], names: Sequence[str]) -> str:
    """BLAKE3 (`digest_of`) of the named tensors' names, dtypes, shapes and bytes, by chunks."""

    def parts() -> Iterator[bytes]:
        for name in names:
            tensor = tensors[name]
            yield f"{name}|{tensor.dtype}|{tensor.shape}|".encode()
            yield from tensor.byte_chunks()

    return digest_of(parts()).hex()
