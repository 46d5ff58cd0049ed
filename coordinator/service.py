"""The coordinator's gRPC service: one `Exchange` per silo request over mutual TLS.

Each request is checked before it is used: a revoked silo (by its TLS client certificate's
common name) is refused before anything of its request is read, the certificate's common name
must be the envelope's sender, the sender must be in the roster, and the envelope must verify
(signature, deployment, freshness, replay, digest; wire/framing.py); then, before anything
else reads the payload, its header must speak this coordinator's protocol version: a silo of
another is refused with FAILED_PRECONDITION and one line naming both sides' protocol and
package versions and what to upgrade (wire/messages.py `version_mismatch`), logged once however
often the silo retries (`MismatchLog`). A result is taken only
for a task waiting for that very silo (coordinator/hub.py), and its reply is what a PULL would
get (the silo's next task, IDLE or FINISHED, after the same long poll), so a silo sends one
message per task, not two. A control message carries the id of the agent process that sent
it: a second agent with a kit that another agent holds is refused with ALREADY_EXISTS, naming
the first (coordinator/hub.py `claim`). A rejected request is refused with
a gRPC status naming the reason, logged, and counted in `fedsilo_rejected_messages_total{reason}`;
nothing of it reaches the engine.

The service answers for one job at a time: `coordinator start` builds it with its one policy;
`coordinator serve` sets each job's policy as the job starts and clears it when it ends
(`more_jobs`: FINISHED then tells the silos to stay and join the next). A silo that joins while
no job runs, or that refused the current one, is held up to the long poll for a job to start
and then told the policy, or IDLE. The POLICY reply carries the operator-signed roster the job
started with (privacy/roster.py; the same for every silo of the job), which each silo checks
itself (silo/roster_gate.py); a kit provisioned before rosters were signed sends none.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import grpc
from nacl.signing import SigningKey

from fedsilo.coordinator.hub import SiloHub
from fedsilo.coordinator.staggered_sends import StaggeredSends
from fedsilo.privacy.roster import SignedRoster
from fedsilo.wire.control import (
    ACCEPT,
    ACK,
    FINISHED,
    HEARTBEAT,
    IDLE,
    JOIN,
    LATE,
    NOT_A_MEMBER,
    POLICY,
    PULL,
    REFUSE,
    Control,
    decode_control,
    payload_type,
)
from fedsilo.wire.envelope import UNKNOWN_SENDER, EnvelopeVerifier
from fedsilo.wire.framing import (
    SILO_SERVICE,
    MessageRejected,
    exchange_handler,
    read_message,
    seal_reply,
    to_frames,
)
from fedsilo.wire.messages import TaskResult, payload_mismatch
from fedsilo.wire.payload import AnyPayload
from fedsilo.wire.tensors import WireError

log = logging.getLogger("fedsilo.coordinator")

COORDINATOR = "coordinator"
HEARTBEATS_PER_WINDOW = 4  # a silo is gone only after missing this many heartbeats in a row
IDENTITY_MISMATCH, REVOKED = "identity_mismatch", "revoked"
DUPLICATE_AGENT = "duplicate_agent"  # a second agent with a kit another agent holds
WINDOW_METADATA = "fedsilo-heartbeat-window-s"  # told to a duplicate: how long to wait
PROTOCOL_MISMATCH = "protocol_version"  # a sender of another protocol version


class ChannelCounters(Protocol):
    """What the channel counts (ops/metrics.py `CoordinatorMetrics` counts it for Prometheus):
    payload bytes per silo and direction, and refused messages by reason."""

    def count_bytes(self, direction: str, silo: str, n: int) -> None: ...

    def count_rejected(self, reason: str) -> None: ...


class MismatchLog:
    """Logs each protocol mismatch line once (it names the sender and both sides' versions),
    however often its sender retries; later ones at DEBUG."""

    def __init__(self, logger: logging.Logger) -> None:
        self.logger = logger
        self._logged: set[str] = set()
        self._lock = threading.Lock()

    def warn(self, line: str) -> None:
        with self._lock:
            first = line not in self._logged
            self._logged.add(line)
        self.logger.log(logging.WARNING if first else logging.DEBUG, "%s", line)


@dataclass(frozen=True)
class SignedPolicy:
    """A job's policy as the operator signed it; from the second attempt at it on, with the
    operator's signature of the attempt (privacy/policy_signing.py `sign_attempt`)."""

    text: str
    signature: str
    digest: str
    attempt: int = 1
    attempt_signature: str = ""


class CoordinatorService:
    def __init__(
        self,
        deployment: str,
        hub: SiloHub,
        verifier: EnvelopeVerifier,
        signing_key: SigningKey,
        policy: SignedPolicy | None,
        metrics: ChannelCounters,
        max_payload_bytes: int,
        poll_seconds: float = 5.0,
        more_jobs: bool = False,
        roster: SignedRoster | None = None,
        sends: StaggeredSends | None = None,
    ) -> None:
        """`policy`: the one job's policy (`coordinator start`), or None until `set_job`;
        `roster`: the consortium's signed roster now (`roster` is updated as it changes, and a
        job keeps the one it started with); `sends`: large replies one silo at a time
        (coordinator/staggered_sends.py), None: side by side."""
        self.deployment = deployment
        self.hub = hub
        self.verifier = verifier
        self.signing_key = signing_key
        self.policy = policy
        self.metrics = metrics
        self.max_payload_bytes = max_payload_bytes
        self.poll_seconds = poll_seconds
        self.more_jobs = more_jobs
        self.roster = roster
        self.job_roster = roster
        self.mismatches = MismatchLog(log)
        self.sends = sends

    def set_job(self, policy: SignedPolicy, job: str) -> None:
        """Job `job` runs `policy` from now on, under the roster of now; every silo joins it
        afresh."""
        self.policy = policy
        self.job_roster = self.roster
        self.hub.start_job(job)

    def clear_job(self) -> None:
        """The current job ended: silos hear FINISHED, and joins wait for the next job."""
        self.hub.end_job()
        self.policy = None

    def Exchange(
        self, request_iterator: Iterator[bytes], context: grpc.ServicerContext
    ) -> Iterator[bytes]:  # noqa: N802 (gRPC's name)
        """Frames arrive and leave as serialized bytes (see `handler`), so that a frame that does
        not parse is told apart from a silo that went away mid-message."""
        peer = _common_name(context)
        try:
            if peer in self.hub.revoked:
                raise MessageRejected(REVOKED, f"silo {peer!r} is revoked")
            envelope, payload = read_message(
                self._heard_while_moving(peer, request_iterator),
                self.verifier,
                self.max_payload_bytes,
            )
            if envelope.sender != peer:
                raise MessageRejected(
                    IDENTITY_MISMATCH, f"certificate of {peer!r} signed as {envelope.sender!r}"
                )
            mismatch = payload_mismatch(payload, f"silo {peer}", "coordinator")
            if mismatch is not None:
                raise MessageRejected(PROTOCOL_MISMATCH, mismatch)
            message = _control_of(payload)
            agent = None if message is None else message.get("agent")
            if isinstance(agent, str) and agent:
                refusal = self.hub.claim(envelope.sender, agent, _peer_address(context))
                if refusal is not None:
                    raise MessageRejected(DUPLICATE_AGENT, refusal)
            self.metrics.count_bytes("from_silo", envelope.sender, len(payload))
            self.hub.seen(envelope.sender)
            reply = self._answer(envelope.sender, payload, message)
        except MessageRejected as rejected:
            if not context.is_active():  # the silo hung up: not an attack, nothing to refuse
                log.info("silo %s went away mid-message (%s)", peer, rejected.reason)
                return
            self._refuse(context, peer, rejected)
        except WireError as exc:
            self._refuse(context, peer, MessageRejected("malformed", str(exc)))
        reply_envelope = seal_reply(
            reply,
            envelope,
            signing_key=self.signing_key,
            sender=COORDINATOR,
            deployment=self.deployment,
        )
        self.metrics.count_bytes("to_silo", envelope.sender, len(reply))
        frames = to_frames(reply_envelope, reply)
        if self.sends is not None:
            frames = self.sends.frames(frames, len(reply))
        for frame in frames:
            yield frame
            self.hub.moving(envelope.sender)  # gRPC asks for the next: the silo took this one

    def _heard_while_moving(self, silo: str, frames: Iterator[bytes]) -> Iterator[bytes]:
        """`frames` from `silo`, which is moving at each (liveness, coordinator/hub.py), as it
        is at each frame of a reply it takes: a silo whose large message is still crossing a
        narrow link, and which its heartbeats queue behind, is not taken for gone."""
        for frame in frames:
            self.hub.moving(silo)
            yield frame

    def _answer(
        self, silo: str, payload: AnyPayload, message: Control | None
    ) -> bytes | AnyPayload:
        """The reply to `payload`: a result (`message` None) or the control `message`."""
        if message is None:
            return self._result(silo, payload)
        if message.type == JOIN:
            return self._join(silo)
        if message.type == ACCEPT:
            if self.policy is None or message.get("policy_digest") != self.policy.digest:
                return _ack(False, "the accepted policy digest is not this deployment's policy")
            self.hub.accept(silo)
            log.info("silo %s accepted policy %s", silo, self.policy.digest[:12])
            return _ack(True)
        if message.type == REFUSE:
            reason = str(message.get("reason", "no reason given"))
            self.hub.refuse(silo, reason)
            log.warning("silo %s refused the policy: %s", silo, reason)
            return _ack(True)
        if message.type == PULL:
            return self._pull(silo)
        if message.type == HEARTBEAT:  # heard: `seen` above
            every_s = self.hub.heartbeat_window_s / HEARTBEATS_PER_WINDOW
            return Control(ACK, {"accepted": True, "every_s": every_s}).encode()
        raise MessageRejected("malformed", f"a silo may not send {message.type!r}")

    def _join(self, silo: str) -> bytes:
        policy = self.policy
        if policy is None or (self.more_jobs and silo in self.hub.refused):
            self.hub.wait_for_job(silo, self.poll_seconds)
            policy = self.policy
            if policy is None or silo in self.hub.refused:
                return Control(IDLE).encode()
        log.info("silo %s joined; sending the signed policy", silo)
        roster = self.job_roster
        signed_roster = (
            {} if roster is None else {"roster": roster.text, "roster_signature": roster.signature}
        )
        return Control(
            POLICY,
            {
                "deployment": self.deployment,
                "policy": policy.text,
                "signature": policy.signature,
                "attempt": policy.attempt,
                "attempt_signature": policy.attempt_signature,
                "more": self.more_jobs,
                **signed_roster,
            },
        ).encode()

    def _finished(self) -> bytes:
        return Control(
            FINISHED, {"reason": "the deployment is complete", "more": self.more_jobs}
        ).encode()

    def _pull(self, silo: str) -> bytes | AnyPayload:
        if silo not in self.hub.accepted:
            return _ack(False, NOT_A_MEMBER)
        if self.hub.finished.is_set():
            return self._finished()
        task = self.hub.next_task(silo, self.poll_seconds)
        if task is not None:
            return task.payload
        if self.hub.finished.is_set():
            return self._finished()
        return Control(IDLE).encode()

    def _result(self, silo: str, payload: AnyPayload) -> bytes:
        result, _ = TaskResult.decode_lazily(payload)  # the tensors are the engine's to read
        if result.silo != silo:
            raise MessageRejected(IDENTITY_MISMATCH, f"{silo!r} sent a result as {result.silo!r}")
        if not self.hub.deliver(silo, result.task_id, payload):
            self.metrics.count_rejected(LATE)
            log.warning(
                "late result from %s for %s (no such task waits for it): discarded",
                silo,
                result.task_id,
            )
            return _ack(False, LATE)
        return self._pull(silo)  # the reply to a result is the next task: no PULL needed

    def _refuse(self, context: grpc.ServicerContext, peer: str, rejected: MessageRejected) -> None:
        self.metrics.count_rejected(rejected.reason)
        if rejected.reason == PROTOCOL_MISMATCH:  # the line alone (wire/messages.py)
            self.mismatches.warn(rejected.detail)
            context.abort(grpc.StatusCode.FAILED_PRECONDITION, rejected.detail)
        if rejected.reason == DUPLICATE_AGENT:  # logged by the hub once, retried by the agent
            log.info("refused a second agent of %s: %s", peer, rejected.detail)
            context.set_trailing_metadata(((WINDOW_METADATA, f"{self.hub.heartbeat_window_s}"),))
            context.abort(grpc.StatusCode.ALREADY_EXISTS, rejected.detail)
        log.warning("rejected a message from %s: %s", peer, rejected)
        code = (
            grpc.StatusCode.PERMISSION_DENIED
            if rejected.reason in {IDENTITY_MISMATCH, REVOKED, UNKNOWN_SENDER, "bad_signature"}
            else grpc.StatusCode.INVALID_ARGUMENT
        )
        context.abort(code, f"{rejected.reason}: {rejected.detail}")


def handler(service: CoordinatorService) -> grpc.GenericRpcHandler:
    """The service's gRPC handler, frames in and out as serialized bytes (wire/framing.py)."""
    return exchange_handler(SILO_SERVICE, service.Exchange)


def _ack(accepted: bool, reason: str = "") -> bytes:
    return Control(ACK, {"accepted": accepted, "reason": reason}).encode()


def _control_of(payload: AnyPayload) -> Control | None:
    """A silo's control message, read once; None for a result (a WireError for anything else).
    Every agent's control messages carry its `agent` id."""
    return None if payload_type(payload) == "result" else decode_control(payload)


def _peer_address(context: grpc.ServicerContext) -> str:
    """Where a request came from, as gRPC names it without its scheme ("127.0.0.1:50312")."""
    peer = context.peer() or "an unknown address"
    return peer.split(":", 1)[1] if peer.startswith(("ipv4:", "ipv6:")) else peer


def _common_name(context: grpc.ServicerContext) -> str:
    names = context.auth_context().get("x509_common_name", [])
    return names[0].decode() if names else ""
