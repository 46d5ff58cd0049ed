"""The coordinator's command line loads only the coordinator's side: not the silo's data pipeline
(pandas), the DP trainer (Opacus, with SciPy) or plotting, which would cost its process 150 MB
and seconds of start-up (ops/lazy_group.py). A silo command still finds its commands.
`fedsilo --version` and `fedsilo --help` load neither torch nor grpc nor pydantic: the index of
commands comes from their summaries in ops/cli.py, each checked against its command's help."""

from __future__ import annotations

import json
import subprocess
import sys

import click
from click.testing import CliRunner

from fedsilo.ops.cli import main

SILO_SIDE = ("pandas", "opacus", "scipy", "matplotlib")


def _loaded_after(code: str) -> list[str]:
    probe = (
        f"import json, sys; {code}; "
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({SILO_SIDE!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_the_coordinators_command_line_loads_nothing_of_the_silo_side() -> None:
    assert _loaded_after("import fedsilo.ops.cli") == []
    assert _loaded_after("import fedsilo.ops.coordinator_process") == []


def test_silo_commands_load_when_asked_for() -> None:
    result = CliRunner().invoke(main, ["silo", "--help"], catch_exceptions=False)
    assert result.exit_code == 0
    assert {"init", "start", "check"} <= set(result.output.split())
    assert "pandas" in _loaded_after(
        "from fedsilo.ops.cli import main; main.get_command(None, 'silo')"
    )


def test_the_command_list_names_the_lazy_commands_too() -> None:
    result = CliRunner().invoke(main, ["--help"], catch_exceptions=False)
    listed = {
        line.split()[0] for line in result.output.split("Commands:")[1].splitlines() if line.strip()
    }
    assert {"model", "predict", "silo", "coordinator", "simulate"} <= listed


HEAVY = ("torch", "grpc", "pydantic")


def _heavy_after(args: list[str]) -> list[str]:
    """The heavy packages loaded once `fedsilo ARGS` ran in a fresh process."""
    probe = (
        "import json, sys\n"
        "from fedsilo.ops.cli import main\n"
        "try:\n"
        f"    main({args!r})\n"
        "except SystemExit:\n"
        "    pass\n"
        f"print(json.dumps(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r}))))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_version_and_help_load_neither_torch_nor_grpc_nor_pydantic() -> None:
    assert _heavy_after(["--version"]) == []
    assert _heavy_after(["--help"]) == []


def test_the_command_index_summaries_are_each_commands_own() -> None:
    """`fedsilo --help` shows ops/cli.py's summaries without loading the commands: each is
    what the loaded command's own help would show, at any width."""
    context = click.Context(main, info_name="fedsilo")
    for name in main.list_commands(context):
        command = main.get_command(context, name)
        assert command is not None and command.name == name
        summary = click.Command(name, help=main.summaries[name])
        for limit in (30, 45, 60, 200):
            assert summary.get_short_help_str(limit) == command.get_short_help_str(limit), name
