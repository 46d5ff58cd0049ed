"""`fedsilo plugin`: the plug-ins installed at this site (`list`), and the pin a policy needs for
a strategy plug-in or a training step (`pin`): its package's version and code digest
(policies/package_pin.py), printed as the YAML block to paste."""

from __future__ import annotations

from importlib.metadata import EntryPoint, entry_points

import click
import yaml
from rich.table import Table

from fedsilo.ops.cli_support import console
from fedsilo.policies.package_pin import installed_pin

# entry point group -> what its plug-ins are, and how a policy names one
GROUPS = {
    "fedsilo.algorithms": ("strategy", "algorithm.name: NAME"),
    "fedsilo.steps": ("training step", "training.step.plugin: VALUE"),
    "fedsilo.models": ("model factory", "model.factory: VALUE"),
    "fedsilo.datasets": ("data loader", "data.source.loader: VALUE"),
    "fedsilo.tasks": ("task", "data.task: VALUE"),
}


@click.group("plugin")
def plugin_group() -> None:
    """List this site's plug-ins and print the pin of a strategy or training step."""


@plugin_group.command("list")
def list_command() -> None:
    """Every plug-in installed here: its kind, how a policy names it, and its package."""
    table = Table("kind", "name", "value", "package")
    for group, (kind, _) in GROUPS.items():
        for point in sorted(entry_points(group=group), key=lambda ep: (ep.name, ep.value)):
            dist = f"{point.dist.name} {point.dist.version}" if point.dist else "-"
            table.add_row(kind, point.name, point.value, dist)
    if not table.row_count:
        console.print("No fedsilo plug-ins are installed here.")
        return
    console.print(table)


@plugin_group.command("pin")
@click.argument("plugin")
def pin_command(plugin: str) -> None:
    """Print the `package:` block that pins PLUGIN: a strategy plug-in's algorithm name, or a
    training step's `module:attr`.

    Paste it under `algorithm:` or `training.step:`; every silo refuses a job whose pinned
    version or code digest differs from what it has installed."""
    point = _find(plugin)
    pin = installed_pin(point)
    if pin is None:
        raise click.ClickException(
            f"PLUGIN {plugin!r}: {point.value} is not part of an installed package folder, so "
            "its code cannot be pinned; install it with pip"
        )
    where = "algorithm" if point.group == "fedsilo.algorithms" else "training.step"
    click.echo(f"# under {where}: ({point.dist.name if point.dist else point.value})")
    click.echo(yaml.safe_dump({"package": pin.model_dump()}, sort_keys=False).rstrip())


def _find(plugin: str) -> EntryPoint:
    """The strategy plug-in named `plugin`, or the training step whose value it is."""
    candidates = [
        *(point for point in entry_points(group="fedsilo.algorithms") if point.name == plugin),
        *(point for point in entry_points(group="fedsilo.steps") if point.value == plugin),
    ]
    if candidates:
        return candidates[0]
    installed = [
        *(point.name for point in entry_points(group="fedsilo.algorithms")),
        *(point.value for point in entry_points(group="fedsilo.steps")),
    ]
    raise click.ClickException(
        f"PLUGIN {plugin!r}: no strategy plug-in (algorithm name) or training step "
        f"(module:attr) of that name is installed here; installed: "
        f"{', '.join(sorted(installed)) or 'none'}"
    )
