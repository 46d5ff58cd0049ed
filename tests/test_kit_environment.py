"""Every `--kit` option of the command line takes its default from the environment variable
`FEDSILO_KIT` (a shell that works with one kit sets it once); a command given neither says
so, naming both."""

from __future__ import annotations

from pathlib import Path

import click
import pytest
from click.testing import CliRunner

from fedsilo.ops.cli import main
from fedsilo.ops.options import KIT_ENVIRONMENT


def commands(command: click.Command, path: str) -> list[tuple[str, click.Command]]:
    """Every command of `fedsilo` with its path, lazily loaded ones too."""
    found = [(path, command)]
    if isinstance(command, click.Group):
        context = click.Context(command, info_name=path)
        for name in command.list_commands(context):
            found += commands(command.get_command(context, name), f"{path} {name}")
    return found


def kit_options() -> dict[str, click.Option]:
    return {
        path: option
        for path, command in commands(main, "fedsilo")
        for option in command.params
        if isinstance(option, click.Option) and "--kit" in option.opts
    }


def test_every_kit_option_reads_fedsilo_kit() -> None:
    options = kit_options()
    assert {"fedsilo status", "fedsilo job submit", "fedsilo coordinator serve"} <= set(options)
    assert {
        path: option.envvar for path, option in options.items() if option.envvar != KIT_ENVIRONMENT
    } == {}


@pytest.mark.parametrize(
    "args",
    [["job", "list"], ["status"], ["coordinator", "revoke", "silo-1", "--state", "s.db"]],
)
def test_without_kit_or_fedsilo_kit_the_error_names_both(args: list[str]) -> None:
    result = CliRunner().invoke(main, args, env={KIT_ENVIRONMENT: None})
    assert result.exit_code == 2
    assert "Error: Missing option '--kit' (env var: 'FEDSILO_KIT')." in result.output


@pytest.mark.parametrize("args", [["job", "list"], ["status"]])
def test_fedsilo_kit_is_the_kit_when_no_kit_is_given(tmp_path: Path, args: list[str]) -> None:
    kit = tmp_path / "no-such-kit"
    result = CliRunner().invoke(main, args, env={KIT_ENVIRONMENT: str(kit)})
    assert result.exit_code == 1
    assert str(kit) in result.output and "Missing option" not in result.output
