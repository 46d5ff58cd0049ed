"""The commands of `fedsilo` itself, loaded when one of them runs (ops/cli.py lists them
lazily): `policy validate` and `policy sign`, `algorithms`, `simulate`, `coordinator start |
serve | revoke`, `demo` and `status`.

Every user error (policy, data, device, an option out of range, a run that cannot go on or
whose every round failed) is printed as one clear message naming the field, option or file,
and exits with status 1 before anything is written; an output folder is never deleted.
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Mapping
from contextlib import ExitStack
from importlib.resources import as_file, files
from pathlib import Path
from typing import TYPE_CHECKING

import click
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

import fedsilo.ops.openmp  # noqa: F401 (first, before torch loads: see the module)
from fedsilo.coordinator.engine import RoundRecord, RunAborted
from fedsilo.coordinator.hub import DEFAULT_HEARTBEAT_WINDOW_S
from fedsilo.coordinator.staggered_sends import SEND_MODES
from fedsilo.coordinator.strategies import STRATEGIES
from fedsilo.ops.backends import BACKENDS, IN_PROCESS, RAY, BackendError
from fedsilo.ops.cli_support import (
    DEPLOYMENT_ERRORS,
    USER_ERRORS,
    console,
    health_file_option,
    host_and_port,
    start_service,
    stop_on_signals,
    user_message,
    within,
)
from fedsilo.ops.coordinator_process import (
    CoordinatorOptions,
    revoke,
    run_coordinator,
)
from fedsilo.ops.coordinator_serve import ServeOptions, serve_coordinator
from fedsilo.ops.cross_site_view import print_simulated
from fedsilo.ops.demo import DemoFailed, run_demo
from fedsilo.ops.job_cli import coordinator_option, print_json, print_remote_status
from fedsilo.ops.options import kit_option
from fedsilo.ops.plan_cli import consortium_plans, over_policy_cap, planned_line, validate_line
from fedsilo.ops.provision import OPERATOR, KitError, kit_role, load_coordinator_kit
from fedsilo.ops.provision_cli import policy_sign as sign_command
from fedsilo.ops.report import (
    OutputFolderError,
    check_output_folder,
    comparison_table,
    fmt_metric,
    write_results,
)
from fedsilo.ops.shown_metrics import MetricDisplay, ShownRounds
from fedsilo.ops.status import certificate_status, state_file_document
from fedsilo.ops.status_view import print_certificate, print_consortium
from fedsilo.ops.tracking import JobTracking, TrackTarget, simulation_tracking, track_option
from fedsilo.policies.loading import (
    PolicyError,
    load_policy,
    policy_folder,
    with_algorithm,
    with_overrides,
)
from fedsilo.policies.schema import MAX_SEED, Policy

if TYPE_CHECKING:
    from fedsilo.ops.simulate import SimulationResult

DEFAULT_POLICY = "examples/heart-fedavg.yaml"
SQLITE_HEADER = b"SQLite format 3\x00"
MAX_SECONDS = 7 * 24 * 3600.0
OVERWRITE_HELP = "Replace an --out folder of earlier fedsilo results (nothing else is deleted)."


def check_state_file(path: Path) -> None:
    """Refuse a --state path that exists but is not a SQLite file (a new path is fine)."""
    if path.exists() and not path.is_file():
        raise click.ClickException(f"--state {path}: not a file")
    if path.is_file() and path.stat().st_size:
        with path.open("rb") as handle:
            header = handle.read(len(SQLITE_HEADER))
        if header != SQLITE_HEADER:
            raise click.ClickException(
                f"--state {path}: not a fedsilo state file (not an SQLite database); give the "
                "coordinator's state file, or a new path for a new deployment"
            )


@click.group()
def policy() -> None:
    """Work with policy files."""


@policy.command("validate")
@click.argument(
    "files", metavar="FILE...", nargs=-1, required=True, type=click.Path(path_type=Path)
)
def validate(files: tuple[Path, ...]) -> None:
    """Check each FILE against the policy schema and say what it selects; where its data is on
    this machine, also check the consortium it makes as `simulate` would. Every FILE is
    checked; one that fails is one error line, and the status is 1 if any failed."""
    failed = 0
    for file in files:
        try:
            _validate(file)
        except click.ClickException as exc:
            if len(files) == 1:
                raise
            failed += 1
            click.echo(f"Error: {exc.format_message()}", err=True)
    if failed:
        raise click.ClickException(f"{failed} of {len(files)} policies failed")


def _validate(file: Path) -> None:
    loaded = _load(file)
    from fedsilo.ops.model_cli import plugin_report, warm_start_report  # the model zoo's checks
    from fedsilo.ops.simulate import consortium_report  # the silo side: data, Opacus

    try:
        consortium = consortium_report(loaded, policy_folder(file))
    except USER_ERRORS as exc:
        raise click.ClickException(f"{file}: {user_message(exc)}") from None
    warm_start = warm_start_report(loaded, file)
    console.print(
        f"[green]OK[/green] {file}: policy '{loaded.name}' (version {loaded.version}), "
        f"algorithm {loaded.algorithm.name}, model {loaded.model.name}, {loaded.rounds} rounds, "
        f"data {loaded.data.source}"
    )
    click.echo(consortium)
    try:
        planned = validate_line(loaded, policy_folder(file))
    except USER_ERRORS as exc:
        raise click.ClickException(f"{file}: {user_message(exc)}") from None
    if planned is not None:
        click.echo(planned)
    for line in [*warm_start, *plugin_report(loaded, file)]:
        click.echo(line)


@click.command("algorithms")
def algorithms() -> None:
    """List the algorithms a policy may select."""
    from fedsilo.policies.algorithms.plugins import installed_algorithms, plugin_config_class

    rows = {
        name: (cls.__doc__ or cls.__module__).strip().splitlines()[0]
        for name, cls in STRATEGIES.items()
    }
    for point in installed_algorithms():
        if point.name in rows:
            continue  # a built-in name always means the built-in algorithm
        package = f"{point.dist.name} {point.dist.version}" if point.dist else point.value
        try:
            config = plugin_config_class(point.name, list(STRATEGIES))
            summary = (config.__doc__ or point.value).strip().splitlines()[0]
        except ValueError as error:
            summary = f"cannot be used here: {error}"
        rows[point.name] = f"{summary} (strategy plug-in, {package})"
    width = max(len(name) for name in rows)
    for name, summary in rows.items():
        console.print(f"{name:{width}s}  {summary}", highlight=False, soft_wrap=True)


@click.command("simulate")
@click.option(
    "--policy",
    "policy_file",
    type=click.Path(path_type=Path),
    help="Policy YAML (default: FedAvg on the bundled four-hospital heart data).",
)
@click.option(
    "--silos",
    type=int,
    callback=within(1, 10_000),
    help="Override the number of silos (simulated partitions only).",
)
@click.option("--seed", type=int, callback=within(0, MAX_SEED), help="Override the policy's seed.")
@click.option(
    "--out", type=click.Path(path_type=Path), help="Output folder (default: runs/<policy name>)."
)
@click.option("--overwrite", is_flag=True, help=OVERWRITE_HELP)
@click.option(
    "--compare",
    "compare",
    multiple=True,
    type=click.Choice(sorted(STRATEGIES)),
    help="Also run this algorithm on the same silos, side by side (repeatable).",
)
@click.option(
    "--backend",
    type=click.Choice(BACKENDS),
    default=IN_PROCESS,
    show_default=True,
    help="Where the silos run: in this process, or as Ray actors (pip install 'fedsilo[ray]'; "
    "per-silo CPUs/GPUs/memory from the policy's compute.resources). Same results bit for bit.",
)
@click.option(
    "--address",
    help="With --backend ray: the Ray cluster to join (as `ray start --head` printed it, or "
    "auto); default: a local Ray instance with this machine's CPUs.",
)
@track_option
def simulate_command(
    policy_file: Path | None,
    silos: int | None,
    seed: int | None,
    out: Path | None,
    overwrite: bool,
    compare: tuple[str, ...],
    backend: str,
    address: str | None,
    track: tuple[TrackTarget, ...],
) -> None:
    """Run a consortium (in this process, or on Ray) and write results, tables and plots."""
    from fedsilo.ops.ray_backend import import_ray, ray_session  # the silo side: data, Opacus
    from fedsilo.ops.simulate import load_silos

    if address and backend != RAY:
        raise click.ClickException("--address: only with --backend ray")
    if backend == RAY:
        try:
            import_ray()  # before anything runs: without Ray, how to install it
        except BackendError as exc:
            raise click.ClickException(str(exc)) from None

    base = _load(policy_file) if policy_file else _default_policy()
    base_dir = policy_folder(policy_file) if policy_file else None
    out = out or Path("runs") / base.name
    try:
        base = with_overrides(base, seed, silos)
        variants = {base.algorithm.name: base}
        variants.update({n: with_algorithm(base, n) for n in compare if n not in variants})
        check_output_folder(out, overwrite)
        datasets = load_silos(base, base_dir)
        _plan_before_running(variants, datasets)
        with ExitStack() as tracked:  # each run ends failed unless its results are logged
            tracking = {
                name: tracked.enter_context(simulation_tracking(track, variant))
                for name, variant in variants.items()
            }
            with ExitStack() as stack:
                if backend == RAY:
                    stack.enter_context(ray_session(address))  # one session for every variant
                results = _run_all(variants, datasets, backend, tracking)
            _require_an_evaluated_round(results)
            write_results(out, results, overwrite)
            for name, result in results.items():
                tracking[name].finish(result.history, out / name if len(results) > 1 else out)
    except USER_ERRORS as exc:
        raise click.ClickException(user_message(exc)) from None
    first = next(iter(results.values()))
    console.print(f"device: {first.device}")
    console.print(comparison_table(results))
    print_simulated(console, results)
    for name, result in results.items():
        for note in (result.history.failed_note(), _diverged_note(result)):
            if note is not None:
                console.print(f"[yellow]Note:[/yellow] {name}: {note}", highlight=False)
    _explain_label_rates(first)
    console.print(f"results in {out}/")


def _plan_before_running(variants: dict[str, Policy], datasets: list) -> None:
    """Each DP variant's planned epsilon per silo, printed before round 1; a RunAborted, before
    anything runs or is written, where a silo's plan is above the policy's
    privacy.epsilon_cap (the silo would refuse the job)."""
    from fedsilo.ops.simulate import check_consortium

    for name, variant in variants.items():
        if not variant.privacy.differentially_private:
            continue
        check_consortium(variant, datasets)  # what `simulate` checks first, before planning
        plans = consortium_plans(variant, datasets)
        line = planned_line(plans)
        if line is not None:
            shown = line if len(variants) == 1 else f"{name}: {line}"
            console.print(shown, highlight=False, soft_wrap=True)
        problem = over_policy_cap(variant, plans)
        if problem is not None:
            raise RunAborted(f"{name}: {problem}; nothing run, nothing written")


def _run_all(
    variants: dict[str, Policy],
    datasets: list,
    backend: str,
    tracking: Mapping[str, JobTracking],
) -> dict[str, SimulationResult]:
    """Each variant simulated, its rounds shown on its progress bar and tracked (`tracking`)."""
    from fedsilo.ops.simulate import simulate

    results: dict[str, SimulationResult] = {}
    with Progress(*_progress_columns(), console=console) as progress:
        for name, variant in variants.items():
            bar = progress.add_task(name, total=variant.rounds, status="")
            display = MetricDisplay.of(variant.privacy)
            results[name] = simulate(
                variant,
                datasets,
                observers=[
                    ShownRounds(_ProgressObserver(progress, bar, display), display),
                    tracking[name],
                ],
                backend=backend,
            )
    return results


def _require_an_evaluated_round(results: dict[str, SimulationResult]) -> None:
    """A run with no round that trained and evaluated (every round failed, or left a model
    that cannot be evaluated) has no result to write: its first error is the message."""
    for name, result in results.items():
        history = result.history
        rounds = [r for r in history.records if r.round > 0]  # round 0: the setup
        completed = any(r.status == "completed" for r in rounds)
        if completed and (any(r.evaluation for r in rounds) or history.final.evaluation):
            continue
        first = next((r for r in rounds if r.error), None)
        cause = f"; round {first.round}: {first.error}" if first else ""
        raise RunAborted(
            f"{name}: every round failed (none trained and evaluated), nothing written{cause}"
        )


def _progress_columns() -> tuple:
    return (
        TextColumn("{task.description:>10}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[status]}"),
        TimeElapsedColumn(),
    )


class _ProgressObserver:
    """The progress bar's status: a round's mean metric, as shown (`ShownRounds`)."""

    def __init__(self, progress: Progress, bar: object, display: MetricDisplay) -> None:
        self.progress, self.bar, self.display = progress, bar, display

    def on_round(self, record: RoundRecord, total_rounds: int) -> None:
        status = f"round {record.round} {record.status}"
        if record.summary:
            metric = "accuracy" if "accuracy" in record.summary else next(iter(record.summary))
            status += f"  mean {self.display.label(metric)} {record.summary[metric]['mean']:.3f}"
        self.progress.update(self.bar, advance=1, status=status)


def _diverged_note(result: SimulationResult) -> str | None:
    """One line naming the silos whose final headline metric is not finite (the model's
    outputs overflow there: a training that diverged), or None."""
    metric = result.headline_metric
    final = result.history.final.evaluation or {}
    lost = sorted(s for s, m in final.items() if not math.isfinite(m.get(metric, math.nan)))
    if not lost:
        return None
    return (
        f"the final {metric} is not finite at {', '.join(lost)}: the model's outputs overflow "
        "there, a training that diverged (a smaller training.lr or other optimizer settings "
        "may help)"
    )


def _explain_label_rates(result: SimulationResult) -> None:
    rates = [p.positive_rate for p in result.silos if p.positive_rate is not None]
    if len(rates) >= 2 and max(rates) - min(rates) > 0.2:
        console.print(
            "Note: the silos' positive-label rates range from "
            f"{min(rates):.0%} to {max(rates):.0%}. "
            "A local model learns its own silo's base rate, so local-only training can rival one "
            "shared model; personalised methods (e.g. SuPerFed) exist for exactly this."
        )


def _load(file: Path) -> Policy:
    try:
        return load_policy(file)
    except PolicyError as exc:
        raise click.ClickException(str(exc)) from None


def _default_policy() -> Policy:
    with as_file(files("fedsilo.policies") / DEFAULT_POLICY) as path:
        return _load(path)


policy.add_command(sign_command)


@click.group()
def coordinator() -> None:
    """Run and administer the coordinator of a consortium."""


coordinator_kit_option = kit_option("The coordinator kit.")
metrics_port_option = click.option(
    "--metrics-port",
    type=int,
    callback=within(1, 65535),
    help="Serve Prometheus metrics on PORT (of --metrics-host).",
)
silo_poll_option = click.option(
    "--poll-seconds",
    default=5.0,
    show_default=True,
    callback=within(0.01, 3600),
    help="Long-poll window for silos.",
)
heartbeat_window_option = click.option(
    "--heartbeat-window",
    "heartbeat_window_s",
    default=DEFAULT_HEARTBEAT_WINDOW_S,
    show_default=True,
    callback=within(1.0, 3600),
    help="Seconds without a silo's heartbeat after which it is a dropout (it beats 4x as often).",
)
max_payload_option = click.option(
    "--max-payload-mb",
    default=1024,
    show_default=True,
    callback=within(1, 1 << 20),
    help="Largest message accepted.",
)
sends_option = click.option(
    "--sends",
    type=click.Choice(SEND_MODES),
    default="concurrent",
    show_default=True,
    help="How large tasks leave the coordinator: side by side, or one silo at a time, which "
    "shortens rounds where the coordinator's link is the narrowest (docs/performance.md).",
)
log_json_option = click.option(
    "--log-json", is_flag=True, help="Log JSON lines instead of key=value lines."
)


@coordinator.command("start")
@coordinator_kit_option
@click.option(
    "--policy",
    "policy_file",
    required=True,
    type=click.Path(path_type=Path),
    help="The signed deployment policy (POLICY.sig beside it).",
)
@click.option(
    "--state",
    "state_file",
    required=True,
    type=click.Path(path_type=Path),
    help="SQLite state file; an interrupted deployment resumes from it.",
)
@metrics_port_option
@click.option(
    "--join-timeout",
    default=600.0,
    show_default=True,
    callback=within(0.01, MAX_SECONDS),
    help="Seconds to wait for silos to join.",
)
@silo_poll_option
@heartbeat_window_option
@max_payload_option
@sends_option
@click.option(
    "--out", type=click.Path(path_type=Path), help="Write the final model and history here."
)
@click.option("--overwrite", is_flag=True, help=OVERWRITE_HELP)
@click.option(
    "--linger-seconds",
    default=0.0,
    show_default=True,
    callback=within(0, MAX_SECONDS),
    help="Keep serving metrics this long after the last round.",
)
@track_option
@log_json_option
def coordinator_start(
    kit_dir: Path,
    policy_file: Path,
    state_file: Path,
    metrics_port: int | None,
    join_timeout: float,
    poll_seconds: float,
    heartbeat_window_s: float,
    max_payload_mb: int,
    sends: str,
    out: Path | None,
    overwrite: bool,
    linger_seconds: float,
    track: tuple[TrackTarget, ...],
    log_json: bool,
) -> None:
    """Serve the consortium and run the policy's rounds to completion."""
    started = _load(policy_file)  # its fields checked here, before anything starts
    check_state_file(state_file)
    if out is not None:
        try:
            check_output_folder(out, overwrite)
        except OutputFolderError as exc:
            raise click.ClickException(str(exc)) from None
    stop = start_service(log_json)
    options = CoordinatorOptions(
        kit_dir,
        policy_file,
        state_file,
        metrics_port,
        join_timeout_s=join_timeout,
        poll_seconds=poll_seconds,
        heartbeat_window_s=heartbeat_window_s,
        max_payload_bytes=max_payload_mb << 20,
        linger_s=linger_seconds,
        out=out,
        overwrite=overwrite,
        track=track,
        sends=sends,
    )
    try:
        history = run_coordinator(options, stop)
    except DEPLOYMENT_ERRORS as exc:
        raise click.ClickException(str(exc)) from None
    final = history.final
    console.print(f"deployment complete at round {final.round}")
    failed = history.failed_note()
    if failed is not None:
        console.print(f"[yellow]Note:[/yellow] {failed}", highlight=False)
    display = MetricDisplay.of(started.privacy)
    for name, metrics in sorted((display.evaluation(final.evaluation) or {}).items()):
        console.print(
            f"  {name:16s} "
            + "  ".join(f"{display.label(k)} {v:.4f}" for k, v in sorted(metrics.items()))
        )
    if out is not None:
        console.print(f"final model and history in {out}/")


