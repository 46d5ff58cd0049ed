"""Experiment tracking: each job's parameters, rounds and results streamed to MLflow or
TensorBoard, as `--track` asks on `simulate`, `coordinator start` and `coordinator serve`
(docs/how-to/tracking.md).

Only what the coordinator already holds is tracked, nothing more is asked of a silo: the policy
(flattened, `training.lr`) with the job's id and the policy's digest as parameters; per round,
with the round as the step, whether it completed (`round/completed`), its cross-silo summary of
the silos' test metrics (`accuracy/weighted_mean`, coordinator/summary.py) and each silo's
epsilon where the record carries it (`epsilon/<silo>`, under DP) or the published model's
(`client_epsilon`, client-level DP); at the end, the job's results folder but the silos' ledgers.
Metrics are the ones shown everywhere else (ops/shown_metrics.py): under a DP policy every
summary is of noised releases, clipped into range, and its name starts with `noised/` in both
backends.

A job is one MLflow run (its experiment: the consortium of a deployment, the policy's name for a
simulation; a deployment's job resumed after a restart goes on in its run) and one TensorBoard
folder, `DIR/<job id>`. Tracking never breaks a job: a tracker that fails logs one warning and
is dropped, the job and the other trackers go on. The libraries load only when a target of
theirs is asked for (ops/tracking_mlflow.py, ops/tracking_tensorboard.py).
"""

from __future__ import annotations

import importlib
import json
import logging
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

import click

from fedsilo import __version__
from fedsilo.coordinator.engine import RoundRecord, RunHistory
from fedsilo.coordinator.jobs import ABORTED, COMPLETED, FAILED
from fedsilo.coordinator.state import digest_policy
from fedsilo.ops.job_id import job_id
from fedsilo.ops.report import LEDGERS, MARKER
from fedsilo.ops.shown_metrics import MetricDisplay
from fedsilo.policies.schema import Policy

log = logging.getLogger("fedsilo.tracking")

MLFLOW, TENSORBOARD = "mlflow", "tensorboard"
# MLflow 3's own default store (its file store is in maintenance mode and refused by default)
DEFAULT_MLFLOW_URI = "sqlite:///mlflow.db"
MLFLOW_URI_VARIABLE = "MLFLOW_TRACKING_URI"
DATABASE_SCHEMES = ("sqlite", "postgresql", "mysql", "mssql")  # MLflow's SQLAlchemy stores
INSTALL = "pip install 'fedsilo[tracking]'"
NOISED = "noised/"  # the prefix of every metric that is a noised release (a DP policy)
ROUND_COMPLETED = "completed"  # a round's status (RoundRecord), else failed
FINAL = "final"  # the status of a final evaluation's record after an unevaluated last round
UNSAFE_NAME = re.compile(r"[^\w.\- /]")  # what MLflow refuses in a metric's name
TRACK_HELP = (
    "Stream each job's policy, per-round metrics and results to mlflow (the store at "
    f"${MLFLOW_URI_VARIABLE}, else {DEFAULT_MLFLOW_URI}), mlflow:URI or tensorboard:DIR; "
    f"repeatable. Needs {INSTALL}."
)


class TrackError(ValueError):
    """A `--track` value that names no tracking target."""


@dataclass(frozen=True)
class TrackTarget:
    """Where a job is tracked: `kind` (mlflow or tensorboard) and its `location` (an MLflow
    tracking URI, a TensorBoard folder)."""

    kind: str
    location: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.location}"


def parse_target(value: str) -> TrackTarget:
    """The target `--track VALUE` names: `mlflow`, `mlflow:URI` or `tensorboard:DIR`."""
    kind, colon, location = value.partition(":")
    if kind == MLFLOW and not colon:
        return TrackTarget(MLFLOW, os.environ.get(MLFLOW_URI_VARIABLE) or DEFAULT_MLFLOW_URI)
    if kind in (MLFLOW, TENSORBOARD) and location.strip():
        return TrackTarget(kind, location)
    raise TrackError(
        f"--track {value}: give mlflow, mlflow:URI (e.g. mlflow:{DEFAULT_MLFLOW_URI}) or "
        "tensorboard:DIR"
    )


def missing_packages(target: TrackTarget) -> str | None:
    """What `target` needs that is not installed, as one line saying how to install it."""
    needs = {MLFLOW: {"mlflow": "mlflow-skinny"}, TENSORBOARD: {"tensorboard": "tensorboard"}}[
        target.kind
    ]
    if target.kind == MLFLOW and _scheme(target.location) in DATABASE_SCHEMES:
        needs |= {"sqlalchemy": "sqlalchemy", "alembic": "alembic"}
    missing = [package for module, package in needs.items() if not _importable(module)]
    if not missing:
        return None
    packages = " and ".join(missing) + (" package" if len(missing) == 1 else " packages")
    return f"--track {target.kind} needs the {packages}: {INSTALL}"


