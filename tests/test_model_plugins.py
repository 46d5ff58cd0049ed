"""Model plug-ins (issue 20): a policy names a network by an installed entry point of group
`fedsilo.models` and pins its architecture; sites build it, check it and refuse what they do
not allow, have not installed or cannot train under DP; the coordinator checks the pin
without the plug-in; a final model loads back into the plug-in's network.

Factories are registered by monkeypatching the entry point discovery, never installed.
"""

from __future__ import annotations

from importlib.metadata import EntryPoint
from pathlib import Path

import pytest
import torch
import yaml
from click.testing import CliRunner

from fedsilo.coordinator.phases import PhaseOutcome
from fedsilo.coordinator.strategies import make_strategy
from fedsilo.coordinator.strategies.base import RoundContext, SetupError
from fedsilo.models import architecture, plugins
from fedsilo.models.card import CARD_KEY, load_final_model
from fedsilo.models.plugins import GROUP, PluginError
from fedsilo.models.zoo import build_model
from fedsilo.ops import silo_process
from fedsilo.ops.cli import main
from fedsilo.ops.metrics import SiloMetrics
from fedsilo.ops.provision import load_silo_kit
from fedsilo.ops.report import write_final_model
from fedsilo.ops.simulate import load_silos, simulate
from fedsilo.policies.loading import PolicyError, parse_policy
from fedsilo.policies.model import PINNING, PluginModel
from fedsilo.silo.config import LocalRules, load_silo_config
from fedsilo.silo.dp_training import DpSgdError
from fedsilo.wire.tasks.tensor_names import MODEL
from fedsilo.wire.tensors import ParameterSpec, decode_tensors
from tests.deployment import provision

SMALL = "tests.plugin_fixtures:small_net"
WIDE = "tests.plugin_fixtures:wide_net"
BATCHNORM = "tests.plugin_fixtures:batchnorm_net"
NOT_A_MODULE = "tests.plugin_fixtures:not_a_module"
DROPOUT = "tests.plugin_fixtures:dropout_net"
HEART = ((23,), 2)  # the bundled heart data's input shape and classes


