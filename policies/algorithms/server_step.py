"""The server step of FedAvg's round, read by both sides: the coordinator's strategies apply
it to each round's mean (coordinator/strategies/fedavg.py, fedopt.py, scaffold.py), and under
model lineage every silo repeats it on the mean it recomputed itself (silo/lineage.py), so both
must get the same bits from one function.

FedAvg, FedProx and ApproxFedAvg take the mean as the next model. SCAFFOLD (docs/algorithms/
scaffold.md) steps the model towards the mean, x += server_lr (mean(y_i) - x), and its control
variate by the cohort's share of the silos, c += (|S| / N) mean(c_i+ - c_i). FedOpt (Reddi
et al. 2021: FedAdagrad, FedAdam, FedYogi) treats Delta = mean - x as a pseudo-gradient and
takes a per-coordinate adaptive step (docs/algorithms/fedadam.md):

    m  = beta1 m + (1 - beta1) Delta
    v  = v + Delta^2                                   (Adagrad)
    v  = beta2 v + (1 - beta2) Delta^2                 (Adam)
    v  = v - (1 - beta2) Delta^2 sign(v - Delta^2)     (Yogi)
    x  = x + server_lr * m / (sqrt(v) + tau),          m_0 = 0, v_0 = tau^2

AAggFF's `server_optimizer` applies the same step to its own mixed mean
(docs/algorithms/aaggff.md).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from fedsilo.policies.algorithms.base import AlgorithmBase
from fedsilo.policies.algorithms.fedopt import FedOptConfig, ServerStepSettings
from fedsilo.policies.algorithms.scaffold import ScaffoldConfig
from fedsilo.wire.tasks.tensor_names import CONTROL, CONTROL_DELTA, MODEL

FIRST_MOMENT, SECOND_MOMENT = "m", "v"  # the server optimiser's state beside MODEL

SecondMoment = Callable[[ServerStepSettings, torch.Tensor, torch.Tensor], torch.Tensor]
SECOND_MOMENTS: dict[str, SecondMoment] = {
    "fedadagrad": lambda c, v, delta_sq: v + delta_sq,
    "fedadam": lambda c, v, delta_sq: c.beta2 * v + (1 - c.beta2) * delta_sq,
    "fedyogi": lambda c, v, delta_sq: v - (1 - c.beta2) * delta_sq * torch.sign(v - delta_sq),
}


def with_moments(tensors: Mapping[str, torch.Tensor], tau: float) -> dict[str, torch.Tensor]:
    """`tensors` with the optimiser's initial moments beside MODEL: m_0 = 0, v_0 = tau^2."""
    zeros = torch.zeros_like(tensors[MODEL])
    return {
        **tensors,
        FIRST_MOMENT: zeros,
        SECOND_MOMENT: torch.full_like(zeros, tau**2),
    }


def adaptive_step(
    name: str,
    settings: ServerStepSettings,
    tensors: Mapping[str, torch.Tensor],
    mean: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """One `name` step (fedadam, fedyogi, fedadagrad) from MODEL and its moments in `tensors`
    towards `mean`: the new MODEL, m and v (other tensors kept)."""
    c = settings
    x, m, v = tensors[MODEL], tensors[FIRST_MOMENT], tensors[SECOND_MOMENT]
    delta = mean - x
    m = c.beta1 * m + (1 - c.beta1) * delta
    v = SECOND_MOMENTS[name](c, v, delta * delta)
    x = x + c.server_lr * m / (v.sqrt() + c.tau)
    return {**tensors, MODEL: x, FIRST_MOMENT: m, SECOND_MOMENT: v}


def initial_state(algorithm: AlgorithmBase, model: torch.Tensor) -> dict[str, torch.Tensor]:
    """The server state of FedAvg's round before its first round: the initial model, and a
    server optimiser's initial moments or SCAFFOLD's control variate (zeros)."""
    if isinstance(algorithm, FedOptConfig):
        return with_moments({MODEL: model}, algorithm.tau)
    if isinstance(algorithm, ScaffoldConfig):
        return {MODEL: model, CONTROL: torch.zeros_like(model)}
    return {MODEL: model}


def server_step(
    algorithm: AlgorithmBase,
    tensors: Mapping[str, torch.Tensor],
    mean: Mapping[str, torch.Tensor],
    share: float = 1.0,
) -> dict[str, torch.Tensor]:
    """The state after one round whose weighted means are `mean` (other tensors kept);
    `share`: SCAFFOLD's |S| / N, the silos summed over those counted."""
    if isinstance(algorithm, FedOptConfig):
        return adaptive_step(algorithm.name, algorithm, tensors, mean[MODEL])
    if isinstance(algorithm, ScaffoldConfig):
        model, control = tensors[MODEL], tensors[CONTROL]
        return {
            **tensors,
            MODEL: model + algorithm.server_lr * (mean[MODEL] - model),
            CONTROL: control + share * mean[CONTROL_DELTA].to(control),
        }
    return {**tensors, MODEL: mean[MODEL]}
