"""The silo agent's connection to its coordinator: outbound mTLS gRPC only (the channel, its
route through a proxy and its renewed certificates: silo/channel.py).

It joins, receives the deployment policy and checks the operator's signature on it (and, for
a second or later attempt at a policy, the operator's signature of the attempt: the attempt is
part of the job's id, so only the operator starts one), checks the consortium's signed roster
that comes with it (silo/roster_gate.py: its peers are the job's), checks the site's local
rules, and accepts (pinning the policy digest) or refuses naming the rule or what is wrong
with the roster.
Then it long-polls for a task, runs it with the agent and sends the result, whose reply is its
next task (or IDLE, or FINISHED), so it pulls only when it holds no reply. A coordinator
that serves several jobs (`coordinator serve`) says so (`more` in POLICY and FINISHED): the
silo stays connected when a job finishes or when it refused one, and joins the next (with a new
agent; the last job's is dropped first); a single-policy coordinator's FINISHED ends the run. A lost
connection is retried with exponential backoff and jitter; a task it has already answered
(the coordinator restarted, or an acknowledgement was lost) gets the very bytes it got before
from the agent's answer store (kept in the silo's state folder, so across restarts too), so
result delivery is idempotent. A coordinator that does not know this silo (not on its roster:
it may have been enrolled a moment ago) is retried with the same backoff; one that refuses it
(revoked, or another identity) ends the agent with `SiloRefused`: retrying cannot help. Nor can
it with a coordinator of another protocol version: its refusal (FAILED_PRECONDITION), or a reply
in another protocol, ends the agent with `ProtocolMismatch`, one line naming both sides'
protocol and package versions and what to upgrade (wire/messages.py `version_mismatch`). A
heartbeat (silo/heartbeat.py) tells the coordinator the agent is alive, also while it trains.

Failures are reported, not left to time out: a job the silo cannot prepare (its data does not
load, the model does not build, the device is unavailable, a site rule is broken) is refused
with the reason, and a task that fails outside its handler (while being decoded, booked or
stored) is answered with an error result naming the task, so the coordinator drops the silo at
once. What the coordinator learns is `failure_reason`: one short line, never data.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
from nacl.signing import SigningKey, VerifyKey

from fedsilo.policies.loading import parse_policy_text
from fedsilo.policies.schema import Policy
from fedsilo.privacy.policy_signing import PolicySignatureError, verify_attempt, verify_policy
from fedsilo.privacy.roster import RosterError, SignedRoster
from fedsilo.silo.call_progress import watched_reply
from fedsilo.silo.channel import ChannelSettings, CoordinatorChannel, ExchangeCalls
from fedsilo.silo.roster_gate import RosterGate
from fedsilo.wire.chunks import DEFAULT_CHUNK_BYTES
from fedsilo.wire.control import (
    ACCEPT,
    ACK,
    FINISHED,
    IDLE,
    JOIN,
    LATE,
    POLICY,
    PULL,
    REFUSE,
    Control,
    decode_control,
    payload_type,
)
from fedsilo.wire.envelope import UNKNOWN_SENDER, Envelope, EnvelopeVerifier, seal
from fedsilo.wire.framing import check_answers, one_message, read_message, to_frames
from fedsilo.wire.messages import (
    STATUS_ERROR,
    BadTaskConfig,
    SiloEndpoint,
    TaskHeader,
    TaskMessage,
    TaskResult,
    payload_mismatch,
)
from fedsilo.wire.payload import AnyPayload, as_payload
from fedsilo.wire.tensors import WireError

log = logging.getLogger("fedsilo.silo")

RETRYABLE = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED}
WINDOW_METADATA = "fedsilo-heartbeat-window-s"  # what a coordinator tells a second agent
DEFAULT_WINDOW_S = 10.0  # the coordinator's heartbeat window when it does not say
DUPLICATE_MARGIN_S = 5.0
MAX_WINDOW_S = 3600.0  # the longest heartbeat window a coordinator's word is taken for
MAX_REASON_CHARS = 300
T = TypeVar("T")


class PolicyRefused(RuntimeError):
    """This silo will not take part: the policy is unsigned, tampered, or breaks a local rule."""


class SiloRefused(PolicyRefused):
    """The coordinator refuses this silo (PERMISSION_DENIED): it is revoked, or its identity is
    not on the roster; it cannot take part."""


class ChannelError(RuntimeError):
    """The coordinator rejected a request of this silo, or answered with something this silo
    cannot read (e.g. another protocol version): retrying the same request cannot help."""


class ProtocolMismatch(ChannelError):
    """The coordinator speaks another protocol version than this silo; the message is the one
    line that names both sides' versions and which side to upgrade."""


