from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Frames(_message.Message):
    __slots__ = ("frames",)
    FRAMES_FIELD_NUMBER: _ClassVar[int]
    frames: _containers.RepeatedCompositeFieldContainer[Frame]
    def __init__(self, frames: _Optional[_Iterable[_Union[Frame, _Mapping]]] = ...) -> None: ...

class Frame(_message.Message):
    __slots__ = ("envelope", "chunk")
    ENVELOPE_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    envelope: Envelope
    chunk: bytes
    def __init__(self, envelope: _Optional[_Union[Envelope, _Mapping]] = ..., chunk: _Optional[bytes] = ...) -> None: ...

class Envelope(_message.Message):
    __slots__ = ("deployment", "round", "task_id", "sender", "nonce", "payload_digest", "payload_size", "sent_at", "signature")
    DEPLOYMENT_FIELD_NUMBER: _ClassVar[int]
    ROUND_FIELD_NUMBER: _ClassVar[int]
    TASK_ID_FIELD_NUMBER: _ClassVar[int]
    SENDER_FIELD_NUMBER: _ClassVar[int]
    NONCE_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_DIGEST_FIELD_NUMBER: _ClassVar[int]
    PAYLOAD_SIZE_FIELD_NUMBER: _ClassVar[int]
    SENT_AT_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    deployment: str
    round: int
    task_id: str
    sender: str
    nonce: bytes
    payload_digest: bytes
    payload_size: int
    sent_at: float
    signature: bytes
    def __init__(self, deployment: _Optional[str] = ..., round: _Optional[int] = ..., task_id: _Optional[str] = ..., sender: _Optional[str] = ..., nonce: _Optional[bytes] = ..., payload_digest: _Optional[bytes] = ..., payload_size: _Optional[int] = ..., sent_at: _Optional[float] = ..., signature: _Optional[bytes] = ...) -> None: ...
