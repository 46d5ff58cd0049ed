"""Strategy plug-ins: algorithms from packages installed at the coordinator and at every silo,
found through the entry point group `fedsilo.algorithms`.

The entry point's name is the algorithm's `algorithm.name`; its value is the algorithm's config
class, a `PluginAlgorithm`: a pydantic class like a built-in algorithm's (its `name` a
`Literal` of that name, its own typed settings, its capabilities, its `silo_contract`), which
names its server strategy (`strategy`, a `Strategy` subclass in the same package). A policy
selects a plug-in only by the name of an installed entry point, never a module path, and pins
its package (`algorithm.package`: version and code digest, policies/package_pin.py), so every
party runs the same code and a silo derives its contract from its own copy of it. A built-in
algorithm's name always means the built-in one.
"""

from __future__ import annotations

import typing
from importlib import import_module
from importlib.metadata import EntryPoint, entry_points
from typing import Any, ClassVar

from pydantic import model_validator

from fedsilo.policies.algorithms.base import AlgorithmBase
from fedsilo.policies.base import closest
from fedsilo.policies.package_pin import PackagePin, pin_problem
from fedsilo.policies.plugin_loading import load_or_refuse

GROUP = "fedsilo.algorithms"


class PluginAlgorithm(AlgorithmBase):
    """The base of a strategy plug-in's config: subclass it with `name: Literal["<entry point
    name>"]`, the algorithm's settings (each with its comment), `strategy` and
    `silo_contract`."""

    # the server strategy's class, "module:attr" inside the plug-in's own package
    strategy: ClassVar[str]
    # the plug-in package every party must have installed: its version and code digest, printed
    # by `fedsilo plugin pin NAME` (required)
    package: PackagePin

    @model_validator(mode="after")
    def _installed_as_pinned(self) -> PluginAlgorithm:
        entry_point = find_algorithm(self.name)
        if entry_point is None:
            raise ValueError(f"algorithm {self.name!r} is not installed at this site")
        problem = pin_problem(entry_point, self.package, "package")
        if problem is not None:
            raise ValueError(problem)
        return self

    def strategy_class(self) -> type:
        """The strategy class `strategy` names, which must live in the config's own package."""
        module, _, attr = self.strategy.partition(":")
        own = type(self).__module__.partition(".")[0]
        if module.partition(".")[0] != own:
            raise PluginAlgorithmError(
                f"algorithm {self.name!r}: its strategy {self.strategy!r} is outside its own "
                f"package {own!r}"
            )
        return typing.cast(type, getattr(import_module(module), attr))


class PluginAlgorithmError(ValueError):
    """A strategy plug-in that cannot be used as installed: one message naming it."""


def installed_algorithms() -> list[EntryPoint]:
    """The entry points of group `fedsilo.algorithms` installed here."""
    return list(entry_points(group=GROUP))


def find_algorithm(name: str) -> EntryPoint | None:
    """The installed strategy plug-in named `name`, or None."""
    return next((ep for ep in installed_algorithms() if ep.name == name), None)


def plugin_config_class(name: str, builtin: list[str]) -> type[PluginAlgorithm]:
    """The config class of the installed strategy plug-in `name`; a PluginAlgorithmError when
    none is installed, or it does not load, is no `PluginAlgorithm`, or declares no contract."""
    entry_point = find_algorithm(name)
    if entry_point is None:
        installed = sorted(ep.name for ep in installed_algorithms())
        hint = closest(name, [*builtin, *installed])
        suggestion = f" (did you mean '{hint}'?)" if hint else ""
        raise PluginAlgorithmError(
            f"unknown value {name!r}{suggestion}; allowed: {', '.join(sorted(builtin))}, and "
            f"the strategy plug-ins installed here (entry points {GROUP}: "
            f"{', '.join(installed) or 'none'})"
        )
    loaded = load_or_refuse(
        entry_point, PluginAlgorithmError, f"strategy plug-in {name!r} ({entry_point.value})"
    )
    if not (isinstance(loaded, type) and issubclass(loaded, PluginAlgorithm)):
        raise PluginAlgorithmError(
            f"strategy plug-in {name!r} ({entry_point.value}) is not a subclass of "
            "fedsilo.PluginAlgorithm"
        )
    if typing.get_args(loaded.model_fields["name"].annotation) != (name,):
        raise PluginAlgorithmError(
            f"strategy plug-in {name!r} ({entry_point.value}): its `name` must be "
            f'Literal["{name}"], the name of its entry point'
        )
    if loaded.silo_contract is AlgorithmBase.silo_contract:
        raise PluginAlgorithmError(
            f"strategy plug-in {name!r} ({entry_point.value}) declares no silo contract "
            "(silo_contract(policy)): a silo runs only the tasks a contract allows, so an "
            "algorithm without one cannot run"
        )
    if not isinstance(getattr(loaded, "strategy", None), str):
        raise PluginAlgorithmError(
            f"strategy plug-in {name!r} ({entry_point.value}) names no strategy class "
            '(strategy = "module:attr")'
        )
    return loaded


def validate_plugin_algorithm(document: Any, builtin: list[str]) -> PluginAlgorithm | None:
    """`document` validated by its strategy plug-in's config class when its name is no built-in
    algorithm's (None: it is a built-in's, or not a mapping)."""
    if not isinstance(document, dict) or not isinstance(document.get("name"), str):
        return None
    if document["name"] in builtin:
        return None
    return plugin_config_class(document["name"], builtin).model_validate(document)
