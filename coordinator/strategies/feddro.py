"""FedDRO (the FedDRO paper, Wasserstein-barycenter DRO; docs/algorithms/feddro.md).

Setup: the silos' common model (`init`) and data schema (`schema`), then one cloud of
`support_points` points per group (per class with `variant: classwise`, one on (x, one-hot y)
with `datawise`) for each silo and for the barycenter, all from N(0, I) (`ctx.rng`).

Stage A, rounds 1..`barycenter_rounds`: every active silo gets its last cloud and the
barycenter and answers its new cloud (`feddro_support`: interpolating measures towards its
records and towards the barycenter, silo/feddro.py) and which groups it holds; the coordinator
takes, per group, the free-support barycenter of the answered clouds of the silos holding it
(uniform weights; coordinator/feddro.py). A silo that drops keeps its last cloud. The clouds
are data-like and individual, so no secure aggregation covers them. At the last stage-A round,
with `server_epochs` > 0, the coordinator trains the policy's model on the barycenter's points
and their groups' labels (the paper's toy "Ours").

Stage B, the rounds after: FedAvg (sample-weighted mean of the sampled silos' models; secure
aggregation and DP-SGD apply) of `feddro_train`, local training on each silo's records mapped
onto the barycenter, adversarially when the policy sets `adversarial_penalty`.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import numpy as np
import torch

from fedsilo.coordinator.feddro import barycenter, initial_clouds
from fedsilo.coordinator.phases import Phase, Task, WeightedMean
from fedsilo.coordinator.strategies.base import (
    RoundContext,
    RoundScript,
    ServerState,
    Strategy,
)
from fedsilo.coordinator.synthetic import train_classifier
from fedsilo.models.zoo import build_model
from fedsilo.policies.algorithms import FedDroConfig
from fedsilo.policies.algorithms.contract import Position
from fedsilo.policies.seeding import derive_seed
from fedsilo.wire.tasks import FedDroSupport, TaskConfig
from fedsilo.wire.tasks.tensor_names import BARYCENTER, MODEL, PRESENT, SUPPORT

SCHEMA = "schema"  # state.extra: the silos' input shape and number of classes


def support_of(silo: str) -> str:
    """The state tensor holding `silo`'s last cloud."""
    return f"{SUPPORT}/{silo}"


class FedDro(Strategy):
    """A federated Wasserstein barycenter, then (adversarial) FedAvg around it (FedDRO)."""

    name = "feddro"

    @property
    def config(self) -> FedDroConfig:
        return self.policy.algorithm  # type: ignore[return-value]

    def setup(self, ctx: RoundContext) -> RoundScript:
        state = yield from super().setup(ctx)
        shape, classes = yield from self.classification_schema(ctx)
        width = int(np.prod(shape))
        groups, dim = (
            (classes, width) if self.config.variant == "classwise" else (1, width + classes)
        )
        rng = ctx.rng("feddro-init")
        points = self.config.support_points
        clouds = {
            support_of(s): torch.from_numpy(initial_clouds(groups, points, dim, rng))
            for s in ctx.silos
        }
        clouds[BARYCENTER] = torch.from_numpy(initial_clouds(groups, points, dim, rng))
        return replace(
            state,
            tensors={**state.tensors, **clouds},
            extra={**state.extra, SCHEMA: {"input_shape": list(shape), "classes": classes}},
        )

    def round(self, state: ServerState, ctx: RoundContext) -> RoundScript:
        config = self.config
        if ctx.round > config.barycenter_rounds:
            chosen = self.sample_silos(ctx)
            tasks = tuple(self.mapped_task(s, state, ctx) for s in chosen)
            out = yield Phase("train", tasks, aggregate=WeightedMean((MODEL,)))
            return replace(state, tensors={**state.tensors, MODEL: out.mean[MODEL]})
        tasks = tuple(
            Task(
                s,
                FedDroSupport(),
                {SUPPORT: state.tensors[support_of(s)], BARYCENTER: state.tensors[BARYCENTER]},
            )
            for s in ctx.silos
        )
        out = yield Phase("support", tasks)
        clouds = {s: t[SUPPORT].double().numpy() for s, t in out.tensors.items()}
        present = {s: t[PRESENT].double().numpy() for s, t in out.tensors.items()}
        previous = state.tensors[BARYCENTER].double().numpy()
        tensors = {
            **state.tensors,
            **{support_of(s): torch.from_numpy(c) for s, c in clouds.items()},
            BARYCENTER: torch.from_numpy(barycenter(clouds, present, previous)),
        }
        if ctx.round == config.barycenter_rounds and config.server_epochs > 0:
            tensors[MODEL] = self.classifier(state, tensors[BARYCENTER], ctx)
        return replace(state, tensors=tensors)

    def mapped_task(self, silo: str, state: ServerState, ctx: RoundContext) -> Task:
        """A training task that carries the barycenter beside the model."""
        task = self.train_task(silo, state.model, state.spec, ctx)
        return replace(task, tensors={**task.tensors, BARYCENTER: state.tensors[BARYCENTER]})

    def train_config(self, position: Position, **chosen: Any) -> TaskConfig:
        return self.config.train_config(self.policy, position)

    def classifier(
        self, state: ServerState, clouds: torch.Tensor, ctx: RoundContext
    ) -> torch.Tensor:
        """The policy's model trained on the barycenter's points alone, labelled by class
        (classwise) or by the largest entry of the one-hot part (datawise), as a flat vector."""
        config, schema = self.config, state.extra[SCHEMA]
        shape, classes = tuple(schema["input_shape"]), schema["classes"]
        width = int(np.prod(shape))
        points = clouds.float()
        if config.variant == "classwise":
            labels = torch.arange(classes).repeat_interleave(points.shape[1])
            x = points.reshape(-1, width)
        else:
            x, labels = points[0, :, :width], points[0, :, width:].argmax(dim=1)
        model = build_model(
            self.policy.model, shape, classes, derive_seed(ctx.seed, "classifier", ctx.round)
        )
        generator = torch.Generator().manual_seed(ctx.seed_for("classifier"))
        train_classifier(
            model,
            (x.reshape(-1, *shape), labels),
            config.server_epochs,
            config.server_batch_size,
            config.server_lr,
            generator,
        )
        return state.spec.flatten(dict(model.named_parameters()))
