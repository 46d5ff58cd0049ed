"""Silo task handlers, shared by many strategies and looked up by the task's `kind`."""

from __future__ import annotations

from fedsilo.silo.tasks.base import TaskHandler
from fedsilo.silo.tasks.evaluate import evaluate, report_loss
from fedsilo.silo.tasks.init import initialise
from fedsilo.silo.tasks.scaling import feature_moments, standardise
from fedsilo.silo.tasks.train import train

TASK_HANDLERS: dict[str, TaskHandler] = {
    "init": initialise,
    "train": train,
    "evaluate": evaluate,
    "loss": report_loss,
    "feature_moments": feature_moments,
    "standardise": standardise,
}
