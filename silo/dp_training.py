"""Sample-level DP-SGD at a silo, on top of Opacus: the plan of one training task (noise,
sample rate, steps, clip norm) and the private training loop every task with a per-sample
loss runs through.

The DP parameters come from the silo's own copy of the signed policy (`PrivacyConfig`),
never from the task the coordinator sends: a coordinator cannot weaken a silo's DP. The task
config supplies only the schedule (batch size, epochs or steps), and `DpSgdPlan.mechanism()`
is what the silo books for it, so a coordinator that asks for more work is charged for it.

The loop clips per sample in one backward pass of its own, with Opacus' layer validator and
per-layer gradient functions, rather than through Opacus' module and optimiser wrappers
(`ClippedSums`). Forward hooks keep each trainable layer's input and output; one autograd call
gives the gradient of the summed per-sample losses at every layer output and no parameter
gradient, and row i of it is sample i's alone (rows are independent: no BatchNorm). A dense
layer's per-sample gradient norm follows from those two (|g_i| |a_i|, the "ghost" norm) and
its clipped sum is one product of the clip-scaled output gradients with the inputs, so its
per-sample gradients are never formed; other layers (convolutions, norms) form theirs with
Opacus' grad samplers and sum them weighted by the clip factors. Clip factor
min(1, C / (n_i + 1e-6)), n_i the norm of row i's whole gradient; Gaussian noise of std
`noise_multiplier` * C on each parameter's sum; division by the batch size: DPOptimizer's
arithmetic, and the tests check the update against Opacus' own per-sample clipping. What it
cannot clip exactly it refuses: a layer type without an Opacus grad sampler, a layer run twice
in one batch, an output modified in place.

Why not Opacus' wrappers: on small models the per-step work is tiny and their bookkeeping
(backward hooks, per-sample buffers, a second backward pass) dominates. DP-SGD epoch time over
non-private, MLP [64, 64] / CNN [16, 32] on digits at batch 64, 2 CPU cores (bench/dp.py's
task, each candidate in turn, medians of 15; bench/results/dp.json has the current run):
ghost clipping (GradSampleModuleFastGradientClipping, two backward passes) 4.9x / 3.1x;
GradSampleModule hooks + DPOptimizer 5.4x / 2.7x, with functorch 9.2x / 4.2x; Opacus'
ExpandedWeights mode + DPOptimizer 3.9x / 2.2x; torch.func vmap(grad) 5.6x / 2.5x; this loop
1.9x / 1.5x. Per-sample gradients are formed only for non-dense layers, as in Opacus' hooks
mode; a model whose convolutions are large gets memory of batch x their parameters.

Nor `PrivacyEngine.make_private`: its Poisson sampler draws from the global torch RNG
(a seed is refused outside secure mode), which would make runs irreproducible and let silos in
one process disturb each other; and its fixed expected batch size would divide the smaller
last batch of a shuffled pass by the full batch size. Here batches come from the task's
seeded generator (the very order non-private training uses when `poisson_sampling` is false),
Poisson draws and noise from generators seeded with the silo's private seed (its secret and the
task: the coordinator, which chose the task's seed, cannot predict them), and a shuffled batch
is averaged over its true size (noise std / sensitivity stays `noise_multiplier`). An empty
Poisson batch is still a step: noise alone, over the expected batch size.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from opacus.accountants.utils import get_noise_multiplier
from opacus.grad_sample import GradSampleModule
from opacus.utils.module_utils import trainable_modules
from opacus.validators import ModuleValidator
from torch import nn

from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.privacy.accounting import Mechanism, quiet_optimal_order
from fedsilo.silo.errors import DpSgdError
from fedsilo.silo.objectives import PerSampleLoss
from fedsilo.silo.schedule import LocalSchedule, shuffled_batches
from fedsilo.wire.tasks import LocalTraining

# The layer types Opacus has a per-sample gradient function for.
_SAMPLED_TYPES = tuple(GradSampleModule.GRAD_SAMPLERS)


@dataclass(frozen=True)
class DpSgdPlan:
    """What one DP-SGD training task will do: exactly the numbers the training uses."""

    noise_multiplier: float
    sample_rate: float
    max_grad_norm: float
    poisson_sampling: bool
    schedule: LocalSchedule

    @property
    def steps(self) -> int:
        """The noisy steps this task takes."""
        return self.schedule.steps

    def public_metrics(self) -> dict[str, float]:
        """The plan's public parameters, as a training result reports them."""
        return {
            "dp_noise_multiplier": self.noise_multiplier,
            "dp_sample_rate": self.sample_rate,
            "dp_steps": float(self.steps),
        }

    def mechanism(self) -> Mechanism:
        """The release this task is, for the silo's ledger (no noise: no DP guarantee)."""
        if self.noise_multiplier == 0:
            return Mechanism.none()
        return Mechanism.dp_sgd(
            noise_multiplier=self.noise_multiplier,
            sample_rate=self.sample_rate,
            steps=self.steps,
            max_grad_norm=self.max_grad_norm,
        )