@coordinator.command("serve")
@coordinator_kit_option
@click.option(
    "--state",
    "state_file",
    required=True,
    type=click.Path(path_type=Path),
    help="SQLite state file: every job, the queue; a job left running resumes from it.",
)
@metrics_port_option
@silo_poll_option
@click.option(
    "--join-timeout",
    default=600.0,
    show_default=True,
    callback=within(0.01, MAX_SECONDS),
    help="Seconds each job waits for silos to join (not for one known gone).",
)
@heartbeat_window_option
@max_payload_option
@sends_option
@click.option(
    "--jobs-dir",
    type=click.Path(path_type=Path),
    help="Each job's results and log go to JOBS_DIR/<job>/ (default: <state stem>.jobs/).",
)
@click.option(
    "--listen",
    metavar="HOST:PORT",
    callback=host_and_port,
    help="Listen here instead of on the kit's address, e.g. 0.0.0.0:50051 in a container or "
    "a pod, where the silos reach the coordinator by the name its certificate is issued for.",
)
@click.option(
    "--metrics-host",
    default="127.0.0.1",
    show_default=True,
    help="The interface of --metrics-port: 0.0.0.0 where Prometheus scrapes from another "
    "container or host (the samples name silos: keep the port off public networks).",
)
@health_file_option
@track_option
@log_json_option
def coordinator_serve(
    kit_dir: Path,
    state_file: Path,
    metrics_port: int | None,
    poll_seconds: float,
    join_timeout: float,
    heartbeat_window_s: float,
    max_payload_mb: int,
    sends: str,
    jobs_dir: Path | None,
    listen: str | None,
    metrics_host: str,
    health_file: Path | None,
    track: tuple[TrackTarget, ...],
    log_json: bool,
) -> None:
    """Serve the consortium and run the jobs the operator submits (`fedsilo job submit`), one
    at a time, until stopped."""
    check_state_file(state_file)
    if jobs_dir is not None and jobs_dir.exists() and not jobs_dir.is_dir():
        raise click.ClickException(f"--jobs-dir {jobs_dir}: not a folder")
    stop = start_service(log_json)
    options = ServeOptions(
        kit_dir,
        state_file,
        metrics_port,
        poll_seconds=poll_seconds,
        join_timeout_s=join_timeout,
        heartbeat_window_s=heartbeat_window_s,
        max_payload_bytes=max_payload_mb << 20,
        jobs_dir=jobs_dir,
        listen=listen,
        metrics_host=metrics_host,
        health_file=health_file,
        track=track,
        sends=sends,
    )
    try:
        serve_coordinator(options, stop)
    except DEPLOYMENT_ERRORS as exc:
        raise click.ClickException(str(exc)) from None