def failure_reason(exc: BaseException) -> str:
    """Why something failed, as the coordinator may learn it: the first line of the message
    (an operator's mistake names its file, field or column), clipped, with the exception's type
    where it is not an operator's mistake (a ValueError or an OSError). A path on the site's
    machine is named by its file name only: where the site keeps its data is its own (the
    site's log has the whole message)."""
    lines = str(exc).strip().splitlines()
    text = _LOCAL_PATH.sub(r"\g<name>", lines[0] if lines else type(exc).__name__)
    if not isinstance(exc, (ValueError, OSError)):
        text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= MAX_REASON_CHARS else text[: MAX_REASON_CHARS - 3] + "..."


# an absolute path (POSIX, or a Windows drive's), up to its last component
_LOCAL_PATH = re.compile(
    r"(?<![\w.:/])(?:/|[A-Za-z]:\\)(?:[^\s'\"/\\]+[/\\])+(?P<name>[^\s'\"/\\]+)"
)


@dataclass(frozen=True)
class SiloIdentity:
    name: str
    deployment: str
    signing_key: SigningKey
    coordinator_key: VerifyKey


class CoordinatorConnection:
    """Signed request/reply exchanges with the coordinator, retried while it is unreachable."""

    def __init__(
        self, settings: ChannelSettings, identity: SiloIdentity, stop: threading.Event
    ) -> None:
        self.settings = settings
        self.identity = identity
        self.stop = stop
        self.channel = CoordinatorChannel(settings)
        self.verifier = EnvelopeVerifier(
            identity.deployment, {"coordinator": identity.coordinator_key}
        )
        self._one_message = True  # until a coordinator without `ExchangeOne` answers
        self.agent = uuid.uuid4().hex  # this process: the coordinator lets one speak per kit
        self._duplicate_since: float | None = None  # refused as a second agent since

    def control(self, kind: str, fields: Mapping[str, Any] | None = None) -> bytes:
        """A control message of this agent (it names the agent process)."""
        return Control(kind, {**(fields or {}), "agent": self.agent}).encode()

    @property
    def call(self) -> ExchangeCalls:
        """The exchange methods on the channel as it is now (a new one once the certificate is
        renewed)."""
        return self.channel.exchange()

    def exchange(self, payload: bytes | AnyPayload, label: str, round_no: int = 0) -> bytes:
        """Send one request (a control message, or the result of the task `label`) and return the
        verified reply, retrying with backoff while the coordinator is unreachable; never retried
        when the coordinator speaks another protocol version (`ProtocolMismatch`).

        Every attempt is a new message with its own envelope id (`label/<random>`), so replay
        protection never refuses a retry or a re-sent result; a result counts once because the
        coordinator takes only one answer per task id inside the payload.
        """
        delay = self.settings.backoff_initial_s
        while not self.stop.is_set():
            try:
                reply = self.exchange_once(
                    payload, label, round_no, timeout_s=self.settings.call_timeout_s
                )
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.PERMISSION_DENIED:
                    if not exc.details().startswith(UNKNOWN_SENDER):
                        raise SiloRefused(
                            f"the coordinator refuses this silo: {exc.details()}"
                        ) from None
                    log.warning(  # it may have been enrolled a moment ago
                        "the coordinator does not know this silo yet (%s); retrying in %.0fs",
                        exc.details(),
                        delay,
                    )
                elif exc.code() == grpc.StatusCode.FAILED_PRECONDITION:  # another protocol
                    raise ProtocolMismatch(exc.details() or exc.code().name) from None
                elif exc.code() == grpc.StatusCode.ALREADY_EXISTS:
                    self._wait_out_predecessor(exc)
                    delay = min(delay, 1.0)
                elif exc.code() not in RETRYABLE:
                    raise ChannelError(
                        f"the coordinator rejected this silo's {label!r}: {exc.details()}"
                    ) from None
                else:
                    log.info(
                        "coordinator unreachable (%s); retrying in %.1fs: %s",
                        exc.code().name,
                        delay,
                        exc.details(),
                    )
            else:
                self._duplicate_since = None
                coordinator = f"the coordinator at {self.settings.address}"
                mismatch = payload_mismatch(reply, coordinator, "silo")
                if mismatch is not None:
                    raise ProtocolMismatch(mismatch)
                return reply
            self.stop.wait(delay * random.uniform(0.5, 1.0))
            delay = min(delay * 2, self.settings.backoff_max_s)
        raise InterruptedError("stopped")

    def _wait_out_predecessor(self, exc: grpc.RpcError) -> None:
        """Another agent holds this kit's identity: retry while that may be this agent's
        predecessor (killed, and not yet silent for the coordinator's heartbeat window); after
        twice the window it is a live agent, and this one gives up with the coordinator's
        word, which names it."""
        now = time.monotonic()
        if self._duplicate_since is None:
            self._duplicate_since = now
            log.warning("%s; retrying while that may be this agent's predecessor", exc.details())
        if now - self._duplicate_since > 2 * _told_window_s(exc) + DUPLICATE_MARGIN_S:
            raise SiloRefused(f"the coordinator refuses this agent: {exc.details()}") from None

    def exchange_once(
        self, payload: bytes | AnyPayload, label: str, round_no: int, timeout_s: float
    ) -> bytes:
        """One attempt of `exchange`: the verified reply, or the `grpc.RpcError`; the call is
        cancelled once no frame has moved for `timeout_s` (silo/call_progress.py), however long
        a large model takes to cross."""
        envelope = seal(
            payload,
            signing_key=self.identity.signing_key,
            sender=self.identity.name,
            deployment=self.identity.deployment,
            round=round_no,
            task_id=f"{label}/{uuid.uuid4().hex}",
        )
        calls = self.call
        if self._one_message and len(as_payload(payload)) <= DEFAULT_CHUNK_BYTES:
            try:  # one message: gRPC starts no thread for it (docs/performance.md)
                request = one_message(envelope, payload)
                return self._reply(watched_reply(lambda _: calls.one(request), timeout_s), envelope)
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.UNIMPLEMENTED:
                    raise
                log.info("the coordinator takes no one-message requests: sending frames")
                self._one_message = False
        frames = to_frames(envelope, payload)
        return self._reply(
            watched_reply(lambda progress: calls.stream(progress.moving(frames)), timeout_s),
            envelope,
        )

    def _reply(self, frames: Iterable[bytes], request: Envelope) -> bytes:
        """The verified reply in `frames` to `request`."""
        answered, reply = read_message(frames, self.verifier, self.settings.max_payload_bytes)
        check_answers(answered, request)
        return reply.to_bytes()

    def close(self) -> None:
        self.channel.close()


