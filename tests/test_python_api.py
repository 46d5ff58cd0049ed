"""The Python API is what docs/python-api.md documents: exactly those names, importable from
`fedsilo`, and the page's example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import fedsilo

PAGE = Path(__file__).resolve().parents[1] / "docs" / "python-api.md"


def documented_names() -> set[str]:
    """The names of the page's table (its first column, each `name` or `name(args)`)."""
    names = set()
    for row in re.findall(r"^\| (`.*?) \|", PAGE.read_text(), flags=re.MULTILINE):
        names |= {re.match(r"\w+", cell).group(0) for cell in re.findall(r"`([^`]+)`", row)}
    return names


def test_fedsilo_exports_exactly_the_documented_names() -> None:
    assert set(fedsilo.__all__) == documented_names()
    for name in fedsilo.__all__:
        assert getattr(fedsilo, name) is not None, name
    assert sorted(dir(fedsilo)) == sorted(fedsilo.__all__)


def test_an_undocumented_name_is_not_part_of_it() -> None:
    with pytest.raises(AttributeError, match="no attribute 'engine'"):
        fedsilo.engine  # noqa: B018


def test_importing_fedsilo_does_not_import_torch() -> None:
    """The API is imported on first use, so `import fedsilo` (every command) stays light."""
    check = "import sys, fedsilo; print('torch' in sys.modules)"
    assert (
        subprocess.run(
            [sys.executable, "-c", check], capture_output=True, text=True, check=True
        ).stdout.strip()
        == "False"
    )


def test_the_pages_example_runs_as_written(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    (code,) = re.findall(r"```python\n(.*?)```", PAGE.read_text(), flags=re.DOTALL)
    exec(compile(code, str(PAGE), "exec"), {})  # noqa: S102 (the documentation's own code)
    assert (tmp_path / "runs" / "api-example" / "final_model.safetensors").is_file()