@coordinator.command("revoke")
@click.argument("silo_name", metavar="SILO")
@coordinator_kit_option
@click.option(
    "--state", "state_file", required=True, type=click.Path(path_type=Path), help="The state file."
)
@click.option("--reason", default="revoked by the operator", show_default=True)
def coordinator_revoke(silo_name: str, kit_dir: Path, state_file: Path, reason: str) -> None:
    """Remove SILO from the consortium: its messages are refused from now on."""
    check_state_file(state_file)
    try:
        kit = load_coordinator_kit(kit_dir)
        if silo_name not in kit.silos:
            raise click.ClickException(
                f"no silo {silo_name!r} in this consortium; silos: {sorted(kit.silos)}"
            )
        revoke(state_file, kit.consortium, silo_name, reason)
    except DEPLOYMENT_ERRORS as exc:
        raise click.ClickException(str(exc)) from None
    console.print(f"revoked {silo_name}: a running coordinator refuses it within a second")


@click.command("demo")
@click.option(
    "--folder",
    type=click.Path(path_type=Path),
    help="A fresh folder for kits, logs and results (default: a new temporary folder).",
)
@click.option(
    "--rounds", type=click.IntRange(min=1), help="Fewer rounds than the policy's, for a quick look."
)
def demo(folder: Path | None, rounds: int | None) -> None:
    """Run a real consortium on this machine: coordinator and four hospitals over mTLS."""
    folder = (folder or Path(tempfile.mkdtemp(prefix="fedsilo-demo-"))).resolve()
    stop_on_signals()
    console.print(f"provisioning a throw-away consortium of four hospitals in {folder}/")
    with Progress(*_progress_columns(), console=console) as progress:
        bar = progress.add_task("rounds", total=None, status="starting processes")

        def on_round(done: int, total: int) -> None:
            progress.update(bar, completed=done, total=total, status=f"round {done}")

        try:
            history = run_demo(folder, on_round, rounds)
        except (DemoFailed, *DEPLOYMENT_ERRORS) as exc:
            raise click.ClickException(str(exc)) from None
    final = history["final"]
    table = Table(
        title=f"test metrics per hospital after round {final['round']} (FedAvg over mTLS)"
    )
    names = sorted({m for values in final["evaluation"].values() for m in values})
    table.add_column("silo")
    for name in names:
        table.add_column(name, justify="right")
    for silo, values in sorted(final["evaluation"].items()):
        table.add_row(silo, *(fmt_metric(values.get(m)) for m in names))
    console.print(table)
    console.print(
        f"results (final model, history.json, plots): {folder}/results/\n"
        f"logs of the coordinator and each hospital:  {folder}/logs/\n"
        f"startup kits and the signed policy:         {folder}/kits/, {folder}/policy.yaml"
    )


