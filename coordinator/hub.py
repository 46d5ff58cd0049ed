"""The coordinator's meeting point with its silos: per-silo outboxes of encoded tasks, the results
they return, who has joined and accepted the policy, and when each silo was last heard from.

The gRPC servicer (coordinator/service.py) fills it from the network; the transport the engine
uses (coordinator/grpc_transport.py) posts tasks and collects results through it. A task not
picked up before its deadline is withdrawn, and a result for a withdrawn or unknown task is
refused as late: it can never be applied to a later round. Only the silo a task was posted to
can answer it, and the tasks of a revoked silo, or of one that refused the policy (it could
not prepare the job, and said why), fail at once instead of waiting for their deadline.

Liveness: every agent heartbeats (silo/heartbeat.py) every quarter of the coordinator's
heartbeat window (`heartbeat_window_s`), also while it trains. A silo not heard from for a whole
window is gone (`reap`, once a second): every task it holds or has queued fails at once as
`offline`, which the engine takes for a dropout, it leaves the job's members (it joins again
when it comes back: its next pull is answered "not a member"), a task posted to it fails at
once, and the join of a job stops waiting for it once the silos that did answer can meet the
quorum. A silo never heard from has `STARTUP_WINDOWS` windows from the hub's start to be heard
(agents started with their coordinator import torch and read their data first). A silo counts
as connected when heard from within the window; a revoked silo never does.

One agent per identity: every control message of an agent carries its `agent` id (a random
one per process), and the first agent heard binds the silo's identity (`claim`). Another agent
with the same kit is refused, naming where the first connects from and since when, for as long
as the first is heard within the window; once the first is silent for a whole window (its
process was killed, and the service manager started a new one) the new agent takes its place,
and the tasks the old one held fail at once as `offline`, so the job need not wait for them.

Quorum with patience: a job short of its quorum waits for silos to come back
(`wait_for_quorum`, for the policy's `participants.quorum_grace_s`) before its next round.

A long-running coordinator (`fedsilo coordinator serve`) runs a sequence of jobs through one
hub: `start_job` forgets the last job's acceptances, refusals, tasks and its end, and keeps the
consortium's (the roster, revocations, when each silo was last heard from); `end_job` tells the
silos the job is over; `abort` fails every task of the running job at once and refuses new ones.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import NamedTuple

from fedsilo.coordinator.transport import Reply
from fedsilo.wire.payload import AnyPayload

log = logging.getLogger("fedsilo.coordinator")
REVOKED = "revoked"
REFUSED = "refused"
NOT_CONNECTED = "not connected"
OFFLINE = "offline"  # no heartbeat for a whole window
DEFAULT_HEARTBEAT_WINDOW_S = 10.0
STARTUP_WINDOWS = 6  # a silo never heard from has this many windows from the hub's start


@dataclass(frozen=True)
class PostedTask:
    silo: str
    task_id: str
    round: int
    payload: AnyPayload
    until: float | None = None  # the phase's deadline, unix seconds


class Waiting(NamedTuple):
    """A posted task waiting for its silo's result."""

    silo: str
    replies: queue.Queue[Reply]
    since: float  # unix seconds
    until: float | None


@dataclass(frozen=True)
class AgentSession:
    """The agent process that holds a silo's identity: its id, where it connects from and
    since when (unix seconds)."""

    agent: str
    peer: str
    since: float


@dataclass(frozen=True)
class Awaited:
    """A silo the running job waits for: to join it, or for the result of task `task_id`."""

    silo: str
    task_id: str | None  # None: its join
    since: float  # unix seconds
    until: float | None


