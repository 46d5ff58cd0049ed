"""Policy files: every example validates, and every mistake is named with the allowed values."""

import re
from importlib.resources import files
from pathlib import Path

import pytest
import yaml

from fedsilo.coordinator.strategies import STRATEGIES
from fedsilo.policies.algorithms import AlgorithmConfig
from fedsilo.policies.loading import PolicyError, load_policy, parse_policy, with_algorithm
from fedsilo.policies.training import TrainingConfig

EXAMPLES = sorted(Path(str(files("fedsilo.policies") / "examples")).glob("*.yaml"))


def policy(**sections: object) -> dict:
    return {"version": 1, **sections}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.name)
def test_every_example_policy_validates(path: Path) -> None:
    assert load_policy(path).version == 1


def test_there_is_an_example_for_every_strategy() -> None:
    used = {load_policy(p).algorithm.name for p in EXAMPLES}
    assert used == set(STRATEGIES)


def test_every_algorithm_the_schema_accepts_has_a_strategy() -> None:
    union = AlgorithmConfig.__origin__.__args__  # type: ignore[attr-defined]
    names = {tag for member in union for tag in member.model_fields["name"].annotation.__args__}
    assert names == set(STRATEGIES)


def test_a_typo_in_a_key_names_the_field_and_suggests_the_right_one() -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy(policy(training={"lrr": 0.1}), source="p.yaml")
    message = str(err.value)
    assert message.startswith("p.yaml: training: unknown field 'lrr' (did you mean 'lr'?)")


def test_a_typo_at_the_top_level_is_caught_too() -> None:
    with pytest.raises(PolicyError, match="unknown field 'round' \\(did you mean 'rounds'\\?\\)"):
        parse_policy(policy(round=3))


def test_an_unknown_algorithm_lists_the_allowed_ones_with_a_hint() -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy(policy(algorithm={"name": "fedavgg"}))
    message = str(err.value)
    assert "algorithm: unknown value 'fedavgg' (did you mean 'fedavg'?)" in message
    assert "fedyogi" in message and "central" in message


def test_an_out_of_range_value_names_the_nested_field_and_the_value() -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy(policy(algorithm={"name": "fedavg", "client_fraction": 1.5}))
    assert "algorithm.client_fraction: Input should be less than or equal to 1 (got 1.5)" in str(
        err.value
    )


def test_errors_in_a_tagged_section_name_the_field_not_the_tag() -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy(
            policy(data={"source": "sklearn:wine", "partition": {"kind": "dirichlet", "silos": 3}})
        )
    assert "data.partition.alpha: Field required" in str(err.value)


def test_several_problems_are_all_reported() -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy(policy(rounds=0, training={"lr": -1}))
    assert "2 problems" in str(err.value)
    assert "rounds:" in str(err.value) and "training.lr:" in str(err.value)


def test_version_is_required_and_checked() -> None:
    with pytest.raises(PolicyError, match="'version' is required"):
        parse_policy({"rounds": 3})
    with pytest.raises(PolicyError, match="unsupported policy version 7"):
        parse_policy({"version": 7})


def test_file_problems_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="missing.yaml: policy file not found"):
        load_policy(tmp_path / "missing.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: [1\n")
    with pytest.raises(PolicyError, match="bad.yaml: not valid YAML"):
        load_policy(bad)
    listed = tmp_path / "list.yaml"
    listed.write_text(yaml.safe_dump([1, 2]))
    with pytest.raises(PolicyError, match="a policy is a mapping"):
        load_policy(listed)


def test_defaults_make_a_runnable_policy() -> None:
    loaded = parse_policy(policy())
    assert loaded.algorithm.name == "fedavg" and loaded.data.source == "heart"


def test_training_needs_exactly_one_of_epochs_and_steps() -> None:
    assert TrainingConfig(steps=5).epochs is None
    with pytest.raises(PolicyError, match="exactly one of 'epochs' and 'steps'"):
        parse_policy(policy(training={"epochs": 2, "steps": 5}))


def test_learning_rate_schedules() -> None:
    exponential = TrainingConfig(lr=0.1, lr_schedule={"kind": "exponential", "gamma": 0.5})
    assert [exponential.lr_at(r, 10) for r in range(3)] == [0.1, 0.05, 0.025]
    step = TrainingConfig(lr=1.0, lr_schedule={"kind": "step", "every": 2, "gamma": 0.1})
    assert [step.lr_at(r, 10) for r in range(4)] == pytest.approx([1.0, 1.0, 0.1, 0.1])
    cosine = TrainingConfig(lr=1.0, lr_schedule={"kind": "cosine", "min_lr": 0.0})
    assert cosine.lr_at(0, 11) == 1.0 and cosine.lr_at(10, 11) == pytest.approx(0.0)
    assert cosine.lr_at(5, 11) == pytest.approx(0.5)


def test_comparison_variants_swap_only_the_algorithm() -> None:
    base = parse_policy(policy(seed=4, algorithm={"name": "fedprox", "prox_mu": 0.5}))
    local = base.with_algorithm("local")
    assert local.algorithm.name == "local" and local.seed == 4 and local.training == base.training


def test_comparison_variants_keep_the_schedule_settings_they_read() -> None:
    base = parse_policy(policy(algorithm={"name": "drfa", "step": 0.5}, training={"steps": 2}))
    assert base.with_algorithm("afl").algorithm.step == 0.5  # type: ignore[union-attr]
    assert base.with_algorithm("fedavg").algorithm == parse_policy(policy()).algorithm


def test_a_comparison_with_an_unknown_algorithm_names_it() -> None:
    with pytest.raises(PolicyError) as err:
        with_algorithm(parse_policy(policy()), "fedavgg")
    assert "--compare fedavgg: unknown value 'fedavgg' (did you mean 'fedavg'?)" in str(err.value)


def test_an_old_mixing_section_is_told_where_each_key_moved() -> None:
    with pytest.raises(PolicyError) as err:
        parse_policy(policy(algorithm={"name": "drfa"}, mixing={"step": 0.1, "q": 1.0}))
    message = str(err.value)
    assert "mixing.step moved to algorithm.step;" in message
    assert "mixing.q moved to algorithm.q (read by qfedavg, not drfa)" in message


def test_a_setting_of_another_algorithm_names_the_algorithms_that_read_it() -> None:
    with pytest.raises(
        PolicyError, match="fedavg does not read 'floor' \\(read by afl, drfa, drflm\\)"
    ):
        parse_policy(policy(algorithm={"name": "fedavg", "floor": 0.01}))


def test_the_policy_checks_capabilities_never_algorithm_names() -> None:
    schema = (Path(__file__).resolve().parents[1] / "policies" / "schema.py").read_text()
    comparisons = [line for line in schema.splitlines() if re.search(r'[=!]= "| in \(', line)]
    assert not [line for line in comparisons for name in STRATEGIES if f'"{name}"' in line]