@click.command("status")
@kit_option("The coordinator kit (with --state), or the operator's kit (asks the coordinator).")
@coordinator_option
@click.option(
    "--state",
    "state_file",
    type=click.Path(path_type=Path),
    help="The state file (with the coordinator kit).",
)
@click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON document (docs/how-to/operator.md, 'Scripting the admin CLI') "
    "instead of tables.",
)
def status(kit_dir: Path, state_file: Path | None, as_json: bool) -> None:
    """Show the consortium's running or latest job: its status, round, participants, last
    metrics and dropouts; and how long the kit's certificate is valid."""
    try:
        role = kit_role(kit_dir)
    except KitError as exc:
        raise click.ClickException(str(exc)) from None
    if role == OPERATOR:
        if state_file is not None:
            raise click.ClickException(
                "--state: the operator's kit asks the running coordinator; --state goes with "
                "the coordinator kit, on the coordinator host"
            )
        print_remote_status(kit_dir, as_json)
        return
    if state_file is None:
        raise click.ClickException(
            "--state: give the coordinator's state file, or --kit OPERATOR_KIT to ask the "
            "running coordinator"
        )
    check_state_file(state_file)
    try:
        kit = load_coordinator_kit(kit_dir)
        document = state_file_document(state_file, kit.consortium, kit.silos)
    except DEPLOYMENT_ERRORS as exc:
        raise click.ClickException(str(exc)) from None
    if as_json:
        print_json(
            {**document, "certificate": certificate_status("coordinator", kit.tls.certificate)}
        )
        return
    print_consortium(console, document)
    print_certificate(console, "coordinator", kit.tls.certificate)
