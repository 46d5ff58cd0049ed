"""A site's installed plug-ins: data loaders (entry point group `fedsilo.datasets`) and tasks
beyond classification and regression (group `fedsilo.tasks`).

A policy names a plug-in by the *value* of its entry point ("module:attr"); only an installed,
registered entry point with that value is ever loaded, so a policy string is never imported.
No code travels: every site runs the plug-ins installed at that site.

A data loader, called `loader(**args)`, returns a `PluginData` (arrays) or a `PluginDataset` (a
torch Dataset of (x, y) pairs and its schema). A task plug-in is a `TaskPlugin`, or a class (a
factory) whose instances are. The built-in survival task (silo/data/survival.py) is a
`TaskPlugin` too, so it takes the same path through training and evaluation.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib.metadata import EntryPoint, entry_points
from typing import Any, Protocol, runtime_checkable

import numpy as np
import torch
from torch import Tensor
from torch.utils.data import Dataset

from fedsilo.policies.data import BUILTIN_TASKS, SURVIVAL, DataConfig, is_entry_point_value
from fedsilo.policies.plugin_loading import PluginChanged, load_plugin
from fedsilo.silo.data.survival import SurvivalTask
from fedsilo.silo.errors import SECTION, DataError, DataNotHere

DATASETS_GROUP = "fedsilo.datasets"
TASKS_GROUP = "fedsilo.tasks"

Rows = np.ndarray | Tensor


@dataclass(frozen=True)
class PluginData:
    """What a data loader returns: `x` of shape (n, *input_shape), `y` of shape (n,) (class
    codes or regression targets) or (n, k) (a task plug-in's targets, e.g. (time, event)),
    `task` ("classification", "regression" or a task plug-in's entry point value), and
    optionally the feature names (one per feature of a 2-D `x`) and the number of classes (the
    labels then lie in 0..num_classes-1, even where a silo lacks some class)."""

    x: Rows
    y: Rows
    task: str
    feature_names: tuple[str, ...] | None = None
    num_classes: int | None = None


@dataclass(frozen=True)
class PluginDataset:
    """What a data loader returns instead of arrays: a map-style `torch.utils.data.Dataset` of
    (x, y) pairs and its schema (as `PluginData`'s). It is materialised into tensors, row by
    row: the whole dataset must fit in memory."""

    dataset: Dataset[tuple[Any, Any]]
    task: str
    feature_names: tuple[str, ...] | None = None
    num_classes: int | None = None


@runtime_checkable
class TaskPlugin(Protocol):
    """A task beyond classification and regression: its loss and its metrics.

    `output_dim(y)`: the model's output width for the source's targets `y`;
    `loss(output, y)`: a scalar tensor, the mean over the batch, which training descends;
    `metrics(output, y)`: the metrics of a whole split (the mean `loss` is added unless given);
    `higher_is_better`: each metric's direction; `selection`: the metric that picks a model.
    Optional `per_sample_loss(output, y)`: each row's loss, shape (n,), which DP-SGD, the mixing
    schedules' probes and the domain weights need; without it they are refused.
    """

    higher_is_better: Mapping[str, bool]
    selection: str

    def output_dim(self, y: Tensor) -> int: ...

    def loss(self, output: Tensor, y: Tensor) -> Tensor: ...

    def metrics(self, output: Tensor, y: Tensor) -> dict[str, float]: ...


def installed(group: str) -> tuple[EntryPoint, ...]:
    """The entry points of `group` installed at this site."""
    return tuple(entry_points(group=group))


def _registered(group: str, value: str, key: str) -> Any:
    """The object of the installed entry point of `group` whose value is `value`."""
    found = [point for point in installed(group) if point.value == value]
    if not found:
        listing = ", ".join(sorted(point.value for point in installed(group))) or "none"
        raise DataNotHere(
            f"{SECTION}.{key}: '{value}' is not an installed plug-in of group {group}; "
            f"installed: {listing}"
        )
    try:
        return load_plugin(found[0])
    except PluginChanged as error:
        raise DataError(f"{SECTION}.{key}: plug-in '{value}' {error}") from None
    except Exception as error:  # the package is broken: say so, never a traceback
        raise DataError(
            f"{SECTION}.{key}: plug-in '{value}' fails to load: {error} ({type(error).__name__})"
        ) from None


def is_plugin_task(task: str) -> bool:
    """Whether a `TaskPlugin` defines `task`: the built-in survival task, or a task plug-in (an
    entry point value, "module:attr")."""
    return task == SURVIVAL or (task not in BUILTIN_TASKS and is_entry_point_value(task))


def task_plugin(task: str, key: str = "task") -> TaskPlugin:
    """The `TaskPlugin` of `task`: the built-in survival task, or the installed task plug-in
    whose entry point value is `task` (a class is instantiated)."""
    if task == SURVIVAL:
        return SurvivalTask()
    loaded = _registered(TASKS_GROUP, task, key)
    plugin = loaded() if isinstance(loaded, type) else loaded
    if not isinstance(plugin, TaskPlugin):
        raise DataError(
            f"{SECTION}.{key}: plug-in '{task}' is no task plug-in (it needs output_dim, loss, "
            "metrics, higher_is_better and selection)"
        )
    return plugin


def per_sample_loss_of(task: str) -> Callable[[Tensor, Tensor], Tensor] | None:
    """A task plug-in's per-row loss, or None when it defines none."""
    return getattr(task_plugin(task), "per_sample_loss", None)


@dataclass(frozen=True)
class LoadedData:
    """A plug-in's rows checked and as arrays: x (n, ...) float64, y (n,) or (n, k)."""

    x: np.ndarray
    y: np.ndarray
    task: str
    feature_names: tuple[str, ...]
    num_classes: int | None


def load_plugin_data(config: DataConfig) -> LoadedData:
    """Call the data section's registered `loader` with its `args` and check what it returns:
    shapes, finite values, its task (each refusal a DataError naming the key)."""
    assert config.loader is not None  # the policy requires it for plugin sources
    loader = _registered(DATASETS_GROUP, config.loader, "loader")
    where = f"{SECTION}.loader: data plug-in '{config.loader}'"
    try:
        returned = loader(**config.args)
    except Exception as error:  # arguments the loader refuses, its data missing, or a bug in it
        raise DataError(
            f"{where} failed with args {config.args}: {error} ({type(error).__name__})"
        ) from None
    if isinstance(returned, PluginDataset):
        returned = _materialised(returned, where)
    if not isinstance(returned, PluginData):
        raise DataError(
            f"{where} returned a {type(returned).__name__}, not a PluginData or PluginDataset"
        )
    x, y = _as_array(returned.x, "x", where), _as_array(returned.y, "y", where)
    if x.ndim < 2 or y.ndim not in (1, 2) or len(x) != len(y) or len(x) == 0:
        raise DataError(
            f"{where}: 'x' must have shape (n, ...) and 'y' shape (n,) or (n, k), n > 0, got "
            f"{x.shape} and {y.shape}"
        )
    for name, values in (("x", x), ("y", y)):
        if not np.isfinite(values).all():
            raise DataError(
                f"{where}: '{name}' holds {int((~np.isfinite(values)).sum())} "
                "non-finite values (NaN or inf)"
            )
    if returned.task not in BUILTIN_TASKS and not is_plugin_task(returned.task):
        raise DataError(
            f"{where} returns task '{returned.task}': not classification, regression or a "
            "task plug-in 'module:attr'"
        )
    task = config.task or returned.task
    if returned.task != task:
        raise DataError(
            f"{SECTION}.task: the section says {task}, but data plug-in '{config.loader}' "
            f"returns a {returned.task} task"
        )
    if y.ndim == 2 and not is_plugin_task(task):
        raise DataError(f"{where}: a {task} task needs 'y' of shape (n,), got {y.shape}")
    if task == "classification":
        if not np.array_equal(y, y.round()):
            raise DataError(f"{where}: a classification task needs integer class codes in 'y'")
        y = y.astype(np.int64)
    features = x[0].size
    names = returned.feature_names or tuple(f"x{i}" for i in range(features))
    if len(names) != features or len(set(names)) != len(names):
        raise DataError(
            f"{where}: feature_names must name each of the {features} features once, got "
            f"{len(names)} names"
        )
    return LoadedData(x, y, task, tuple(names), _num_classes(returned, y, task, where))


def _num_classes(returned: PluginData, y: np.ndarray, task: str, where: str) -> int | None:
    classes = returned.num_classes
    if classes is None:
        return None
    if task != "classification":
        raise DataError(f"{where}: num_classes applies to classification, not {task}")
    if classes < 2 or y.min() < 0 or y.max() >= classes:
        raise DataError(
            f"{where}: with num_classes {classes} (at least 2), 'y' must hold class codes "
            f"0..{classes - 1}"
        )
    return classes


def _as_array(values: Any, name: str, where: str) -> np.ndarray:
    if isinstance(values, Tensor):
        values = values.detach().cpu().numpy()
    try:
        return np.asarray(values, dtype=np.float64)
    except (TypeError, ValueError) as error:
        raise DataError(f"{where}: '{name}' is not an array of numbers: {error}") from None


def _materialised(returned: PluginDataset, where: str) -> PluginData:
    """The dataset's (x, y) pairs stacked into tensors (in memory)."""
    dataset = returned.dataset
    try:
        pairs = [dataset[i] for i in range(len(dataset))]  # type: ignore[arg-type]
        xs = torch.stack([torch.as_tensor(x, dtype=torch.float64) for x, _ in pairs])
        ys = torch.stack([torch.as_tensor(y, dtype=torch.float64) for _, y in pairs])
    except (TypeError, ValueError, RuntimeError) as error:
        raise DataError(
            f"{where}: its dataset must be a sized map-style Dataset of (x, y) pairs of equal "
            f"shapes: {error}"
        ) from None
    return PluginData(xs, ys, returned.task, returned.feature_names, returned.num_classes)