@pytest.fixture(autouse=True)
def installed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The test factories, as a site that installed them would see them."""
    entry_points = [
        EntryPoint(name=value.rsplit(":", 1)[1], value=value, group=GROUP)
        for value in (SMALL, WIDE, BATCHNORM, NOT_A_MODULE, DROPOUT)
    ]
    monkeypatch.setattr(plugins, "installed_factories", lambda: entry_points)


def unpinned(factory: str, **args) -> PluginModel:
    """A plugin model section as `fedsilo model pin` reads it, before it is pinned."""
    document = {"name": "plugin", "factory": factory, "args": args}
    return PluginModel.model_validate(document, context={PINNING: True})


def pinned(factory: str, shape=HEART[0], outputs=HEART[1], **args) -> dict:
    """A plugin model section pinned to what `factory` builds for `shape` and `outputs`."""
    model = plugins.build_plugin(unpinned(factory, **args), shape, outputs, seed=0)
    lines = architecture.describe(model)
    return {
        "name": "plugin",
        "factory": factory,
        "args": args,
        "architecture": {
            "digest": architecture.digest(lines),
            "tensors": lines,
            "input_shape": list(shape),
            "output_dim": outputs,
        },
    }


def plugin_policy(model: dict, **overrides: object) -> dict:
    return {
        "version": 1,
        "rounds": 2,
        "seed": 3,
        "algorithm": {"name": "fedavg"},
        "model": model,
        **overrides,
    }


DP = {"dp_sgd": {"noise_multiplier": 1.0, "max_grad_norm": 1.0}}


def cli(*args: str):
    return CliRunner().invoke(main, list(args))


def write_policy(tmp_path: Path, document: dict) -> Path:
    path = tmp_path / "policy.yaml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    return path


# -- the policy --------------------------------------------------------------------------------


def test_a_plugin_model_without_its_architecture_is_refused_saying_how_to_pin_it() -> None:
    with pytest.raises(
        PolicyError, match="model: architecture is required for a plugin model"
    ) as error:
        parse_policy(plugin_policy({"name": "plugin", "factory": SMALL}))
    assert "fedsilo model pin" in str(error.value)


def test_a_digest_that_is_not_the_digest_of_the_tensors_is_refused() -> None:
    model = pinned(SMALL)
    model["architecture"]["tensors"][0] = "fc1.weight [9,23] float32"
    with pytest.raises(PolicyError, match="is not the digest of the tensors listed"):
        parse_policy(plugin_policy(model))


def test_a_tensor_line_that_is_not_name_shape_dtype_is_refused() -> None:
    model = pinned(SMALL)
    lines = ["fc1.weight (8, 23) float32"]
    model["architecture"].update(tensors=lines, digest=architecture.digest(lines))
    with pytest.raises(PolicyError, match="is not '<name> \\[<shape>\\] <dtype>'"):
        parse_policy(plugin_policy(model))


def test_a_factory_must_read_module_colon_attribute() -> None:
    model = {**pinned(SMALL), "factory": "tests.plugin_fixtures.small_net"}
    with pytest.raises(PolicyError, match="factory"):
        parse_policy(plugin_policy(model))


def test_loading_a_policy_does_not_need_the_plugin_installed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    document = plugin_policy(pinned(SMALL))
    monkeypatch.setattr(plugins, "installed_factories", lambda: [])
    assert isinstance(parse_policy(document).model, PluginModel)


def test_fedevg_refuses_a_plugin_model_its_coordinator_would_have_to_run() -> None:
    document = plugin_policy(
        pinned(SMALL),
        algorithm={"name": "fedevg"},
        data={"source": "sklearn:digits", "scaling": "none"},
    )
    with pytest.raises(PolicyError, match="fedevg trains its classifier at the coordinator"):
        parse_policy(document)


# -- building and pinning ----------------------------------------------------------------------


def test_a_pinned_plugin_model_builds_as_its_policy_pins_it() -> None:
    policy = parse_policy(plugin_policy(pinned(SMALL, hidden=5)))
    model = build_model(policy.model, *HEART, seed=1)
    assert architecture.describe(model) == policy.model.architecture.tensors
    assert model.fc1.out_features == 5  # the policy's args reach the factory


def test_the_pin_command_prints_a_block_that_pins_what_the_plugin_builds(tmp_path: Path) -> None:
    path = write_policy(tmp_path, plugin_policy({"name": "plugin", "factory": SMALL}))
    before = path.read_text()
    result = cli("model", "pin", str(path), "--input-shape", "1,4,4", "--output-dim", "10")
    assert result.exit_code == 0, result.output
    assert path.read_text() == before  # the user's file is never rewritten
    block = yaml.safe_load(result.output)["architecture"]
    assert block["input_shape"] == [1, 4, 4] and block["output_dim"] == 10
    assert block["tensors"] == [
        "fc1.weight [8,16] float32",
        "fc1.bias [8] float32",
        "fc2.weight [10,8] float32",
        "fc2.bias [10] float32",
    ]
    policy = parse_policy(
        plugin_policy({"name": "plugin", "factory": SMALL, **yaml.safe_load(result.output)})
    )
    assert (
        architecture.describe(build_model(policy.model, (1, 4, 4), 10, seed=0)) == block["tensors"]
    )


def test_the_pin_command_reads_the_shape_from_the_data_section_and_replaces_an_old_pin(
    tmp_path: Path,
) -> None:
    stale = pinned(WIDE)["architecture"]
    path = write_policy(
        tmp_path, plugin_policy({"name": "plugin", "factory": SMALL, "architecture": stale})
    )
    result = cli("model", "pin", str(path))
    assert result.exit_code == 0, result.output
    assert yaml.safe_load(result.output)["architecture"] == pinned(SMALL)["architecture"]


def test_the_pin_command_refuses_a_zoo_model(tmp_path: Path) -> None:
    path = write_policy(tmp_path, plugin_policy({"name": "mlp"}))
    result = cli("model", "pin", str(path))
    assert result.exit_code == 1
    assert "only a plugin model is pinned" in result.output


def test_a_network_other_than_the_pinned_one_is_refused_naming_the_first_tensor_that_differs() -> (
    None
):
    model = {**pinned(SMALL), "factory": WIDE}
    policy = parse_policy(plugin_policy(model))
    with pytest.raises(PluginError) as error:
        build_model(policy.model, *HEART, seed=0)
    assert (
        "tensor 0 'fc1.weight': the policy pins [8, 23] float32, this site builds [16, 23] float32"
        in str(error.value)
    )


def test_a_missing_or_an_extra_tensor_is_named() -> None:
    lines = ["a.weight [2,3] float32", "a.bias [2] float32"]
    assert "tensor 1 'a.bias' ([2] float32) is pinned by the policy" in str(
        architecture.first_difference(lines, lines[:1])
    )
    assert "tensor 2 'b.bias' ([1] float32): this site builds it" in str(
        architecture.first_difference(lines, [*lines, "b.bias [1] float32"])
    )
    assert architecture.first_difference(lines, list(lines)) is None


def test_a_factory_not_installed_is_refused_naming_it_and_the_installed_ones(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policy = parse_policy(plugin_policy(pinned(SMALL)))
    monkeypatch.setattr(plugins, "installed_factories", lambda: [])
    with pytest.raises(PluginError) as error:
        build_model(policy.model, *HEART, seed=0)
    assert str(error.value) == (
        f"model factory '{SMALL}' is not installed at this site (entry points fedsilo.models: [])"
    )


def test_only_an_installed_entry_point_is_loaded_never_a_module_the_policy_names() -> None:
    model = {**pinned(SMALL), "factory": "os:getcwd"}  # importable, but no entry point
    policy = parse_policy(plugin_policy(model))
    with pytest.raises(PluginError, match="'os:getcwd' is not installed at this site"):
        build_model(policy.model, *HEART, seed=0)


def test_a_factory_that_returns_no_module_is_refused() -> None:
    with pytest.raises(PluginError, match="returned a list, not a torch.nn.Module"):
        plugins.build_plugin(unpinned(NOT_A_MODULE), *HEART, seed=0)


def test_the_same_seed_builds_bit_identical_parameters_and_the_global_rng_is_untouched() -> None:
    policy = parse_policy(plugin_policy(pinned(SMALL)))
    torch.manual_seed(1234)
    state = torch.random.get_rng_state()
    first = build_model(policy.model, *HEART, seed=5)
    assert torch.equal(torch.random.get_rng_state(), state)
    second = build_model(policy.model, *HEART, seed=5)
    other = build_model(policy.model, *HEART, seed=6)
    for a, b in zip(first.parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b)
    assert not torch.equal(first.fc1.weight, other.fc1.weight)


# -- the site ----------------------------------------------------------------------------------


def test_a_site_refuses_a_plugin_model_its_rules_do_not_list() -> None:
    policy = parse_policy(plugin_policy(pinned(SMALL)))
    (problem,) = LocalRules().violations(policy)
    assert problem.startswith(f"allowed_model_factories: the policy's model factory '{SMALL}'")
    assert LocalRules(allowed_model_factories=[SMALL]).violations(policy) == []
    assert LocalRules(allowed_model_factories=[WIDE]).violations(policy) != []


def test_a_silo_prepares_the_model_before_accepting_and_refuses_what_it_cannot_build_or_train(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`silo start`'s preparation of a job: not installed, and BatchNorm under DP-SGD, are
    refused naming the factory and the layer; BatchNorm without DP is accepted."""
    consortium = provision(tmp_path, ("silo-0",))
    config_path = tmp_path / "silo.yaml"
    config_path.write_text(
        yaml.safe_dump(
            {
                "version": 1,
                "kit": str(consortium.kits / "silos" / "silo-0"),
                "data": {"source": {"source": "heart"}, "select": "Cleveland"},
                "rules": {"allowed_model_factories": [SMALL, BATCHNORM]},
            }
        )
    )
    config = load_silo_config(config_path)
    kit = load_silo_kit(config.kit_path(config_path))

    def prepare(document: dict) -> object:
        policy = parse_policy(document)
        assert config.rules.violations(policy) == []
        return silo_process._start_agent(
            config, config_path, kit, policy, "0" * 64, 1, SiloMetrics()
        )

    assert callable(prepare(plugin_policy(pinned(BATCHNORM))))
    with pytest.raises(DpSgdError, match="BatchNorm1d at 'bn1'.*replace it with GroupNorm"):
        prepare(plugin_policy(pinned(BATCHNORM), privacy=DP))
    monkeypatch.setattr(plugins, "installed_factories", lambda: [])
    with pytest.raises(PluginError, match=f"'{SMALL}' is not installed at this site"):
        prepare(plugin_policy(pinned(SMALL)))


