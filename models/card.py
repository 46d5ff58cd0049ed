"""The model card: what a final model needs to be used on its own, stored in the header of
`final_model.safetensors` beside its parameters (the `card` key of fedsilo's header).

A card records the model config (`model:` of the policy), the parameter spec, the task and its
classes, the preprocessing a site repeats (`data.scaling`, and the seed that drew the site's
training rows, on which its statistics are fitted), the input width and the fedsilo version.

Feature names: the coordinator never sees a site's columns (each site's data dictionary is in
its own silo.yaml), so a card written by the coordinator records no names (`feature_names` is
None) but the width of one input row, read from the parameter spec. What makes a model fit a
site is that the network the card describes, built for the site's own encoded features,
has exactly the card's parameter spec (`check_fits`).

A plugin model's card records its model config whole (factory, args, pinned architecture), so
where the plug-in is installed `load_final_model` rebuilds the network from the plug-in's
module and loads the trained parameters into it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import TypeAdapter, ValidationError
from torch import nn

from fedsilo.models.plugins import PluginError
from fedsilo.models.zoo import build_model, load_flat
from fedsilo.policies.model import ModelConfig, PluginModel
from fedsilo.wire.tasks.tensor_names import MODEL
from fedsilo.wire.tensors import ParameterSpec, WireError, decode_tensors

CARD_KEY = "card"
FORMAT = "fedsilo-model/1"
_MODEL_CONFIG: TypeAdapter[ModelConfig] = TypeAdapter(ModelConfig)


class ModelCardError(ValueError):
    """A card that is missing, malformed, or describes a model that does not fit the data."""


@dataclass(frozen=True)
class ModelCard:
    fedsilo_version: str
    algorithm: str
    model: ModelConfig
    spec: ParameterSpec
    task: str  # "classification" | "regression"
    num_classes: int | None
    input_width: int | None  # features of one (flattened) input row; None when not readable
    scaling: str  # data.scaling: local | none | federated
    seed: int  # the policy's seed: it drew each site's train/val/test rows
    feature_names: tuple[str, ...] | None = None

    @classmethod
    def describe(
        cls,
        *,
        fedsilo_version: str,
        algorithm: str,
        model: ModelConfig,
        spec: ParameterSpec,
        scaling: str,
        seed: int,
    ) -> ModelCard:
        """The card of a model with parameter spec `spec`: the output size (classes, or 1 for
        regression) is a zoo model's last layer's bias, the input width its first weight's
        fan-in; a plugin model's output size is the one its architecture was pinned for (else
        its last tensor's size), and its input width is not read from its tensors."""
        if not spec.entries:
            raise ModelCardError("the model has no parameters")
        outputs = math.prod(spec.entries[-1].shape)
        first = spec.entries[0].shape
        if isinstance(model, PluginModel):
            pinned = model.architecture.output_dim if model.architecture else None
            outputs, first = pinned or outputs, ()
        return cls(
            fedsilo_version=fedsilo_version,
            algorithm=algorithm,
            model=model,
            spec=spec,
            task="classification" if outputs > 1 else "regression",
            num_classes=outputs if outputs > 1 else None,
            input_width=first[1] if len(first) == 2 else None,
            scaling=scaling,
            seed=seed,
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "fedsilo_version": self.fedsilo_version,
            "algorithm": self.algorithm,
            "model": self.model.model_dump(mode="json"),
            "spec": self.spec.to_json(),
            "task": self.task,
            "num_classes": self.num_classes,
            "input_width": self.input_width,
            "preprocessing": {"scaling": self.scaling, "seed": self.seed},
            "feature_names": None if self.feature_names is None else list(self.feature_names),
        }

    @classmethod
    def from_json(cls, data: Any, origin: str) -> ModelCard:
        """The card in `data`, or a ModelCardError naming `origin` and the field."""
        if not isinstance(data, Mapping) or data.get("format") != FORMAT:
            raise ModelCardError(
                f"{origin}: no fedsilo model card ({FORMAT}) in its header; use the "
                "final_model.safetensors a fedsilo run wrote"
            )
        try:
            preprocessing = data["preprocessing"]
            names = data["feature_names"]
            return cls(
                fedsilo_version=str(data["fedsilo_version"]),
                algorithm=str(data["algorithm"]),
                model=_MODEL_CONFIG.validate_python(data["model"]),
                spec=ParameterSpec.from_json(data["spec"]),
                task=str(data["task"]),
                num_classes=data["num_classes"],
                input_width=data["input_width"],
                scaling=str(preprocessing["scaling"]),
                seed=int(preprocessing["seed"]),
                feature_names=None if names is None else tuple(str(n) for n in names),
            )
        except KeyError as error:
            raise ModelCardError(f"{origin}: model card lacks {error.args[0]!r}") from None
        except (TypeError, ValueError, ValidationError, WireError) as error:
            raise ModelCardError(f"{origin}: malformed model card: {error}") from None

    def check_fits(
        self,
        task: str,
        num_classes: int | None,
        input_shape: tuple[int, ...],
        feature_names: tuple[str, ...],
    ) -> nn.Module:
        """The card's network for a site whose encoded data has this task, classes, input shape
        and feature names, with untrained parameters; a ModelCardError saying what differs when
        the model does not fit them."""
        if (task, num_classes) != (self.task, self.num_classes):
            raise ModelCardError(
                f"the model predicts {_target(self.task, self.num_classes)}, but this site's "
                f"target is {_target(task, num_classes)}"
            )
        width = math.prod(input_shape)
        if self.input_width is not None and width != self.input_width:
            raise ModelCardError(
                f"the model reads {self.input_width} features, but this site's data encodes to "
                f"{width} ({', '.join(feature_names)}); the site's data dictionary (columns, "
                "categorical lists, drop_columns) must be the consortium's"
            )
        if self.feature_names is not None and tuple(feature_names) != self.feature_names:
            raise ModelCardError(
                f"the model's features are {list(self.feature_names)}, but this site's are "
                f"{list(feature_names)}"
            )
        output = self.num_classes or 1
        try:
            model = build_model(self.model, input_shape, output, seed=0)
        except PluginError as error:
            raise ModelCardError(f"the model cannot be built here: {error}") from None
        except ValueError as error:
            raise ModelCardError(f"the model does not fit this site's data: {error}") from None
        if ParameterSpec.of(dict(model.named_parameters())) != self.spec:
            raise ModelCardError(
                f"the model's parameter spec does not fit this site's data (input shape "
                f"{tuple(input_shape)}, {output} outputs)"
            )
        return model

    def load(self, model: nn.Module, flat: torch.Tensor) -> nn.Module:
        """`model` (from `check_fits`) with the card's trained parameters `flat`."""
        try:
            self.spec.check(flat)
        except WireError as error:
            raise ModelCardError(f"the parameters do not match the card's spec: {error}") from None
        return load_flat(model, flat).eval()


