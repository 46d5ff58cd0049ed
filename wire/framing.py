"""One channel message as gRPC frames: the signed envelope first, then the payload in chunks;
and the way back, which checks the envelope before buffering anything and the digest after the
last chunk, so an unknown sender never gets memory and a corrupted payload is never returned.
A reply is sealed bound to the request it answers (`seal_reply`), which the requester checks
(`check_answers`): on the silo channel and on the admin channel alike."""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from nacl.signing import SigningKey

from fedsilo.wire import fedsilo_pb2 as pb
from fedsilo.wire.chunks import DEFAULT_CHUNK_BYTES, ChunkAssembler, ChunkError
from fedsilo.wire.envelope import REPLAY, Envelope, EnvelopeRejected, EnvelopeVerifier, seal
from fedsilo.wire.payload import AnyPayload, as_payload
from fedsilo.wire.tensors import WireError

MALFORMED = "malformed"


class MessageRejected(Exception):
    """A message that must not be used; `reason` is a short label (also a metric label)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def to_frames(
    envelope: Envelope, payload: bytes | AnyPayload, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[pb.Frame]:
    yield pb.Frame(envelope=envelope_to_proto(envelope))
    for chunk in as_payload(payload).chunks(chunk_bytes):
        yield pb.Frame(chunk=bytes(chunk))


def read_message(
    frames: Iterable[pb.Frame], verifier: EnvelopeVerifier, max_bytes: int
) -> tuple[Envelope, AnyPayload]:
    """The verified (envelope, payload) of a frame stream, or MessageRejected with the reason.
    A large payload comes back spooled to a temporary file (wire/chunks.py)."""
    stream = iter(frames)
    first = next(stream, None)
    if first is None:
        raise MessageRejected(MALFORMED, "no frame arrived (an empty stream, or bytes not a Frame)")
    if first.WhichOneof("body") != "envelope":
        raise MessageRejected(MALFORMED, "a message must start with its envelope")
    try:
        envelope = envelope_from_proto(first.envelope)
    except WireError as exc:
        raise MessageRejected(MALFORMED, f"malformed envelope: {exc}") from None
    try:
        verifier.check_header(envelope)
        assembler = ChunkAssembler(envelope.payload_size, envelope.payload_digest, max_bytes)
        for frame in stream:
            if frame.WhichOneof("body") != "chunk":
                raise MessageRejected(MALFORMED, "a second envelope inside one message")
            assembler.add(frame.chunk)
        payload = assembler.finish()
        verifier.verify(envelope, payload)
    except EnvelopeRejected as exc:
        raise MessageRejected(exc.reason, str(exc)) from None
    except ChunkError as exc:
        raise MessageRejected(exc.reason, f"{exc} (from {envelope.sender!r})") from None
    return envelope, payload


def envelope_to_proto(envelope: Envelope) -> pb.Envelope:
    return pb.Envelope(
        deployment=envelope.deployment,
        round=envelope.round,
        task_id=envelope.task_id,
        sender=envelope.sender,
        nonce=envelope.nonce,
        payload_digest=envelope.payload_digest,
        payload_size=envelope.payload_size,
        sent_at=envelope.sent_at,
        signature=envelope.signature,
    )


def envelope_from_proto(message: pb.Envelope) -> Envelope:
    return Envelope(
        deployment=message.deployment,
        round=message.round,
        task_id=message.task_id,
        sender=message.sender,
        nonce=message.nonce,
        payload_digest=message.payload_digest,
        payload_size=message.payload_size,
        sent_at=message.sent_at,
        signature=message.signature,
    )


def seal_reply(
    payload: bytes | AnyPayload,
    request: Envelope,
    *,
    signing_key: SigningKey,
    sender: str,
    deployment: str,
) -> Envelope:
    """The envelope of the reply to `request`: it names the request (its sender and random id)
    and its round, which `check_answers` requires."""
    return seal(
        payload,
        signing_key=signing_key,
        sender=sender,
        deployment=deployment,
        round=request.round,
        task_id=f"{request.sender}/{request.task_id}",
    )


def check_answers(reply: Envelope, request: Envelope) -> None:
    """A reply must name the request it answers: each request carries a fresh random id, so a
    reply recorded earlier (before a restart of either side too) can never be passed off as
    the answer to a new one."""
    if reply.task_id != f"{request.sender}/{request.task_id}" or reply.round != request.round:
        raise MessageRejected(
            REPLAY, f"the reply answers {reply.task_id!r}, not this request's {request.task_id!r}"
        )
