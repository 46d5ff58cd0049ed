"""Bad input through the real command line: every mistake an operator can make in a policy, a
data file or an option is one message naming the field, option or file, exit status 1, no
traceback, no pydantic boilerplate, and nothing written."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import yaml
from click.testing import CliRunner, Result

from fedsilo.ops.cli import main
from fedsilo.ops.provision import provision
from fedsilo.policies.consortium import parse_consortium
from fedsilo.privacy.identity import read_signing_key
from fedsilo.privacy.policy_signing import sign_policy

PYDANTIC_BOILERPLATE = ("For further information visit", "type=", "input_value=", "errors.pydantic")
SILOS = ("north", "south")


def invoke(*args: str) -> Result:
    return CliRunner().invoke(main, list(args))


def assert_refused(result: Result, *named: str) -> None:
    """Exit status 1, one message naming each of `named`, no traceback, no pydantic noise."""
    assert result.exception is None or isinstance(result.exception, SystemExit), repr(
        result.exception
    )
    assert result.exit_code == 1, result.output
    assert "Traceback" not in result.output, result.output
    for text in named:
        assert text in result.output, result.output
    for noise in PYDANTIC_BOILERPLATE:
        assert noise not in result.output, result.output


def nothing_written(folder: Path, *before: str) -> bool:
    return sorted(p.name for p in folder.iterdir()) == sorted(before)


def write_csv(folder: Path, header: str = "a,b,c,label") -> Path:
    x = np.random.default_rng(0).normal(size=(60, 3))
    lines = [header, *(f"{r[0]},{r[1]},{r[2]},{int(r[0] > 0)}" for r in x)]
    path = folder / "records.csv"
    path.write_text("\n".join(lines) + "\n")
    return path


def policy_text(**sections: object) -> str:
    document = {
        "version": 1,
        "name": "t",
        "rounds": 2,
        "algorithm": {"name": "fedavg"},
        "data": {
            "source": "csv",
            "path": "records.csv",
            "target": "label",
            "partition": {"kind": "iid", "silos": 2},
        },
        **sections,
    }
    return yaml.safe_dump(document, sort_keys=False)


def simulate(folder: Path, text: str, *extra: str) -> Result:
    """`fedsilo simulate` of the policy `text` on the CSV in `folder`, into `folder/out`."""
    if not (folder / "records.csv").exists():
        write_csv(folder)
    (folder / "policy.yaml").write_text(text)
    return invoke(
        "simulate", "--policy", str(folder / "policy.yaml"), "--out", str(folder / "out"), *extra
    )


# Policies


@pytest.mark.parametrize(
    ("training", "value"),
    [({"lr": float("inf")}, "inf"), ({"lr": 1e300}, "1e+300")],
    ids=["infinite", "huge"],
)
def test_a_learning_rate_that_is_not_a_sane_finite_number_is_refused(
    tmp_path: Path, training: dict, value: str
) -> None:
    assert_refused(simulate(tmp_path, policy_text(training=training)), "training.lr", value)
    assert nothing_written(tmp_path, "records.csv", "policy.yaml")


def test_a_secure_aggregation_bound_beyond_any_model_is_refused(tmp_path: Path) -> None:
    text = policy_text(secure_aggregation={"method": "masking", "bound": 1e300})
    assert_refused(simulate(tmp_path, text), "secure_aggregation.bound")
    assert nothing_written(tmp_path, "records.csv", "policy.yaml")


def test_a_boolean_is_not_a_number_of_rounds(tmp_path: Path) -> None:
    assert_refused(simulate(tmp_path, policy_text(rounds=True)), "rounds", "true")
    assert nothing_written(tmp_path, "records.csv", "policy.yaml")


def test_a_duplicate_key_is_refused_naming_the_key_and_both_lines(tmp_path: Path) -> None:
    text = "version: 1\nrounds: 2\ntraining:\n  lr: 0.1\n  lr: 0.5\n"
    (tmp_path / "policy.yaml").write_text(text)
    result = invoke("policy", "validate", str(tmp_path / "policy.yaml"))
    assert_refused(result, "policy.yaml", "duplicate key 'lr'", "line 5", "line 4")


def test_dp_sgd_without_noise_is_refused(tmp_path: Path) -> None:
    text = policy_text(privacy={"dp_sgd": {"noise_multiplier": 0, "max_grad_norm": 1.0}})
    assert_refused(simulate(tmp_path, text), "privacy.dp_sgd.noise_multiplier", "training_epsilon")
    assert nothing_written(tmp_path, "records.csv", "policy.yaml")


def test_a_binary_policy_file_is_named_as_not_text(tmp_path: Path) -> None:
    (tmp_path / "policy.yaml").write_bytes(bytes(range(256)) * 4)
    result = invoke("policy", "validate", str(tmp_path / "policy.yaml"))
    assert_refused(result, "policy.yaml", "UTF-8")


def test_federated_scaling_without_a_validation_split_is_refused_when_read(tmp_path: Path) -> None:
    data = yaml.safe_load(policy_text())["data"]
    data |= {"scaling": "federated", "split": {"train": 0.8, "val": 0.0, "test": 0.2}}
    assert_refused(simulate(tmp_path, policy_text(data=data)), "data.split.val", "federated")
    assert nothing_written(tmp_path, "records.csv", "policy.yaml")


def test_an_out_of_range_override_is_one_message_naming_the_option(tmp_path: Path) -> None:
    assert_refused(simulate(tmp_path, policy_text(), "--silos", "0"), "--silos")
    assert nothing_written(tmp_path, "records.csv", "policy.yaml")


# Comparisons


def test_compare_drfa_runs_on_a_policy_with_local_steps(tmp_path: Path) -> None:
    result = simulate(tmp_path, policy_text(training={"steps": 2}), "--compare", "drfa")
    assert result.exit_code == 0, result.output
    assert (tmp_path / "out" / "drfa" / "results.json").is_file()


def test_compare_drfa_on_a_policy_with_epochs_names_the_field(tmp_path: Path) -> None:
    result = simulate(tmp_path, policy_text(), "--compare", "drfa")
    assert_refused(result, "--compare drfa", "training.steps")
    assert nothing_written(tmp_path, "records.csv", "policy.yaml")


# Data


def test_a_csv_header_naming_a_column_twice_is_refused(tmp_path: Path) -> None:
    write_csv(tmp_path, header="a,b,a,label")
    assert_refused(simulate(tmp_path, policy_text()), "records.csv", "'a'", "twice")
    assert nothing_written(tmp_path, "records.csv", "policy.yaml")


# Output folders and runs


def test_an_out_that_cannot_be_created_is_refused_before_the_run(tmp_path: Path) -> None:
    (tmp_path / "blocker").write_text("a file, not a folder")
    write_csv(tmp_path)
    (tmp_path / "policy.yaml").write_text(policy_text())
    out = tmp_path / "blocker" / "out"
    result = invoke("simulate", "--policy", str(tmp_path / "policy.yaml"), "--out", str(out))
    assert_refused(result, "--out", "blocker")
    assert (tmp_path / "blocker").read_text() == "a file, not a folder"


def test_a_simulation_whose_every_round_failed_exits_non_zero(tmp_path: Path) -> None:
    # An MLP at the largest learning rate the policy allows on features scaled by 1e30, for
    # ten epochs a round, yields non-finite models from round 1, which the engine records as
    # failed rounds.
    x = np.random.default_rng(0).normal(size=(60, 3)) * 1e37
    lines = ["a,b,c,label", *(f"{r[0]},{r[1]},{r[2]},{int(r[0] > 0)}" for r in x)]
    (tmp_path / "records.csv").write_text("\n".join(lines) + "\n")
    data = yaml.safe_load(policy_text())["data"] | {"scaling": "none"}
    text = policy_text(data=data, model={"name": "mlp"}, training={"lr": 10, "epochs": 10})
    result = simulate(tmp_path, text)
    assert_refused(result, "every round failed")
    assert nothing_written(tmp_path, "records.csv", "policy.yaml")


# The deployment commands


@pytest.fixture(scope="module")
def kits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("consortium") / "kits"
    consortium = {
        "consortium": "bad-input",
        "coordinator": {"address": "127.0.0.1:1"},
        "silos": [{"name": name} for name in SILOS],
    }
    provision(parse_consortium(consortium), out)
    return out


def signed_policy(kits: Path, folder: Path) -> Path:
    path = folder / "policy.yaml"
    path.write_text(yaml.safe_dump(yaml.safe_load(policy_text()) | {"data": {"source": "heart"}}))
    key = kits / "operator" / "operator.key"
    assert invoke("policy", "sign", str(path), "--key", str(key)).exit_code == 0
    return path


def coordinator_start(kits: Path, folder: Path, *options: str) -> Result:
    policy = signed_policy(kits, folder)
    return invoke(
        "coordinator",
        "start",
        "--kit",
        str(kits / "coordinator"),
        "--policy",
        str(policy),
        "--join-timeout",
        "0.1",
        *options,
    )


def test_a_state_file_that_is_not_a_database_is_refused_by_coordinator_start(
    kits: Path, tmp_path: Path
) -> None:
    (tmp_path / "garbage.db").write_bytes(b"not sqlite at all\n" * 10)
    result = coordinator_start(kits, tmp_path, "--state", str(tmp_path / "garbage.db"))
    assert_refused(result, "--state", "garbage.db")
    assert (tmp_path / "garbage.db").read_bytes() == b"not sqlite at all\n" * 10


@pytest.mark.parametrize(
    ("option", "value"),
    [("--max-payload-mb", "-5"), ("--max-payload-mb", "0"), ("--metrics-port", "70000")],
)
def test_an_out_of_range_coordinator_option_is_refused_before_anything_starts(
    kits: Path, tmp_path: Path, option: str, value: str
) -> None:
    result = coordinator_start(kits, tmp_path, "--state", str(tmp_path / "s.db"), option, value)
    assert_refused(result, option)
    assert not (tmp_path / "s.db").exists()


def test_an_out_that_cannot_be_created_is_refused_by_coordinator_start(
    kits: Path, tmp_path: Path
) -> None:
    (tmp_path / "blocker").write_text("a file")
    out = tmp_path / "blocker" / "results"
    result = coordinator_start(kits, tmp_path, "--state", str(tmp_path / "s.db"), "--out", str(out))
    assert_refused(result, "--out", "blocker")
    assert not (tmp_path / "s.db").exists()


def test_coordinator_start_refuses_an_out_folder_it_did_not_write_before_starting(
    kits: Path, tmp_path: Path
) -> None:
    (tmp_path / "results").mkdir()
    (tmp_path / "results" / "notes.txt").write_text("mine")
    out = str(tmp_path / "results")
    result = coordinator_start(kits, tmp_path, "--state", str(tmp_path / "s.db"), "--out", out)
    assert_refused(result, "--out", "did not write")
    assert (tmp_path / "results" / "notes.txt").read_text() == "mine"
    assert not (tmp_path / "s.db").exists()


def test_a_binary_policy_is_refused_by_coordinator_start(kits: Path, tmp_path: Path) -> None:
    # `fedsilo policy sign` refuses to sign it; an operator's own tooling might not.
    policy = tmp_path / "policy.yaml"
    policy.write_bytes(b"\xff\xfe\x00binary" * 50)
    sign_policy(policy, read_signing_key(kits / "operator" / "operator.key"))
    result = invoke(
        "coordinator",
        "start",
        "--kit",
        str(kits / "coordinator"),
        "--policy",
        str(policy),
        "--state",
        str(tmp_path / "s.db"),
    )
    assert_refused(result, "policy.yaml", "UTF-8")
    assert not (tmp_path / "s.db").exists()


def test_a_state_file_that_is_not_a_database_is_refused_by_revoke(
    kits: Path, tmp_path: Path
) -> None:
    (tmp_path / "garbage.db").write_bytes(b"\x00garbage" * 100)
    result = invoke(
        "coordinator",
        "revoke",
        SILOS[0],
        "--kit",
        str(kits / "coordinator"),
        "--state",
        str(tmp_path / "garbage.db"),
    )
    assert_refused(result, "--state", "garbage.db")
    assert (tmp_path / "garbage.db").read_bytes() == b"\x00garbage" * 100


def test_a_state_file_that_is_not_a_database_is_refused_by_status(
    kits: Path, tmp_path: Path
) -> None:
    (tmp_path / "garbage.db").write_bytes(b"\x00garbage" * 100)
    result = invoke(
        "status", "--kit", str(kits / "coordinator"), "--state", str(tmp_path / "garbage.db")
    )
    assert_refused(result, "--state", "garbage.db")


def silo_init(kits: Path, folder: Path, *options: str) -> Result:
    return invoke(
        "silo",
        "init",
        "--kit",
        str(kits / "silos" / SILOS[0]),
        "--out",
        str(folder / "site" / "silo.yaml"),
        *options,
    )


def test_silo_init_refuses_a_data_file_that_does_not_exist(kits: Path, tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent.csv"
    result = silo_init(kits, tmp_path, "--source", "csv", "--data", str(missing), "--target", "y")
    assert_refused(result, "nonexistent.csv")
    assert not (tmp_path / "site").exists()


def test_silo_init_names_a_missing_data_option_without_pydantic_noise(
    kits: Path, tmp_path: Path
) -> None:
    result = silo_init(kits, tmp_path, "--source", "csv", "--target", "y")
    assert_refused(result, "--data")
    assert not (tmp_path / "site").exists()


def test_silo_init_refuses_an_out_of_range_metrics_port(kits: Path, tmp_path: Path) -> None:
    result = silo_init(kits, tmp_path, "--select", "Hungary", "--metrics-port", "70000")
    assert_refused(result, "--metrics-port")
    assert not (tmp_path / "site").exists()
