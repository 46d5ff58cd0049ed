"""Roster changes after provisioning: `fedsilo consortium add-silo` issues one more silo kit
from the same CA and operator key and enrols it in the coordinator kit's roster, touching no
other kit, and refusing a name or folder that exists with one message and nothing written."""

from __future__ import annotations

import hashlib
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner

from fedsilo.ops.cli import main
from fedsilo.ops.provision import load_coordinator_kit, load_silo_kit, provision
from fedsilo.policies.consortium import parse_consortium
from fedsilo.privacy.certificates import certificate_fingerprint, verify_issued_by
from fedsilo.privacy.identity import public_key_hex

SILOS = ["cleveland", "hungary", "va"]
CONSORTIUM = {
    "consortium": "heart-consortium",
    "coordinator": {"address": "127.0.0.1:50051"},
    "silos": [{"name": name} for name in SILOS],
}


@pytest.fixture
def kits(tmp_path: Path) -> Path:
    (tmp_path / "consortium.yaml").write_text(yaml.safe_dump(CONSORTIUM))
    provision(parse_consortium(CONSORTIUM), tmp_path / "kits")
    return tmp_path / "kits"


def add_silo(kits: Path, name: str, operator: Path | None = None) -> tuple[int, str]:
    result = CliRunner().invoke(
        main,
        [
            "consortium",
            "add-silo",
            name,
            "--ca-kit",
            str(operator or kits / "operator"),
            "--coordinator-kit",
            str(kits / "coordinator"),
            "--consortium",
            str(kits.parent / "consortium.yaml"),
            "--out",
            str(kits),
        ],
    )
    return result.exit_code, result.output


def fingerprints(root: Path) -> dict[str, str]:
    return {
        str(path.relative_to(root)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }


def test_add_silo_issues_a_kit_from_the_same_ca_and_touches_no_other_kit(kits: Path) -> None:
    before = fingerprints(kits)

    code, output = add_silo(kits, "zurich")

    assert code == 0, output
    new = load_silo_kit(kits / "silos" / "zurich")
    ca = (kits / "operator" / "ca.crt").read_bytes()
    assert verify_issued_by(new.tls.certificate.read_bytes(), ca)
    assert set(new.peers) == set(SILOS)
    after = fingerprints(kits)
    changed = {path for path in before if before[path] != after[path]}
    assert changed == {"coordinator/kit.yaml"}
    assert all(path.startswith("silos/zurich/") for path in set(after) - set(before))
    assert "silos/zurich" in output and "coordinator" in output and "peer" in output


def test_a_coordinator_started_afterwards_enrols_the_new_silo_by_its_real_keys(
    kits: Path,
) -> None:
    assert add_silo(kits, "zurich")[0] == 0

    coordinator = load_coordinator_kit(kits / "coordinator")
    new = load_silo_kit(kits / "silos" / "zurich")
    assert sorted(coordinator.silos) == sorted([*SILOS, "zurich"])
    enrolled = coordinator.silos["zurich"]
    assert enrolled.verify_key == new.signing_key.verify_key
    assert enrolled.sealing_public_key == new.sealing_key.public_key
    assert enrolled.certificate_fingerprint == certificate_fingerprint(
        new.tls.certificate.read_bytes()
    )
    assert public_key_hex(new.coordinator_verify_key) == public_key_hex(
        coordinator.coordinator_verify_key
    )
    assert new.coordinator_address == coordinator.address


@pytest.mark.parametrize("name", ["hungary", "HUNGARY"])
def test_an_enrolled_name_is_refused_and_nothing_is_written(kits: Path, name: str) -> None:
    before = fingerprints(kits)

    code, output = add_silo(kits, name)

    assert code == 1
    assert "already enrolled" in output and "Traceback" not in output
    assert fingerprints(kits) == before


def test_an_existing_kit_folder_is_never_replaced(kits: Path) -> None:
    (kits / "silos" / "zurich").mkdir()
    (kits / "silos" / "zurich" / "notes.txt").write_text("the site's own")
    before = fingerprints(kits)

    code, output = add_silo(kits, "zurich")

    assert code == 1
    assert "already exists" in output
    assert fingerprints(kits) == before


def test_a_ca_of_another_consortium_is_refused(kits: Path, tmp_path: Path) -> None:
    provision(parse_consortium(CONSORTIUM), tmp_path / "other")
    before = fingerprints(kits)

    code, output = add_silo(kits, "zurich", operator=tmp_path / "other" / "operator")

    assert code == 1
    assert "--ca-kit" in output and "operator key" in output
    assert fingerprints(kits) == before


def test_a_bad_name_is_refused_naming_it(kits: Path) -> None:
    code, output = add_silo(kits, "../escape")

    assert code == 1
    assert "NAME" in output and "not a valid name" in output
    assert not (kits / "escape").exists()
