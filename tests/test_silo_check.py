"""`fedsilo silo check`: a hospital's own data, checked offline before any job. The happy path
summarises the data as the agent will load it; each data problem is one message naming the key
to change as silo.yaml spells it (`data.<key>`), exit status 1, no traceback. `silo init`
sets the data dictionary from flags and runs the same check; `provision --example` writes a
commented consortium.yaml that provisioning accepts."""

from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner, Result

from fedsilo.ops.cli import main
from fedsilo.ops.provision import provision
from fedsilo.policies.consortium import EXAMPLE, parse_consortium
from fedsilo.policies.loading import parse_policy
from fedsilo.silo import config as silo_config_module
from fedsilo.silo.config import load_silo_config, parse_silo_config

HEADER = "age,smoker,bp,outcome"
HEART_FEDAVG = str(Path(__file__).parents[1] / "policies" / "examples" / "heart-fedavg.yaml")
ROWS = [f"{30 + i},{'yes' if i % 3 else 'no'},{110 + i % 7}.5,{i % 2}" for i in range(40)]


def site(
    folder: Path, rows: list[str] = ROWS, header: str = HEADER, kit: Path | str = "kit", **source
) -> Path:
    """A site folder with records.csv and a silo.yaml reading it (its kit `kit`: a folder that
    is none for a check refused before the kit is read); returns silo.yaml's path."""
    (folder / "records.csv").write_text("\n".join([header, *rows]) + "\n")
    data = {"source": "csv", "path": "records.csv", "target": "outcome"}
    data.update({"categorical": {"smoker": ["no", "yes"]}, **source})
    config = folder / "silo.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "kit": str(kit), "data": data}))
    return config


def check(config: Path, *extra: str) -> Result:
    return CliRunner().invoke(main, ["silo", "check", "--config", str(config), *extra])


def refused(result: Result, *expected: str) -> str:
    """The one error message of a refused check, holding each of `expected`."""
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    message = result.output.strip()
    assert message.startswith("Error: ") and message.count("Error:") == 1, message
    for text in expected:
        assert text in message, message
    return message


def test_a_sites_file_is_summarised_as_one_silo(tmp_path: Path, silo_kit: Path) -> None:
    result = check(site(tmp_path, kit=silo_kit))
    assert result.exit_code == 0, result.output
    out = result.output
    assert "records.csv: 40 rows, 4 columns" in out and "40 rows)" in out  # all rows, one silo
    assert "smoker" in out and "categorical (2 declared)" in out
    assert "outcome" in out and "target" in out
    assert "labels (2 classes): 0: 20 (50%), 1: 20 (50%)" in out
    assert "after encoding: 4 features (age, smoker=no, smoker=yes, bp)" in out
    assert "splits: train 32, val 4, test 4" in out


def test_a_selected_hospital_of_the_bundled_data_is_summarised_alone(
    tmp_path: Path, silo_kit: Path
) -> None:
    config = tmp_path / "silo.yaml"
    data = {"source": "heart", "select": "Hungary"}
    document = {"version": 1, "kit": str(silo_kit), "data": data}
    config.write_text(yaml.safe_dump(document))
    result = check(config)
    assert result.exit_code == 0, result.output
    assert "dataset Hungary: 294 rows" in result.output
    assert "labels (2 classes): False: 188 (64%), True: 106 (36%)" in result.output


def test_missing_values_are_counted_per_column_and_imputed_when_asked(
    tmp_path: Path, silo_kit: Path
) -> None:
    rows = [row.replace("110.5", "") for row in ROWS]  # every 7th bp is empty
    result = check(site(tmp_path, rows, kit=silo_kit, missing="impute"))
    assert result.exit_code == 0, result.output
    bp = next(line for line in result.output.splitlines() if line.strip().startswith("bp"))
    assert bp.split()[-1] == "6"


def test_a_policy_adds_its_model_on_this_data(tmp_path: Path, silo_kit: Path) -> None:
    result = check(site(tmp_path, kit=silo_kit), "--policy", HEART_FEDAVG)
    assert result.exit_code == 0, result.output
    assert "the policy's model: 10 parameters on this data" in result.output