def read_final_model(path: Path, origin: str) -> tuple[ModelCard, torch.Tensor]:
    """The card and flat parameters of a `final_model.safetensors`; `origin` names it in errors."""
    try:
        tensors, header = decode_tensors(path.read_bytes())
    except OSError as error:
        raise ModelCardError(f"{origin}: cannot read it: {error.strerror}") from None
    except WireError as error:
        raise ModelCardError(f"{origin}: not a fedsilo model file: {error}") from None
    card = ModelCard.from_json(header.get(CARD_KEY), origin)
    if MODEL not in tensors:
        raise ModelCardError(f"{origin}: holds no {MODEL!r} tensor")
    return card, tensors[MODEL]


def load_final_model(path: Path, input_shape: tuple[int, ...] | None = None) -> nn.Module:
    """The trained network of a run's `final_model.safetensors`, rebuilt from its card's model
    config (a plugin model: by the installed plug-in) for `input_shape` (default: the shape
    the plugin architecture was pinned for, or a zoo model's input width), in eval mode."""
    card, flat = read_final_model(Path(path), str(path))
    shape = input_shape or _input_shape(card)
    if shape is None:
        raise ModelCardError(
            f"{path}: its card records no input shape ({card.model.name} model); pass input_shape"
        )
    try:
        model = build_model(card.model, tuple(shape), card.num_classes or 1, seed=0)
    except ValueError as error:
        raise ModelCardError(f"{path}: the model cannot be built here: {error}") from None
    if ParameterSpec.of(dict(model.named_parameters())) != card.spec:
        raise ModelCardError(
            f"{path}: the network built for input shape {tuple(shape)} does not have the "
            "card's parameter spec"
        )
    return card.load(model, flat)


def _input_shape(card: ModelCard) -> tuple[int, ...] | None:
    if isinstance(card.model, PluginModel):
        pinned = card.model.architecture.input_shape if card.model.architecture else None
        return tuple(pinned) if pinned else None
    return None if card.input_width is None else (card.input_width,)


def _target(task: str, num_classes: int | None) -> str:
    return f"{num_classes} classes" if task == "classification" else "a regression value"