def dp_sgd_plan(
    privacy: PrivacyConfig,
    local: LocalTraining,
    n_train: int,
    rounds: int,
    job_noise: float | None = None,
) -> DpSgdPlan:
    """The DP-SGD plan of a train task over `n_train` rows, in a deployment of `rounds` rounds.

    Sample rate: batch / n. The noise: the policy's `noise_multiplier`; with
    `training_epsilon`, calibrated so that `rounds` such tasks together reach at most it at
    the policy's delta (a silo that sits out some rounds spends less; cheap after the first
    call: calibrations are cached); with the policy's `job_epsilon`, `job_noise`, which the
    silo calibrated over its whole plan (silo/budget_plan.py).
    """
    dp = privacy.dp_sgd
    if dp is None:
        raise DpSgdError("the policy's privacy section has no dp_sgd")
    schedule = LocalSchedule.of(local, n_train)
    sample_rate = schedule.batch / schedule.n
    if dp.noise_multiplier is not None:
        noise = dp.noise_multiplier
    elif dp.training_epsilon is not None:
        noise = _calibrated_noise(
            dp.training_epsilon,
            privacy.delta,
            sample_rate,
            rounds * schedule.steps,
            privacy.accountant,
        )
    elif job_noise is not None:
        noise = job_noise
    else:
        raise DpSgdError("privacy.job_epsilon: the job's noise was not calibrated")
    return DpSgdPlan(
        noise_multiplier=noise,
        sample_rate=sample_rate,
        max_grad_norm=dp.max_grad_norm,
        poisson_sampling=dp.poisson_sampling,
        schedule=schedule,
    )


def check_model(model: nn.Module) -> None:
    """Raise `DpSgdError` naming every layer Opacus cannot train privately, with its fix."""
    errors = ModuleValidator.validate(model, strict=False)
    if not errors:
        return
    layers = [_layer_problem(name, m) for name, m in model.named_modules() if _violations(m)]
    raise DpSgdError("; ".join(layers or [str(error) for error in errors]))


def train_private(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: DpSgdPlan,
    seed: int,
    private_seed: int,
    per_sample_loss: PerSampleLoss,
    after_noise: Callable[[], None] | None = None,
    after_step: Callable[[int], None] | None = None,
) -> list[float | None]:
    """Run `plan` on `model` with `optimizer`; the mean loss of each step (None for an empty
    batch). `seed` orders shuffled batches; `private_seed` draws Poisson batches and the noise.
    The same seeds give the same model.

    `after_noise` runs after the gradient is clipped, noised and averaged and before the
    optimiser steps: the place for a data-independent gradient term such as FedProx's.
    `after_step` runs after each optimiser step with its number (1-based).
    """

    def gradients_of(params: list[torch.Tensor], clipped_sums: ClippedSums) -> ClippedGradients:
        def gradients(index: torch.Tensor) -> tuple[list[torch.Tensor], float]:
            per_sample = per_sample_loss(index)
            return clipped_sums(per_sample), float(per_sample.detach().mean())

        return gradients

    return private_run(
        model, optimizer, plan, seed, private_seed, gradients_of, after_noise, after_step
    )


def private_run(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    plan: DpSgdPlan,
    seed: int,
    private_seed: int,
    gradients_of: Callable[[list[torch.Tensor], ClippedSums], ClippedGradients],
    after_noise: Callable[[], None] | None = None,
    after_step: Callable[[int], None] | None = None,
) -> list[float | None]:
    """`plan` on `model`, each batch's clipped sums from `gradients_of(params, clipped_sums)`
    (a site's training step goes through here: silo/training_step.py)."""
    check_model(model)
    # What DPOptimizer clips and noises: the optimiser's parameters that want a gradient.
    params = [p for group in optimizer.param_groups for p in group["params"] if p.requires_grad]
    with ClippedSums(model, params, plan.max_grad_norm) as clipped_sums:
        gradients = gradients_of(params, clipped_sums)
        return noisy_steps(
            plan, seed, private_seed, params, optimizer, gradients, after_noise, after_step
        )


# A batch's clipped per-sample gradient sums (one per parameter) and its mean loss.
ClippedGradients = Callable[[torch.Tensor], tuple[list[torch.Tensor], float]]


