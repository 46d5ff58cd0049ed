"""One data shape: silo.yaml's `data:` section is a policy's `data:` section, less the keys only
a simulation uses (`partition`, `label_noise`), plus `select`. The same text means the same
section in both files; a key that belongs to the other file is refused in one message naming
it and the other shape; silo.yaml's old nested shape (`data: {source: {source: csv, ...}}`)
still loads to the same data, with a note saying how to write it flat (in `silo check` and in
a running silo's log)."""

import tempfile
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from click.testing import CliRunner, Result
from hypothesis import HealthCheck, given, settings
from pydantic import ValidationError

from fedsilo.ops.cli import main
from fedsilo.policies.data import SIMULATION_ONLY_KEYS, DataConfig
from fedsilo.policies.loading import PolicyError, parse_policy
from fedsilo.silo.config import SiloConfig, parse_silo_config
from fedsilo.silo.data import DataError
from tests.deployment import Consortium
from tests.policy_space import data_sections

FILES = Path(tempfile.mkdtemp(prefix="fedsilo-site-data-shape-"))
HEADER = "age,smoker,bp,outcome"
ROWS = [f"{30 + i},{'yes' if i % 3 else 'no'},{110 + i % 7}.5,{i % 2}" for i in range(40)]
SITE_SECTION = {
    "source": "csv",
    "path": "records.csv",
    "target": "outcome",
    "categorical": {"smoker": ["no", "yes"]},
}
SIMULATION_VALUES = {
    "partition": {"kind": "iid", "silos": 3},
    "label_noise": {"silo_fraction": 0.5, "probability": 0.2},
}


def silo_yaml(data: Any, kit: Path | str = "kit") -> dict[str, Any]:
    return {"version": 1, "kit": str(kit), "data": data}


def as_silo_yaml(data: Any) -> SiloConfig:
    return parse_silo_config(silo_yaml(data), "silo.yaml")


def as_policy(data: Any) -> Any:
    return parse_policy({"version": 1, "data": data}, "policy.yaml")


def refusal(parse: Any, data: Any) -> str:
    with pytest.raises(PolicyError) as refused:
        parse(data)
    return str(refused.value)


def written_site(folder: Path, data: dict[str, Any], kit: Path | str = "kit") -> Path:
    """A site folder holding records.csv and a silo.yaml whose data section is `data` (its
    kit `kit`: a folder that is none for a check refused before the kit is read)."""
    (folder / "records.csv").write_text("\n".join([HEADER, *ROWS]) + "\n")
    config = folder / "silo.yaml"
    config.write_text(yaml.safe_dump(silo_yaml(data, kit), sort_keys=False))
    return config


def check(config: Path) -> Result:
    return CliRunner().invoke(main, ["silo", "check", "--config", str(config)])


def one_error(result: Result) -> str:
    """The one error message of a refused command: status 1, no traceback."""
    assert result.exit_code == 1, result.output
    assert result.exception is None or isinstance(result.exception, SystemExit)
    assert "Traceback" not in result.output
    assert result.output.count("Error:") == 1, result.output
    return result.output


