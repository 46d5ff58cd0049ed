"""Silo agents for tests, built the one way a silo is built (`SiloAgent`, from a policy), and
the tasks they accept: the one their algorithm's contract asks for at a position (`honest`),
or, to test what a handler computes for a config no policy would derive, the handler alone
(`run_handler`: no contract, no booking, as the agent runs a handler once a task passed)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import torch
from pydantic import BaseModel

from fedsilo.ops.sim_silos import ConsortiumKeys
from fedsilo.policies.loading import parse_policy
from fedsilo.policies.schema import Policy
from fedsilo.silo.agent import SiloAgent
from fedsilo.silo.data import SiloDataset
from fedsilo.silo.tasks import TASK_KINDS
from fedsilo.silo.tasks.base import SiloContext
from fedsilo.wire.messages import SIMULATION, TASK_STEPS, TaskMessage, TaskResult, task_id
from fedsilo.wire.tasks import TaskConfig
from fedsilo.wire.tensors import ParameterSpec

DATA = {"source": "sklearn:breast_cancer", "partition": {"kind": "iid", "silos": 3}}


def policy_with(**sections: Any) -> Policy:
    """A policy of the given sections (typed configs or plain mappings), the rest defaults:
    one round of FedAvg of a linear model over three breast-cancer silos."""
    document: dict[str, Any] = {"version": 1, "rounds": 1, "data": DATA}
    for key, value in sections.items():
        document[key] = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
    return parse_policy(document)


def agent(
    data: SiloDataset, policy: Policy | None = None, name: str | None = None, **kwargs: Any
) -> SiloAgent:
    """The agent of silo `name` (the data's), as a simulation builds it, with keys of its
    own when `kwargs` gives none."""
    name = name or data.name
    if "keys" not in kwargs:
        kwargs["keys"] = ConsortiumKeys.generate([name]).of(name)
    return SiloAgent(name, data, policy or policy_with(), **kwargs)


def honest(
    silo: SiloAgent,
    phase: str = "train",
    round_no: int = 1,
    tensors: Mapping[str, torch.Tensor] | None = None,
    spec: ParameterSpec | None = None,
    **chosen: Any,
) -> TaskMessage:
    """The task `silo`'s contract asks for at (`round_no`, `phase`), as an honest engine names
    it, with `chosen` set among the fields the contract lets a coordinator choose."""
    ctx = silo.context
    rule, position = ctx.contract.position(round_no, phase, ctx.name, ctx.facts)
    config = rule.expected(_Placeholder(), position, ctx.facts)
    if chosen:
        config = replace(config, **chosen)
    name = task_id(ctx.deployment, round_no, phase, TASK_STEPS.get(config.KIND), ctx.name)
    return TaskMessage(
        name,
        round_no,
        phase,
        ctx.name,
        config,
        dict(tensors or {}),
        spec,
        policy_digest=silo.policy_digest or "",
    )


def answer(silo: SiloAgent, message: TaskMessage) -> TaskResult:
    """What `silo` answers to `message`, encoded and decoded as the network carries it."""
    return TaskResult.decode(silo.handle_bytes(message.encode()))


def run_handler(
    ctx: SiloContext | SiloAgent,
    config: TaskConfig,
    tensors: Mapping[str, torch.Tensor] | None = None,
    spec: ParameterSpec | None = None,
    round_no: int = 1,
    phase: str = "train",
) -> TaskResult:
    """`config`'s handler run on the silo's data, as the agent runs it once a task passed its
    contract: for what a handler computes from settings no policy derives (a unit test)."""
    context = ctx.context if isinstance(ctx, SiloAgent) else ctx
    message = TaskMessage(
        task_id(SIMULATION, round_no, phase, None, context.name),
        round_no,
        phase,
        context.name,
        config,
        dict(tensors or {}),
        spec,
    )
    return TASK_KINDS[config.KIND].handler(message, context)


class _Placeholder(TaskConfig):
    """A config of no kind: what `expected` derives from when nothing is chosen."""

    KIND = "placeholder"