class SiloClient:
    def __init__(
        self,
        connection: CoordinatorConnection,
        operator_key: VerifyKey,
        check_policy: Callable[[Policy, str], list[str]],
        start_agent: Callable[[Policy, str, int, SignedRoster | None], SiloEndpoint],
        record_decision: Callable[[Policy, str, int, list[str]], None] = lambda *_: None,
        roster_gate: RosterGate | None = None,
        job_finished: Callable[[], None] = lambda: None,
    ) -> None:
        """`check_policy(policy, digest)` lists broken local rules; `start_agent(policy, digest,
        attempt, roster)` returns the agent's endpoint (encoded task in, encoded result out) for
        that attempt at the policy, its peers the roster's (None: the kit's);
        `record_decision(policy, digest, attempt, problems)` keeps the silo's final word on a
        policy (accepted when `problems` is empty), before the coordinator hears it;
        `roster_gate` checks the roster that comes with each policy (None: no roster is read,
        the kit's peers are used); `job_finished()` is called when the coordinator says the
        agent's job finished."""
        self.connection = connection
        self.operator_key = operator_key
        self.check_policy = check_policy
        self.start_agent = start_agent
        self.record_decision = record_decision
        self.roster_gate = roster_gate
        self.job_finished = job_finished
        # digest, attempt and roster version of the agent's job, and its endpoint
        self._current: tuple[str, SiloEndpoint] | None = None

    def run(self) -> str:
        """Take part in job after job: join, accept or refuse the job's policy, work until the
        job finishes, and join again while the coordinator says more jobs may come; returns
        why it ended (the coordinator's last FINISHED without `more`, or "stopped")."""
        while not self.connection.stop.is_set():
            if self.join() is None:
                continue  # no job yet, or one this silo refused: join again
            finished = self._work()
            if finished is None:
                continue  # the coordinator does not know this silo (restarted): join again
            reason = str(finished.get("reason", "finished"))
            self.job_finished()
            if not finished.get("more"):
                return reason
            log.info("job finished (%s); waiting for the next job", reason)
            self._current = None  # the finished job's agent and data go
        return "stopped"

    def _work(self) -> Control | None:
        """Run the current job's tasks until the coordinator says it finished (its FINISHED)
        or no longer knows this silo (None). The reply to a result is the next task (or IDLE,
        or FINISHED), so the silo pulls only when it holds no reply."""
        reply: bytes | None = None
        while not self.connection.stop.is_set() and self._current is not None:
            if reply is None:
                reply = self.connection.exchange(self.connection.control(PULL), PULL)
            if _readable(payload_type, reply) == "task":
                reply = self._answer(reply, self._current[1])
                continue
            control = _readable(decode_control, reply)
            reply = None
            if control.type == FINISHED:
                return control
            if control.type == ACK and (control.get("accepted") or control.get("reason") == LATE):
                continue  # the result was taken, or came too late to count: pull the next task
            if control.type == ACK and not control.get("accepted"):
                log.info(
                    "coordinator does not know this silo (%s); joining again", control.get("reason")
                )
                return None
            if control.type != IDLE:
                log.warning("unexpected %s from the coordinator; ignored", control.type)
        return None

    def join(self) -> tuple[str, SiloEndpoint] | None:
        """Join, verify the policy (and its attempt), check the local rules and get ready to
        work under it (load the data, build the agent; the current one is reused when its
        digest, attempt and roster are the job's, else dropped first), and only then accept:
        acceptance means ready. A policy this silo cannot work under is refused with the
        reason. Returns the accepted digest and the agent's endpoint; None when no job is
        running yet, or when a coordinator that serves several jobs (POLICY's `more`) is told
        this silo refuses (or missed) this one: the silo then joins again for the next. A
        single-policy coordinator's refused policy raises `PolicyRefused`."""
        reply = _readable(
            decode_control, self.connection.exchange(self.connection.control(JOIN), JOIN)
        )
        if reply.type == IDLE:
            return None
        if reply.type != POLICY:
            raise PolicyRefused(f"the coordinator answered a join with {reply.type!r}")
        more = bool(reply.get("more"))
        policy, digest = self._verified_policy(reply)
        attempt = self._verified_attempt(reply, digest)
        try:
            roster = self._admitted_roster(reply)
        except RosterError as exc:
            roster, problems = None, [f"roster refused: {exc}"]
        else:
            problems = []
        pinned = f"{digest}/{attempt}/{roster.version if roster is not None else 'kit'}"
        if self._current is not None and self._current[0] != pinned:
            self._current = None  # the last job's agent goes before the next one is built
        endpoint = self._current[1] if self._current is not None else None
        try:
            problems = problems or self.check_policy(policy, digest)
            if not problems and endpoint is None:
                endpoint = self.start_agent(policy, digest, attempt, roster)
        except Exception as exc:  # data, model, device or state that do not fit: refused
            log.warning("cannot prepare policy %s: %s", policy.name, exc)
            problems = [f"cannot work under this policy: {failure_reason(exc)}"]
        self.record_decision(policy, digest, attempt, problems)
        if problems:
            self.connection.exchange(
                self.connection.control(REFUSE, {"reason": "; ".join(problems)}), REFUSE
            )
            if more:
                log.warning("refused policy %s: %s", policy.name, "; ".join(problems))
                return None
            raise PolicyRefused("refused the policy: " + "; ".join(problems))
        ack = _readable(
            decode_control,
            self.connection.exchange(
                self.connection.control(ACCEPT, {"policy_digest": digest}), ACCEPT
            ),
        )
        if not ack.get("accepted"):
            if more:  # the job ended while this silo got ready: join the next
                log.info("acceptance of %s not taken: %s", policy.name, ack.get("reason"))
                return None
            raise PolicyRefused(f"the coordinator did not take our acceptance: {ack.get('reason')}")
        log.info("accepted policy %s (%s, attempt %d)", policy.name, digest[:12], attempt)
        self._current = (pinned, endpoint)
        return digest, endpoint

    def _verified_policy(self, reply: Control) -> tuple[Policy, str]:
        text = str(reply.get("policy", ""))
        try:
            digest = verify_policy(
                text.encode(), str(reply.get("signature", "")), self.operator_key
            )
        except PolicySignatureError as exc:
            raise PolicyRefused(f"policy signature check failed: {exc}") from None
        return parse_policy_text(text, source="the deployment policy"), digest

    def _verified_attempt(self, reply: Control, digest: str) -> int:
        """Which attempt at the policy the job is: 1, or a later one the operator signed."""
        attempt = reply.get("attempt", 1)
        if attempt == 1 and not isinstance(attempt, bool):
            return 1
        if not isinstance(attempt, int) or isinstance(attempt, bool) or attempt < 1:
            raise PolicyRefused(f"the policy's attempt {attempt!r} is not a number from 1")
        try:
            verify_attempt(
                digest, attempt, str(reply.get("attempt_signature", "")), self.operator_key
            )
        except PolicySignatureError as exc:
            raise PolicyRefused(f"attempt signature check failed: {exc}") from None
        return attempt

    def _admitted_roster(self, reply: Control) -> SignedRoster | None:
        if self.roster_gate is None:
            return None
        roster = self.roster_gate.admit(reply.get("roster"), reply.get("roster_signature"))
        if roster is not None:
            log.info(
                "roster version %d: %s", roster.version, ", ".join(sorted(roster.document.silos))
            )
        return roster

    def _answer(self, payload: bytes, endpoint: SiloEndpoint) -> bytes | None:
        """Run the task, send its result and return the coordinator's reply (the next task,
        IDLE, FINISHED, or why the result was not taken); a failure outside the handler is
        answered with an error result naming the task. A task whose header does not read cannot
        be named: it is logged and left to its deadline (None: pull again)."""
        task = _header(payload)
        if task is None:
            log.warning("a task whose header does not read: not answered")
            return None
        try:
            result = endpoint(payload)  # a task id answered before gets the same bytes
        except Exception as exc:  # decoding, booking or storing the answer failed
            log.warning("task %s failed outside its handler: %s", task.task_id, exc)
            result = TaskResult(
                task.task_id,
                self.connection.identity.name,
                task.kind,
                STATUS_ERROR,
                error=failure_reason(exc),
            ).encode()
        reply = self.connection.exchange(result, task.task_id, task.round)
        if _readable(payload_type, reply) != "task":
            control = _readable(decode_control, reply)
            if control.type == ACK and not control.get("accepted"):
                log.warning("result for %s not taken: %s", task.task_id, control.get("reason"))
        return reply


def _told_window_s(exc: grpc.RpcError) -> float:
    """The heartbeat window a coordinator told a second agent, within (0, MAX_WINDOW_S]; the
    default where it told none, or something else (a coordinator's word bounds only how long
    this agent retries)."""
    for key, value in exc.trailing_metadata() or ():
        if key == WINDOW_METADATA:
            try:
                told = float(value)
            except ValueError:
                break
            if 0 < told <= MAX_WINDOW_S:
                return told
    return DEFAULT_WINDOW_S


def _header(payload: bytes) -> TaskHeader | None:
    """Who the task is for and what it is, also when its config does not read."""
    try:
        return TaskMessage.decode(payload).header
    except BadTaskConfig as exc:
        return exc.header
    except WireError:
        return None


def _readable(read: Callable[[bytes], T], reply: bytes) -> T:
    """`read(reply)`, or a `ChannelError` saying why the coordinator's reply does not read."""
    try:
        return read(reply)
    except WireError as exc:
        raise ChannelError(f"the coordinator's reply does not read: {exc}") from None
