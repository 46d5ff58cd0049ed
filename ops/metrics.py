"""Prometheus metrics of the coordinator and of the silo agents, and the HTTP endpoint that serves
them.

Each service owns its own `CollectorRegistry` (never prometheus_client's global one), so a
coordinator and several silo agents can live in one process without sharing a sample.
The coordinator's metrics follow the round engine as an observer (`CoordinatorMetrics.on_round`)
and are fed by the transport for bytes, rejections, connections and silo status; a silo agent
records its own tasks, bytes and rejections (`SiloMetrics`), and the epsilon its own privacy
ledger books (`fedsilo_silo_epsilon_spent{silo,deployment}` per job, `fedsilo_silo_epsilon_total`
and `fedsilo_silo_epsilon_remaining{silo}` over all jobs). Both export the days their own TLS
certificate has left, `fedsilo_certificate_expiry_days{party}`, read at each scrape, and the
process's own CPU, memory and file descriptors (prometheus_client's process and platform
collectors, on the service's registry).

The round and result series carry the job they belong to as `deployment` (the job's id; not
`job`, which Prometheus sets to the scrape job): the gauges hold the current job's values only,
the counters keep each job's. What is read at scrape time rather than pushed: each roster
silo's `fedsilo_silo_up` and `fedsilo_silo_heartbeat_age_seconds` (from the hub, `watch_silos`)
and the jobs on a serving coordinator's queue by status, `fedsilo_jobs` (`watch_jobs`); how jobs
ended is counted in `fedsilo_jobs_ended_total{status,reason}`, its reasons one of the fixed
`JOB_END_REASONS`.

It imports nothing of ours: it reads round records through the `RecordedRound` protocol, and
the coordinator's channel counts through its own `ChannelCounters` protocol
(coordinator/service.py), so no layer below ops/ imports this module.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import Any, Protocol
from wsgiref.simple_server import WSGIServer

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    start_http_server,
)
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# 0.01 s .. 1 h: a loopback phase on a toy model up to a long local epoch on a large one.
DURATION_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.1,
    0.25,
    0.5,
    1.0,
    2.5,
    5.0,
    10.0,
    30.0,
    60.0,
    120.0,
    300.0,
    600.0,
    1800.0,
    3600.0,
)
ROUND_STATUSES = ("completed", "failed")
DIRECTIONS = ("to_silo", "from_silo")
SILO_STATUSES = ("active", "retired", "revoked", "refused")
TRAIN_PHASE_MARKER = "train"  # a phase whose name contains this is a training phase
# A job's statuses (coordinator/jobs.py), and the only reasons `fedsilo_jobs_ended_total` counts
# each ended status with: a failure's reason is bucketed (ops/job_outcomes.py), never its text.
JOB_STATUSES = ("queued", "running", "completed", "failed", "refused", "aborted")
JOB_END_REASONS: Mapping[str, tuple[str, ...]] = {
    "completed": ("none",),
    "refused": ("silos",),  # too few silos accepted its policy, some refusing it
    "aborted": ("operator",),
    # consortium: too few silos joined, or the consortium cannot run it; rounds: its rounds kept
    # missing their quorum or its setup failed; policy: its policy does not check; storage:
    # the state file or results could not be written; internal: anything else (a bug)
    "failed": ("consortium", "rounds", "policy", "storage", "internal"),
}


class RecordedRound(Protocol):
    """What the metrics read of one round record (`fedsilo.coordinator.engine.RoundRecord`)."""

    @property
    def round(self) -> int: ...

    @property
    def status(self) -> str: ...

    @property
    def seconds(self) -> float: ...

    @property
    def phases(self) -> Mapping[str, Mapping[str, Any]]: ...

    @property
    def compute_seconds(self) -> Mapping[str, Mapping[str, float]]: ...

    @property
    def evaluation(self) -> Mapping[str, Mapping[str, float]] | None: ...

    @property
    def summary(self) -> Mapping[str, Mapping[str, float]] | None: ...

    @property
    def retired(self) -> Mapping[str, str] | None: ...

    @property
    def revoked(self) -> Sequence[str] | None: ...

    @property
    def privacy(self) -> Mapping[str, Mapping[str, Any]] | None: ...

    @property
    def client_epsilon(self) -> float | None: ...

    @property
    def mixing(self) -> Mapping[str, float] | None: ...


class CoordinatorMetrics:
    """The coordinator's view of a deployment: rounds, silos, traffic, rejections and results.

    Usable directly as a round-engine observer (`on_round`).
    """

    def __init__(self, registry: CollectorRegistry | None = None, deployment: str = "") -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.round = Gauge(
            "fedsilo_round", "Last completed round of the job.", ["deployment"], registry=r
        )
        self.rounds_planned = Gauge(
            "fedsilo_rounds_planned",
            "Rounds the job's policy plans.",
            ["deployment"],
            registry=r,
        )
        self.round_duration = Histogram(
            "fedsilo_round_duration_seconds",
            "Wall time of one round, evaluation included.",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.rounds = Counter(
            "fedsilo_rounds",
            "Rounds ended, by job and status.",
            ["deployment", "status"],
            registry=r,
        )
        self.silos_connected = Gauge(
            "fedsilo_silos_connected", "Silo agents connected now.", registry=r
        )
        self.bytes = Counter(
            "fedsilo_bytes",
            "Payload bytes exchanged with each silo, by direction.",
            ["direction", "silo"],
            registry=r,
        )
        self.dropouts = Counter(
            "fedsilo_dropouts",
            "Rounds of the job in which the silo dropped out of at least one phase.",
            ["silo", "deployment"],
            registry=r,
        )
        self.rejected = Counter(
            "fedsilo_rejected_messages",
            "Messages refused (unknown or revoked silo, replay, tampering, size, format).",
            ["reason"],
            registry=r,
        )
        self.silo_metric = Gauge(
            "fedsilo_silo_metric",
            "Last evaluation metric of each silo's test split; (noised) when "
            "fedsilo_metrics_noised is 1: a DP release, clipped into the metric's range.",
            ["silo", "name", "deployment"],
            registry=r,
        )
        self.summary_metric = Gauge(
            "fedsilo_summary_metric",
            "Last cross-silo summary of an evaluation metric (mean, worst, gini, ...); (noised) "
            "when fedsilo_metrics_noised is 1: computed from the clipped noised releases.",
            ["name", "statistic", "deployment"],
            registry=r,
        )
        self.metrics_noised = Gauge(
            "fedsilo_metrics_noised",
            "1 when the deployment's policy is DP: every metric its silos report is (noised), "
            "a Gaussian release shown clipped into the metric's range; 0 when exact.",
            ["deployment"],
            registry=r,
        )
        self.mixing_weight = Gauge(
            "fedsilo_mixing_weight",
            "Mixing schedules (DRFA, AFL, AAggFF, ...): each silo's coefficient after the last "
            "round (lambda, or the weight its update got).",
            ["silo", "deployment"],
            registry=r,
        )
        self.local_train_seconds = Histogram(
            "fedsilo_local_train_seconds",
            "Compute time silos report for their training tasks.",
            ["silo"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.silo_status = Gauge(
            "fedsilo_silo_status",
            "1 for each silo's current status (active, retired, revoked, refused), else 0.",
            ["silo", "status"],
            registry=r,
        )
        self.privacy_epsilon = Gauge(
            "fedsilo_privacy_epsilon",
            "Each silo's epsilon for the deployment, as it last reported it (+Inf: a release "
            "without noise).",
            ["silo", "deployment"],
            registry=r,
        )
        self.client_epsilon = Gauge(
            "fedsilo_client_dp_epsilon",
            "Client-level DP: the epsilon of the deployment's published model so far.",
            ["deployment"],
            registry=r,
        )
        self.epsilon_cap = Gauge(
            "fedsilo_privacy_epsilon_cap",
            "The policy's epsilon cap per silo for the deployment (a site may set a lower one).",
            ["deployment"],
            registry=r,
        )
        self.certificate_expiry = certificate_expiry_gauge(r)
        self.jobs_ended = Counter(
            "fedsilo_jobs_ended",
            "Jobs of a serving coordinator that ended, by status and a bucketed reason "
            "(completed: none; refused: silos; aborted: operator; failed: consortium, rounds, "
            "policy, storage or internal). Counted since the coordinator started.",
            ["status", "reason"],
            registry=r,
        )
        for status, reasons in JOB_END_REASONS.items():
            for reason in reasons:
                self.jobs_ended.labels(status, reason)
        self._scraped = _ScrapeTimeMetrics()
        r.register(self._scraped)
        add_process_collectors(r)
        self._deployment = ""
        self.deployment = deployment

    @property
    def deployment(self) -> str:
        """The job the round and result series are labelled with (its id)."""
        return self._deployment

    @deployment.setter
    def deployment(self, job: str) -> None:
        """A new job: the last job's gauges go (its counters stay); its round starts at 0."""
        if job != self._deployment:
            for gauge in (
                self.round,
                self.rounds_planned,
                self.silo_metric,
                self.summary_metric,
                self.mixing_weight,
            ):
                gauge.clear()
        self._deployment = job
        for status in ROUND_STATUSES:
            self.rounds.labels(job, status)
        self.round.labels(job).set(0)

    def watch_silos(
        self,
        heard_ages: Callable[[], Mapping[str, float | None]],
        heartbeat_window_s: float,
        revoked: Callable[[], Collection[str]] = frozenset,
    ) -> None:
        """Export, at each scrape, each roster silo's `fedsilo_silo_up` (1: heard within
        `heartbeat_window_s`) and `fedsilo_silo_heartbeat_age_seconds` from `heard_ages()`
        (seconds since each was last heard, None: never); `revoked()` silos are left out."""
        self._scraped.heard_ages = heard_ages
        self._scraped.heartbeat_window_s = heartbeat_window_s
        self._scraped.revoked = revoked

    def watch_jobs(self, count_by_status: Callable[[], Mapping[str, int]]) -> None:
        """Export, at each scrape, the jobs on the queue by status (`fedsilo_jobs`)."""
        self._scraped.count_jobs = count_by_status

    def count_job_ended(self, status: str, reason: str) -> None:
        """Count one job that ended `status` for `reason`, one of `JOB_END_REASONS[status]`."""
        _check_choice("job status", status, tuple(JOB_END_REASONS))
        _check_choice(f"reason of a {status} job", reason, JOB_END_REASONS[status])
        self.jobs_ended.labels(status, reason).inc()

    def watch_certificate(self, party: str, days_left: Callable[[], float]) -> None:
        """Export `days_left()` of `party`'s certificate (the coordinator's) at each scrape."""
        self.certificate_expiry.labels(party).set_function(days_left)

    def set_privacy(self, cap: float | None, noised: bool) -> None:
        """The running job's policy cap (nothing exported for a policy without one), and
        whether its metrics are noised releases."""
        if cap is not None:
            self.epsilon_cap.labels(self.deployment).set(cap)
        self.metrics_noised.labels(self.deployment).set(1 if noised else 0)

    # -- from the round engine ----------------------------------------------------------------

    def observe_round(self, record: RecordedRound, total_rounds: int) -> None:
        """Book one ended round: its status and duration, dropouts, compute times, results."""
        job = self.deployment
        self.rounds_planned.labels(job).set(total_rounds)
        self.rounds.labels(job, record.status).inc()
        self.round_duration.observe(record.seconds)
        if record.status == "completed":
            self.round.labels(job).set(record.round)
        revoked = set(record.revoked or ())
        for silo in _dropped_silos(record.phases) - revoked:  # a revoked silo is no dropout
            self.dropouts.labels(silo, job).inc()
        self._observe_train_seconds(record.compute_seconds)
        if record.evaluation is not None:
            _set_nested(self.silo_metric, record.evaluation, job)
        if record.summary is not None:
            _set_nested(self.summary_metric, record.summary, job)
        for silo in record.retired or {}:
            self.set_silo_status(silo, "retired")
        for silo in revoked:
            self.set_silo_status(silo, "revoked")
        for silo, reported in (record.privacy or {}).items():
            if _is_number(reported.get("epsilon")):
                self.privacy_epsilon.labels(silo, self.deployment).set(reported["epsilon"])
        if record.client_epsilon is not None:
            self.client_epsilon.labels(self.deployment).set(record.client_epsilon)
        if record.mixing is not None:
            self.set_mixing_weights(record.mixing)

    on_round = observe_round  # the `EngineObserver` signature

    def _observe_train_seconds(self, compute_seconds: Mapping[str, Mapping[str, float]]) -> None:
        for phase, per_silo in compute_seconds.items():
            if TRAIN_PHASE_MARKER not in phase:
                continue
            for silo, seconds in per_silo.items():
                if _is_number(seconds):
                    self.local_train_seconds.labels(silo).observe(seconds)

    # -- from the transport -------------------------------------------------------------------

    def count_bytes(self, direction: str, silo: str, n: int) -> None:
        """Count `n` payload bytes sent to ("to_silo") or received from ("from_silo") `silo`."""
        _check_choice("direction", direction, DIRECTIONS)
        self.bytes.labels(direction, silo).inc(n)

    def count_rejected(self, reason: str) -> None:
        """Count one refused message; `reason` is a short fixed code (e.g. "replay")."""
        self.rejected.labels(reason).inc()

    def set_connected(self, n: int) -> None:
        self.silos_connected.set(n)

    def set_silo_status(self, silo: str, status: str) -> None:
        """Mark `silo` as being in `status` (and in no other)."""
        _check_choice("silo status", status, SILO_STATUSES)
        for known in SILO_STATUSES:
            self.silo_status.labels(silo, known).set(1 if known == status else 0)

    def set_mixing_weights(self, weights: Mapping[str, float]) -> None:
        """Replace the mixing weights; silos absent from `weights` disappear from the metric."""
        self.mixing_weight.clear()
        for silo, weight in weights.items():
            self.mixing_weight.labels(silo, self.deployment).set(weight)