class SiloHub:
    def __init__(
        self,
        roster: list[str],
        clock: Callable[[], float] = time.monotonic,
        heartbeat_window_s: float = DEFAULT_HEARTBEAT_WINDOW_S,
    ) -> None:
        """`clock`: when silos were last heard from (a test's fake clock); a silo silent for
        `heartbeat_window_s` is gone."""
        self.roster = tuple(roster)
        self.heartbeat_window_s = heartbeat_window_s
        self._clock = clock
        self._started = clock()
        self._enrolled_at: dict[str, float] = {}  # silos enrolled while serving: since when
        self._lock = threading.Condition()
        self._outboxes: dict[str, deque[PostedTask]] = {s: deque() for s in roster}
        self._pending: dict[str, Waiting] = {}  # by task id
        self._last_seen: dict[str, float] = {}
        self._moving_at: dict[str, float] = {}  # a frame of a message to or from it last moved
        self._gone: set[str] = set()  # reaped, not heard from since
        self._agents: dict[str, AgentSession] = {}  # the agent that holds each identity
        self._joining: tuple[float, float] | None = None  # since, until (unix) while gathering
        self.accepted: set[str] = set()
        self.refused: dict[str, str] = {}
        self.revoked: set[str] = set()
        self.finished = threading.Event()
        self.job: str | None = None  # the current job of a coordinator that serves several
        self.aborted: str | None = None  # why the current job stops, once it is aborted

    # -- jobs -------------------------------------------------------------------------------

    def set_roster(self, roster: list[str]) -> None:
        """The consortium's silos from now on (one enrolled while serving joins later jobs)."""
        with self._lock:
            for silo in set(roster) - set(self.roster):  # a window to connect from enrolment
                self._enrolled_at[silo] = self._clock()
            self.roster = tuple(roster)
            for silo in roster:
                self._outboxes.setdefault(silo, deque())

    def start_job(self, job: str) -> None:
        """Job `job` starts: every silo joins it afresh (accepts or refuses its policy)."""
        with self._lock:
            self._fail_all(f"job {job} started")
            self.accepted.clear()
            self.refused.clear()
            self.aborted = None
            self.finished.clear()
            self.job = job
            self._lock.notify_all()

    def end_job(self) -> None:
        """The current job is over: silos that poll hear it finished, and none is current."""
        with self._lock:
            self.job = None
            self.finished.set()
            self._lock.notify_all()

    def wait_for_job(self, silo: str, timeout_s: float) -> str | None:
        """The current job once there is one `silo` has not refused, waiting up to `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while self.job is None or silo in self.refused:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._lock.wait(timeout=remaining)
            return self.job

    def abort(self, reason: str) -> None:
        """Stop the current job: every task waiting or queued fails at once with `reason`, a
        task posted from now on too, and the wait for members ends."""
        with self._lock:
            self.aborted = reason
            self._fail_all(reason)
            self._lock.notify_all()

    def _fail_all(self, failure: str) -> None:
        for outbox in self._outboxes.values():
            outbox.clear()
        for task_id, (silo, replies, *_) in list(self._pending.items()):
            del self._pending[task_id]
            replies.put(Reply(silo, task_id, None, failure))

    # -- membership -------------------------------------------------------------------------

    def seen(self, silo: str) -> None:
        with self._lock:
            self._last_seen[silo] = self._clock()
            self._gone.discard(silo)

    def moving(self, silo: str) -> None:
        """A frame of a message from or to `silo` moved: it is not silent (`reap`) while a
        large message crosses a narrow link and its heartbeats queue behind it. Unlike `seen`,
        it binds no agent's claim to the identity: the frames may be a new agent's first."""
        with self._lock:
            self._moving_at[silo] = self._clock()

    def connected(self) -> list[str]:
        """The silos not revoked heard from within the heartbeat window."""
        now = self._clock()
        with self._lock:
            heard = {s for s, t in self._last_seen.items() if now - t <= self.heartbeat_window_s}
            return sorted(heard - self.revoked)

    def claim(self, silo: str, agent: str, peer: str) -> str | None:
        """Let agent `agent` (connecting from `peer`) speak for `silo`; the refusal, naming the
        agent that holds the identity, while that one is heard within the window. An agent that
        takes the place of a silent one starts afresh: the tasks the old one held fail."""
        with self._lock:
            bound = self._agents.get(silo)
            if bound is not None and bound.agent == agent:
                return None
            if bound is not None:
                heard_s = self._clock() - self._last_seen.get(silo, float("-inf"))
                if heard_s <= self.heartbeat_window_s:
                    since = datetime.fromtimestamp(bound.since, UTC).strftime("%Y-%m-%d %H:%M:%S")
                    return (
                        f"silo {silo} already has an agent connected from {bound.peer} since "
                        f"{since} UTC (heard {heard_s:.0f}s ago): two agents with one kit cannot "
                        "both take part; stop one of them (a stopped agent counts as gone "
                        f"{self.heartbeat_window_s:g}s after it was last heard)"
                    )
                log.warning(
                    "silo %s: a new agent from %s takes the place of the one from %s",
                    silo,
                    peer,
                    bound.peer,
                )
                self.accepted.discard(silo)
                self._fail_tasks_of(silo, f"{OFFLINE}: its agent was replaced by a new one")
                self._lock.notify_all()
            self._agents[silo] = AgentSession(agent, peer, time.time())
            return None

    def agent_of(self, silo: str) -> AgentSession | None:
        """The agent that holds `silo`'s identity, if one was heard."""
        with self._lock:
            return self._agents.get(silo)

    def heard_ages(self) -> dict[str, float | None]:
        """Seconds since each silo of the roster was last heard from (None: never heard)."""
        now = self._clock()
        with self._lock:
            return {
                s: now - self._last_seen[s] if s in self._last_seen else None for s in self.roster
            }

    def offline(self) -> list[str]:
        """The silos of the roster, revoked or not, silent for a whole heartbeat window."""
        with self._lock:
            return sorted(self._silent())

    def _heard_at(self, silo: str) -> float:
        """When `silo` was last heard from; never: since it could have been (the hub's start,
        or its enrolment)."""
        heard = self._last_seen.get(silo, self._enrolled_at.get(silo, self._started))
        return max(heard, self._moving_at.get(silo, heard))

    def _silent(self) -> set[str]:
        now = self._clock()
        return {
            silo
            for silo in self.roster
            if now - self._heard_at(silo)
            > self.heartbeat_window_s * (1 if silo in self._last_seen else STARTUP_WINDOWS)
        }

    def reap(self) -> None:
        """Take every silo silent for a whole window for gone: the tasks it holds or has queued
        fail at once as `offline`, and it leaves the job's members until it joins again."""
        with self._lock:
            for silo in self._silent() - self._gone:
                self._gone.add(silo)
                if silo in self.accepted or self._tasks_of(silo):
                    silent_s = self._clock() - self._heard_at(silo)
                    log.warning("silo %s: no heartbeat for %.0fs; it is a dropout", silo, silent_s)
                self.accepted.discard(silo)
                self._fail_tasks_of(silo, self._offline_reason(silo))
            self._lock.notify_all()

    def _offline_reason(self, silo: str) -> str:
        silent_s = self._clock() - self._heard_at(silo)
        return f"{OFFLINE}: no heartbeat for {silent_s:.0f}s (window {self.heartbeat_window_s:g}s)"

    def _tasks_of(self, silo: str) -> list[str]:
        return [t for t, waiting in self._pending.items() if waiting.silo == silo]

    def accept(self, silo: str) -> None:
        with self._lock:
            self.accepted.add(silo)
            self.refused.pop(silo, None)
            self._lock.notify_all()

    def refuse(self, silo: str, reason: str) -> None:
        """`silo` cannot work under the policy (it says why): it counts as answered for the join
        wait, and every task waiting for it fails at once with its reason."""
        with self._lock:
            self.accepted.discard(silo)
            self.refused[silo] = reason
            self._fail_tasks_of(silo, f"{REFUSED}: {reason}")
            self._lock.notify_all()

    def revoke(self, silo: str) -> None:
        """Refuse `silo` from now on: its queued tasks are dropped and every task waiting for its
        result fails at once as revoked."""
        with self._lock:
            self.revoked.add(silo)
            self.accepted.discard(silo)
            self._fail_tasks_of(silo, REVOKED)
            self._lock.notify_all()

    def _fail_tasks_of(self, silo: str, failure: str) -> None:
        self._outboxes.get(silo, deque()).clear()
        for task_id in self._tasks_of(silo):
            replies = self._pending.pop(task_id).replies
            replies.put(Reply(silo, task_id, None, failure))

    def wait_for_members(self, wanted: int, timeout_s: float, quorum: int = 1) -> list[str]:
        """The silos that accepted the policy once `wanted` did, once every silo not revoked
        has accepted or refused it, once at least `quorum` accepted and every other silo not
        revoked refused or is gone (silent for a window), or when `timeout_s` passed."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            self._joining = (time.time(), time.time() + timeout_s)
            while (
                len(self.accepted) < wanted
                and self.accepted | set(self.refused) < (set(self.roster) - self.revoked)
                and not (
                    len(self.accepted) >= quorum
                    and self.accepted | set(self.refused) | self._silent()
                    >= set(self.roster) - self.revoked
                )
                and self.aborted is None
            ):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    break
                self._lock.wait(timeout=min(remaining, 1.0))
            self._joining = None
            return sorted(self.accepted)

    def wait_for_quorum(
        self,
        silos: Sequence[str],
        quorum: int,
        timeout_s: float,
        should_stop: Callable[[], str | None] = lambda: None,
    ) -> list[str]:
        """Wait up to `timeout_s` until at least `quorum` of `silos` are members of the job (an
        agent restarted by its service manager joins again); the silos still missing then,
        none once the quorum is there (or the job is aborted, or `should_stop` says why)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while True:
                missing = [s for s in silos if s not in self.accepted or s in self.revoked]
                if len(silos) - len(missing) >= quorum:
                    return []
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self.aborted or should_stop():
                    return missing
                self._lock.wait(timeout=min(remaining, 1.0))

    def why_missing(self, silo: str) -> str:
        """Why `silo` is not a member of the running job, in a few words."""
        with self._lock:
            return self._absence(silo)

    def _absence(self, silo: str) -> str:
        """Why `silo` cannot be sent a task: revoked, refused (its reason), gone (offline) or
        not connected."""
        if silo in self.revoked:
            return REVOKED
        if silo in self.refused:
            return f"{REFUSED}: {self.refused[silo]}"
        if silo in self._gone:
            return self._offline_reason(silo)
        return NOT_CONNECTED

    def awaited(self) -> list[Awaited]:
        """Whom the running job waits for: the silos not yet answered while it gathers its
        members (not the ones gone), else the silos that hold a task of it, each with since and
        until when."""
        with self._lock:
            if self._joining is not None:
                since, until = self._joining
                answered = self.accepted | set(self.refused) | self.revoked | self._silent()
                return [Awaited(s, None, since, until) for s in self.roster if s not in answered]
            return sorted(
                (Awaited(w.silo, t, w.since, w.until) for t, w in self._pending.items()),
                key=lambda a: (a.silo, a.task_id or ""),
            )

    # -- tasks and results ------------------------------------------------------------------

    def post(self, task: PostedTask, replies: queue.Queue[Reply]) -> None:
        """Queue `task` for its silo's next poll; a silo that is revoked or has not accepted the
        policy, or any silo of an aborted job, gets a failed reply at once instead."""
        with self._lock:
            if task.silo in self.revoked or task.silo not in self.accepted or self.aborted:
                failure = self.aborted or self._absence(task.silo)
                replies.put(Reply(task.silo, task.task_id, None, failure))
                return
            self._pending[task.task_id] = Waiting(task.silo, replies, time.time(), task.until)
            self._outboxes[task.silo].append(task)
            self._lock.notify_all()

    def next_task(self, silo: str, timeout_s: float) -> PostedTask | None:
        """The silo's next task, waiting up to `timeout_s` (the long poll)."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            while not self._outboxes[silo] and not self.finished.is_set():
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return None
                self._lock.wait(timeout=remaining)
            return self._outboxes[silo].popleft() if self._outboxes[silo] else None

    def deliver(self, silo: str, task_id: str, payload: AnyPayload) -> bool:
        """Hand `silo`'s result to whoever waits for it; False when no task `task_id` waits for
        `silo` (unknown, withdrawn, or posted to another silo)."""
        with self._lock:
            waiting = self._pending.get(task_id)
            if waiting is None or waiting.silo != silo:
                return False
            del self._pending[task_id]
        waiting.replies.put(Reply(silo, task_id, payload))
        return True

    def withdraw(self, task_ids: set[str]) -> None:
        with self._lock:
            for task_id in task_ids:
                self._pending.pop(task_id, None)
            for outbox in self._outboxes.values():
                kept = [t for t in outbox if t.task_id not in task_ids]
                outbox.clear()
                outbox.extend(kept)

    def finish(self) -> None:
        with self._lock:
            self.finished.set()
            self._lock.notify_all()
