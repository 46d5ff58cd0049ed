"""Adaptive federated optimisation (Reddi et al. 2021): FedAdagrad, FedAdam, FedYogi.

The silos run the FedAvg round (FedOpt extends FedAvg); the server treats
Delta = mean(models) - x as a pseudo-gradient and takes a per-coordinate adaptive step
(docs/algorithms/fedadam.md; the step itself is policies/algorithms/server_step.py, which
silos repeat under model lineage):

    m  = beta1 m + (1 - beta1) Delta
    v  = v + Delta^2                                   (Adagrad)
    v  = beta2 v + (1 - beta2) Delta^2                 (Adam)
    v  = v - (1 - beta2) Delta^2 sign(v - Delta^2)     (Yogi)
    x  = x + server_lr * m / (sqrt(v) + tau),          m_0 = 0, v_0 = tau^2
"""

from __future__ import annotations

from fedsilo.coordinator.strategies.fedavg import FedAvg
from fedsilo.policies.algorithms import FedOptConfig


class FedOpt(FedAvg):
    """FedAvg's round with an adaptive server step (`server_step`: its moments start in
    `initial_state`)."""

    @property
    def config(self) -> FedOptConfig:
        return self.policy.algorithm  # type: ignore[return-value]


class FedAdagrad(FedOpt):
    """Adagrad server step on the mean update (Reddi et al. 2021)."""

    name = "fedadagrad"


class FedAdam(FedOpt):
    """Adam server step on the mean update (Reddi et al. 2021)."""

    name = "fedadam"


class FedYogi(FedOpt):
    """Yogi server step on the mean update (Reddi et al. 2021)."""

    name = "fedyogi"