class SiloMetrics:
    """One silo agent's view: the tasks it ran, its traffic, its refusals and its connection."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.tasks = Counter(
            "fedsilo_silo_tasks",
            "Tasks handled, by kind and status.",
            ["kind", "status"],
            registry=r,
        )
        self.task_seconds = Histogram(
            "fedsilo_silo_task_seconds",
            "Wall time to handle one task, by kind.",
            ["kind"],
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.bytes = Counter(
            "fedsilo_silo_bytes",
            "Payload bytes exchanged with the coordinator, by direction.",
            ["direction"],
            registry=r,
        )
        self.rejected = Counter(
            "fedsilo_silo_rejected_messages",
            "Messages this silo refused (bad signature, replay, size, format, budget).",
            ["reason"],
            registry=r,
        )
        self.connected = Gauge(
            "fedsilo_silo_connected", "1 while connected to the coordinator, else 0.", registry=r
        )
        self.local_train_seconds = Histogram(
            "fedsilo_local_train_seconds",
            "Compute time of this silo's training tasks.",
            buckets=DURATION_BUCKETS,
            registry=r,
        )
        self.epsilon_spent = Gauge(
            "fedsilo_silo_epsilon_spent",
            "The epsilon this silo's privacy ledger books for the deployment (job) so far, after "
            "its last booking (+Inf: a release without noise; absent for a job without DP).",
            ["silo", "deployment"],
            registry=r,
        )
        self.epsilon_total = Gauge(
            "fedsilo_silo_epsilon_total",
            "This silo's epsilon over all the jobs its ledger books (their sum).",
            ["silo"],
            registry=r,
        )
        self.epsilon_remaining = Gauge(
            "fedsilo_silo_epsilon_remaining",
            "What the site's rules.total_epsilon_cap leaves of its epsilon over all jobs (never "
            "below 0; absent without a total cap).",
            ["silo"],
            registry=r,
        )
        self.certificate_expiry = certificate_expiry_gauge(r)
        add_process_collectors(r)

    def watch_certificate(self, party: str, days_left: Callable[[], float]) -> None:
        """Export `days_left()` of `party`'s certificate (this silo's) at each scrape."""
        self.certificate_expiry.labels(party).set_function(days_left)

    def set_epsilon(
        self,
        silo: str,
        deployment: str,
        spent: float | None,
        total: float,
        total_cap: float | None,
    ) -> None:
        """From the silo's ledger after a booking: what `deployment` spent (None: a job without
        DP, nothing exported), the silo's `total` over all jobs, and what `total_cap` (None:
        none, the remaining gauge is dropped) leaves of it."""
        if spent is not None:
            self.epsilon_spent.labels(silo, deployment).set(spent)
        self.epsilon_total.labels(silo).set(total)
        if total_cap is None:
            self.epsilon_remaining.clear()
        else:
            self.epsilon_remaining.labels(silo).set(max(total_cap - total, 0.0))

    def observe_task(self, kind: str, status: str, seconds: float) -> None:
        """Book one handled task of `kind` that ended with `status` after `seconds`."""
        self.tasks.labels(kind, status).inc()
        self.task_seconds.labels(kind).observe(seconds)

    def observe_local_train(self, seconds: float) -> None:
        self.local_train_seconds.observe(seconds)

    def count_bytes(self, direction: str, n: int) -> None:
        """Count `n` payload bytes sent ("from_silo") or received ("to_silo")."""
        _check_choice("direction", direction, DIRECTIONS)
        self.bytes.labels(direction).inc(n)

    def count_rejected(self, reason: str) -> None:
        """Count one refused message; `reason` is a short fixed code (e.g. "replay")."""
        self.rejected.labels(reason).inc()

    def set_connected(self, connected: bool) -> None:
        self.connected.set(1 if connected else 0)


class MetricsServer:
    """A running `/metrics` HTTP endpoint for one registry; `close()` frees its port."""

    def __init__(self, server: WSGIServer, thread: threading.Thread) -> None:
        self._server = server
        self._thread = thread
        self._closed = False
        self.host: str = server.server_address[0]
        self.port: int = server.server_address[1]

    @property
    def url(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self.port}/metrics"

    def close(self) -> None:
        """Stop serving and release the socket; closing twice is harmless."""
        if self._closed:
            return
        self._closed = True
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()

    def __enter__(self) -> MetricsServer:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


def serve_metrics(registry: CollectorRegistry, port: int, host: str = "127.0.0.1") -> MetricsServer:
    """Serve `registry` at http://host:port/metrics from a daemon thread; port 0 picks a free one.

    The default host is loopback: the samples name silos and show their results and timing, so
    expose them beyond this machine only on purpose.
    """
    server, thread = start_http_server(port, addr=host, registry=registry)
    return MetricsServer(server, thread)


def certificate_expiry_gauge(registry: CollectorRegistry) -> Gauge:
    return Gauge(
        "fedsilo_certificate_expiry_days",
        "Days until the party's TLS certificate expires (negative once it has), from its file "
        "as it is now: a renewed certificate shows at once.",
        ["party"],
        registry=registry,
    )


def add_process_collectors(registry: CollectorRegistry) -> None:
    """The process's CPU, memory, open files and start time (`process_*`, where the platform
    has /proc) and the Python that runs it (`python_info`), on `registry`."""
    ProcessCollector(registry=registry)
    PlatformCollector(registry=registry)


class _ScrapeTimeMetrics(Collector):
    """The coordinator's series computed at each scrape, so never stale: each roster silo's up
    and heartbeat age (from the hub) and the queue's jobs by status. Each family is exported
    (empty) before its source is watched; a source that fails leaves its family empty."""

    def __init__(self) -> None:
        self.heard_ages: Callable[[], Mapping[str, float | None]] | None = None
        self.heartbeat_window_s = 0.0
        self.revoked: Callable[[], Collection[str]] = frozenset
        self.count_jobs: Callable[[], Mapping[str, int]] | None = None

    def collect(self) -> list[Metric]:
        up = GaugeMetricFamily(
            "fedsilo_silo_up",
            "1 while the silo agent is heard from within the heartbeat window, else 0 (never "
            "heard, or silent); one per silo of the roster, revoked silos left out.",
            labels=["silo"],
        )
        age = GaugeMetricFamily(
            "fedsilo_silo_heartbeat_age_seconds",
            "Seconds since the coordinator last heard from the silo agent (absent until it is "
            "first heard); revoked silos left out.",
            labels=["silo"],
        )
        jobs = GaugeMetricFamily(
            "fedsilo_jobs",
            "Jobs on a serving coordinator's queue, by status (queued, running, completed, "
            "failed, refused, aborted).",
            labels=["status"],
        )
        for silo, heard in sorted(self._heard_ages().items()):
            fresh = heard is not None and heard <= self.heartbeat_window_s
            up.add_metric([silo], 1.0 if fresh else 0.0)
            if heard is not None:
                age.add_metric([silo], heard)
        counts = _called(self.count_jobs, None) if self.count_jobs is not None else None
        if counts is not None:
            for status in JOB_STATUSES:
                jobs.add_metric([status], float(counts.get(status, 0)))
        return [up, age, jobs]

    def _heard_ages(self) -> Mapping[str, float | None]:
        if self.heard_ages is None:
            return {}
        ages = _called(self.heard_ages, {})
        revoked = set(_called(self.revoked, ()))
        return {silo: heard for silo, heard in ages.items() if silo not in revoked}


def _called(source: Callable[[], Any], otherwise: Any) -> Any:
    """`source()`, or `otherwise` when it fails (a closed queue while the coordinator stops): a
    scrape never fails for one source."""
    try:
        return source()
    except Exception:  # noqa: BLE001
        return otherwise


def _dropped_silos(phases: Mapping[str, Mapping[str, Any]]) -> set[str]:
    """Every silo that dropped out of some phase of the round (once per round)."""
    return {silo for phase in phases.values() for silo in phase.get("dropped", {})}


def _set_nested(gauge: Gauge, values: Mapping[str, Mapping[str, float]], job: str) -> None:
    """Set gauge{outer, inner, job} for every number in `values`, skipping NaN and non-numbers."""
    for outer, inner_values in values.items():
        for inner, value in inner_values.items():
            if _is_number(value):
                gauge.labels(outer, inner, job).set(value)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not math.isnan(value)


def _check_choice(what: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"unknown {what} {value!r}; expected one of {list(choices)}")
