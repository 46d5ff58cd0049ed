"""The coordinator's admin channel: gRPC service `fedsilo.v1.Admin`, method `Exchange`, on the
coordinator's mTLS server, through which the operator submits, lists, aborts and inspects jobs
(and follows a job's log, reads its cross-site validation matrix),
and reads and replaces the consortium's signed roster (`fedsilo consortium revoke`).

Each request is checked before it is used: the caller's TLS certificate must be issued to
`operator` (else PERMISSION_DENIED before anything of the request is read); its envelope must
come from `operator` and verify under the operator's key, for this consortium, fresh and never
seen before (wire/envelope.py, with the coordinator's durable replay memory, so a replayed
request is refused after a restart too). An admin CLI of another protocol version is refused
before anything else reads its request, with FAILED_PRECONDITION and the one line naming both
sides' versions and what to upgrade (wire/messages.py `version_mismatch`), logged once. Then
the typed request (wire/admin.py) goes to the `AdminBackend` (coordinator/admin_api.py); an
`AdminError` is answered as ok=False with its message. The reply is sealed by the coordinator
and bound to the request, as on the silo channel (coordinator/service.py). Every admin action is
logged at INFO.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import grpc
from nacl.signing import SigningKey, VerifyKey

from fedsilo.coordinator.admin_api import OPERATOR, AdminBackend, AdminError
from fedsilo.coordinator.service import COORDINATOR, MismatchLog
from fedsilo.wire.admin import (
    ABORT,
    CONSORTIUM,
    INSTALL_ROSTER,
    LIST,
    LOG_LINES,
    LOGS,
    RESULTS,
    RETRY,
    ROSTER,
    STATUS,
    SUBMIT,
    VALIDATE,
    AdminReply,
    AdminRequest,
)
from fedsilo.wire.envelope import (
    BAD_SIGNATURE,
    UNKNOWN_SENDER,
    EnvelopeVerifier,
    ReplayMemory,
)
from fedsilo.wire.framing import (
    MessageRejected,
    exchange_handler,
    read_message,
    seal_reply,
    to_frames,
)
from fedsilo.wire.messages import payload_mismatch
from fedsilo.wire.tensors import WireError

log = logging.getLogger("fedsilo.coordinator.admin")

SERVICE = "fedsilo.v1.Admin"
_DENIED = {UNKNOWN_SENDER, BAD_SIGNATURE}


class AdminService:
    """Answers the operator's signed requests from `backend`."""

    def __init__(
        self,
        backend: AdminBackend,
        consortium: str,
        verifier: EnvelopeVerifier,
        signing_key: SigningKey,
        max_payload_bytes: int,
    ) -> None:
        self.backend = backend
        self.consortium = consortium
        self.verifier = verifier
        self.signing_key = signing_key
        self.max_payload_bytes = max_payload_bytes
        self.mismatches = MismatchLog(log)

    def Exchange(  # noqa: N802 (gRPC's name)
        self, request_iterator: Iterator[bytes], context: grpc.ServicerContext
    ) -> Iterator[bytes]:
        peer = _common_name(context)
        if peer != OPERATOR:
            log.warning("refused an admin request from certificate %r: not the operator", peer)
            context.abort(
                grpc.StatusCode.PERMISSION_DENIED,
                f"only the operator's certificate may administer; this one is {peer!r}",
            )
        try:
            envelope, payload = read_message(
                request_iterator, self.verifier, self.max_payload_bytes
            )
            if envelope.sender != OPERATOR:  # the roster holds only the operator
                raise MessageRejected(UNKNOWN_SENDER, f"signed as {envelope.sender!r}")
            mismatch = payload_mismatch(payload, "the operator's admin CLI", "coordinator")
            if mismatch is not None:  # the line alone (wire/messages.py)
                self.mismatches.warn(mismatch)
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, mismatch)
            request = AdminRequest.decode(payload)
        except MessageRejected as rejected:
            log.warning("refused an admin request: %s", rejected)
            code = (
                grpc.StatusCode.PERMISSION_DENIED
                if rejected.reason in _DENIED
                else grpc.StatusCode.INVALID_ARGUMENT
            )
            context.abort(code, f"{rejected.reason}: {rejected.detail}")
        except WireError as exc:
            log.warning("refused a malformed admin request: %s", exc)
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"malformed: {exc}")
        reply = self._answer(request).encode()
        sealed = seal_reply(
            reply,
            envelope,
            signing_key=self.signing_key,
            sender=COORDINATOR,
            deployment=self.consortium,
        )
        yield from to_frames(sealed, reply)

    def _answer(self, request: AdminRequest) -> AdminReply:
        job = request.args.get("job")
        log.info("operator: %s%s", request.command, f" job {job}" if job is not None else "")
        try:
            reply = self._dispatch(request.command, request.args)
        except AdminError as exc:
            log.info("operator: %s refused: %s", request.command, exc)
            return AdminReply(ok=False, error=str(exc))
        if request.command in (SUBMIT, RETRY):
            log.info("operator: submitted job %s", reply.data["job_id"])
        return reply

    def _dispatch(self, command: str, args: dict[str, Any]) -> AdminReply:
        backend = self.backend
        if command == SUBMIT:
            info = backend.submit(args["policy"], args["signature"], OPERATOR)
            return AdminReply(ok=True, data=info.to_json())
        if command == RETRY:
            info = backend.retry(args["job"], args["attempt"], args["signature"], OPERATOR)
            return AdminReply(ok=True, data=info.to_json())
        if command == LIST:
            return AdminReply(ok=True, data=[info.to_json() for info in backend.jobs()])
        if command == STATUS:
            info = backend.job(args["job"])
            return AdminReply(
                ok=True,
                data={
                    **info.to_json(),
                    "awaiting": backend.awaiting(info.job_id),
                    "progress": backend.progress(info.job_id),
                },
            )
        if command == ABORT:
            return AdminReply(ok=True, data=backend.abort(args["job"]).to_json())
        if command == LOGS:
            return AdminReply(ok=True, data={"text": backend.logs(args["job"], args["tail"])})
        if command == LOG_LINES:
            return AdminReply(ok=True, data=backend.log_lines(args["job"], args["offset"]))
        if command == RESULTS:
            files = backend.results(args["job"])
            return AdminReply(ok=True, data={"files": sorted(files)}, files=files)
        if command == VALIDATE:
            return AdminReply(ok=True, data=backend.cross_site(args["job"]))
        if command == ROSTER:
            return AdminReply(ok=True, data=backend.roster())
        if command == INSTALL_ROSTER:
            return AdminReply(
                ok=True, data=backend.install_roster(args["roster"], args["signature"])
            )
        assert command == CONSORTIUM  # AdminRequest admits no other command
        return AdminReply(ok=True, data=backend.consortium_status())


def admin_handler(
    backend: AdminBackend,
    consortium: str,
    operator_verify_key: VerifyKey,
    signing_key: SigningKey,
    replays: ReplayMemory,
    max_payload_bytes: int,
) -> grpc.GenericRpcHandler:
    """The admin service's gRPC handler, for the coordinator's mTLS server."""
    verifier = EnvelopeVerifier(
        consortium,
        {OPERATOR: operator_verify_key},
        max_payload_bytes=max_payload_bytes,
        memory=replays,
    )
    service = AdminService(backend, consortium, verifier, signing_key, max_payload_bytes)
    return exchange_handler(SERVICE, service.Exchange)


def _common_name(context: grpc.ServicerContext) -> str:
    names = context.auth_context().get("x509_common_name", [])
    return names[0].decode() if names else ""
