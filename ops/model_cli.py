"""`fedsilo model pin` and `fedsilo model digest`, and what `fedsilo policy validate` says about
a plugin model and a warm start.

A plugin model's policy pins the network (`model.architecture`): `model pin` builds it with the
plug-in installed here and prints the block to paste under `model:` (it never rewrites the
policy file). `plugin_report` checks a loaded policy's plugin model where it is installed
(the pinned architecture, and DP-SGD compatibility under `privacy.dp_sgd`); where it is not,
each silo checks it when it joins.

A warm start (`model.init`) pins a model file by the digest of its tensors: `model digest`
prints the `init:` block for a file (models/warm_start.py). `warm_start_report` checks a loaded
policy's warm start where its file is on this machine: the digest, and that its tensors fit
the network the policy builds (for the data here, or as a plugin model's architecture pins it).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import click
from pydantic import ValidationError

from fedsilo.models import architecture
from fedsilo.models.plugins import PluginError, build_plugin, find_factory
from fedsilo.models.warm_start import (
    FILE_KEY,
    WarmStartError,
    digest_problem,
    fit_problem,
    init_block,
    read_warm_start,
)
from fedsilo.models.zoo import build_model
from fedsilo.policies.loading import (
    PolicyError,
    describe_errors,
    example_file,
    example_name,
    read_text_file,
    read_yaml,
)
from fedsilo.policies.model import PINNING, PluginModel
from fedsilo.policies.schema import Policy
from fedsilo.silo.data import DataError, load_consortium
from fedsilo.silo.errors import DpSgdError

Schema = tuple[tuple[int, ...], int]  # one input row's shape, the output size


def plugin_report(policy: Policy, file: Path) -> list[str]:
    """What `policy validate` adds for a plugin model (nothing for a zoo model): whether the
    plug-in is installed here and, if so, the architecture and DP-SGD checks; a
    ClickException when the plug-in here builds another network or one DP-SGD cannot train."""
    config = policy.model
    if not isinstance(config, PluginModel):
        return []
    dp = policy.privacy.dp_sgd is not None
    checks = "the pinned architecture" + (" and DP-SGD compatibility" if dp else "")
    entry_point = find_factory(config.factory)
    if entry_point is None:
        return [
            f"model plug-in {config.factory!r}: not installed here; each silo checks it when it "
            f"joins (listed in rules.allowed_model_factories, installed, {checks})"
        ]
    installed = (
        f"model plug-in {config.factory!r}: installed here (entry point {entry_point.name!r})"
    )
    try:
        shape, outputs = _schema(policy, _base_dir(file), None, None)
    except DataError as error:
        return [f"{installed}; {checks} not checked here, each silo checks them: {error}"]
    try:
        model = build_model(config, shape, outputs, policy.seed)
    except PluginError as error:
        raise click.ClickException(f"{file}: model.factory: {error}") from None
    pin = config.architecture
    assert pin is not None  # a loaded policy's plugin model is pinned
    lines = [
        installed,
        f"  architecture: as pinned ({len(pin.tensors)} tensors, digest {pin.digest[:12]}...) "
        f"for input shape {shape} and {outputs} outputs",
    ]
    if dp:
        from fedsilo.silo.dp_training import check_model as check_dp_model  # Opacus: seconds

        try:
            check_dp_model(model)
        except DpSgdError as error:
            raise click.ClickException(
                f"{file}: model: DP-SGD (privacy.dp_sgd) cannot train this model: {error}; "
                "fedsilo never swaps layers silently"
            ) from None
        lines.append("  DP-SGD: every layer supports per-sample gradients (opacus ModuleValidator)")
    return lines


def warm_start_report(policy: Policy, file: Path) -> list[str]:
    """What `policy validate` says of the policy's warm start (nothing without one): its file's
    digest and fit where the file is on this machine (a ClickException naming
    `model.init.digest` or `model.init.file` when they are not the policy's), else that the
    coordinator checks them when the job starts."""
    init = policy.model.init
    if init is None:
        return []
    path = Path(init.file)
    if not path.is_file():
        return [
            f"{FILE_KEY} {init.file!r}: not on this machine; the coordinator reads it and checks "
            "its digest and fit when the job starts"
        ]
    try:
        warm = read_warm_start(path)
        problem = digest_problem(init, warm.digest, "the file's tensors")
        if problem is None:
            network, checked = _network(policy, file)
            problem = fit_problem(warm, network, "the policy's model has") if network else None
    except WarmStartError as error:
        raise click.ClickException(f"{file}: {error}") from None
    if problem is not None:
        raise click.ClickException(f"{file}: {problem}")
    return [f"model.init: {init.file} holds the pinned tensors; {checked}"]


def _network(policy: Policy, file: Path) -> tuple[list[str], str]:
    """The architecture lines of the network the policy's model is (a plugin's pin, a zoo
    network built for the data here; none where the data is not here), and what that checks."""
    config = policy.model
    if isinstance(config, PluginModel) and config.architecture is not None:
        return config.architecture.tensors, "they fit the architecture the policy pins"
    try:
        shape, outputs = _schema(policy, _base_dir(file), None, None)
    except DataError as error:
        return [], f"their fit to the network is checked when the job starts ({error})"
    network = architecture.describe(build_model(config, shape, outputs, policy.seed))
    return network, f"they fit the network the policy builds for this data (input shape {shape})"


@click.group("model")
def model_group() -> None:
    """Work with a policy's model."""


