"""FedDC, federated daisy chaining: local steps, hand-offs between silos, periodic aggregation."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from fedsilo.policies.algorithms.base import AlgorithmBase


class FedDcConfig(AlgorithmBase):
    """FedDC (Kamp et al. 2023): every round is one local step; every `daisy_period` rounds the
    sampled silos' models move to a random permutation of them, every `aggregation_period`
    rounds they are aggregated (`mean`, or the iterated Radon point of height
    `radon_iterations`) and sent back. None: never (daisy chaining only, or FedAvg with
    `aggregation_period` local steps). `permutation`: `uniform` (fixed points allowed, as the
    paper) or `derangement`; `no_return_window` L: a model never returns to a silo that held
    it in its last L hops (a return would hand the silo its recipient's exact update)."""

    hands_off: ClassVar[bool] = True
    name: Literal["feddc"]
    daisy_period: int | None = Field(default=1, ge=1)
    aggregation_period: int | None = Field(default=10, ge=1)
    aggregator: Literal["mean", "radon"] = "mean"
    radon_iterations: int = Field(default=1, ge=1)
    client_fraction: float = Field(default=1.0, gt=0, le=1)
    prox_mu: float = Field(default=0.0, ge=0)
    permutation: Literal["uniform", "derangement"] = "uniform"
    no_return_window: int = Field(default=0, ge=0)

    @property
    def averages(self) -> bool:  # type: ignore[override]
        """Aggregation rounds take a mean (secure aggregation applies); Radon needs every model."""
        return self.aggregator == "mean"

    @property
    def title(self) -> str:
        return f"{self.name} with the Radon aggregator" if self.aggregator == "radon" else self.name

    def is_aggregation(self, step: int) -> bool:
        """Local step `step` (0-based) ends with an aggregation."""
        return self.aggregation_period is not None and (step + 1) % self.aggregation_period == 0

    def is_daisy(self, step: int) -> bool:
        """Local step `step` ends with a hand-off (never when it also aggregates)."""
        return (
            self.daisy_period is not None
            and (step + 1) % self.daisy_period == 0
            and not self.is_aggregation(step)
        )
