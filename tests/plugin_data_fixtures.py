"""Plug-ins as a site would install them, registered by tests/test_data_plugins.py: data loaders
returning arrays or a torch Dataset, loaders returning bad rows, and a Cox survival task (a
plug-in's own loss, Breslow's; its concordance index the built-in survival task's, lifelines').
"""

from __future__ import annotations

import numpy as np
import torch
from sklearn.datasets import load_breast_cancer
from torch import Tensor
from torch.utils.data import Dataset

from fedsilo.silo.data.plugins import PluginData, PluginDataset
from fedsilo.silo.data.survival import concordance_index

COX_TASK = "tests.plugin_data_fixtures:CoxTask"


def breast_cancer(rows: int = 400) -> PluginData:
    """scikit-learn's breast-cancer table, its first `rows` rows, as arrays."""
    bunch = load_breast_cancer()
    return PluginData(
        x=bunch.data[:rows],
        y=bunch.target[:rows],
        task="classification",
        feature_names=tuple(str(name) for name in bunch.feature_names),
        num_classes=2,
    )


class _Rows(Dataset[tuple[Tensor, Tensor]]):
    def __init__(self, x: np.ndarray, y: np.ndarray) -> None:
        self.x, self.y = torch.from_numpy(x), torch.from_numpy(y)

    def __len__(self) -> int:
        return len(self.y)

    def __getitem__(self, index: int) -> tuple[Tensor, Tensor]:
        return self.x[index], self.y[index]


def breast_cancer_dataset(rows: int = 400) -> PluginDataset:
    """The same rows as `breast_cancer`, as a torch Dataset of (x, y) pairs."""
    bunch = load_breast_cancer()
    return PluginDataset(_Rows(bunch.data[:rows], bunch.target[:rows]), task="classification")


def flat_x() -> PluginData:
    """Bad: `x` of shape (n,), not (n, features)."""
    return PluginData(x=np.zeros(10), y=np.zeros(10), task="regression")


def nan_x() -> PluginData:
    """Bad: a NaN among the features."""
    x = np.ones((10, 3))
    x[4, 1] = np.nan
    return PluginData(x=x, y=np.arange(10.0), task="regression")


def survival(rows: int = 480, seed: int = 0) -> PluginData:
    """Synthetic survival rows: 4 features, hazard exp(x . beta), exponential censoring; y is
    (time, event) with event 1 for an observed death and 0 for a censored row."""
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(rows, 4))
    risk = x @ np.array([1.0, -0.8, 0.5, 0.0])
    death = rng.exponential(1.0 / np.exp(risk))
    censoring = rng.exponential(2.0, size=rows)
    y = np.stack([np.minimum(death, censoring), (death <= censoring).astype(float)], axis=1)
    return PluginData(x=x, y=y, task=COX_TASK)


class CoxTask:
    """Cox proportional hazards: the model's one output is each row's log-risk. The loss is the
    negative partial log-likelihood (Breslow's handling of tied times) divided by the batch's
    rows; it has no per-row loss, since a row's term depends on its whole risk set."""

    higher_is_better = {"loss": False, "c_index": True}
    selection = "c_index"

    def output_dim(self, y: Tensor) -> int:
        return 1

    def loss(self, output: Tensor, y: Tensor) -> Tensor:
        risk = output.reshape(-1)
        time, event = y[:, 0].to(risk), y[:, 1].to(risk)
        order = torch.argsort(time, descending=True, stable=True)
        risk, time, event = risk[order], time[order], event[order]
        # log sum of exp(risk) over each row's risk set {j: t_j >= t_i}: with times descending,
        # the running log-sum-exp up to the last row tied with t_i (Breslow)
        running = torch.logcumsumexp(risk, dim=0)
        _, counts = torch.unique_consecutive(time, return_counts=True)
        last_of_tie = torch.cumsum(counts, dim=0) - 1
        risk_set = running[torch.repeat_interleave(last_of_tie, counts)]
        return -(event * (risk - risk_set)).sum() / len(risk)

    def metrics(self, output: Tensor, y: Tensor) -> dict[str, float]:
        return {"c_index": concordance_index(output.reshape(-1), y[:, 0], y[:, 1])}
