"""One channel message as gRPC frames: the signed envelope first, then the payload in chunks;
and the way back, which checks the envelope before buffering anything and the digest after the
last chunk, so an unknown sender never gets memory and a corrupted payload is never returned.
A reply is sealed bound to the request it answers (`seal_reply`), which the requester checks
(`check_answers`): on the silo channel and on the admin channel alike.

Frames cross gRPC as serialized `fedsilo.v1.Frame` bytes (`exchange_call`, and the servers'
handlers, set no serializer), and chunk frames are written and read here rather than through
the protobuf classes: a chunk frame is one tag byte, the chunk's length as a varint, then the
chunk. Going through `pb.Frame` copied each chunk four more times on the way out (the slice
joined, the message built, encoded, turned into bytes) and twice more on the way in (decoded,
read out of the message); each copy of a fresh megabyte faults its pages in, and that was most
of a coordinator's CPU in a round (docs/performance.md, "Where a round's time goes"). Every
other frame (the envelope, or a chunk frame laid out any other way) goes through the protobuf
parser, so what is accepted is exactly what `pb.Frame` accepts; tests/test_framing.py checks
the hand-written frames against it byte for byte.

A request whose payload fits in one chunk can also cross as one gRPC message, its frames in a
`fedsilo.v1.Frames` (`one_message`, `exchange_one_call`): gRPC's Python client starts a thread
for every streamed request and none for a unary one, which was most of what a small exchange
cost a silo (docs/performance.md). The server reads it through the same `read_message` as a
streamed request (`frames_of` hands it the same frames, one at a time), so every check is the
same; a `Frames` holding anything but its frames is refused. The reply is streamed either way,
since only the server knows its size.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator

import grpc
from google.protobuf.message import DecodeError
from nacl.signing import SigningKey

from fedsilo.wire import fedsilo_pb2 as pb
from fedsilo.wire.chunks import DEFAULT_CHUNK_BYTES, ChunkAssembler, ChunkError
from fedsilo.wire.envelope import REPLAY, Envelope, EnvelopeRejected, EnvelopeVerifier, seal
from fedsilo.wire.payload import AnyPayload, Chunk, as_payload
from fedsilo.wire.tensors import WireError

MALFORMED = "malformed"
SILO_SERVICE = "fedsilo.v1.Coordinator"  # the silos' channel; the admin channel has its own
CHUNK_TAG = b"\x12"  # field 2 of fedsilo.v1.Frame (chunk), wire type 2 (length-delimited)
FRAMES_TAG = b"\x0a"  # field 1 of fedsilo.v1.Frames (frames), wire type 2


class MessageRejected(Exception):
    """A message that must not be used; `reason` is a short label (also a metric label)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason
        self.detail = detail


