"""Plug-ins that fail, as a site might install them (registered by tests/test_plugin_errors.py):
a data loader and a model factory that raise when called, and a module that raises on import."""

from __future__ import annotations

from typing import Any

from tests.plugin_fixtures import small_net


def exploding_loader(**args: Any) -> Any:
    """A data loader whose site-side code fails."""
    raise RuntimeError("the hospital's export share is not mounted")


def exploding_net(input_shape: tuple[int, ...], output_dim: int, explode: bool = False) -> Any:
    """small_net, or, with explode, a factory that fails."""
    if explode:
        raise RuntimeError("CUDA kernels of this layer are not built")
    return small_net(input_shape, output_dim)