def noisy_steps(
    plan: DpSgdPlan,
    seed: int,
    private_seed: int,
    params: list[torch.Tensor],
    optimizer: torch.optim.Optimizer,
    gradients: ClippedGradients,
    after_noise: Callable[[], None] | None = None,
    after_step: Callable[[int], None] | None = None,
) -> list[float | None]:
    """The steps of `plan`: each batch's clipped sums (`gradients`, one per parameter of
    `params`), Gaussian noise of std noise_multiplier * C on each, division by the batch size,
    then the optimiser's step; the mean loss of each step (None for an empty batch)."""
    device = params[0].device
    noise = torch.Generator(device=device).manual_seed(_noise_seed(private_seed))
    std = plan.noise_multiplier * plan.max_grad_norm
    losses: list[float | None] = []
    for step, index in enumerate(_batches(plan, seed, private_seed), start=1):
        if len(index) == 0:  # Poisson sampling drew nobody: the step is still noised
            grads = [torch.zeros_like(p) for p in params]
            losses.append(None)
        else:
            grads, loss = gradients(index.to(device))
            losses.append(loss)
        batch = plan.schedule.batch if plan.poisson_sampling else len(index)
        for p, grad in zip(params, grads, strict=True):
            if std:
                grad.add_(
                    torch.normal(0.0, std, p.shape, generator=noise, dtype=p.dtype, device=p.device)
                )
            p.grad = grad.div_(batch)
        if after_noise is not None:
            after_noise()
        optimizer.step()
        if after_step is not None:
            after_step(step)
    return losses


class ClippedSums:
    """Called with a batch's per-sample losses: per parameter, the sum over the rows of each
    row's gradient clipped to total L2 norm `max_grad_norm` (all parameters together).

    A context manager: its forward hooks on the model's trainable layers live as long as it
    does. The layers are the optimiser's parameters' owners, each of a type Opacus has a grad
    sampler for.
    """

    def __init__(self, model: nn.Module, params: list[torch.Tensor], max_grad_norm: float):
        self.params, self.max_grad_norm = params, max_grad_norm
        wanted = {id(p) for p in params}
        self.layers: dict[nn.Module, list[torch.Tensor]] = {}
        for name, module in trainable_modules(model):
            own = [p for p in module.parameters(recurse=False) if id(p) in wanted]
            if not own:
                continue
            if type(module) not in GradSampleModule.GRAD_SAMPLERS:
                raise DpSgdError(
                    f"{type(module).__name__} at '{name}' has parameters but Opacus has no "
                    "per-sample gradient for its type; build the model from layers it has one "
                    f"for ({', '.join(sorted(t.__name__ for t in _SAMPLED_TYPES))})"
                )
            self.layers[module] = own
        held = {id(p) for own in self.layers.values() for p in own}
        if held != wanted:
            raise DpSgdError("the optimiser holds parameters that are not the model's")
        self._seen: dict[nn.Module, tuple[list[torch.Tensor], torch.Tensor, int]] = {}
        self._paused = False
        self._hooks = [m.register_forward_hook(self._capture) for m in self.layers]

    def __enter__(self) -> ClippedSums:
        return self

    @contextlib.contextmanager
    def unwatched(self) -> Iterator[None]:
        """Forward passes in this block are not the batch's (e.g. on public data): the hooks
        leave them alone."""
        self._paused = True
        try:
            yield
        finally:
            self._paused = False

    def __exit__(self, *exc: object) -> None:
        for hook in self._hooks:
            hook.remove()
        self._seen.clear()

    def _capture(self, module: nn.Module, inputs: tuple[Any, ...], output: Any) -> None:
        if self._paused or not torch.is_grad_enabled():
            return
        if module in self._seen:
            raise DpSgdError(
                f"{type(module).__name__} ran twice in one forward pass; per-sample clipping "
                "here needs each layer once per batch (no shared parameters)"
            )
        activations = [t.detach() for t in inputs if torch.is_tensor(t)]
        self._seen[module] = (activations, output, output._version)

    def __call__(
        self, per_sample: torch.Tensor, scales: Mapping[torch.Tensor, float] | None = None
    ) -> list[torch.Tensor]:
        """The clipped sums, one per parameter, for the batch whose losses are `per_sample`.

        `scales` multiplies a parameter's per-sample gradient norms in the clipping norm (1 for
        a parameter it does not name): SuPerFed's mixed layers, whose gradient reaches the
        federated and the local weight as (1 - lambda) g and lambda g, a norm
        sqrt((1 - lambda)^2 + lambda^2) |g| together. The sums themselves are not scaled."""
        scale = scales or {}
        seen, self._seen = self._seen, {}
        if not seen:  # the loss does not involve the model: every gradient is zero
            return [torch.zeros_like(p) for p in self.params]
        for module, (_, output, version) in seen.items():
            if output._version != version:
                raise DpSgdError(
                    f"the output of {type(module).__name__} is modified in place (e.g. by "
                    "ReLU(inplace=True)); per-sample clipping here needs it as the layer "
                    "produced it: use the out-of-place operation"
                )
        # The gradient at each layer's output, nothing else (no parameter gradients); checked
        # above to be the output as the layer produced it (`_version` counts in-place writes).
        backprops = torch.autograd.grad(
            per_sample.sum(), [output for _, output, _ in seen.values()], allow_unused=True
        )
        norms: list[torch.Tensor] = []  # per parameter: each row's gradient norm
        linear, sampled = [], []
        for (module, (activations, _, _)), backprop in zip(seen.items(), backprops, strict=True):
            if backprop is None:  # not on the loss's path: zero gradients
                continue
            own = self.layers[module]
            if type(module) is nn.Linear and backprop.dim() == 2:
                # Row i's weight gradient is the outer product g_i a_i^T, of norm |g_i| |a_i|;
                # its bias gradient is g_i (Opacus' ghost norm, without forming either).
                inputs = activations[0].to(backprop.dtype)
                backprop_norm = torch.linalg.vector_norm(backprop, dim=1)
                input_norm = torch.linalg.vector_norm(inputs, dim=1)
                norms += [
                    (backprop_norm * input_norm if p is module.weight else backprop_norm)
                    * scale.get(p, 1.0)
                    for p in own
                ]
                linear.append((module.weight, own, inputs, backprop))
            else:
                grad_sampler = GradSampleModule.GRAD_SAMPLERS[type(module)]
                samples = grad_sampler(module, activations, backprop)
                flat = [samples[p].flatten(1) for p in own]
                norms += [
                    torch.linalg.vector_norm(f, dim=1) * scale.get(p, 1.0)
                    for p, f in zip(own, flat, strict=True)
                ]
                sampled.append((own, flat))
        sums: dict[torch.Tensor, torch.Tensor] = {}
        if norms:
            total = torch.linalg.vector_norm(torch.stack(norms, dim=1), dim=1)
            factors = (self.max_grad_norm / (total + 1e-6)).clamp(max=1.0)
            for weight, own, inputs, backprop in linear:
                scaled = backprop * factors.unsqueeze(1)
                for p in own:
                    sums[p] = scaled.T @ inputs if p is weight else scaled.sum(0)
            for own, flat in sampled:
                for p, f in zip(own, flat, strict=True):
                    sums[p] = (factors @ f).view_as(p)
        return [sums[p] if p in sums else torch.zeros_like(p) for p in self.params]


