"""`fedsilo examples`: what ships inside the package for a user to start from, listed with one
line each and copied out to edit. The example policies (`policies/examples/`, also usable in
place as `--policy example:NAME`) and the monitoring files (`ops/deploy/`: the Prometheus scrape
configuration, its alert rules and the Grafana dashboard) are package data, read through
importlib.resources, so an installed wheel has them too. A copy is a new file: it never replaces
an existing one."""

from __future__ import annotations

import difflib
import json
import os
import re
from dataclasses import dataclass
from importlib.resources import files
from pathlib import Path
from typing import TYPE_CHECKING

import click
import yaml

from fedsilo.policies.loading import EXAMPLE_PREFIX, example_file, example_names, policy_folder
from fedsilo.wire.durable import fsync_folder

if TYPE_CHECKING:
    from importlib.resources.abc import Traversable

POLICIES = "policy"
MONITORING = "monitoring"
HEADINGS = {
    POLICIES: "Example policies (run one in place with --policy example:NAME):",
    MONITORING: "Monitoring (ops/deploy):",
}


@dataclass(frozen=True)
class Example:
    """One packaged file a user can copy: its NAME, its kind and the file itself."""

    name: str
    kind: str
    file: Traversable

    @property
    def description(self) -> str:
        """The first comment line of a YAML file, or a JSON file's `description`."""
        text = self.file.read_text(encoding="utf-8")
        if self.file.name.endswith(".json"):
            return str(json.loads(text).get("description", ""))
        comments = (line for line in text.splitlines() if line.startswith("#"))
        return next(comments, "").lstrip("#").strip()


def packaged_examples() -> dict[str, Example]:
    """Every packaged example by NAME: the policies, then the monitoring files."""
    examples = {name: Example(name, POLICIES, example_file(name)) for name in example_names()}
    deploy = files("fedsilo.ops") / "deploy"
    for entry in sorted(deploy.iterdir(), key=lambda entry: entry.name):
        if entry.is_file():
            name = entry.name.rsplit(".", 1)[0]
            examples[name] = Example(name, MONITORING, entry)
    return examples


@click.group("examples")
def examples_group() -> None:
    """List and copy the example policies and monitoring files that ship with fedsilo."""


@examples_group.command("list")
def list_examples() -> None:
    """Print every example's NAME and what it is."""
    examples = packaged_examples()
    width = max(len(name) for name in examples)
    for kind, heading in HEADINGS.items():
        click.echo(heading)
        for example in examples.values():
            if example.kind == kind:
                click.echo(f"  {example.name:{width}s}  {example.description}")
    click.echo("Copy one to edit it: fedsilo examples copy NAME [--out PATH]")


@examples_group.command("copy")
@click.argument("name")
@click.option(
    "--out",
    type=click.Path(path_type=Path),
    help="The file to write, or an existing folder to write it in "
    "(default: the example's file name, in this folder). Never overwritten.",
)
def copy_example(name: str, out: Path | None) -> None:
    """Copy example NAME out of the package, to edit it or deploy it."""
    example = _find(name)
    target = _target(out, example.file.name)
    data, moved = _with_absolute_data_path(example)
    try:
        write_new_file(target, data)
    except FileExistsError:
        raise click.ClickException(_exists(target)) from None
    except OSError as exc:
        raise click.ClickException(f"{target}: cannot write it: {exc.strerror}") from None
    click.echo(f"Copied {name} to {target}")
    if moved is not None:
        click.echo(f"Its data.path now names the packaged file itself: {moved}")
    if example.kind == POLICIES:
        click.echo(f"Edit it, then: fedsilo policy validate {target}")


def _with_absolute_data_path(example: Example) -> tuple[bytes, Path | None]:
    """The example's bytes, with a `data.path` relative to the packaged examples' folder made
    absolute (a copy lives elsewhere), and that absolute path (None when nothing changed)."""
    text = example.file.read_text(encoding="utf-8")
    if example.kind != POLICIES:
        return text.encode(), None
    relative = (yaml.safe_load(text).get("data") or {}).get("path")
    if not relative or Path(relative).is_absolute():
        return text.encode(), None
    absolute = (policy_folder(f"{EXAMPLE_PREFIX}{example.name}") / relative).resolve()
    line = re.compile(rf"^(\s*path:\s*){re.escape(relative)}(\s|$)", flags=re.MULTILINE)
    copied = line.sub(lambda m: f"{m.group(1)}{absolute}{m.group(2)}", text, count=1)
    return copied.encode(), absolute


def _find(name: str) -> Example:
    examples = packaged_examples()
    if name in examples:
        return examples[name]
    close = difflib.get_close_matches(name, list(examples), n=3, cutoff=0.6)
    hint = f"; did you mean {', '.join(close)}?" if close else ""
    raise click.ClickException(
        f"no example named '{name}'{hint} (`fedsilo examples list` shows them all)"
    )


def _target(out: Path | None, file_name: str) -> Path:
    """Where the copy goes; a ClickException naming --out when it cannot go there."""
    target = out / file_name if out is not None and out.is_dir() else out or Path(file_name)
    if target.exists() or target.is_symlink():
        raise click.ClickException(_exists(target))
    if not target.parent.is_dir():
        raise click.ClickException(f"--out {out}: folder {target.parent} does not exist")
    return target


def _exists(target: Path) -> str:
    return f"{target} already exists and is never overwritten; give --out another path"


def write_new_file(path: Path, data: bytes) -> None:
    """Create `path` holding `data` (failing with FileExistsError rather than replacing
    anything there), fsynced; a file left half-written by an error is removed again."""
    descriptor = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    try:
        with os.fdopen(descriptor, "wb") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
    except BaseException:
        path.unlink(missing_ok=True)
        raise
    fsync_folder(path.parent)