# -- policy validate ---------------------------------------------------------------------------


def test_validate_checks_an_installed_plugin_and_its_dp_compatibility(tmp_path: Path) -> None:
    result = cli(
        "policy", "validate", str(write_policy(tmp_path, plugin_policy(pinned(SMALL), privacy=DP)))
    )
    assert result.exit_code == 0, result.output
    assert f"model plug-in '{SMALL}': installed here" in result.output
    assert "architecture: as pinned (4 tensors" in result.output
    assert "DP-SGD: every layer supports per-sample gradients" in result.output

    result = cli(
        "policy",
        "validate",
        str(write_policy(tmp_path, plugin_policy(pinned(BATCHNORM), privacy=DP))),
    )
    assert result.exit_code == 1
    assert "DP-SGD (privacy.dp_sgd) cannot train this model: BatchNorm1d at 'bn1'" in result.output


def test_validate_refuses_a_plugin_installed_here_that_builds_another_network(
    tmp_path: Path,
) -> None:
    policy = write_policy(tmp_path, plugin_policy({**pinned(SMALL), "factory": WIDE}))
    result = cli("policy", "validate", str(policy))
    assert result.exit_code == 1
    assert "tensor 0 'fc1.weight'" in result.output


def test_validate_says_a_plugin_not_installed_here_is_checked_at_each_silo(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    policy = write_policy(tmp_path, plugin_policy(pinned(BATCHNORM), privacy=DP))
    monkeypatch.setattr(plugins, "installed_factories", lambda: [])
    result = cli("policy", "validate", str(policy))
    assert result.exit_code == 0, result.output
    assert "not installed here; each silo checks it when it joins" in result.output


# -- the coordinator, a run, its final model ---------------------------------------------------


def test_the_coordinator_fails_the_setup_when_the_initial_model_is_not_the_pinned_one() -> None:
    """No plug-in at the coordinator: the init answer's parameter spec is held to the pin."""
    policy = parse_policy(plugin_policy(pinned(SMALL)))
    wide = plugins.build_plugin(unpinned(WIDE), *HEART, seed=0)
    spec = ParameterSpec.of(dict(wide.named_parameters()))
    script = make_strategy(policy).setup(RoundContext(0, 2, ("a",), 3, 1))
    next(script)
    outcome = PhaseOutcome(
        "init",
        {},
        {},
        tensors={"a": {MODEL: torch.zeros(spec.numel)}},
        spec=spec,
        digests={"a": "x"},
    )
    with pytest.raises(
        SetupError,
        match=r"tensor 0 'fc1.weight': the policy pins \[8, 23\] float32, the silos built \[16, ",
    ):
        script.send(outcome)


def test_a_simulation_trains_a_plugin_model_whose_final_model_loads_back_into_the_plugin(
    tmp_path: Path,
) -> None:
    policy = parse_policy(plugin_policy(pinned(SMALL, hidden=6)))
    result = simulate(policy, load_silos(policy, None))
    state = result.history.state
    assert [e.name for e in state.spec.entries] == [
        "fc1.weight",
        "fc1.bias",
        "fc2.weight",
        "fc2.bias",
    ]
    assert result.history.final.summary["accuracy"]["mean"] > 0.5
    again = simulate(policy, load_silos(policy, None)).history.state.model
    assert torch.equal(state.model, again)

    card = write_final_model(tmp_path, policy, state)
    path = tmp_path / "final_model.safetensors"
    recorded = decode_tensors(path.read_bytes())[1][CARD_KEY]["model"]
    assert (recorded["factory"], recorded["args"]) == (SMALL, {"hidden": 6})
    assert recorded["architecture"] == policy.model.architecture.model_dump(mode="json")
    assert (card.task, card.num_classes) == ("classification", 2)

    model = load_final_model(path)
    assert type(model).__name__ == "SmallNet" and not model.training
    assert torch.equal(state.spec.flatten(dict(model.named_parameters())), state.model)


@pytest.mark.parametrize("privacy", [{}, DP], ids=["plain", "dp-sgd"])
def test_a_plugin_with_dropout_gives_the_same_bits_in_two_identical_runs(privacy: dict) -> None:
    # dropout draws from torch's global generator, which concurrent silos share: each training
    # task seeds it from the task alone, and holds it while it trains (models/global_rng.py)
    policy = parse_policy(
        plugin_policy(
            pinned(DROPOUT), rounds=2, privacy=privacy, training={"epochs": 2, "batch_size": 16}
        )
    )
    datasets = load_silos(policy, None)
    first, second = (simulate(policy, datasets).history.state.model for _ in range(2))
    assert torch.equal(first, second)
    other_seed = policy.with_overrides(seed=policy.seed + 1)
    assert not torch.equal(first, simulate(other_seed, datasets).history.state.model)


def test_a_simulation_refuses_a_batchnorm_plugin_under_dp_before_its_first_round() -> None:
    """What each silo of a deployment checks before it accepts, `simulate` checks too."""
    policy = parse_policy(plugin_policy(pinned(BATCHNORM), privacy=DP))
    with pytest.raises(DpSgdError, match="bn1"):
        simulate(policy)