def test_a_policy_the_sites_rules_refuse_names_the_rule(tmp_path: Path) -> None:
    config = site(tmp_path)
    document = yaml.safe_load(config.read_text())
    config.write_text(yaml.safe_dump({**document, "rules": {"max_rounds": 1}}))
    result = check(config, "--policy", HEART_FEDAVG)
    refused(result, "this site's rules refuse the policy", "rules.max_rounds")


def test_a_missing_data_file_names_data_path(tmp_path: Path) -> None:
    config = site(tmp_path)
    (tmp_path / "records.csv").unlink()
    refused(check(config), "data.path: data file not found", "records.csv")


def test_a_target_absent_from_the_file_names_data_target(tmp_path: Path) -> None:
    refused(
        check(site(tmp_path, target="label")),
        "data.target: target column 'label' not found",
        "columns: age, smoker, bp, outcome",
    )


def test_a_text_column_without_its_categories_names_data_categorical(
    tmp_path: Path,
) -> None:
    message = refused(
        check(site(tmp_path, categorical={})),
        "column 'smoker' in",
        "is not numeric",
        "data.categorical",
        "data.drop_columns",
    )
    assert "data.source" not in message


def test_a_category_list_left_empty_names_data_categorical(tmp_path: Path) -> None:
    refused(check(site(tmp_path, categorical={"smoker": []})), "data.categorical")


def test_a_value_outside_the_declared_categories_names_its_category_list(tmp_path: Path) -> None:
    refused(
        check(site(tmp_path, categorical={"smoker": ["yes"]})),
        "data.categorical.smoker:",
        "value 'no'",
    )


def test_a_duplicated_header_names_data_path(tmp_path: Path) -> None:
    refused(
        check(site(tmp_path, header="age,smoker,age,outcome")),
        "data.path: CSV file",
        "names column(s) 'age' twice",
    )


def test_missing_values_name_data_missing(tmp_path: Path) -> None:
    rows = [row.replace("110.5", "") for row in ROWS]
    refused(
        check(site(tmp_path, rows)),
        "column 'bp'",
        "missing values in 6 rows",
        "data.missing: impute",
    )


def test_inf_names_the_column_and_data_drop_columns(tmp_path: Path) -> None:
    rows = [row.replace("110.5", "inf") for row in ROWS]
    refused(check(site(tmp_path, rows)), "column 'bp'", "contains inf", "data.drop_columns")


def test_one_class_only_names_data_target(tmp_path: Path) -> None:
    rows = [row[: row.rfind(",")] + ",1" for row in ROWS]
    refused(check(site(tmp_path, rows)), "data.target:", "holds a single class")


def test_a_partitioned_file_without_select_says_how_to_keep_it_whole(tmp_path: Path) -> None:
    config = site(tmp_path)
    document = yaml.safe_load(config.read_text())
    section = {**document["data"], "partition": {"kind": "iid", "silos": 4}}
    config.write_text(yaml.safe_dump({**document, "data": {"source": section}}))  # old shape
    refused(check(config), "set data.select", "remove data.source.partition")


def test_a_bundled_source_without_select_says_to_set_it(tmp_path: Path) -> None:
    config = tmp_path / "silo.yaml"
    config.write_text(yaml.safe_dump({"version": 1, "kit": "kit", "data": {"source": "heart"}}))
    message = refused(check(config), "set data.select to the one this site is", "Hungary")
    assert "partition" not in message


def test_a_missing_policy_is_one_message(tmp_path: Path) -> None:
    refused(check(site(tmp_path), "--policy", str(tmp_path / "absent.yaml")), "absent.yaml")


