"""The `fedsilo` command's processes let torch's idle OpenMP threads sleep (ops/openmp.py): the
wait policy is in the environment before torch loads, and an operator's own is kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys

CLI = (
    "import json, os, sys; from fedsilo.ops.cli import main;"
    " main.get_command(None, 'simulate'); names = list(sys.modules);"
    " print(json.dumps([os.environ['OMP_WAIT_POLICY'],"
    " names.index('fedsilo.ops.openmp') < names.index('torch')]))"
)
OWN = "import os, fedsilo.ops.openmp; print(os.environ['OMP_WAIT_POLICY'])"


def _run(code: str, **env: str) -> str:
    clean = {k: v for k, v in os.environ.items() if k != "OMP_WAIT_POLICY"} | env
    out = subprocess.run(
        [sys.executable, "-c", code], env=clean, capture_output=True, text=True, check=True
    )
    return out.stdout.strip().splitlines()[-1]


def test_the_cli_sets_a_passive_wait_policy_before_torch_loads() -> None:
    assert json.loads(_run(CLI)) == ["PASSIVE", True]


def test_an_operators_own_wait_policy_is_kept() -> None:
    assert _run(OWN, OMP_WAIT_POLICY="ACTIVE") == "ACTIVE"
