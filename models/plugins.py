"""Model plug-ins: networks built by packages installed at a site, found through the entry
point group `fedsilo.models`.

A policy's plugin model names its factory by the entry point's value (`module:attr`); only an
installed entry point with exactly that value is ever loaded, so a policy cannot make a site
import a module of its choosing. The factory is called as
`factory(input_shape, output_dim, **args)` with the global torch RNG seeded from the policy
for the call and restored after it: same seed, bit-identical parameters, and the caller's
random state untouched.
"""

from __future__ import annotations

from collections.abc import Callable
from importlib.metadata import EntryPoint, entry_points

from torch import nn

from fedsilo.models.global_rng import seeded_global_rng
from fedsilo.policies.model import PluginModel
from fedsilo.policies.plugin_loading import load_or_refuse

GROUP = "fedsilo.models"


class PluginError(ValueError):
    """A plugin model this site cannot build as the policy pins it."""


def installed_factories() -> list[EntryPoint]:
    """The entry points of group `fedsilo.models` installed here."""
    return list(entry_points(group=GROUP))


def find_factory(factory: str) -> EntryPoint | None:
    """The installed entry point whose value is `factory`, or None."""
    return next((ep for ep in installed_factories() if ep.value == factory), None)


def load_factory(factory: str) -> Callable[..., nn.Module]:
    """The callable the installed entry point `factory` (`module:attr`) names."""
    entry_point = find_factory(factory)
    if entry_point is None:
        installed = sorted(ep.value for ep in installed_factories())
        raise PluginError(
            f"model factory {factory!r} is not installed at this site (entry points {GROUP}: "
            f"{installed})"
        )
    loaded = load_or_refuse(entry_point, PluginError, f"model factory {factory!r}")
    if not callable(loaded):
        raise PluginError(f"model factory {factory!r} is a {type(loaded).__name__}, not callable")
    return loaded


def build_plugin(
    config: PluginModel, input_shape: tuple[int, ...], output_dim: int, seed: int
) -> nn.Module:
    """The network `config.factory` builds for the schema, seeded with `seed`; unchecked
    against the policy's pin (`zoo.build_model` checks it)."""
    factory = load_factory(config.factory)
    try:
        with seeded_global_rng(seed):
            model = factory(tuple(input_shape), output_dim, **config.args)
    except Exception as error:  # arguments the factory refuses, or a bug in it
        raise PluginError(
            f"model factory {config.factory!r} failed for input shape {tuple(input_shape)} and "
            f"{output_dim} outputs with args {config.args}: {type(error).__name__}: {error}"
        ) from None
    if not isinstance(model, nn.Module):
        raise PluginError(
            f"model factory {config.factory!r} returned a {type(model).__name__}, not a "
            "torch.nn.Module"
        )
    return model
