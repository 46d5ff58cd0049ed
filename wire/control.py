"""Control messages of the channel: joining, policy pinning, polling and acknowledgements.

Like tasks and results they are fedsilo safetensors messages (no tensors, a JSON header), so
every payload on the channel has one format and one type field, and names the protocol and the
package version its sender speaks (wire/messages.py `versions`; a JOIN is how a coordinator
first hears a silo's):

  silo -> coordinator: join, accept, refuse, pull, heartbeat, and results (wire/messages.py)
  coordinator -> silo: policy, ack, idle, finished, and tasks (wire/messages.py)

A heartbeat is answered at once with an ack carrying `every_s`: how often the coordinator wants
to hear from the silo (a quarter of its heartbeat window, coordinator/hub.py).

A result is answered like a pull (the silo's next task, idle or finished), or with an ack that
refuses it (`LATE`: no task waits for it; `NOT_A_MEMBER`: the silo has not accepted the
current job's policy).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from fedsilo.wire.messages import check_protocol, versions
from fedsilo.wire.payload import AnyPayload, as_payload
from fedsilo.wire.tensors import WireError, decode_tensors, encode_tensors, index_tensors

JOIN, ACCEPT, REFUSE, PULL, HEARTBEAT = "join", "accept", "refuse", "pull", "heartbeat"
POLICY, ACK, IDLE, FINISHED = "policy", "ack", "idle", "finished"
CONTROL_TYPES = {JOIN, ACCEPT, REFUSE, PULL, HEARTBEAT, POLICY, ACK, IDLE, FINISHED}
LATE, NOT_A_MEMBER = "late", "not_a_member"  # why an ack refuses a result or a pull


@dataclass(frozen=True)
class Control:
    type: str
    fields: Mapping[str, Any] = field(default_factory=dict)

    def encode(self) -> bytes:
        if self.type not in CONTROL_TYPES:
            raise WireError(f"unknown control message {self.type!r}")
        return encode_tensors({}, {"type": self.type, **versions(), **self.fields})

    def get(self, key: str, default: Any = None) -> Any:
        return self.fields.get(key, default)


def payload_type(payload: bytes | AnyPayload) -> str:
    """The `type` of any channel payload: a control type, "task" or "result" (its tensors are
    not read)."""
    _, header = index_tensors(as_payload(payload))
    check_protocol(header)
    kind = header.get("type")
    if kind not in CONTROL_TYPES | {"task", "result"}:
        raise WireError(f"unknown payload type {kind!r}")
    return str(kind)


def decode_control(payload: bytes | AnyPayload) -> Control:
    tensors, header = decode_tensors(payload)
    kind = header.pop("type", None)
    header.pop("protocol", None)
    header.pop("fedsilo", None)
    if tensors or kind not in CONTROL_TYPES:
        raise WireError(f"not a control message: {kind!r}")
    return Control(str(kind), header)
