"""Specification of the model zoo (models/zoo.py) and the policy's `model:` section."""

from __future__ import annotations

import pytest
import torch
from pydantic import TypeAdapter, ValidationError
from torch import nn

from fedsilo.models.zoo import build_model
from fedsilo.policies.model import CnnModel, LinearModel, MlpModel, ModelConfig

MODEL_CONFIG = TypeAdapter(ModelConfig)

CASES = [
    (LinearModel(name="linear"), (30,)),
    (LinearModel(name="linear"), (1, 8, 8)),
    (MlpModel(name="mlp"), (30,)),
    (MlpModel(name="mlp", hidden=[64, 128, 128], activation="tanh"), (64,)),
    (CnnModel(name="cnn"), (1, 8, 8)),
    (CnnModel(name="cnn", channels=[8, 16, 32]), (1, 28, 28)),
    (CnnModel(name="cnn", channels=[4, 4, 4], hidden=8), (3, 5, 7)),
]


def parameters_of(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


@pytest.mark.parametrize(("config", "shape"), CASES)
def test_every_model_maps_a_batch_to_logits_of_output_dim(config, shape):
    model = build_model(config, shape, output_dim=3, seed=0)
    assert model(torch.randn(5, *shape)).shape == (5, 3)


@pytest.mark.parametrize(("config", "shape"), CASES)
def test_regression_models_output_one_column(config, shape):
    model = build_model(config, shape, output_dim=1, seed=0)
    assert model(torch.randn(4, *shape)).shape == (4, 1)


@pytest.mark.parametrize(("config", "shape"), CASES)
def test_no_model_uses_batchnorm_or_dropout(config, shape):
    model = build_model(config, shape, output_dim=2, seed=0)
    forbidden = (nn.modules.batchnorm._BatchNorm, nn.modules.dropout._DropoutNd)
    assert not any(isinstance(module, forbidden) for module in model.modules())


@pytest.mark.parametrize(("config", "shape"), CASES)
def test_same_seed_gives_bit_identical_parameters(config, shape):
    torch.manual_seed(1)
    first = parameters_of(build_model(config, shape, output_dim=2, seed=7))
    torch.manual_seed(2)
    second = parameters_of(build_model(config, shape, output_dim=2, seed=7))
    assert all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


@pytest.mark.parametrize(("config", "shape"), CASES)
def test_different_seeds_give_different_parameters(config, shape):
    first = parameters_of(build_model(config, shape, output_dim=2, seed=7))
    second = parameters_of(build_model(config, shape, output_dim=2, seed=8))
    assert not all(torch.equal(a, b) for a, b in zip(first, second, strict=True))


def test_building_a_model_leaves_the_global_rng_untouched():
    torch.manual_seed(123)
    expected = torch.rand(8)
    torch.manual_seed(123)
    build_model(CnnModel(name="cnn"), (1, 8, 8), output_dim=10, seed=0)
    assert torch.equal(torch.rand(8), expected)


def test_parameters_follow_pytorch_default_bounds():
    model = build_model(LinearModel(name="linear"), (100,), output_dim=4, seed=0)
    layer = model[1]
    assert layer.weight.abs().max() <= 0.1
    assert layer.bias.abs().max() <= 0.1
    assert layer.weight.std() > 0.03


def test_mlp_64_128_128_10_has_the_exact_parameter_count():
    model = build_model(MlpModel(name="mlp", hidden=[128, 128]), (64,), output_dim=10, seed=0)
    count = sum(parameter.numel() for parameter in model.parameters())
    assert count == (64 * 128 + 128) + (128 * 128 + 128) + (128 * 10 + 10)
    assert count == 26122


def test_mlp_uses_the_requested_activation():
    model = build_model(MlpModel(name="mlp", hidden=[4, 4], activation="tanh"), (3,), 2, seed=0)
    assert sum(isinstance(m, nn.Tanh) for m in model.modules()) == 2
    assert not any(isinstance(m, nn.ReLU) for m in model.modules())


@pytest.mark.parametrize(
    ("shape", "pools"), [((1, 28, 28), 3), ((1, 8, 8), 2), ((1, 4, 4), 1), ((3, 5, 7), 1)]
)
def test_cnn_skips_pooling_once_the_image_would_shrink_below_2(shape, pools):
    model = build_model(CnnModel(name="cnn", channels=[4, 4, 4]), shape, output_dim=2, seed=0)
    assert sum(isinstance(m, nn.MaxPool2d) for m in model.modules()) == pools
    assert model(torch.randn(2, *shape)).shape == (2, 2)


@pytest.mark.parametrize("shape", [(30,), (1, 3, 3), (28, 28)])
def test_cnn_on_non_image_input_is_refused_with_the_shape_and_a_suggestion(shape):
    with pytest.raises(ValueError, match="cnn") as refused:
        build_model(CnnModel(name="cnn"), shape, output_dim=2, seed=0)
    assert str(shape) in str(refused.value)
    assert "'mlp' or 'linear'" in str(refused.value)


def test_nonsense_dimensions_are_refused():
    with pytest.raises(ValueError, match="output_dim"):
        build_model(LinearModel(name="linear"), (3,), output_dim=0, seed=0)
    with pytest.raises(ValueError, match="input shape"):
        build_model(LinearModel(name="linear"), (), output_dim=2, seed=0)


def test_model_section_picks_the_class_by_name_with_defaults():
    assert MODEL_CONFIG.validate_python({"name": "linear"}) == LinearModel(name="linear")
    mlp = MODEL_CONFIG.validate_python({"name": "mlp"})
    assert (mlp.hidden, mlp.activation) == ([64, 64], "relu")
    cnn = MODEL_CONFIG.validate_python({"name": "cnn"})
    assert (cnn.channels, cnn.hidden) == ([16, 32], 64)


@pytest.mark.parametrize(
    "section",
    [
        {"name": "rnn"},
        {"name": "mlp", "hidden": []},
        {"name": "mlp", "hidden": [64, 0]},
        {"name": "mlp", "activation": "gelu"},
        {"name": "cnn", "channels": []},
        {"name": "cnn", "channels": [8, 8, 8, 8]},
        {"name": "cnn", "hidden": -1},
        {"name": "cnn", "norm": "batch"},
    ],
)
def test_model_section_refuses_invalid_settings(section):
    with pytest.raises(ValidationError):
        MODEL_CONFIG.validate_python(section)


def test_model_section_refuses_unknown_keys_with_a_hint():
    with pytest.raises(ValidationError, match="did you mean 'hidden'"):
        MODEL_CONFIG.validate_python({"name": "mlp", "hiden": [8]})


def test_a_cnn_can_use_silu_group_norm_and_no_hidden_layer() -> None:
    config = MODEL_CONFIG.validate_python(
        {"name": "cnn", "channels": [32, 12], "hidden": 0, "activation": "silu", "norm": "group"}
    )
    model = build_model(config, (1, 8, 8), 10, seed=0)
    kinds = [type(layer).__name__ for layer in model]
    assert kinds == [
        "Conv2d", "SiLU", "GroupNorm", "MaxPool2d",
        "Conv2d", "SiLU", "GroupNorm", "MaxPool2d", "Flatten", "Linear",
    ]  # fmt: skip
    assert [m.num_groups for m in model if isinstance(m, torch.nn.GroupNorm)] == [8, 6]
    assert model(torch.zeros(2, 1, 8, 8)).shape == (2, 10)
    assert torch.equal(model[2].weight, torch.ones(32))
