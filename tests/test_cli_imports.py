"""The coordinator's command line loads only the coordinator's side: not the silo's data pipeline
(pandas), the DP trainer (Opacus, with SciPy) or plotting, which would cost its process 150 MB
and seconds of start-up (ops/lazy_group.py). A silo command still finds its commands."""

from __future__ import annotations

import json
import subprocess
import sys

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