def _scheme(uri: str) -> str:
    """A URI's scheme without its driver (`postgresql+psycopg2://` is postgresql's)."""
    return uri.partition(":")[0].partition("+")[0]


def _importable(module: str) -> bool:
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


def _track_targets(
    ctx: click.Context, param: click.Parameter, values: Sequence[str]
) -> tuple[TrackTarget, ...]:
    """`--track`'s callback: each value parsed and its packages there, else one message naming
    the option and exit status 1."""
    try:
        targets = tuple(parse_target(value) for value in values)
    except TrackError as exc:
        raise click.ClickException(str(exc)) from None
    for target in dict.fromkeys(targets):
        problem = missing_packages(target)
        if problem is not None:
            raise click.ClickException(problem)
    return targets


def track_option(command: Callable[..., Any]) -> Callable[..., Any]:
    """`--track TARGET` (repeatable; the targets go to `track`)."""
    return click.option(
        "--track",
        "track",
        multiple=True,
        metavar="TARGET",
        callback=_track_targets,
        help=TRACK_HELP,
    )(command)


@dataclass(frozen=True)
class TrackedJob:
    """What names a job's run: its `experiment`, its `id` (the run's name, the TensorBoard
    folder's), whether a run of that id goes on when there is one (`resume`: a deployment's job,
    resumed after a restart; each simulation is a run of its own) and whether its metrics are
    `noised` releases."""

    experiment: str
    id: str
    resume: bool
    noised: bool


class Tracker(Protocol):
    """One job's run in one tracking backend."""

    def log_params(self, params: Mapping[str, str]) -> None: ...

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None: ...

    def log_artifacts(self, folder: Path, files: Sequence[Path]) -> None:
        """`files`, relative to `folder`, kept with the run under the same relative paths."""
        ...

    def end(self, status: str) -> None:
        """The job ended `status` (completed, failed, refused or aborted)."""
        ...


def open_tracker(target: TrackTarget, job: TrackedJob) -> Tracker:
    """`job`'s run at `target`, its backend's library loaded now."""
    if target.kind == MLFLOW:
        from fedsilo.ops.tracking_mlflow import MlflowTracker

        return MlflowTracker.open(target.location, job)
    from fedsilo.ops.tracking_tensorboard import TensorBoardTracker

    return TensorBoardTracker.open(Path(target.location), job)


@dataclass
class JobTracking:
    """One job's trackers, fed by the round engine as an observer (`on_round`, each round as it
    is recorded, in a simulation and a deployment alike) and told how the job ended (`finish`,
    `end`; as a context manager, an exception ends it failed). A tracker that raises is logged
    once and dropped."""

    display: MetricDisplay = field(default_factory=MetricDisplay)
    trackers: list[tuple[TrackTarget, Tracker]] = field(default_factory=list)

    @classmethod
    def start(
        cls, targets: Sequence[TrackTarget], job: TrackedJob, policy: Policy, digest: str
    ) -> JobTracking:
        """`job`'s run opened at every target, the policy (whose digest is `digest`) logged."""
        tracking = cls(MetricDisplay.of(policy.privacy))
        for target in dict.fromkeys(targets):
            try:
                tracking.trackers.append((target, open_tracker(target, job)))
            except Exception as exc:  # noqa: BLE001 (tracking never breaks a job)
                _warn(target, f"opening job {job.id}'s run", exc)
        params = job_parameters(policy, job.id, digest)
        tracking._each("logging the parameters", lambda tracker: tracker.log_params(params))
        return tracking

    def on_round(self, record: RoundRecord, total_rounds: int) -> None:
        metrics = round_metrics(self.display.record(record), self.display.noised)
        self._each(
            f"logging round {record.round}",
            lambda tracker: tracker.log_metrics(metrics, record.round),
        )

    def finish(self, history: RunHistory, results: Path | None) -> None:
        """The job completed: its final evaluation (when it ran after the last round), its
        `results` folder (if any) and its end."""
        final = history.final
        if final.status == FINAL:
            metrics = round_metrics(self.display.record(final), self.display.noised)
            self._each(
                "logging the final evaluation",
                lambda tracker: tracker.log_metrics(metrics, final.round),
            )
        self.end(COMPLETED, results)

    def end(self, status: str, results: Path | None = None) -> None:
        """The job ended `status`, with the results in `results` (if that folder exists); the
        trackers closed. Once only: later calls do nothing."""
        if results is not None and results.is_dir():
            files = result_files(results)
            self._each(
                "logging the results",
                lambda tracker: tracker.log_artifacts(results, files),
            )
        self._each(f"ending the run {status}", lambda tracker: tracker.end(status))
        self.trackers.clear()

    def __enter__(self) -> JobTracking:
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        if kind is None:
            self.end(COMPLETED)
        else:  # a stop (a signal, Ctrl-C) leaves a deployment's job to resume: aborted
            self.end(FAILED if issubclass(kind, Exception) else ABORTED)

    def _each(self, doing: str, call: Callable[[Tracker], None]) -> None:
        for target, tracker in list(self.trackers):
            try:
                call(tracker)
            except Exception as exc:  # noqa: BLE001 (tracking never breaks a job)
                _warn(target, doing, exc)
                self.trackers.remove((target, tracker))