@pytest.fixture(scope="module")
def kit(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A provisioned silo kit (from the example consortium.yaml)."""
    folder = tmp_path_factory.mktemp("consortium")
    provision(parse_consortium(yaml.safe_load(EXAMPLE)), folder / "kits")
    return folder / "kits" / "silos" / "cleveland"


def init(kit: Path, folder: Path, *flags: str) -> Result:
    (folder / "records.csv").write_text("\n".join([HEADER, *ROWS]) + "\n")
    arguments = ["silo", "init", "--kit", str(kit), "--out", str(folder / "silo.yaml")]
    arguments += ["--source", "csv", "--data", str(folder / "records.csv"), "--target", "outcome"]
    return CliRunner().invoke(main, [*arguments, *flags])


def test_silo_init_sets_the_data_dictionary_from_flags_and_prints_the_check(
    kit: Path, tmp_path: Path
) -> None:
    result = init(
        kit, tmp_path, "--categorical", "smoker=no,yes", "--impute", "--drop-column", "age"
    )
    assert result.exit_code == 0, result.output
    assert "after encoding: 3 features (smoker=no, smoker=yes, bp)" in result.output
    data = yaml.safe_load((tmp_path / "silo.yaml").read_text())["data"]
    assert data["source"] == "csv" and data["target"] == "outcome"  # a policy's data keys
    assert data["categorical"] == {"smoker": ["no", "yes"]}
    assert data["missing"] == "impute" and data["drop_columns"] == ["age"]
    assert "partition" not in data  # the site's file is one silo
    rechecked = check(tmp_path / "silo.yaml")
    assert rechecked.exit_code == 0 and "note:" not in rechecked.output, rechecked.output
    assert (
        parse_policy({"version": 1, "data": data}).data
        == load_silo_config(tmp_path / "silo.yaml").data.source
    )


def test_silo_init_checks_the_data_and_names_the_flag_that_fixes_it(
    kit: Path, tmp_path: Path
) -> None:
    refused(init(kit, tmp_path), "column 'smoker'", "data.categorical", "--categorical")
    assert not (tmp_path / "silo.yaml").exists()


@pytest.mark.parametrize("flag", ["smoker", "=no,yes", "smoker=no,,yes"])
def test_silo_init_refuses_a_malformed_categorical_flag(
    kit: Path, tmp_path: Path, flag: str
) -> None:
    refused(init(kit, tmp_path, "--categorical", flag), "--categorical", "COLUMN=A,B")
    assert not (tmp_path / "silo.yaml").exists()


def test_silo_init_writes_the_proxy_to_reach_the_coordinator_through_and_refuses_a_bad_one(
    kit: Path, tmp_path: Path
) -> None:
    result = init(kit, tmp_path, "--categorical", "smoker=no,yes", "--proxy", "http://p.h:3128")
    assert result.exit_code == 0, result.output
    document = yaml.safe_load((tmp_path / "silo.yaml").read_text())
    assert document["coordinator"] == {"proxy": "http://p.h:3128"}
    for written in ("silo.yaml", "fedsilo-silo-cleveland.service"):
        (tmp_path / written).unlink()
    bad = init(kit, tmp_path, "--categorical", "smoker=no,yes", "--proxy", "p.h:3128")
    refused(bad, "coordinator.proxy", "http://", "--proxy")
    assert not (tmp_path / "silo.yaml").exists()


def test_silo_init_never_replaces_an_existing_silo_yaml(kit: Path, tmp_path: Path) -> None:
    (tmp_path / "silo.yaml").write_text("mine\n")
    refused(init(kit, tmp_path, "--categorical", "smoker=no,yes"), "silo.yaml exists")
    assert (tmp_path / "silo.yaml").read_text() == "mine\n"


def test_provision_example_writes_a_consortium_file_provision_accepts(tmp_path: Path) -> None:
    example = tmp_path / "consortium.yaml"
    result = CliRunner().invoke(main, ["provision", "--example", str(example)])
    assert result.exit_code == 0, result.output
    text = example.read_text()
    for key in ("consortium:", "coordinator:", "address:", "silos:", "ca_days:", "client_days:"):
        assert key in text
    assert text.lstrip().startswith("#")  # commented
    kits = tmp_path / "kits"
    result = CliRunner().invoke(
        main, ["provision", "--consortium", str(example), "--out", str(kits)]
    )
    assert result.exit_code == 0, result.output
    assert (kits / "silos" / "cleveland" / "kit.yaml").is_file()


def test_provision_example_never_replaces_a_file(tmp_path: Path) -> None:
    example = tmp_path / "consortium.yaml"
    example.write_text("mine\n")
    refused(CliRunner().invoke(main, ["provision", "--example", str(example)]), "exists")
    assert example.read_text() == "mine\n"


def test_the_documented_silo_yaml_is_a_valid_silo_configuration() -> None:
    text = silo_config_module.__doc__ or ""
    example = text.split("```yaml\n", 1)[1].split("```", 1)[0]
    config = parse_silo_config(yaml.safe_load(example), "silo/config.py")
    assert config.data.source.categorical == {"smoker": ["no", "yes"]}
    assert config.rules.epsilon_cap == 8.0
