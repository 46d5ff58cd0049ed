"""Click options that several commands share and that load nothing heavy, so that `fedsilo
--help` and `fedsilo --version` stay light (ops/cli.py).

`kit_option`: every command's `--kit` takes its default from the environment variable
`FEDSILO_KIT` (a shell that works with one kit sets it once); when neither is given, the error
names both.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import click

KIT_ENVIRONMENT = "FEDSILO_KIT"


def kit_option(help: str) -> Callable[[Callable], Callable]:
    """`--kit KIT_DIR` (the value goes to `kit_dir`), required, default `$FEDSILO_KIT`."""
    return click.option(
        "--kit",
        "kit_dir",
        required=True,
        envvar=KIT_ENVIRONMENT,
        show_envvar=True,
        type=click.Path(path_type=Path),
        help=help,
    )
