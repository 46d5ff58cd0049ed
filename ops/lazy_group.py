"""A click group whose subcommands load only when they run (click's documented lazy-loading
pattern): `fedsilo coordinator start` must not load the silo's data pipeline (pandas) or the DP
trainer (Opacus), which cost the coordinator's process 150 MB and seconds of start-up, and
`fedsilo --help` lists the commands from their summaries without loading any of them."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import click


class LazyGroup(click.Group):
    """`lazy_subcommands` maps a subcommand's name to "module:attribute" of its click command;
    `summaries`, a subcommand's name to the first sentence of its help, which the group's own
    help shows instead of loading the command."""

    def __init__(
        self,
        *args: Any,
        lazy_subcommands: Mapping[str, str],
        summaries: Mapping[str, str] | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_subcommands = dict(lazy_subcommands)
        self.summaries = dict(summaries or {})

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy_subcommands])

    def get_command(self, ctx: click.Context | None, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy_subcommands:
            module, attribute = self.lazy_subcommands[cmd_name].split(":")
            command = getattr(importlib.import_module(module), attribute)
            assert isinstance(command, click.Command), self.lazy_subcommands[cmd_name]
            return command
        return super().get_command(ctx, cmd_name)  # type: ignore[arg-type]

    def format_commands(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        """click's command index, with a summary from `summaries` where there is one."""
        names = self.list_commands(ctx)
        if not names:
            return
        limit = formatter.width - 6 - max(len(name) for name in names)
        rows = []
        for name in names:
            if name in self.summaries:
                summary = click.Command(name, help=self.summaries[name])
                rows.append((name, summary.get_short_help_str(limit)))
                continue
            command = self.get_command(ctx, name)
            if command is not None and not command.hidden:
                rows.append((name, command.get_short_help_str(limit)))
        with formatter.section("Commands"):
            formatter.write_dl(rows)