def _batches(plan: DpSgdPlan, seed: int, private_seed: int) -> Iterator[torch.Tensor]:
    if not plan.poisson_sampling:
        yield from shuffled_batches(plan.schedule, torch.Generator().manual_seed(seed))
        return
    generator = torch.Generator().manual_seed(private_seed)
    for _ in range(plan.steps):
        chosen = torch.rand(plan.schedule.n, generator=generator) < plan.sample_rate
        yield chosen.nonzero().squeeze(1)


@functools.lru_cache(maxsize=256)
def _calibrated_noise(
    training_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str
) -> float:
    try:
        with quiet_optimal_order():  # calibration tries noise far from the answer
            noise = get_noise_multiplier(
                target_epsilon=training_epsilon,
                target_delta=delta,
                sample_rate=sample_rate,
                steps=steps,
                accountant=accountant,
            )
    except ValueError as exc:  # Opacus: "The privacy budget is too low."
        raise DpSgdError(
            f"no noise multiplier reaches training_epsilon {training_epsilon:g} at delta "
            f"{delta:g} "
            f"over {steps} steps at sample rate {sample_rate:.4g} ({exc})"
        ) from None
    return float(noise)


def _noise_seed(seed: int) -> int:
    """A seed for the noise, apart from the Poisson draws' stream."""
    digest = hashlib.blake2b(f"{seed}/dp-sgd-noise".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def _violations(module: nn.Module) -> list[Exception]:
    """What Opacus' validator for this layer's type (if it has one) objects to."""
    validator = ModuleValidator.VALIDATORS.get(type(module))
    return validator(module) if validator is not None else []


def _layer_problem(name: str, module: nn.Module) -> str:
    kind = type(module).__name__
    fixer = ModuleValidator.FIXERS.get(type(module))
    if fixer is None:
        reason = " ".join(str(error) for error in _violations(module))
        return f"{kind} at '{name}' cannot be trained with DP-SGD: {reason}"
    replacement = type(fixer(module)).__name__
    return (
        f"{kind} at '{name}' cannot be trained with DP-SGD; replace it with {replacement} "
        "(opacus.validators.ModuleValidator.fix does this)"
    )
