"""What the command line's modules share: option range checks, the errors an operator's
mistake raises (each printed as one message, exit status 1), the console, and a clean stop on
SIGTERM/SIGINT. Light on purpose: it loads nothing of the silo's data pipeline or Opacus."""

from __future__ import annotations

import logging
import math
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click
from rich.console import Console

from fedsilo.coordinator.engine import RunAborted
from fedsilo.coordinator.state import StateError
from fedsilo.coordinator.strategies.base import SetupError
from fedsilo.models.plugins import PluginError
from fedsilo.ops.backends import BackendError
from fedsilo.ops.coordinator_process import DeploymentError
from fedsilo.ops.health import ENVIRONMENT as HEALTH_FILE_ENVIRONMENT
from fedsilo.ops.logs import configure_logging
from fedsilo.ops.memory import keep_service_buffers
from fedsilo.ops.provision import KitError
from fedsilo.ops.report import OutputFolderError
from fedsilo.policies.consortium import split_address
from fedsilo.policies.loading import PolicyError
from fedsilo.privacy.certificate_files import CertificateError
from fedsilo.privacy.identity import IdentityError
from fedsilo.privacy.policy_signing import PolicySignatureError
from fedsilo.silo.client import ChannelError, PolicyRefused, SiloRefused
from fedsilo.silo.device import DeviceError
from fedsilo.silo.errors import DataError, DpSgdError
from fedsilo.silo.proxy import ProxyError

USER_ERRORS = (
    PolicyError,
    DataError,
    DeviceError,
    RunAborted,
    SetupError,
    OutputFolderError,
    PluginError,
    DpSgdError,
    BackendError,
)
DEPLOYMENT_ERRORS = (
    *USER_ERRORS,
    StateError,
    DeploymentError,
    KitError,
    CertificateError,
    ProxyError,
    IdentityError,
    PolicySignatureError,
    PolicyRefused,
    SiloRefused,
    ChannelError,
)

console = Console()


def user_message(exc: Exception) -> str:
    """The one line an operator's mistake prints: the error's own, led by the policy key of a
    plug-in model that cannot be built here (a data plug-in's error names `data.loader`)."""
    return f"model.factory: {exc}" if isinstance(exc, PluginError) else str(exc)


def within(low: float, high: float) -> Callable[[click.Context, click.Parameter, Any], Any]:
    """An option callback refusing a value outside [low, high] (or not finite) with one message
    naming the option and exit status 1."""

    def check(ctx: click.Context, param: click.Parameter, value: Any) -> Any:
        if value is not None and not (math.isfinite(value) and low <= value <= high):
            raise click.ClickException(
                f"{param.opts[0]}: {value} is out of range; give a number from {low:g} to {high:g}"
            )
        return value

    return check


def start_service(log_json: bool) -> threading.Event:
    """What a long-running service (`coordinator start`, `coordinator serve`, `silo start`) does
    first: its logging, its allocator (ops/memory.py), and a clean stop on SIGTERM/SIGINT."""
    configure_logging(log_json)
    keep_service_buffers()
    return stop_on_signals()


def stop_on_signals() -> threading.Event:
    """SIGTERM and SIGINT stop a service cleanly: servers closed, state kept at its last round."""
    stop = threading.Event()

    def handler(signum: int, frame: object) -> None:
        stop.set()
        logging.getLogger("fedsilo").info("stopping on %s", signal.Signals(signum).name)
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop


def host_and_port(ctx: click.Context, param: click.Parameter, value: str | None) -> str | None:
    """An option callback refusing a value that is not HOST:PORT with one message naming the
    option and exit status 1."""
    if value is not None:
        try:
            split_address(value)
        except ValueError as exc:
            raise click.ClickException(f"{param.opts[0]}: {exc}") from None
    return value


health_file_option = click.option(
    "--health-file",
    type=click.Path(path_type=Path),
    envvar=HEALTH_FILE_ENVIRONMENT,
    help="Keep this file up to date for `fedsilo-health` (a container's health check, a "
    "Kubernetes probe); default: $FEDSILO_HEALTH_FILE, which the container image sets.",
)
