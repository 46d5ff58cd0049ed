"""The operator's side of the admin channel (coordinator/admin_service.py): an mTLS channel
with the operator's client certificate, each request signed with operator.key, each reply's
signature checked under the coordinator's key and its binding to the request checked as a
silo checks its replies (wire/framing.py `check_answers`).

One attempt per request, within a short timeout; what goes wrong is one line: the coordinator
is unreachable (naming its address), it refuses this identity, it speaks another protocol
version (its own line naming both sides' versions and what to upgrade, or this CLI's when the
reply is the one in another protocol: wire/messages.py `version_mismatch`), or it refuses the
request (`AdminError`, the coordinator's own message).
"""

from __future__ import annotations

import uuid
from typing import Any

import grpc

from fedsilo.coordinator.admin_api import OPERATOR, AdminError
from fedsilo.coordinator.admin_service import SERVICE
from fedsilo.coordinator.service import COORDINATOR
from fedsilo.ops.provision import OperatorKit
from fedsilo.policies.consortium import split_address
from fedsilo.wire.admin import AdminReply, AdminRequest
from fedsilo.wire.envelope import EnvelopeVerifier, seal
from fedsilo.wire.framing import (
    MessageRejected,
    check_answers,
    exchange_call,
    read_message,
    to_frames,
)
from fedsilo.wire.messages import payload_mismatch
from fedsilo.wire.tensors import WireError

TIMEOUT_S = 60.0
MAX_REPLY_BYTES = 2**31


class AdminChannelError(RuntimeError):
    """The request did not get a verified answer: unreachable, refused, or an unreadable reply."""


class AdminConnection:
    """Signed admin requests to the coordinator named in the operator's kit."""

    def __init__(
        self, kit: OperatorKit, timeout_s: float = TIMEOUT_S, address: str | None = None
    ) -> None:
        """`address`: where to reach the coordinator (a published port, a port-forward, a
        tunnel) when not at the kit's address; its certificate is checked for the kit's host
        all the same."""
        self.kit = kit
        self.timeout_s = timeout_s
        self.address = address or kit.coordinator_address
        credentials = grpc.ssl_channel_credentials(
            kit.tls.ca_certificate.read_bytes(),
            kit.tls.private_key.read_bytes(),
            kit.tls.certificate.read_bytes(),
        )
        options = []
        if address is not None:
            host = split_address(kit.coordinator_address)[0]
            options.append(("grpc.ssl_target_name_override", host))
        self.channel = grpc.secure_channel(self.address, credentials, options=options)
        self.exchange = exchange_call(self.channel, SERVICE)
        self.verifier = EnvelopeVerifier(kit.consortium, {COORDINATOR: kit.coordinator_verify_key})

    def __enter__(self) -> AdminConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.channel.close()

    def call(self, command: str, **args: Any) -> AdminReply:
        """The coordinator's verified reply to `command`; AdminError when it refuses the request,
        AdminChannelError when no verified reply came."""
        request = AdminRequest(command, args).encode()
        envelope = seal(
            request,
            signing_key=self.kit.signing_key,
            sender=OPERATOR,
            deployment=self.kit.consortium,
            round=0,
            task_id=f"{command}/{uuid.uuid4().hex}",
        )
        address = self.address
        try:
            frames = self.exchange(to_frames(envelope, request), timeout=self.timeout_s)
            answered, payload = read_message(frames, self.verifier, MAX_REPLY_BYTES)
            check_answers(answered, envelope)
            mismatch = payload_mismatch(payload, f"the coordinator at {address}", "admin CLI")
            if mismatch is not None:
                raise AdminChannelError(mismatch)
            reply = AdminReply.decode(payload)
        except grpc.RpcError as exc:
            raise AdminChannelError(_rpc_failure(exc, address)) from None
        except (MessageRejected, WireError) as exc:
            raise AdminChannelError(
                f"the reply of the coordinator at {address} is not to be trusted: {exc}"
            ) from None
        if not reply.ok:
            raise AdminError(reply.error)
        return reply


def _rpc_failure(exc: grpc.RpcError, address: str) -> str:
    code, details = exc.code(), (exc.details() or "").splitlines()
    detail = details[0] if details else code.name
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return f"the coordinator at {address} is unreachable ({code.name}: {detail})"
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return f"the coordinator at {address} refuses this operator identity: {detail}"
    if code == grpc.StatusCode.FAILED_PRECONDITION:  # another protocol: the coordinator's line
        return detail
    return f"the coordinator at {address} refused the request ({code.name}): {detail}"
