"""Sample-level DP-SGD at a silo, on top of Opacus: the plan of one training task (noise,
sample rate, steps, clip norm) and the private training loop every task with a per-sample
loss runs through.

The DP parameters come from the silo's own copy of the signed policy (`PrivacyConfig`),
never from the task the coordinator sends: a coordinator cannot weaken a silo's DP. The task
config supplies only the schedule (batch size, epochs or steps), and `DpSgdPlan.mechanism()`
is what the silo books for it, so a coordinator that asks for more work is charged for it.

The loop drives Opacus' ghost clipping (`GradSampleModuleFastGradientClipping`,
`DPOptimizerFastGradientClipping`: per-sample gradient norms without materialising per-sample
gradients, then one backward pass of the clip-weighted per-sample losses) rather than
`PrivacyEngine.make_private`: make_private's Poisson sampler draws from the global torch RNG
(a seed is refused outside secure mode), which would make runs irreproducible and let silos in
one process disturb each other; and its fixed expected batch size would divide the smaller
last batch of a shuffled pass by the full batch size. Here batches come from the task's
seeded generator (the very order non-private training uses when `poisson_sampling` is false),
Poisson draws and noise from generators seeded with the silo's private seed (its secret and the
task: the coordinator, which chose the task's seed, cannot predict them), and a shuffled batch
is averaged over its true size (noise std / sensitivity stays `noise_multiplier`).
"""

from __future__ import annotations

import functools
import hashlib
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from opacus.accountants.utils import get_noise_multiplier
from opacus.grad_sample import GradSampleModuleFastGradientClipping
from opacus.optimizers import DPOptimizerFastGradientClipping
from opacus.utils.fast_gradient_clipping_utils import DPTensorFastGradientClipping
from opacus.validators import ModuleValidator
from torch import nn

from fedsilo.policies.privacy import PrivacyConfig
from fedsilo.privacy.accounting import Mechanism
from fedsilo.silo.schedule import LocalSchedule, shuffled_batches

# Opacus' backward hook on the first layer fires without input gradients, which torch reports
# on every task; harmless (per-sample gradient norms need only the layer's own backprops).
warnings.filterwarnings("ignore", message="Full backward hook is firing", category=UserWarning)

# The losses of one minibatch, one per row (shape (len(rows),)), given the rows it holds.
PerSampleLoss = Callable[[torch.Tensor], torch.Tensor]


class DpSgdError(ValueError):
    """A model or task that cannot be trained with DP-SGD; the message says why and the fix."""


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
    privacy: PrivacyConfig, task_config: Mapping[str, Any], n_train: int, rounds: int
) -> DpSgdPlan:
    """The DP-SGD plan of a train task over `n_train` rows, in a deployment of `rounds` rounds.

    Sample rate: batch / n. With `target_epsilon`, the noise is calibrated so that `rounds`
    such tasks together reach at most the target at the policy's delta (a silo that sits out
    some rounds spends less). Cheap after the first call: calibrations are cached.
    """
    dp = privacy.dp_sgd
    if dp is None:
        raise DpSgdError("the policy's privacy section has no dp_sgd")
    schedule = LocalSchedule.of(task_config, n_train)
    sample_rate = schedule.batch / schedule.n
    if dp.noise_multiplier is not None:
        noise = dp.noise_multiplier
    else:
        noise = _calibrated_noise(
            dp.target_epsilon,
            privacy.delta,
            sample_rate,
            rounds * schedule.steps,
            privacy.accountant,
        )
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
) -> list[float | None]:
    """Run `plan` on `model` with `optimizer`; the mean loss of each step (None for an empty
    batch). `seed` orders shuffled batches; `private_seed` draws Poisson batches and the noise.
    The same seeds give the same model.

    `after_noise` runs after the gradient is clipped, noised and averaged and before the
    optimiser steps: the place for a data-independent gradient term such as FedProx's.
    """
    check_model(model)
    device = next(model.parameters()).device
    private_model = GradSampleModuleFastGradientClipping(
        model, loss_reduction="mean", max_grad_norm=plan.max_grad_norm, use_ghost_clipping=True
    )
    dp_optimizer = DPOptimizerFastGradientClipping(
        optimizer,
        noise_multiplier=plan.noise_multiplier,
        max_grad_norm=plan.max_grad_norm,
        expected_batch_size=plan.schedule.batch,
        loss_reduction="mean",
        generator=torch.Generator(device=device).manual_seed(_noise_seed(private_seed)),
        secure_mode=False,
    )
    if after_noise is not None:
        dp_optimizer.attach_step_hook(lambda _: after_noise())
    losses: list[float | None] = []
    try:
        for index in _batches(plan, seed, private_seed):
            dp_optimizer.zero_grad(set_to_none=True)
            if not plan.poisson_sampling:
                dp_optimizer.expected_batch_size = len(index)
            if len(index) == 0:  # Poisson sampling drew nobody: the step is still noised
                for param in dp_optimizer.params:
                    param.grad = torch.zeros_like(param)
                losses.append(None)
            else:
                per_sample = per_sample_loss(index.to(device))
                DPTensorFastGradientClipping(private_model, dp_optimizer, per_sample).backward()
                losses.append(float(per_sample.detach().mean()))
            dp_optimizer.step()
    finally:
        private_model.cleanup()
    return losses


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
    target_epsilon: float, delta: float, sample_rate: float, steps: int, accountant: str
) -> float:
    try:
        noise = get_noise_multiplier(
            target_epsilon=target_epsilon,
            target_delta=delta,
            sample_rate=sample_rate,
            steps=steps,
            accountant=accountant,
        )
    except ValueError as exc:  # Opacus: "The privacy budget is too low."
        raise DpSgdError(
            f"no noise multiplier reaches target_epsilon {target_epsilon:g} at delta {delta:g} "
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
