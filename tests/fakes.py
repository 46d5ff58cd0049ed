"""Scripted silos for engine tests: endpoints that answer with chosen tensors, late, or never."""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from fedsilo.wire.messages import TaskMessage, TaskResult
from fedsilo.wire.tensors import ParameterSpec
from tests.wire_tasks import ONE_PER_KIND

SPEC = ParameterSpec.of({"w": torch.zeros(3)})
# Tasks whose settings the scripted silos ignore.
TRAIN, INIT = ONE_PER_KIND["train"], ONE_PER_KIND["init"]


def scripted_silo(
    name: str, model: Callable[[TaskMessage], torch.Tensor], num_samples: int = 10
) -> Callable[[bytes], bytes]:
    """A silo that answers init/train with `model(task)` and evaluate with a fixed accuracy."""

    def endpoint(payload: bytes) -> bytes:
        task = TaskMessage.decode(payload)
        if task.kind == "evaluate":
            return TaskResult(
                task.task_id,
                name,
                task.kind,
                num_samples=num_samples,
                metrics={"accuracy": 0.5, "loss": 1.0},
            ).encode()
        return TaskResult(
            task.task_id,
            name,
            task.kind,
            num_samples=num_samples,
            tensors={"model": model(task)},
            spec=SPEC,
        ).encode()

    return endpoint


def constant_silo(
    name: str, values: list[float], num_samples: int = 10
) -> Callable[[bytes], bytes]:
    """Initialises to zeros and always trains to `values`."""

    def model(task: TaskMessage) -> torch.Tensor:
        return torch.zeros(3) if task.kind == "init" else torch.tensor(values)

    return scripted_silo(name, model, num_samples)


def silent_silo(release: threading.Event) -> Callable[[bytes], bytes]:
    """Never answers a training task (blocks until the test releases it)."""
    inner = constant_silo("silent", [0.0, 0.0, 0.0])

    def endpoint(payload: bytes) -> bytes:
        if TaskMessage.decode(payload).kind == "train":
            release.wait()
        return inner(payload)

    return endpoint
