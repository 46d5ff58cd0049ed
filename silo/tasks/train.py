"""`train`: local optimisation of a received model on this silo's training split.

Epochs or a fixed number of steps, minibatches drawn from a seeded generator, SGD (with
momentum and weight decay) or Adam, and the optional FedProx proximal term
(mu/2)||w - w_received||^2. Returns the trained parameters, the sample count, and the mean
training loss of the round's last epoch (or of all steps when training by steps).
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from fedsilo.silo.evaluation import loss_function
from fedsilo.silo.tasks.base import MODEL, SiloContext, flat_parameters
from fedsilo.wire.messages import TaskMessage, TaskResult


def train(message: TaskMessage, ctx: SiloContext) -> TaskResult:
    config = message.config
    model, spec = ctx.load_model(message)
    x, y = ctx.split("train")
    n = len(y)
    if n == 0:
        raise ValueError(f"silo {ctx.name!r} has no training samples")
    batch = min(int(config["batch_size"]), n)
    steps_per_epoch = math.ceil(n / batch)
    steps = int(config["steps"]) if config.get("steps") else int(config["epochs"]) * steps_per_epoch
    window = steps_per_epoch if not config.get("steps") else steps

    optimizer = _optimizer(model.parameters(), config)
    loss_fn = loss_function(ctx.data.task)
    mu = float(config.get("prox_mu", 0.0))
    anchor = [p.detach().clone() for p in model.parameters()] if mu > 0 else []
    generator = torch.Generator().manual_seed(int(config["seed"]))

    model.train()
    recent: list[float] = []
    for step, index in enumerate(_minibatches(n, batch, steps, generator)):
        index = index.to(x.device)
        optimizer.zero_grad(set_to_none=True)
        loss = loss_fn(model(x[index]), y[index])
        (loss + _proximal(model, anchor, mu) if mu > 0 else loss).backward()
        optimizer.step()
        if step >= steps - window:
            recent.append(float(loss.detach()))

    return TaskResult(
        task_id=message.task_id,
        silo=ctx.name,
        kind=message.kind,
        num_samples=n,
        metrics={"train_loss": sum(recent) / len(recent), "steps": float(steps)},
        tensors={MODEL: flat_parameters(model, spec)},
        spec=spec,
    )


def _proximal(model: torch.nn.Module, anchor: list[torch.Tensor], mu: float) -> torch.Tensor:
    """FedProx: (mu/2) ||w - w_received||^2 over every parameter."""
    return (
        0.5
        * mu
        * sum(((p - a) ** 2).sum() for p, a in zip(model.parameters(), anchor, strict=True))
    )


def _minibatches(
    n: int, batch: int, steps: int, generator: torch.Generator
) -> Iterator[torch.Tensor]:
    """`steps` minibatches of indices; a fresh permutation each pass through the data."""
    produced = 0
    while produced < steps:
        order = torch.randperm(n, generator=generator)
        for start in range(0, n, batch):
            if produced == steps:
                return
            yield order[start : start + batch]
            produced += 1


def _optimizer(params: Any, config: Mapping[str, Any]) -> torch.optim.Optimizer:
    lr, decay = float(config["lr"]), float(config.get("weight_decay", 0.0))
    if config["optimizer"] == "adam":
        return torch.optim.Adam(params, lr=lr, weight_decay=decay)
    if config["optimizer"] == "sgd":
        return torch.optim.SGD(
            params, lr=lr, momentum=float(config.get("momentum", 0.0)), weight_decay=decay
        )
    raise ValueError(f"unknown optimizer {config['optimizer']!r}; use sgd or adam")
