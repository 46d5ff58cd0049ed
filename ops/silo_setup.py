"""`fedsilo silo init`: a site's silo.yaml and a systemd unit, written by its IT team.

The configuration is validated exactly as `fedsilo silo start` will read it, and the data it
points at is loaded once and summarised (ops/silo_check.py), so a mistake (a missing file, a
missing option, a bad column) is reported now, naming the option, not when a job starts.
A site's own file is one silo. `data_section_options` adds the flags that set the data
dictionary's keys: `--categorical`, `--impute`, `--drop-column`.
"""

from __future__ import annotations

import functools
import shutil
import sys
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import click
import yaml

from fedsilo.ops.provision import load_silo_kit
from fedsilo.ops.silo_check import render, summarise
from fedsilo.policies.data import PATH_SOURCES
from fedsilo.policies.loading import PolicyError
from fedsilo.silo.config import parse_silo_config
from fedsilo.silo.data import DataError

SYSTEMD_RESTART_S = 10.0  # the unit restarts a failed agent this long after (a job waits longer)
UNIT = """[Unit]
Description=fedsilo silo agent ({name})
After=network-online.target
Wants=network-online.target

[Service]
Type=simple
ExecStart={fedsilo} silo start --config {config}
WorkingDirectory={folder}
Restart=on-failure
RestartSec={restart_s:g}
KillSignal=SIGTERM
NoNewPrivileges=true
PrivateTmp=true

[Install]
WantedBy=multi-user.target
"""


def write_silo_config(
    kit_dir: Path,
    out: Path,
    source: str,
    data_path: Path | None,
    target: str | None,
    select: str | None,
    device: str | None,
    metrics_port: int | None,
    rules: Mapping[str, Any],
    data_keys: Mapping[str, Any] | None = None,
    proxy: str | None = None,
) -> tuple[list[Path], list[str]]:
    """Write silo.yaml (at `out`) and fedsilo-silo-<name>.service beside it; return both paths
    and the data's summary. `rules`: the site's local rules (silo/config.py `LocalRules`) that
    differ from the defaults; `data_keys`: more keys of the data section (`data_section_options`);
    `proxy`: coordinator.proxy, the HTTP CONNECT proxy to reach the coordinator through.
    """
    kit = load_silo_kit(kit_dir)
    out = out.resolve()
    unit = out.with_name(f"fedsilo-silo-{kit.name}.service")
    for path in (out, unit):
        if path.exists():
            raise ValueError(f"--out: {path} exists; silo init never replaces a file (move it)")
    data: dict = {"source": source}  # a policy's data keys (silo/config.py `SiloData`)
    if data_path is not None:
        if not data_path.is_file():
            raise DataError(f"--data {data_path}: file not found")
        data["path"] = str(data_path.resolve())
    elif source in PATH_SOURCES:
        raise DataError(f"--data: a {source} source needs the data file (--data FILE)")
    if target is not None:
        data["target"] = target
    data.update(data_keys or {})
    if select is not None:
        data["select"] = select
    document: dict = {"version": 1, "kit": str(kit.folder.resolve()), "data": data}
    if proxy is not None:
        document["coordinator"] = {"proxy": proxy}
    if device is not None:
        document["compute"] = {"device": device}
    if metrics_port is not None:
        document["metrics_port"] = metrics_port
    if rules:
        document["rules"] = dict(rules)
    try:
        config = parse_silo_config(document, "silo init")
    except PolicyError as error:
        raise PolicyError(f"{error}{_flag_hints(str(error))}") from None
    try:
        summary = render(summarise(config, out.parent))
    except DataError as error:
        raise DataError(f"{error}{_flag_hints(str(error))}") from None
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(yaml.safe_dump(document, sort_keys=False))
    executable = shutil.which("fedsilo") or f"{sys.executable} -m fedsilo"
    unit.write_text(
        UNIT.format(
            name=kit.name,
            fedsilo=executable,
            config=out,
            folder=out.parent,
            restart_s=SYSTEMD_RESTART_S,
        )
    )
    return [out, unit], summary


# The silo.yaml keys `silo init` sets, and the flag that sets each.
FLAGS = {
    "data.categorical": "--categorical COLUMN=A,B,...",
    "data.missing": "--impute",
    "data.drop_columns": "--drop-column COLUMN",
    "data.target": "--target",
    "data.path": "--data",
    "coordinator.proxy": "--proxy",
}


def _flag_hints(message: str) -> str:
    """Which `silo init` flags set the keys a message names."""
    hints = [f"{flag} sets {key}" for key, flag in FLAGS.items() if key in message]
    return f" (silo init: {'; '.join(hints)})" if hints else ""


def parse_categorical(values: tuple[str, ...]) -> dict[str, list[str]]:
    """`--categorical COLUMN=A,B` (repeatable) as data.categorical, or one message."""
    categorical: dict[str, list[str]] = {}
    for value in values:
        column, separator, listed = value.partition("=")
        categories = [category.strip() for category in listed.split(",")]
        if not separator or not column.strip() or not all(categories):
            raise click.ClickException(
                f"--categorical {value!r}: give COLUMN=A,B,... (the column's categories, "
                "comma-separated)"
            )
        if column.strip() in categorical:
            raise click.ClickException(f"--categorical: column {column.strip()!r} given twice")
        categorical[column.strip()] = categories
    return categorical


def data_section_options(command: Callable[..., None]) -> Callable[..., None]:
    """Add --categorical, --impute and --drop-column to `command` (put it right above the
    function), handed to it as one `data_keys` mapping of data-section keys."""

    @functools.wraps(command)
    def wrapped(
        categorical: tuple[str, ...], impute: bool, drop_columns: tuple[str, ...], **kwargs: Any
    ) -> None:
        keys: dict[str, Any] = {}
        if categorical:
            keys["categorical"] = parse_categorical(categorical)
        if impute:
            keys["missing"] = "impute"
        if drop_columns:
            keys["drop_columns"] = list(drop_columns)
        command(data_keys=keys, **kwargs)

    options = [
        click.option(
            "--categorical",
            multiple=True,
            metavar="COLUMN=A,B,...",
            help="A categorical column and its categories (repeatable): data.categorical.",
        ),
        click.option(
            "--impute",
            is_flag=True,
            help="Impute missing values locally (data.missing: impute).",
        ),
        click.option(
            "--drop-column",
            "drop_columns",
            multiple=True,
            help="A column that is not a feature (repeatable): data.drop_columns.",
        ),
    ]
    for option in reversed(options):
        wrapped = option(wrapped)
    return wrapped
