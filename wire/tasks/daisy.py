"""FedDC's tasks (federated daisy chaining): train the hosted model, hand it off, receive one,
evaluate it."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, ClassVar, Self

from fedsilo.wire.tasks.codec import JsonFields, TaskConfig, flattened, optional
from fedsilo.wire.tasks.evaluation import EvaluateTask
from fedsilo.wire.tasks.release import Release
from fedsilo.wire.tasks.training import TrainTask
from fedsilo.wire.tensors import WireError


@dataclass(frozen=True, kw_only=True)
class Handoff(JsonFields):
    """Where a hand-off goes: sealed to the X25519 public key `seal_to` (hex), or plain (None),
    encoded as {"seal_to": hex} or {"plain": true}."""

    seal_to: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"plain": True} if self.seal_to is None else {"seal_to": self.seal_to}

    @classmethod
    def decode(cls, data: Any, kind: str) -> Self:
        if isinstance(data, Mapping) and set(data) == {"plain"} and data["plain"] is True:
            return cls()
        if (
            isinstance(data, Mapping)
            and set(data) == {"seal_to"}
            and isinstance(data["seal_to"], str)
        ):
            return cls(seal_to=data["seal_to"])
        raise WireError(
            f"{kind} task: config key 'handoff' must be {{'plain': true}} or "
            f"{{'seal_to': <hex key>}}, not {data!r}"
        )


@dataclass(frozen=True, kw_only=True)
class DaisyTrain(TaskConfig):
    """`daisy_train`: adopt the model sent when `adopt`, else train the hosted one (`train`,
    the round's local training); then send it for aggregation (`send`) or pack it for
    `handoff` (added by the coordinator's routing)."""

    KIND: ClassVar[str] = "daisy_train"
    SENDS: ClassVar[Release] = Release.SEALED_HANDOFF
    train: TrainTask = flattened()
    adopt: bool = False
    send: bool = False
    handoff: Handoff | None = optional()


@dataclass(frozen=True, kw_only=True)
class DaisyReceive(TaskConfig):
    """`daisy_receive`: open the hand-off sent (HANDOFF; `sealed` to this silo) and host it."""

    KIND: ClassVar[str] = "daisy_receive"
    SENDS: ClassVar[Release] = Release.NOTHING_PRIVATE
    sealed: bool = False


@dataclass(frozen=True, kw_only=True)
class DaisyEvaluate(EvaluateTask):
    """`daisy_evaluate`: the hosted model's metrics on `split`, as `evaluate` reports them."""

    KIND: ClassVar[str] = "daisy_evaluate"
    SENDS: ClassVar[Release] = Release.NOTHING_PRIVATE
