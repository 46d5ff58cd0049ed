"""FedEvg (Hahn 2024, thesis ch. IV; docs/algorithms/fedevg.md): silos send energy signals instead
of models, and the coordinator refines a synthetic dataset.

Setup: the silos' common classifier (the policy's model, `init`) and their data schema (`schema`:
one input row's shape, the classes), then the synthetic set: `samples_per_class` points per
class drawn from N(0, I), balanced labels. A round: the sampled silos get the synthetic points
(and labels) and answer `energy_signals`; the engine takes the sample-weighted means of s * g and
of s (both relative to zero tensors of their shapes, so secure aggregation applies), their
ratio is the mixture energy's
gradient, and the points take one Langevin step with the round's step eta_t (the cosine-beta
curve) and noise, clipped to [0, 1]. No model travels to or from a silo in a round. On each
evaluation round the coordinator trains the policy's model on the synthetic set alone (Adam,
`classifier_epochs`) and keeps it as the state's model, which every silo then evaluates on its
own test split. A round no silo answers leaves the points where they were.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch

from fedsilo.coordinator.phases import Phase, Task, WeightedMean
from fedsilo.coordinator.strategies.base import (
    RoundContext,
    RoundScript,
    ServerState,
    Strategy,
)
from fedsilo.coordinator.synthetic import (
    initial_synthetic_set,
    langevin_step,
    mixture_gradient,
    step_sizes,
    train_classifier,
)
from fedsilo.models.zoo import build_model
from fedsilo.policies.algorithms import FedEvgConfig
from fedsilo.policies.algorithms.contract import Position
from fedsilo.policies.seeding import derive_seed
from fedsilo.wire.tasks import TaskConfig
from fedsilo.wire.tasks.tensor_names import (
    MODEL,
    SYNTHETIC,
    SYNTHETIC_LABELS,
    WEIGHT,
    WEIGHTED_GRADIENT,
)

SCHEMA = "schema"  # state.extra: the silos' input shape and number of classes


class FedEvg(Strategy):
    """Energy signals instead of models, a synthetic set at the coordinator (thesis ch. IV)."""

    name = "fedevg"

    @property
    def config(self) -> FedEvgConfig:
        return self.policy.algorithm  # type: ignore[return-value]

    def setup(self, ctx: RoundContext) -> RoundScript:
        state = yield from super().setup(ctx)
        shape, classes = yield from self.classification_schema(ctx)
        generator = torch.Generator().manual_seed(derive_seed(ctx.seed, "synthetic-init"))
        x, labels = initial_synthetic_set(self.config.samples_per_class, classes, shape, generator)
        return replace(
            state,
            tensors={**state.tensors, SYNTHETIC: x, SYNTHETIC_LABELS: labels},
            extra={**state.extra, SCHEMA: {"input_shape": list(shape), "classes": classes}},
        )

    def round(self, state: ServerState, ctx: RoundContext) -> RoundScript:
        config = self.config
        x = state.tensors[SYNTHETIC]
        tasks = tuple(self.energy_task(s, state, ctx) for s in self.sample_silos(ctx))
        shapes = {WEIGHTED_GRADIENT: tuple(x.shape), WEIGHT: (x.shape[0],)}
        references = {WEIGHTED_GRADIENT: torch.zeros_like(x), WEIGHT: torch.zeros(x.shape[0])}
        mean = WeightedMean((WEIGHTED_GRADIENT, WEIGHT), shapes=shapes, references=references)
        out = yield Phase("energy", tasks, aggregate=mean)
        gradient = mixture_gradient(out.mean[WEIGHTED_GRADIENT].float(), out.mean[WEIGHT].float())
        step = float(step_sizes(ctx.total_rounds, config.server_step_max, config.server_step_min)[
            ctx.round - 1
        ])  # fmt: skip
        noise = (
            config.server_noise if config.server_noise_scale is None
            else config.server_noise_scale * step
        )  # fmt: skip
        generator = torch.Generator().manual_seed(ctx.seed_for("langevin"))
        moved = langevin_step(x, gradient, step, noise, generator)
        tensors = {**state.tensors, SYNTHETIC: moved}
        if ctx.round % self.policy.eval_every == 0 or ctx.round == ctx.total_rounds:
            tensors[MODEL] = self.classifier(state, moved, ctx)
        return replace(state, tensors=tensors)

    def train_config(self, position: Position, **chosen: Any) -> TaskConfig:
        return self.config.energy_config(self.policy, position)

    def energy_task(self, silo: str, state: ServerState, ctx: RoundContext) -> Task:
        """A training task that carries the synthetic set instead of a model."""
        task = self.train_task(silo, state.model, state.spec, ctx)
        x, labels = state.tensors[SYNTHETIC], state.tensors[SYNTHETIC_LABELS]
        return replace(task, tensors={SYNTHETIC: x, SYNTHETIC_LABELS: labels}, spec=None)

    def classifier(self, state: ServerState, x: torch.Tensor, ctx: RoundContext) -> torch.Tensor:
        """The policy's model trained on the synthetic set alone, as a flat parameter vector."""
        config, schema = self.config, state.extra[SCHEMA]
        model = build_model(
            self.policy.model,
            tuple(schema["input_shape"]),
            schema["classes"],
            derive_seed(ctx.seed, "classifier", ctx.round),
        )
        generator = torch.Generator().manual_seed(ctx.seed_for("classifier"))
        labels = state.tensors[SYNTHETIC_LABELS].long()
        train_classifier(
            model,
            (x, labels),
            config.classifier_epochs,
            config.classifier_batch_size,
            config.classifier_lr,
            generator,
        )
        return state.spec.flatten(dict(model.named_parameters()))