@settings(
    max_examples=150,
    derandomize=True,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(section=data_sections(FILES))
def test_the_same_data_section_text_means_the_same_in_a_policy_and_in_silo_yaml(
    section: dict[str, Any],
) -> None:
    """A policy's data section less its simulation keys is a site's data section: the same
    section, or refused with the same messages (the policy's checks across its sections, such
    as federated scaling needing a validation split, stay the policy's). With those keys,
    silo.yaml refuses it naming one, before reading any of their values."""
    text = yaml.safe_dump(section, sort_keys=False)
    site = {key: value for key, value in section.items() if key not in SIMULATION_ONLY_KEYS}
    site_text = yaml.safe_dump(site, sort_keys=False)
    try:
        policy_section = DataConfig.model_validate(yaml.safe_load(site_text))
    except ValidationError as refused:  # the catalogue draws some sections no policy takes
        message = refusal(as_silo_yaml, yaml.safe_load(site_text))
        for error in refused.errors():
            assert error["msg"].removeprefix("Value error, ") in message, message
    else:
        assert as_silo_yaml(yaml.safe_load(site_text)).data.source == policy_section
    simulated = [key for key in SIMULATION_ONLY_KEYS if key in section]
    if simulated:
        message = refusal(as_silo_yaml, yaml.safe_load(text))
        assert any(f"data: field '{key}' is a simulation's" in message for key in simulated)


@pytest.mark.parametrize("key", sorted(SIMULATION_ONLY_KEYS))
def test_a_simulations_key_pasted_into_silo_yaml_is_refused_naming_it_and_the_site_shape(
    tmp_path: Path, key: str
) -> None:
    config = written_site(tmp_path, {**SITE_SECTION, key: SIMULATION_VALUES[key]})
    message = one_error(check(config))
    assert f"data: field '{key}' is a simulation's" in message, message
    assert "a site's data is its own, one silo: drop it" in message
    assert "a policy's without partition and label_noise, plus select" in message
    assert config.read_text() == yaml.safe_dump(
        silo_yaml({**SITE_SECTION, key: SIMULATION_VALUES[key]}), sort_keys=False
    )  # nothing the site owns is touched


def test_silo_yamls_nested_source_pasted_into_a_policy_is_refused_naming_both_shapes(
    tmp_path: Path,
) -> None:
    policy = tmp_path / "policy.yaml"
    policy.write_text(yaml.safe_dump({"version": 1, "data": {"source": SITE_SECTION}}))
    message = one_error(CliRunner().invoke(main, ["policy", "validate", str(policy)]))
    assert "data.source: a mapping here is silo.yaml's old nested shape" in message, message
    assert "names its source directly, its keys beside it" in message
    assert "Input should be a valid string" not in message


def test_silo_yamls_select_pasted_into_a_policy_is_refused_naming_where_it_belongs() -> None:
    message = refusal(as_policy, {"source": "heart", "select": "Hungary"})
    assert "data: field 'select' belongs in silo.yaml" in message, message
    assert "a policy's data section describes every silo: drop it" in message


def test_a_misspelt_key_in_silo_yamls_data_is_matched_against_the_sites_keys() -> None:
    message = refusal(as_silo_yaml, {"source": "heart", "selct": "Hungary"})
    assert "unknown field 'selct' (did you mean 'select'?)" in message, message
    assert "partition" not in message.split("allowed:")[1]


def test_a_field_error_in_silo_yamls_data_names_the_key_as_the_file_spells_it() -> None:
    flat = refusal(as_silo_yaml, {**SITE_SECTION, "missing": "guess"})
    nested = refusal(as_silo_yaml, {"source": {**SITE_SECTION, "missing": "guess"}})
    assert "silo.yaml: data.missing: Input should be" in flat, flat
    assert "silo.yaml: data.source.missing: Input should be" in nested, nested


@pytest.mark.parametrize(
    ("section", "select"),
    [(SITE_SECTION, None), ({"source": "heart"}, "Hungary")],
    ids=["a site's own file", "a bundled hospital"],
)
def test_the_old_nested_shape_loads_the_same_section_and_dataset(
    tmp_path: Path, section: dict[str, Any], select: str | None
) -> None:
    (tmp_path / "records.csv").write_text("\n".join([HEADER, *ROWS]) + "\n")
    flat = as_silo_yaml({**section, "select": select}).data
    nested = as_silo_yaml({"source": section, "select": select}).data
    assert nested.source == flat.source and nested.select == flat.select
    old, new = nested.load(seed=3, base_dir=tmp_path), flat.load(seed=3, base_dir=tmp_path)
    assert old.name == new.name and old.feature_names == new.feature_names
    for split in ("x_train", "y_train", "x_val", "y_val", "x_test", "y_test"):
        assert torch.equal(getattr(old, split), getattr(new, split)), split


def test_a_data_problem_names_the_key_as_each_shape_spells_it(tmp_path: Path) -> None:
    for data, key in [
        (SITE_SECTION, "data.path"),
        ({"source": SITE_SECTION}, "data.source.path"),
    ]:
        with pytest.raises(DataError) as refused:
            as_silo_yaml(data).data.load(seed=0, base_dir=tmp_path)  # no records.csv here
        assert f"{key}: data file not found" in str(refused.value), str(refused.value)


def test_silo_check_notes_the_old_nested_shape_and_how_to_write_it_flat(
    tmp_path: Path, silo_kit: Path
) -> None:
    result = check(written_site(tmp_path, {"source": SITE_SECTION}, silo_kit))
    assert result.exit_code == 0, result.output
    assert "note: data.source holds a nested data section, silo.yaml's old shape" in result.output
    assert "write its keys directly under data:, as a policy does" in result.output


def test_silo_check_has_no_note_for_the_current_shape_or_a_nested_simulated_section(
    tmp_path: Path, silo_kit: Path
) -> None:
    current = check(written_site(tmp_path, SITE_SECTION, silo_kit))
    assert current.exit_code == 0 and "note:" not in current.output, current.output
    simulated = {"source": {**SITE_SECTION, "partition": {"kind": "iid", "silos": 2}}}
    dealt = check(written_site(tmp_path, {**simulated, "select": "silo-1"}, silo_kit))
    assert dealt.exit_code == 0 and "note:" not in dealt.output, dealt.output


def test_silo_start_logs_the_old_shapes_note_and_none_for_the_current_shape(
    consortium: Consortium,
) -> None:
    shapes = {"silo-0": {"source": SITE_SECTION}, "silo-1": SITE_SECTION}
    for silo, data in shapes.items():
        folder = consortium.root / "sites" / silo
        folder.mkdir(parents=True)
        config = written_site(folder, data)
        document = yaml.safe_load(config.read_text())
        document["kit"] = str(consortium.kits / "silos" / silo)
        config.write_text(yaml.safe_dump(document, sort_keys=False))
        consortium.start_silo(silo, config)
    for silo in shapes:  # logged once silo.yaml is read, before the coordinator is reached
        consortium.wait_for_log(silo, f"silo {silo} reaches the coordinator at")
    assert "data.source holds a nested data section" in consortium.log("silo-0")
    assert "nested" not in consortium.log("silo-1")