def _warn(target: TrackTarget, doing: str, exc: BaseException) -> None:
    while exc.__cause__ is not None:  # the root cause says it best (a store's database error)
        exc = exc.__cause__
    lines = str(exc).strip().splitlines()
    reason = f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__
    log.warning(
        "tracking to %s stopped (%s failed: %s); the job goes on without it", target, doing, reason
    )


def simulation_tracking(targets: Sequence[TrackTarget], policy: Policy) -> JobTracking:
    """The tracking of one simulated `policy`: a run of its own in the experiment named like the
    policy, named by the job id the policy would have deployed."""
    digest = digest_policy(policy)
    job = TrackedJob(
        policy.name,
        job_id(policy.name, digest),
        resume=False,
        noised=policy.privacy.differentially_private,
    )
    return JobTracking.start(targets, job, policy, digest)


def deployment_tracking(
    targets: Sequence[TrackTarget], consortium: str, job: str, policy: Policy, digest: str
) -> JobTracking:
    """The tracking of deployed job `job` (its policy signed with `digest`) of `consortium`, in
    its run (the one it had before a restart)."""
    tracked = TrackedJob(consortium, job, resume=True, noised=policy.privacy.differentially_private)
    return JobTracking.start(targets, tracked, policy, digest)


def job_parameters(policy: Policy, job: str, digest: str) -> dict[str, str]:
    """The policy's keys flattened (`training.lr`; a value as JSON, a string as itself), with the
    job's id, the policy's digest and fedsilo's version under `fedsilo.`, a key no policy has."""
    return {
        **dict(_flattened(policy.model_dump(mode="json"))),
        "fedsilo.job": job,
        "fedsilo.policy_digest": digest,
        "fedsilo.version": __version__,
    }


def _flattened(value: Any, prefix: str = "") -> Iterator[tuple[str, str]]:
    if isinstance(value, dict) and value:
        for key, inner in value.items():
            yield from _flattened(inner, f"{prefix}.{key}" if prefix else str(key))
    else:
        yield prefix, value if isinstance(value, str) else json.dumps(value)


def round_metrics(record: RoundRecord, noised: bool) -> dict[str, float]:
    """A round's tracked metrics: `round/completed` (1 or 0; not for a final evaluation), each
    summary statistic of each metric (`accuracy/mean`, prefixed `noised/` when `noised`) and
    each silo's reported epsilon (`epsilon/<silo>`) and the published model's
    (`client_epsilon`), where the record has them."""
    metrics: dict[str, float] = {}
    if record.status != FINAL:
        metrics["round/completed"] = float(record.status == ROUND_COMPLETED)
    prefix = NOISED if noised else ""
    for name, summary in sorted((record.summary or {}).items()):
        for statistic, value in summary.items():
            metrics[f"{prefix}{metric_name(name)}/{statistic}"] = float(value)
    for silo, reported in sorted((record.privacy or {}).items()):
        if reported.get("epsilon") is not None:
            metrics[f"epsilon/{metric_name(silo)}"] = float(reported["epsilon"])
    if record.client_epsilon is not None:
        metrics["client_epsilon"] = float(record.client_epsilon)
    return metrics


def metric_name(name: str) -> str:
    """`name` as both backends take it: a character MLflow refuses (`@` of SuPerFed's
    `accuracy@0.50`) becomes `_`."""
    return UNSAFE_NAME.sub("_", name)


def result_files(folder: Path) -> list[Path]:
    """Every file of a results folder, relative to it, but the silos' own ledgers (a
    simulation's `ledgers/`) and fedsilo's marker."""
    return [
        path.relative_to(folder)
        for path in sorted(folder.rglob("*"))
        if path.is_file() and path.relative_to(folder).parts[0] != LEDGERS and path.name != MARKER
    ]
