"""A click group whose subcommands load only when they run (click's documented lazy-loading
pattern): `fedsilo coordinator start` must not load the silo's data pipeline (pandas) or the DP
trainer (Opacus), which cost the coordinator's process 150 MB and seconds of start-up."""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from typing import Any

import click


class LazyGroup(click.Group):
    """`lazy_subcommands` maps a subcommand's name to "module:attribute" of its click command."""

    def __init__(self, *args: Any, lazy_subcommands: Mapping[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy_subcommands = dict(lazy_subcommands)

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted([*super().list_commands(ctx), *self.lazy_subcommands])

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        if cmd_name in self.lazy_subcommands:
            module, attribute = self.lazy_subcommands[cmd_name].split(":")
            command = getattr(importlib.import_module(module), attribute)
            assert isinstance(command, click.Command), self.lazy_subcommands[cmd_name]
            return command
        return super().get_command(ctx, cmd_name)