@model_group.command("digest")
@click.argument("model_file", metavar="FILE", type=click.Path(path_type=Path))
def digest(model_file: Path) -> None:
    """Print the `init:` block that starts a job from the model in FILE (a final_model.safetensors
    of `fedsilo simulate --out` or `fedsilo job results`), to paste under `model:`."""
    try:
        warm = read_warm_start(model_file, str(model_file))
    except WarmStartError as error:
        raise click.ClickException(str(error)) from None
    click.echo(init_block(model_file, warm.digest))


@model_group.command("pin")
@click.argument("policy_file", metavar="POLICY")
@click.option(
    "--input-shape",
    help="One input row's shape, e.g. 1,16,16 (default: read from the policy's data section).",
)
@click.option(
    "--output-dim",
    type=click.IntRange(min=1),
    help="The model's outputs: classes, or 1 for regression (default: from the data section).",
)
def pin(policy_file: str, input_shape: str | None, output_dim: int | None) -> None:
    """Print the `architecture:` block that pins POLICY's plugin model, to paste under `model:`."""
    try:
        policy = _unpinned_policy(policy_file)
        config = policy.model
        if not isinstance(config, PluginModel):
            raise PolicyError(
                f"{policy_file}: model: only a plugin model is pinned; this one is "
                f"{config.name!r}, which fedsilo builds itself"
            )
        shape, outputs = _schema(
            policy, _base_dir(policy_file), _parse_shape(input_shape), output_dim
        )
        model = build_plugin(config, shape, outputs, policy.seed)
    except (PolicyError, PluginError) as error:
        raise click.ClickException(str(error)) from None
    except DataError as error:
        raise click.ClickException(
            f"{policy_file}: cannot read the data section for the input shape ({error}); pass "
            "--input-shape and --output-dim"
        ) from None
    click.echo(architecture_block(architecture.describe(model), shape, outputs))


def architecture_block(tensors: list[str], shape: tuple[int, ...], outputs: int) -> str:
    """`architecture.yaml_block` under a comment saying where to paste it."""
    comment = (
        f"# model.architecture for input shape {list(shape)} and {outputs} outputs:"
        " paste it under model:"
    )
    return "\n".join([comment, architecture.yaml_block(tensors, shape, outputs)])


def _unpinned_policy(policy_file: str) -> Policy:
    """The policy in `policy_file` with its model's architecture (if any) set aside."""
    name = example_name(policy_file)
    if name is not None:
        text, source = example_file(name).read_text(encoding="utf-8"), policy_file
    else:
        text, source = read_text_file(Path(policy_file), "policy file"), policy_file
    document = read_yaml(text, source)
    if not isinstance(document, Mapping):
        raise PolicyError(f"{source}: a policy is a mapping of sections")
    document = dict(document)
    model = document.get("model")
    if isinstance(model, Mapping):
        document["model"] = {k: v for k, v in model.items() if k != "architecture"}
    try:
        return Policy.model_validate(document, context={PINNING: True})
    except ValidationError as error:
        raise PolicyError(describe_errors(error, document, source)) from None


def _schema(
    policy: Policy, base_dir: Path | None, shape: tuple[int, ...] | None, outputs: int | None
) -> Schema:
    """The input shape and outputs: as given, else as the plugin model was pinned for, else
    those of the policy's data section (loaded here; a DataError if it cannot be)."""
    config = policy.model
    pin = config.architecture if isinstance(config, PluginModel) else None
    if shape is None and pin is not None and pin.input_shape is not None:
        shape = tuple(pin.input_shape)
    if outputs is None and pin is not None:
        outputs = pin.output_dim
    if shape is None or outputs is None:
        first = load_consortium(policy.data, policy.seed, base_dir=base_dir)[0]
        shape, outputs = shape or first.input_shape, outputs or first.output_dim
    return tuple(shape), outputs


def _parse_shape(text: str | None) -> tuple[int, ...] | None:
    if text is None:
        return None
    try:
        shape = tuple(int(side) for side in text.split(","))
    except ValueError:
        shape = ()
    if not shape or min(shape) < 1:
        raise click.BadParameter(
            f"{text!r} is not a shape: sides >= 1 separated by commas, e.g. 1,16,16",
            param_hint="--input-shape",
        )
    return shape


def _base_dir(file: str | Path) -> Path | None:
    """Where a policy's relative data paths start: its folder (none for a packaged example)."""
    return None if example_name(file) is not None else Path(file).parent
