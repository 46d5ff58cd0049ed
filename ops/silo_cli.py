"""`fedsilo silo`: a hospital's IT team writes its silo.yaml, checks its data against a policy,
and runs the agent. Loaded only when a silo command runs (ops/lazy_group.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from fedsilo.ops.cli_support import (
    DEPLOYMENT_ERRORS,
    console,
    health_file_option,
    start_service,
    within,
)
from fedsilo.ops.options import kit_option
from fedsilo.ops.silo_check import silo_check
from fedsilo.ops.silo_process import run_silo
from fedsilo.ops.silo_setup import data_section_options, write_silo_config
from fedsilo.policies.loading import PolicyError
from fedsilo.silo.errors import DataError


@click.group()
def silo() -> None:
    """Run a silo agent next to a hospital's data."""


silo.add_command(silo_check)


@silo.command("init")
@kit_option("This silo's kit folder.")
@click.option(
    "--out", required=True, type=click.Path(path_type=Path), help="Where to write silo.yaml."
)
@click.option(
    "--source",
    default="heart",
    show_default=True,
    help="Data source: heart, sklearn:NAME, csv, npz or molecules:csv (see docs/data.md).",
)
@click.option(
    "--data",
    "data_path",
    type=click.Path(path_type=Path),
    help="CSV or NPZ file (csv/npz sources).",
)
@click.option("--target", help="Target column of a CSV file.")
@click.option("--select", help="Which silo of a multi-silo data section this is (e.g. Cleveland).")
@click.option(
    "--device", help="Override the policy's compute device at this site (cpu, cuda:0, ...)."
)
@click.option(
    "--metrics-port",
    type=int,
    callback=within(1, 65535),
    help="Serve Prometheus metrics on 127.0.0.1:PORT.",
)
@click.option(
    "--proxy",
    help="Reach the coordinator through this HTTP CONNECT proxy (http://host:port), or 'direct'; "
    "default: https_proxy and no_proxy (coordinator.proxy).",
)
@click.option(
    "--allow-algorithm",
    "allowed",
    multiple=True,
    help="Local rule: only these algorithms (repeatable).",
)
@click.option("--require-dp", is_flag=True, help="Local rule: only DP deployments.")
@click.option(
    "--epsilon-cap",
    type=click.FloatRange(min=0, min_open=True),
    help="Local rule: this site's own epsilon budget per job (the stricter cap wins).",
)
@click.option(
    "--total-epsilon-cap",
    type=click.FloatRange(min=0, min_open=True),
    help="Local rule: this site's epsilon budget over all jobs of the consortium.",
)
@data_section_options
def silo_init(
    kit_dir: Path,
    out: Path,
    source: str,
    data_path: Path | None,
    target: str | None,
    select: str | None,
    device: str | None,
    metrics_port: int | None,
    proxy: str | None,
    allowed: tuple[str, ...],
    require_dp: bool,
    epsilon_cap: float | None,
    total_epsilon_cap: float | None,
    data_keys: dict[str, Any],
) -> None:
    """Write this site's silo.yaml and a systemd unit to run the agent."""
    rules: dict[str, Any] = {"allowed_algorithms": list(allowed)} if allowed else {}
    if require_dp:
        rules["require_dp"] = True
    if epsilon_cap is not None:
        rules["epsilon_cap"] = epsilon_cap
    if total_epsilon_cap is not None:
        rules["total_epsilon_cap"] = total_epsilon_cap
    try:
        written, summary = write_silo_config(
            kit_dir,
            out,
            source,
            data_path,
            target,
            select,
            device,
            metrics_port,
            rules,
            data_keys,
            proxy,
        )
    except (PolicyError, DataError, ValueError) as exc:
        raise click.ClickException(str(exc)) from None
    click.echo("\n".join(summary))
    for path in written:
        console.print(f"wrote {path}")


@silo.command("start")
@click.option(
    "--config", "config_file", required=True, type=click.Path(path_type=Path), help="silo.yaml"
)
@click.option("--poll-seconds", default=5.0, show_default=True, help="Long-poll window for tasks.")
@health_file_option
@click.option("--log-json", is_flag=True, help="Log JSON lines instead of key=value lines.")
def silo_start(
    config_file: Path, poll_seconds: float, health_file: Path | None, log_json: bool
) -> None:
    """Connect to the coordinator and take part until the deployment is complete."""
    stop = start_service(log_json)
    try:
        run_silo(config_file, stop, poll_seconds, health_file)
    except DEPLOYMENT_ERRORS as exc:
        raise click.ClickException(str(exc)) from None
