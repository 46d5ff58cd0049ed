"""A network's architecture as text: one line per parameter, `<name> [<shape>] <dtype>`, in
`named_parameters()` order, and the digest of those lines. A plugin model's policy pins them
(`model.architecture`, in YAML: `yaml_block`); silos check the network they build against the
pin, and the coordinator checks the initial model's parameter spec, so every party names the
first tensor that differs.
"""

from __future__ import annotations

from torch import nn

from fedsilo.policies.model import ModelConfig, PluginModel, architecture_digest
from fedsilo.wire.tensors import ParameterSpec

digest = architecture_digest  # BLAKE2b-256 hex of the lines joined by "\n"


def describe(model: nn.Module) -> list[str]:
    """`model`'s parameters as architecture lines."""
    return [
        _line(name, tuple(p.shape), str(p.dtype).removeprefix("torch."))
        for name, p in model.named_parameters()
    ]


def describe_spec(spec: ParameterSpec) -> list[str]:
    """The architecture lines of a flat vector's layout (every entry has the spec's dtype)."""
    return [_line(entry.name, entry.shape, spec.dtype) for entry in spec.entries]


def spec_difference(config: ModelConfig, spec: ParameterSpec) -> str | None:
    """Where the silos' model (its parameter spec) departs from the architecture a plugin
    model's policy pins; None when it does not, or for a zoo model (which pins nothing). The
    coordinator checks the initial model so, without the plug-in installed."""
    if not isinstance(config, PluginModel) or config.architecture is None:
        return None
    return first_difference(
        config.architecture.tensors, describe_spec(spec), builder="the silos built"
    )


def first_difference(
    expected: list[str], actual: list[str], *, builder: str = "this site builds"
) -> str | None:
    """The first tensor where `actual` (what `builder` names) departs from `expected` (the
    policy's pin), in words; None when they are the same."""
    for index, (pinned, built) in enumerate(zip(expected, actual, strict=False)):
        if pinned != built:
            name = _name(pinned)
            if name == _name(built):
                return (
                    f"tensor {index} '{name}': the policy pins {_shown(pinned)}, {builder} "
                    f"{_shown(built)}"
                )
            return (
                f"tensor {index}: the policy pins '{name}' {_shown(pinned)}, {builder} "
                f"'{_name(built)}' {_shown(built)}"
            )
    if len(actual) < len(expected):
        missing = expected[len(actual)]
        return (
            f"tensor {len(actual)} '{_name(missing)}' ({_shown(missing)}) is pinned by the policy, "
            f"but {builder} only {len(actual)} of its {len(expected)} tensors"
        )
    if len(actual) > len(expected):
        extra = actual[len(expected)]
        return (
            f"tensor {len(expected)} '{_name(extra)}' ({_shown(extra)}): {builder} it, but the "
            f"policy pins only {len(expected)} tensors"
        )
    return None


def yaml_block(tensors: list[str], shape: tuple[int, ...], outputs: int) -> str:
    """The YAML of `model.architecture` pinning `tensors` (architecture lines) for one input
    row's `shape` and `outputs`, indented to go under `model:`."""
    lines = [
        "  architecture:",
        f"    digest: {digest(tensors)}",
        f"    input_shape: {list(shape)}",
        f"    output_dim: {outputs}",
        "    tensors:",
        *(f'      - "{line}"' for line in tensors),
    ]
    return "\n".join(lines)


def _line(name: str, shape: tuple[int, ...], dtype: str) -> str:
    return f"{name} [{','.join(str(side) for side in shape)}] {dtype}"


def _name(line: str) -> str:
    return line.split(" ", 1)[0]


def _shown(line: str) -> str:
    """`[16, 8, 3, 3] float32` for the line `conv.weight [16,8,3,3] float32`."""
    shape, dtype = line.split(" ", 1)[1].rsplit(" ", 1)
    return f"{shape.replace(',', ', ')} {dtype}"
