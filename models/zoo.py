"""The model zoo: builds the network a policy's `model:` section names, for a data schema (one
row's input shape, the output size): a silo's model, or FedEvg's classifier at the coordinator.

Initialisation is deterministic in `seed` and never draws from the global torch RNG: the
layers are laid out on the meta device and then filled from a private `torch.Generator`,
with PyTorch's default scheme (weights and biases uniform in +-1/sqrt(fan_in)). Concurrent
silos in one process therefore neither disturb nor depend on each other's random state.
No BatchNorm or Dropout is used anywhere (DP-SGD compatibility, determinism).

A `plugin` model is built by its installed factory (models/plugins.py) and checked against the
architecture the policy pins (models/architecture.py).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from fedsilo.models import architecture
from fedsilo.models.graphs import Gat, Gcn, GraphEncoder, Mpnn, graph_atoms
from fedsilo.models.plugins import PluginError, build_plugin
from fedsilo.policies.model import (
    CnnModel,
    GatModel,
    GcnModel,
    LinearModel,
    LogisticModel,
    MlpModel,
    ModelConfig,
    MpnnModel,
    PluginModel,
)
from fedsilo.wire.tensors import ParameterSpec

ACTIVATIONS: dict[str, type[nn.Module]] = {"relu": nn.ReLU, "tanh": nn.Tanh, "silu": nn.SiLU}
GROUPS = 8  # GroupNorm's groups (or the largest divisor of the channels below it)
MIN_IMAGE_SIDE = 4
BINARY = 2  # the classes of the one-logit `logistic` model


def build_model(
    config: ModelConfig, input_shape: tuple[int, ...], output_dim: int, seed: int
) -> nn.Module:
    """The network for `config`, mapping inputs of shape (n, *input_shape) to (n, output_dim).

    The output is logits for classification (`logistic`: one logit for two classes, and any
    other output size refused); for regression `output_dim` is 1 and the caller squeezes.
    Same seed, bit-identical parameters; the global RNG state is left untouched.
    A plugin model that is not installed, fails to build or differs from its pinned
    architecture raises PluginError (a ValueError) saying so.
    """
    _check_dimensions(input_shape, output_dim)
    if isinstance(config, PluginModel):
        return _pinned_plugin(config, tuple(input_shape), output_dim, seed)
    with torch.device("meta"):
        model = _layers(config, tuple(input_shape), output_dim)
    model.to_empty(device="cpu")
    _initialise(model, seed)
    return model


def embedding_and_head(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """A zoo model as g (every layer but the last: the embedding; a graph model's is its
    message passing and readout) and its last, linear layer (the head reading g(x)); refused
    for a model whose last layer reads the inputs."""
    if not isinstance(model, nn.Sequential) or not any(
        isinstance(layer, (nn.Linear, nn.Conv2d, GraphEncoder)) for layer in model[:-1]
    ):
        raise ValueError(
            "this model has no embedding: its last layer reads the inputs (mix the inputs, or "
            "use a model with hidden layers)"
        )
    return model[:-1], model[-1]


@torch.no_grad()
def load_flat(model: nn.Module, flat: torch.Tensor) -> nn.Module:
    """`model` with its parameters set from `flat`, a vector in the layout of its own
    `ParameterSpec` (the wire's), in place."""
    spec = ParameterSpec.of(dict(model.named_parameters()))
    for parameter, value in zip(model.parameters(), spec.unflatten(flat).values(), strict=True):
        parameter.copy_(value)
    return model


def _pinned_plugin(
    config: PluginModel, input_shape: tuple[int, ...], output_dim: int, seed: int
) -> nn.Module:
    if config.architecture is None:
        raise PluginError(f"model factory {config.factory!r}: the policy pins no architecture")
    model = build_plugin(config, input_shape, output_dim, seed)
    difference = architecture.first_difference(
        config.architecture.tensors, architecture.describe(model)
    )
    if difference is not None:
        raise PluginError(
            f"model factory {config.factory!r} does not build the network the policy pins: "
            f"{difference}"
        )
    return model


def _check_dimensions(input_shape: tuple[int, ...], output_dim: int) -> None:
    if not input_shape or any(side < 1 for side in input_shape):
        raise ValueError(f"input shape {tuple(input_shape)} must be non-empty and all sides >= 1")
    if output_dim < 1:
        raise ValueError(f"output_dim must be >= 1, got {output_dim}")


def _layers(config: ModelConfig, input_shape: tuple[int, ...], output_dim: int) -> nn.Sequential:
    if isinstance(config, LinearModel):
        return _linear(input_shape, output_dim)
    if isinstance(config, LogisticModel):
        return _logistic(input_shape, output_dim)
    if isinstance(config, MlpModel):
        return _mlp(config, input_shape, output_dim)
    if isinstance(config, CnnModel):
        return _cnn(config, input_shape, output_dim)
    if isinstance(config, (GcnModel, GatModel, MpnnModel)):
        return _graph(config, input_shape, output_dim)
    raise TypeError(f"unknown model config {type(config).__name__}")


def _linear(input_shape: tuple[int, ...], output_dim: int) -> nn.Sequential:
    return nn.Sequential(nn.Flatten(), nn.Linear(math.prod(input_shape), output_dim))


def _logistic(input_shape: tuple[int, ...], output_dim: int) -> nn.Sequential:
    if output_dim != BINARY:
        raise ValueError(
            f"model 'logistic' is for binary classification only (one logit for 2 classes), but "
            f"the task needs {output_dim} output(s); use model name 'linear'"
        )
    return _linear(input_shape, 1)


def _mlp(config: MlpModel, input_shape: tuple[int, ...], output_dim: int) -> nn.Sequential:
    layers: list[nn.Module] = [nn.Flatten()]
    width = math.prod(input_shape)
    for hidden in config.hidden:
        layers += [nn.Linear(width, hidden), ACTIVATIONS[config.activation]()]
        width = hidden
    layers.append(nn.Linear(width, output_dim))
    return nn.Sequential(*layers)


def _cnn(config: CnnModel, input_shape: tuple[int, ...], output_dim: int) -> nn.Sequential:
    channels, height, width = _image_shape(input_shape)
    layers: list[nn.Module] = []
    activation = ACTIVATIONS[config.activation]
    for out_channels in config.channels:
        layers += [nn.Conv2d(channels, out_channels, kernel_size=3, padding=1), activation()]
        if config.norm == "group":
            groups = max(g for g in range(1, GROUPS + 1) if out_channels % g == 0)
            layers.append(nn.GroupNorm(groups, out_channels))
        if height // 2 >= 2 and width // 2 >= 2:
            layers.append(nn.MaxPool2d(2))
            height, width = height // 2, width // 2
        channels = out_channels
    layers.append(nn.Flatten())
    width = channels * height * width
    if config.hidden:
        layers += [nn.Linear(width, config.hidden), activation()]
        width = config.hidden
    layers.append(nn.Linear(width, output_dim))
    return nn.Sequential(*layers)


def _graph(
    config: GcnModel | GatModel | MpnnModel, input_shape: tuple[int, ...], output_dim: int
) -> nn.Sequential:
    """A graph encoder (models/graphs.py) and a linear head on its readout g(x)."""
    graph_atoms(input_shape)
    encoder: GraphEncoder
    if isinstance(config, GcnModel):
        encoder, width = Gcn(config.hidden, config.readout), config.hidden[-1]
    elif isinstance(config, GatModel):
        encoder = Gat(config.hidden, config.heads, config.readout)
        width = config.hidden[-1] * config.heads
    else:
        encoder, width = Mpnn(config.hidden, config.steps, config.readout), config.hidden
    return nn.Sequential(encoder, nn.Linear(width, output_dim))


def _image_shape(input_shape: tuple[int, ...]) -> tuple[int, int, int]:
    if len(input_shape) != 3 or min(input_shape[1:]) < MIN_IMAGE_SIDE:
        raise ValueError(
            f"model 'cnn' needs image inputs (channels, height, width) with height and width"
            f" >= {MIN_IMAGE_SIDE}, but the data has shape {tuple(input_shape)};"
            " use model name 'mlp' or 'linear' for tabular data"
        )
    channels, height, width = input_shape
    return channels, height, width


def _initialise(model: nn.Module, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, (nn.Linear, nn.Conv2d)):
                bound = 1.0 / math.sqrt(module.weight[0].numel())
                module.weight.uniform_(-bound, bound, generator=generator)
                module.bias.uniform_(-bound, bound, generator=generator)
            elif isinstance(module, nn.GroupNorm):  # PyTorch's default: the identity
                module.weight.fill_(1.0)
                module.bias.zero_()
