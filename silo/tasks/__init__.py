"""Silo task handlers, shared by many strategies and looked up by the task's `kind`, and what
each kind releases (`TASK_RELEASES`), which the agent books and checks against its budget."""

from __future__ import annotations

from fedsilo.silo.tasks.base import ReleasePlan, TaskHandler
from fedsilo.silo.tasks.evaluate import evaluate, evaluate_releases, loss_releases, report_loss
from fedsilo.silo.tasks.init import initialise, public_release
from fedsilo.silo.tasks.scaling import feature_moments, moments_releases, standardise
from fedsilo.silo.tasks.train import train, train_releases

TASK_HANDLERS: dict[str, TaskHandler] = {
    "init": initialise,
    "train": train,
    "evaluate": evaluate,
    "loss": report_loss,
    "feature_moments": feature_moments,
    "standardise": standardise,
}

TASK_RELEASES: dict[str, ReleasePlan] = {
    "init": public_release,
    "train": train_releases,
    "evaluate": evaluate_releases,
    "loss": loss_releases,
    "feature_moments": moments_releases,
    "standardise": public_release,
}
