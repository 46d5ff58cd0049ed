"""Federated MultiBoost (Cortes et al. 2021, federated as in the survey of Tyagi &
Chukkapalli): boosting over the silos' own base classifiers towards the worst silo's loss."""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field

from fedsilo.policies.algorithms.base import SAMPLE_WEIGHTED, AlgorithmBase


class MultiBoostConfig(AlgorithmBase):
    """Federated MultiBoost, each silo one domain (docs/algorithms/multiboost.md).

    - `base_learners`: N, the base classifiers each silo trains once at setup (the policy's
      model and `training:` section, each from its own seed).
    - `step`: eta_0; boosting round t adds eta_0 / sqrt(t) to the chosen classifier's alpha.
    """

    reports: ClassVar[frozenset[str]] = SAMPLE_WEIGHTED | {"losses"}
    averages: ClassVar[bool] = False  # each base classifier is one silo's model, sent as is
    name: Literal["multiboost"]
    base_learners: int = Field(default=1, ge=1, le=16)
    step: float = Field(default=1.0, gt=0)
