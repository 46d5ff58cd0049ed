"""Local preprocessing of a silo's numeric columns, fitted on its own training rows: median
imputation and standardisation (`data.scaling: local`), imputation alone (`none`), or
imputation that leaves unobserved columns missing for the consortium's scaler (`federated`,
silo/tasks/scaling.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np


@dataclass(frozen=True)
class Standardiser:
    """Median imputation and standardisation of the numeric columns, fitted on training rows.

    A column with no value at all in the training rows carries no information here: it becomes
    0 (the mean, after standardisation) in every split.
    """

    numeric: np.ndarray
    observed: np.ndarray
    median: np.ndarray
    mean: np.ndarray
    std: np.ndarray
    fill_unobserved: bool = True

    @classmethod
    def fit(cls, train: np.ndarray, numeric: np.ndarray) -> Standardiser:
        values = train[:, numeric]
        observed = (~np.isnan(values)).any(axis=0)
        median = np.full(values.shape[1], np.nan)
        mean = np.zeros(values.shape[1])
        std = np.ones(values.shape[1])
        if observed.any():
            seen = values[:, observed]
            median[observed] = np.nanmedian(seen, axis=0)
            imputed = np.where(np.isnan(seen), median[observed], seen)
            mean[observed] = imputed.mean(axis=0)
            spread = imputed.std(axis=0)
            std[observed] = np.where(spread > 0, spread, 1.0)
        return cls(numeric, observed, median, mean, std)

    def transform(self, x: np.ndarray) -> np.ndarray:
        values = x[:, self.numeric]
        imputed = np.where(np.isnan(values), self.median, values)
        scaled = (imputed - self.mean) / self.std
        if self.fill_unobserved:
            scaled[:, ~self.observed] = 0.0
        out = x.copy()
        out[:, self.numeric] = scaled
        return out


def fitted_standardiser(train: np.ndarray, numeric: np.ndarray, scaling: str) -> Standardiser:
    """The preprocessing `data.scaling` asks for, fitted on the training rows `train`."""
    standardiser = Standardiser.fit(train, numeric)
    if scaling == "none":  # impute only: features as the source gives them
        standardiser = replace(
            standardiser,
            mean=np.zeros_like(standardiser.mean),
            std=np.ones_like(standardiser.std),
        )
    elif scaling == "federated":  # impute only; the consortium's scaler comes later
        # Columns this silo never observed stay NaN: the federated scaler fills them with the
        # consortium mean, and the silo's moments leave them out.
        standardiser = replace(
            standardiser,
            mean=np.zeros_like(standardiser.mean),
            std=np.ones_like(standardiser.std),
            fill_unobserved=False,
        )
    return standardiser