def to_frames(
    envelope: Envelope, payload: bytes | AnyPayload, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> Iterator[bytes]:
    """The message as serialized frames: the envelope's, then one per chunk of the payload."""
    for pieces in _frame_pieces(envelope, payload, chunk_bytes):
        yield b"".join(pieces)


def one_message(
    envelope: Envelope, payload: bytes | AnyPayload, chunk_bytes: int = DEFAULT_CHUNK_BYTES
) -> bytes:
    """The message as one serialized `fedsilo.v1.Frames` (`ExchangeOne`'s request): the frames
    `to_frames` makes, each after its field tag and length, joined once."""
    parts: list[bytes | memoryview] = []
    for pieces in _frame_pieces(envelope, payload, chunk_bytes):
        parts += (FRAMES_TAG, _varint(sum(len(piece) for piece in pieces)), *pieces)
    return b"".join(parts)


def _frame_pieces(
    envelope: Envelope, payload: bytes | AnyPayload, chunk_bytes: int
) -> Iterator[Chunk]:
    """Each frame of the message as the pieces it is made of, not yet joined: the envelope's
    serialized frame, then each chunk's frame head and the chunk's own memory."""
    yield (pb.Frame(envelope=envelope_to_proto(envelope)).SerializeToString(),)
    for chunk in as_payload(payload).chunks(chunk_bytes):
        yield _chunk_pieces(chunk)


def _chunk_pieces(chunk: Chunk) -> Chunk:
    """`Frame(chunk=...)` as its head (tag and length) and the chunk's pieces."""
    return (CHUNK_TAG + _varint(sum(len(piece) for piece in chunk)), *chunk)


def frames_of(message: bytes) -> Iterator[memoryview]:
    """The serialized frames of one `fedsilo.v1.Frames` message, one at a time, as views of it
    (no copy, and nothing made ahead of the reader: a reader that checks each frame as it comes,
    `read_message`, refuses a bad one before the next is looked at). MessageRejected where the
    message holds anything but its frames (an unknown field, a length beyond its end)."""
    view, at = memoryview(message), 0
    while at < len(message):
        size, start = _read_varint(message, at + 1)
        if message[at : at + 1] != FRAMES_TAG or size < 0 or start + size > len(message):
            raise MessageRejected(
                MALFORMED, f"a request that is not a fedsilo.v1.Frames of frames alone (at {at})"
            )
        yield view[start : start + size]
        at = start + size


def chunk_frame(chunk: Chunk) -> bytes:
    """The serialized `Frame(chunk=...)` of a chunk's pieces, copied once, straight in."""
    return b"".join(_chunk_pieces(chunk))


def frame_body(raw: bytes | memoryview) -> pb.Envelope | memoryview:
    """What one serialized frame carries: its envelope, or its chunk as a view of `raw` (no
    copy) when the frame is laid out as `chunk_frame` writes it, else as the protobuf parser
    reads it. MessageRejected when it is not a `fedsilo.v1.Frame` with a body."""
    if raw[:1] == CHUNK_TAG:
        size, start = _read_varint(raw, 1)
        if start + size == len(raw):
            return memoryview(raw)[start:]
    try:
        frame = pb.Frame.FromString(raw)
    except DecodeError as exc:
        raise MessageRejected(MALFORMED, f"a frame that is not a fedsilo.v1.Frame: {exc}") from None
    body = frame.WhichOneof("body")
    if body is None:
        raise MessageRejected(MALFORMED, "a frame with neither an envelope nor a chunk")
    return frame.envelope if body == "envelope" else memoryview(frame.chunk)


def exchange_call(
    channel: grpc.Channel, service: str = SILO_SERVICE
) -> grpc.StreamStreamMultiCallable:
    """`service`'s `Exchange` method on `channel`, frames in and out as serialized bytes."""
    return channel.stream_stream(f"/{service}/Exchange")


def exchange_one_call(
    channel: grpc.Channel, service: str = SILO_SERVICE
) -> grpc.UnaryStreamMultiCallable:
    """`service`'s `ExchangeOne` method on `channel`: a request as `one_message` writes it, the
    reply's frames as serialized bytes."""
    return channel.unary_stream(f"/{service}/ExchangeOne")


def exchange_handler(
    service: str,
    exchange: Callable[[Iterable[bytes | memoryview], grpc.ServicerContext], Iterator[bytes]],
) -> grpc.GenericRpcHandler:
    """The server's side of `exchange_call` and `exchange_one_call`: `exchange` as `service`'s
    `Exchange` method, and as its `ExchangeOne` over the frames of the one request message."""

    def exchange_one(request: bytes, context: grpc.ServicerContext) -> Iterator[bytes]:
        return exchange(frames_of(request), context)

    methods = {
        "Exchange": grpc.stream_stream_rpc_method_handler(exchange),
        "ExchangeOne": grpc.unary_stream_rpc_method_handler(exchange_one),
    }
    return grpc.method_handlers_generic_handler(service, methods)


def read_message(
    frames: Iterable[bytes | memoryview], verifier: EnvelopeVerifier, max_bytes: int
) -> tuple[Envelope, AnyPayload]:
    """The verified (envelope, payload) of a stream of serialized frames, or MessageRejected with
    the reason. A large payload comes back spooled to a temporary file (wire/chunks.py)."""
    stream = iter(frames)
    first = next(stream, None)
    if first is None:
        raise MessageRejected(MALFORMED, "no frame arrived (an empty stream, or bytes not a Frame)")
    body = frame_body(first)
    if not isinstance(body, pb.Envelope):
        raise MessageRejected(MALFORMED, "a message must start with its envelope")
    try:
        envelope = envelope_from_proto(body)
    except WireError as exc:
        raise MessageRejected(MALFORMED, f"malformed envelope: {exc}") from None
    try:
        verifier.check_header(envelope)
        assembler = ChunkAssembler(envelope.payload_size, envelope.payload_digest, max_bytes)
        for raw in stream:
            body = frame_body(raw)
            if isinstance(body, pb.Envelope):
                raise MessageRejected(MALFORMED, "a second envelope inside one message")
            assembler.add(body)
        payload = assembler.finish()
        verifier.verify(envelope, payload)
    except EnvelopeRejected as exc:
        raise MessageRejected(exc.reason, str(exc)) from None
    except ChunkError as exc:
        raise MessageRejected(exc.reason, f"{exc} (from {envelope.sender!r})") from None
    return envelope, payload


def _varint(value: int) -> bytes:
    """`value` (non-negative) as a protobuf base-128 varint."""
    out = bytearray()
    while value > 0x7F:
        out.append(value & 0x7F | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _read_varint(raw: bytes, start: int) -> tuple[int, int]:
    """The varint at `start` and the offset after it; (-1, 0) where none ends within 10 bytes
    (a protobuf varint's most), which no frame length matches."""
    value = 0
    for index in range(start, min(start + 10, len(raw))):
        value |= (raw[index] & 0x7F) << (7 * (index - start))
        if raw[index] < 0x80:
            return value, index + 1
    return -1, 0


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
