"""SCAFFOLD (Karimireddy et al. 2020; docs/algorithms/scaffold.md): stochastic controlled
averaging, in FLamby's protocol.

The state holds the global model x and the server's control variate c (zeros at setup). Each
round the cohort trains from x with every step's gradient corrected by c - c_i, each silo's
own c_i kept at the silo (silo/tasks/scaffold.py), and answers y_i and c_i+ - c_i. Both come
back as one sample-weighted mean, so secure aggregation and DP-SGD apply unchanged:

    x+ = x + server_lr * mean_S(y_i - x)
    c+ = c + (|S| / N) * mean_S(c_i+ - c_i)

With every silo answering (|S| = N, FLamby's setting) c stays the sample-weighted mean of the
silos' c_i, as FLamby's implementation keeps it.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from fedsilo.coordinator.phases import Phase, WeightedMean
from fedsilo.coordinator.strategies.base import (
    RoundContext,
    RoundScript,
    ServerState,
    Strategy,
)
from fedsilo.policies.algorithms import ScaffoldConfig
from fedsilo.policies.algorithms.contract import Position
from fedsilo.policies.algorithms.server_step import initial_state, server_step
from fedsilo.wire.tasks import TaskConfig
from fedsilo.wire.tasks.tensor_names import CONTROL, CONTROL_DELTA, MODEL


class Scaffold(Strategy):
    """FedAvg with control variates correcting each silo's drift (Karimireddy et al. 2020)."""

    name = "scaffold"

    @property
    def config(self) -> ScaffoldConfig:
        return self.policy.algorithm  # type: ignore[return-value]

    def setup(self, ctx: RoundContext) -> RoundScript:
        state = yield from super().setup(ctx)
        return replace(state, tensors=initial_state(self.config, state.model))

    def round(self, state: ServerState, ctx: RoundContext) -> RoundScript:
        model, control = state.model, state.tensors[CONTROL]
        tasks = tuple(
            replace(task, tensors={**task.tensors, CONTROL: control})
            for task in (self.train_task(s, model, state.spec, ctx) for s in self.sample_silos(ctx))
        )
        mean = WeightedMean(
            (MODEL, CONTROL_DELTA),
            shapes={CONTROL_DELTA: tuple(control.shape)},
            references={CONTROL_DELTA: torch.zeros_like(control)},
        )
        out = yield Phase("train", tasks, aggregate=mean)
        share = len(out.answered) / len(ctx.silos)
        # policies/algorithms/server_step.py, which silos repeat under model lineage
        return replace(state, tensors=server_step(self.config, state.tensors, out.mean, share))

    def train_config(self, position: Position, **chosen: Any) -> TaskConfig:
        return self.config.train_config(self.policy, position)
