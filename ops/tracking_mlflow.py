"""The MLflow side of experiment tracking (ops/tracking.py): one run per job, written through
MLflow's own client, so any store MLflow reaches works (a tracking server over http(s), a
database; MLflow 3 keeps a local store in SQLite, `sqlite:///mlflow.db`).

A run is tagged with its job's id (`fedsilo.job`) and whether its metrics are noised releases
(`fedsilo.metrics_noised`); a deployment's job resumed after a restart finds its run by that tag
and goes on in it. In a local SQLite store the folder is made if it is missing, and the
artifacts of an experiment fedsilo creates go beside the database (`mlartifacts/<experiment>/`)
rather than into the working folder of whichever process opened it first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path

from mlflow import MlflowClient
from mlflow.entities import Metric, Param, RunStatus
from mlflow.utils.time import get_current_time_millis
from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

from fedsilo.coordinator.jobs import ABORTED, COMPLETED, FAILED, REFUSED
from fedsilo.ops.tracking import TrackedJob

JOB_TAG = "fedsilo.job"
NOISED_TAG = "fedsilo.metrics_noised"
LOCAL_SQLITE = "sqlite:///"
ARTIFACTS = "mlartifacts"
ENDED = {
    COMPLETED: RunStatus.FINISHED,
    FAILED: RunStatus.FAILED,
    REFUSED: RunStatus.FAILED,
    ABORTED: RunStatus.KILLED,
}
CUT = "..."  # ends a parameter longer than MLflow takes


class MlflowTracker:
    """A job's MLflow run (`run_id`) in the store of `client`."""

    def __init__(self, client: MlflowClient, run_id: str) -> None:
        self.client, self.run_id = client, run_id

    @classmethod
    def open(cls, uri: str, job: TrackedJob) -> MlflowTracker:
        """`job`'s run in the store at `uri`, in its experiment (made if missing): the run of
        the same job id when `job.resume` and there is one, else a new one."""
        database = _local_database(uri)
        if database is not None:
            database.parent.mkdir(parents=True, exist_ok=True)
            uri = f"{LOCAL_SQLITE}{database}"
        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name(job.experiment)
        if experiment is not None:
            experiment_id = experiment.experiment_id
        else:
            beside = database.parent / ARTIFACTS / job.experiment if database else None
            experiment_id = client.create_experiment(
                job.experiment, artifact_location=beside.as_uri() if beside else None
            )
        earlier = (
            client.search_runs([experiment_id], f"tags.`{JOB_TAG}` = '{job.id}'", max_results=1)
            if job.resume
            else []
        )
        if earlier:
            run_id = earlier[0].info.run_id
            client.update_run(run_id, status=RunStatus.to_string(RunStatus.RUNNING))
        else:
            tags = {JOB_TAG: job.id, NOISED_TAG: str(job.noised).lower()}
            run_id = client.create_run(experiment_id, run_name=job.id, tags=tags).info.run_id
        return cls(client, run_id)

    def log_params(self, params: Mapping[str, str]) -> None:
        self.client.log_batch(
            self.run_id, params=[Param(key, _fitted(value)) for key, value in params.items()]
        )

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        now = get_current_time_millis()
        self.client.log_batch(
            self.run_id,
            metrics=[Metric(key, value, now, step) for key, value in metrics.items()],
        )

    def log_artifacts(self, folder: Path, files: Sequence[Path]) -> None:
        for name in files:
            parent = name.parent.as_posix()
            self.client.log_artifact(
                self.run_id, str(folder / name), None if parent == "." else parent
            )

    def end(self, status: str) -> None:
        self.client.set_terminated(self.run_id, RunStatus.to_string(ENDED[status]))


def _local_database(uri: str) -> Path | None:
    """The absolute path of a local SQLite store's database (`sqlite:///mlflow.db` is relative
    to the working folder, `sqlite:////srv/mlflow.db` absolute), or None for another store."""
    if not uri.startswith(LOCAL_SQLITE) or "?" in uri:
        return None
    path = uri[len(LOCAL_SQLITE) :]
    return Path(path).resolve() if path and path != ":memory:" else None


def _fitted(value: str) -> str:
    """A parameter's value within MLflow's length limit (a longer one cut, ending in `...`)."""
    if len(value) <= MAX_PARAM_VAL_LENGTH:
        return value
    return value[: MAX_PARAM_VAL_LENGTH - len(CUT)] + CUT
