"""Provisioning: consortium.yaml in, one startup kit per party out. Every private key lives in
exactly one kit with mode 0600, every certificate chains to the consortium CA, the kits agree on
each other's public keys and fingerprints, and a kit reads back as typed keys or one clear error.
"""

import os
import shutil
from pathlib import Path

import pytest
import yaml
from click.testing import CliRunner
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from nacl.signing import SigningKey

from fedsilo.ops import provision as provisioning
from fedsilo.ops.consortium_cli import consortium_group
from fedsilo.ops.provision import (
    CoordinatorKit,
    KitError,
    ProvisionedConsortium,
    ProvisionError,
    SiloKit,
    add_silo,
    load_coordinator_kit,
    load_kit,
    load_operator_kit,
    load_silo_kit,
    provision,
)
from fedsilo.ops.provision_cli import policy_sign, provision_command
from fedsilo.policies.consortium import ConsortiumConfig, load_consortium_file, parse_consortium
from fedsilo.policies.loading import PolicyError
from fedsilo.privacy.certificates import (
    certificate_common_name,
    certificate_fingerprint,
    verify_issued_by,
)
from fedsilo.privacy.identity import public_key_hex, read_signing_key
from fedsilo.privacy.policy_signing import policy_digest, verify_policy

SILOS = ["cleveland", "hungary", "va"]
CONSORTIUM = {
    "consortium": "heart-consortium",
    "coordinator": {"address": "127.0.0.1:50051"},
    "silos": [{"name": name} for name in SILOS],
    "certificates": {"ca_days": 3650, "server_days": 365, "client_days": 365},
}
LAYOUT = {
    "operator": {"kit.yaml", "operator.key", "ca.crt", "ca.key", "client.crt", "client.key"},
    "coordinator": {"kit.yaml", "roster.json", "ca.crt", "server.crt", "server.key", "signing.key"},
    **{
        f"silos/{name}": {
            "kit.yaml",
            "ca.crt",
            "client.crt",
            "client.key",
            "signing.key",
            "sealing.key",
        }
        for name in SILOS
    },
}


def config(**changes: object) -> ConsortiumConfig:
    return parse_consortium({**CONSORTIUM, **changes}, source="consortium.yaml")


@pytest.fixture(scope="module")
def kits(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("provisioned") / "kits"
    provision(config(), out)
    return out


@pytest.fixture
def copied(kits: Path, tmp_path: Path) -> Path:
    """A private copy of the provisioned kits (modes kept) for tests that break one."""
    return Path(shutil.copytree(kits, tmp_path / "kits"))


def kit_yaml(folder: Path) -> dict:
    return yaml.safe_load((folder / "kit.yaml").read_text())


def private_key_files(root: Path) -> list[Path]:
    return sorted(root.rglob("*.key"))


# The kits on disk


def test_each_kit_holds_exactly_its_files(kits: Path) -> None:
    found = {
        str(folder.relative_to(kits)): {p.name for p in folder.iterdir()}
        for folder in [kits / "operator", kits / "coordinator", *(kits / "silos").iterdir()]
    }
    assert found == LAYOUT


def test_every_private_key_is_readable_by_its_owner_only(kits: Path) -> None:
    keys = private_key_files(kits)
    assert len(keys) == 3 + 2 + 3 * len(SILOS)  # operator, coordinator, silos
    assert all(path.stat().st_mode & 0o777 == 0o600 for path in keys)
    assert kits.stat().st_mode & 0o077 == 0  # the whole tree starts private to the operator


def test_no_private_key_appears_in_any_other_file(kits: Path) -> None:
    files = [path for path in kits.rglob("*") if path.is_file()]
    for key_file in private_key_files(kits):
        secrets = secret_forms(key_file)
        for other in files:
            if other == key_file:
                continue
            content = other.read_bytes()
            leaked = [s for s in secrets if s in content]
            assert not leaked, f"{key_file.relative_to(kits)} leaks into {other.relative_to(kits)}"


def secret_forms(key_file: Path) -> list[bytes]:
    """The ways a private key could be copied: its file's text, hex and raw bytes."""
    text = key_file.read_bytes()
    if text.startswith(b"-----BEGIN"):
        body = b"".join(line for line in text.splitlines() if not line.startswith(b"-----"))
        scalar = load_pem_private_key(text, password=None).private_numbers().private_value
        raw = scalar.to_bytes(32, "big")
        return [text, body, raw, raw.hex().encode()]
    hex_text = text.strip()
    return [hex_text, hex_text.upper(), bytes.fromhex(hex_text.decode())]


def test_every_certificate_chains_to_the_consortium_ca(kits: Path) -> None:
    ca = (kits / "operator" / "ca.crt").read_bytes()
    certificates = sorted(kits.rglob("server.crt")) + sorted(kits.rglob("client.crt"))
    assert len(certificates) == 1 + 1 + len(SILOS)  # the server, the operator, the silos
    for path in certificates:
        assert verify_issued_by(path.read_bytes(), ca), path
    assert all(p.read_bytes() == ca for p in kits.rglob("ca.crt"))


def test_a_certificate_of_another_provisioning_does_not_chain(kits: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    provision(config(), other)
    foreign = (other / "silos" / "va" / "client.crt").read_bytes()
    assert not verify_issued_by(foreign, (kits / "operator" / "ca.crt").read_bytes())


def test_client_certificates_carry_the_silo_name(kits: Path) -> None:
    for name in SILOS:
        pem = (kits / "silos" / name / "client.crt").read_bytes()
        assert certificate_common_name(pem) == name


def test_the_coordinator_kit_knows_each_silo_by_its_real_keys(kits: Path) -> None:
    roster = kit_yaml(kits / "coordinator")["silos"]
    assert list(roster) == SILOS
    for name in SILOS:
        silo = load_silo_kit(kits / "silos" / name)
        pem = (kits / "silos" / name / "client.crt").read_bytes()
        assert roster[name] == {
            "verify_key": public_key_hex(silo.signing_key.verify_key),
            "sealing_public_key": public_key_hex(silo.sealing_key.public_key),
            "certificate_fingerprint": certificate_fingerprint(pem),
        }


def test_kit_files_name_the_operator_and_coordinator_keys(kits: Path) -> None:
    operator = read_signing_key(kits / "operator" / "operator.key").verify_key
    coordinator = read_signing_key(kits / "coordinator" / "signing.key").verify_key
    documents = [kit_yaml(kits / p) for p in ("coordinator", "operator")]
    documents += [kit_yaml(kits / "silos" / n) for n in SILOS]
    for document in documents:
        assert document["operator_verify_key"] == public_key_hex(operator)
        assert document["coordinator_verify_key"] == public_key_hex(coordinator)


def test_a_silo_kit_lists_every_other_silo_as_a_peer(kits: Path) -> None:
    roster = kit_yaml(kits / "coordinator")["silos"]
    for name in SILOS:
        document = kit_yaml(kits / "silos" / name)
        assert document["role"] == "silo" and document["name"] == name
        assert document["coordinator_address"] == "127.0.0.1:50051"
        expected = {
            peer: {k: v for k, v in roster[peer].items() if k != "certificate_fingerprint"}
            for peer in SILOS
            if peer != name
        }
        assert document["peers"] == expected


# Refusals: nothing is replaced, nothing is half-written


def test_a_non_empty_out_is_refused_and_left_alone(tmp_path: Path) -> None:
    out = tmp_path / "kits"
    out.mkdir()
    (out / "old.key").write_text("precious")
    with pytest.raises(ProvisionError, match="already exists and is not an empty folder"):
        provision(config(), out)
    assert [p.name for p in out.iterdir()] == ["old.key"]
    assert [p.name for p in tmp_path.iterdir()] == ["kits"]


def test_an_empty_out_folder_is_used(tmp_path: Path) -> None:
    out = tmp_path / "kits"
    out.mkdir()
    provisioned = provision(config(), out)
    assert provisioned.coordinator == out / "coordinator"
    assert sorted(provisioned.silos) == SILOS


def test_a_failure_midway_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    written: list[Path] = []

    def failing_write(path: Path, key: object) -> None:
        written.append(path)
        if len(written) == 3:
            raise OSError("disk full")
        path.write_text("x")

    monkeypatch.setattr(provisioning, "write_private_key", failing_write)
    with pytest.raises(OSError, match="disk full"):
        provision(config(), tmp_path / "kits")
    assert list(tmp_path.iterdir()) == []


# consortium.yaml


def test_a_consortium_file_loads(tmp_path: Path) -> None:
    path = tmp_path / "consortium.yaml"
    path.write_text(yaml.safe_dump(CONSORTIUM))
    loaded = load_consortium_file(path)
    assert loaded.silo_names == SILOS
    assert loaded.coordinator.host == "127.0.0.1"
    assert loaded.certificates.server_days == 365


def test_a_missing_consortium_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(PolicyError, match="absent.yaml: consortium file not found"):
        load_consortium_file(tmp_path / "absent.yaml")


def test_duplicate_silo_names_are_refused() -> None:
    with pytest.raises(PolicyError, match="silos: silo names must be unique.*'va'"):
        config(silos=[{"name": "va"}, {"name": "cleveland"}, {"name": "VA"}])


@pytest.mark.parametrize(
    ("address", "problem"),
    [
        ("127.0.0.1", "is not host:port"),
        ("127.0.0.1:99999", "port from 1 to 65535"),
        ("300.1.2.3:50051", "'300.1.2.3' is not an IPv4 address"),
        ("coord_inator:50051", "neither an IPv4 address nor a DNS name"),
        ("::1:50051", "an IPv6 host needs brackets"),
        ("[fe80::zz]:50051", "is not an IPv6 address"),
    ],
)
def test_a_bad_coordinator_address_is_explained(address: str, problem: str) -> None:
    with pytest.raises(PolicyError) as err:
        config(coordinator={"address": address})
    assert str(err.value).startswith("consortium.yaml: coordinator.address: ")
    assert problem in str(err.value)


@pytest.mark.parametrize(
    ("address", "host"),
    [("coord.example.org:443", "coord.example.org"), ("[::1]:50051", "::1")],
)
def test_dns_and_ipv6_hosts_are_accepted(address: str, host: str) -> None:
    assert config(coordinator={"address": address}).coordinator.host == host


def test_an_unknown_key_is_named_with_a_hint() -> None:
    with pytest.raises(PolicyError, match="unknown field 'silo' \\(did you mean 'silos'\\?\\)"):
        parse_consortium({**CONSORTIUM, "silo": []})
    with pytest.raises(PolicyError, match="certificates: unknown field 'ca_day' .*'ca_days'"):
        config(certificates={"ca_day": 10})


@pytest.mark.parametrize("name", ["..", "a/b", "-lead", "x" * 65, "caf\u00e9"])
def test_a_silo_name_must_be_safe_as_a_folder_and_common_name(name: str) -> None:
    with pytest.raises(PolicyError, match="silos.0.name: .* is not a valid name"):
        config(silos=[{"name": name}])


def test_no_certificate_may_outlive_the_ca() -> None:
    with pytest.raises(
        PolicyError, match="server_days \\(400\\) must not exceed ca_days \\(365\\)"
    ):
        config(certificates={"ca_days": 365, "server_days": 400, "client_days": 30})
    with pytest.raises(PolicyError, match="client_days: Input should be greater than or equal"):
        config(certificates={"client_days": 0})


def test_at_least_one_silo_is_required() -> None:
    with pytest.raises(PolicyError, match="silos: List should have at least 1 item"):
        config(silos=[])


# Reading a kit back


def test_the_coordinator_kit_loads_with_typed_keys(kits: Path) -> None:
    kit = load_kit(kits / "coordinator")
    assert isinstance(kit, CoordinatorKit)
    assert (kit.consortium, kit.address) == ("heart-consortium", "127.0.0.1:50051")
    assert kit.tls.private_key == kits / "coordinator" / "server.key"
    assert kit.signing_key.verify_key == kit.coordinator_verify_key
    operator = read_signing_key(kits / "operator" / "operator.key")
    assert kit.operator_verify_key == operator.verify_key
    assert list(kit.silos) == SILOS
    va = load_silo_kit(kits / "silos" / "va")
    assert kit.silos["va"].verify_key == va.signing_key.verify_key
    assert bytes(kit.silos["va"].sealing_public_key) == bytes(va.sealing_key.public_key)


def test_a_silo_kit_loads_with_typed_keys(kits: Path) -> None:
    kit = load_kit(kits / "silos" / "hungary")
    assert isinstance(kit, SiloKit)
    assert (kit.name, kit.coordinator_address) == ("hungary", "127.0.0.1:50051")
    assert kit.tls.certificate == kits / "silos" / "hungary" / "client.crt"
    assert sorted(kit.peers) == ["cleveland", "va"]
    coordinator = load_coordinator_kit(kits / "coordinator")
    assert kit.coordinator_verify_key == coordinator.signing_key.verify_key
    cleveland = load_silo_kit(kits / "silos" / "cleveland")
    assert bytes(kit.peers["cleveland"].sealing_public_key) == bytes(
        cleveland.sealing_key.public_key
    )


def test_a_kit_of_the_wrong_role_is_named(kits: Path) -> None:
    with pytest.raises(KitError, match="kit of silo 'va'; the coordinator needs its own kit"):
        load_coordinator_kit(kits / "silos" / "va")
    with pytest.raises(KitError, match="kit of coordinator; a silo needs its own kit"):
        load_silo_kit(kits / "coordinator")
    with pytest.raises(KitError, match="the operator's kit, for `fedsilo job`"):
        load_kit(kits / "operator")
    with pytest.raises(KitError, match="kit of 'silo', not the operator's"):
        load_operator_kit(kits / "silos" / "va")
    with pytest.raises(KitError, match="no kit.yaml, so not a coordinator, silo or operator kit"):
        load_kit(kits / "silos")


def test_an_unknown_role_is_named(copied: Path) -> None:
    folder = copied / "silos" / "va"
    document = {**kit_yaml(folder), "role": "auditor"}
    (folder / "kit.yaml").write_text(yaml.safe_dump(document))
    with pytest.raises(KitError, match="role must be .* or 'operator', got 'auditor'"):
        load_kit(folder)


@pytest.mark.parametrize("missing", ["signing.key", "sealing.key", "client.key", "ca.crt"])
def test_a_missing_kit_file_is_named(copied: Path, missing: str) -> None:
    folder = copied / "silos" / "cleveland"
    (folder / missing).unlink()
    with pytest.raises(KitError, match=f"{folder / missing}: .*(not found|missing)"):
        load_kit(folder)


def test_a_missing_field_in_kit_yaml_is_named(copied: Path) -> None:
    folder = copied / "coordinator"
    document = kit_yaml(folder)
    del document["operator_verify_key"]
    (folder / "kit.yaml").write_text(yaml.safe_dump(document))
    with pytest.raises(KitError, match="kit.yaml: operator_verify_key: Field required"):
        load_kit(folder)


def test_a_key_readable_by_others_is_refused_with_the_fix(copied: Path) -> None:
    key = copied / "coordinator" / "server.key"
    os.chmod(key, 0o644)
    with pytest.raises(KitError, match=f"run `chmod 600 {key}`"):
        load_kit(copied / "coordinator")


def test_files_mixed_from_two_kits_are_refused(copied: Path) -> None:
    hungary, va = copied / "silos" / "hungary", copied / "silos" / "va"
    shutil.copy2(hungary / "client.crt", va / "client.crt")
    with pytest.raises(KitError, match="does not certify .*client.key"):
        load_kit(va)
    shutil.copy2(hungary / "client.key", va / "client.key")
    with pytest.raises(KitError, match="issued to 'hungary', but this kit is silo 'va'"):
        load_kit(va)


def test_a_coordinator_signing_key_must_match_its_kit(copied: Path) -> None:
    folder = copied / "coordinator"
    (folder / "signing.key").unlink()
    shutil.copy2(copied / "silos" / "va" / "signing.key", folder / "signing.key")
    with pytest.raises(KitError, match="not the key of this kit's coordinator_verify_key"):
        load_kit(folder)


# The operator's commands


def test_the_provision_command_says_where_each_kit_goes(tmp_path: Path) -> None:
    consortium = tmp_path / "consortium.yaml"
    consortium.write_text(yaml.safe_dump(CONSORTIUM))
    out = tmp_path / "kits"
    result = CliRunner().invoke(
        provision_command, ["--consortium", str(consortium), "--out", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "the coordinator host" in result.output
    for name in SILOS:
        assert f"silo '{name}'" in result.output
    fingerprint = certificate_fingerprint((out / "operator" / "ca.crt").read_bytes())
    assert fingerprint in result.output


def test_the_provision_command_reports_errors_without_writing(tmp_path: Path) -> None:
    consortium = tmp_path / "consortium.yaml"
    consortium.write_text(yaml.safe_dump({**CONSORTIUM, "silos": [{"name": "a"}, {"name": "a"}]}))
    result = CliRunner().invoke(
        provision_command, ["--consortium", str(consortium), "--out", str(tmp_path / "kits")]
    )
    assert result.exit_code == 1
    assert "silo names must be unique" in result.output
    assert not (tmp_path / "kits").exists()


def test_policy_sign_writes_a_signature_the_kits_verify(kits: Path, tmp_path: Path) -> None:
    policy = tmp_path / "heart.yaml"
    policy.write_text("version: 1\nname: heart\nalgorithm: {name: fedavg}\n")
    key = kits / "operator" / "operator.key"
    result = CliRunner().invoke(policy_sign, [str(policy), "--key", str(key)])
    assert result.exit_code == 0, result.output
    signature = (tmp_path / "heart.yaml.sig").read_text()
    silo = load_silo_kit(kits / "silos" / "va")
    digest = verify_policy(policy.read_bytes(), signature, silo.operator_verify_key)
    assert digest == policy_digest(policy.read_bytes())
    assert digest in result.output


def test_policy_sign_refuses_an_invalid_policy_or_key(kits: Path, tmp_path: Path) -> None:
    policy = tmp_path / "heart.yaml"
    policy.write_text("version: 1\nrounds: 0\n")
    key = kits / "operator" / "operator.key"
    result = CliRunner().invoke(policy_sign, [str(policy), "--key", str(key)])
    assert result.exit_code == 1 and "rounds" in result.output
    policy.write_text("version: 1\n")
    loose = tmp_path / "loose.key"
    loose.write_bytes(SigningKey.generate().encode().hex().encode())
    loose.chmod(0o644)
    result = CliRunner().invoke(policy_sign, [str(policy), "--key", str(loose)])
    assert result.exit_code == 1 and "chmod 600" in result.output
    assert not (tmp_path / "heart.yaml.sig").exists()


def test_provision_returns_where_everything_went(tmp_path: Path) -> None:
    provisioned = provision(config(silos=[{"name": "solo"}]), tmp_path / "kits")
    assert isinstance(provisioned, ProvisionedConsortium)
    assert provisioned.silos == {"solo": tmp_path / "kits" / "silos" / "solo"}
    operator = read_signing_key(provisioned.operator / "operator.key")
    assert provisioned.operator_verify_key == public_key_hex(operator.verify_key)
    assert kit_yaml(provisioned.silos["solo"])["peers"] == {}


# The operator's kit


def test_the_operator_kit_loads_with_its_certificate_and_keys(kits: Path) -> None:
    kit = load_operator_kit(kits / "operator")
    assert (kit.consortium, kit.coordinator_address) == ("heart-consortium", "127.0.0.1:50051")
    assert certificate_common_name(kit.tls.certificate.read_bytes()) == "operator"
    assert kit.tls.private_key == kits / "operator" / "client.key"
    assert kit.signing_key == read_signing_key(kits / "operator" / "operator.key")
    coordinator = load_coordinator_kit(kits / "coordinator")
    assert kit.coordinator_verify_key == coordinator.signing_key.verify_key


def test_an_operator_kit_must_hold_the_operator_key(copied: Path) -> None:
    folder = copied / "operator"
    document = {**kit_yaml(folder), "operator_verify_key": public_key_hex(SigningKey.generate())}
    (folder / "kit.yaml").write_text(yaml.safe_dump(document))
    with pytest.raises(KitError, match="operator.key: not the key of this kit's"):
        load_operator_kit(folder)


def test_an_older_operator_folder_is_told_how_to_get_its_kit(copied: Path) -> None:
    folder = copied / "operator"
    for name in ("kit.yaml", "client.crt", "client.key"):
        (folder / name).unlink()
    fix = "fedsilo consortium issue-operator-kit --operator"
    with pytest.raises(KitError, match=f"without kit.yaml .*{fix}"):
        load_operator_kit(folder)
    issue = ["issue-operator-kit", "--operator", str(folder)]
    issue += ["--coordinator-kit", str(copied / "coordinator")]
    result = CliRunner().invoke(consortium_group, issue)
    assert result.exit_code == 0, result.output
    kit = load_operator_kit(folder)
    assert kit.coordinator_address == "127.0.0.1:50051"
    assert (folder / "client.key").stat().st_mode & 0o777 == 0o600
    before = {p.name: p.read_bytes() for p in folder.iterdir()}
    again = CliRunner().invoke(consortium_group, issue)
    assert again.exit_code == 1
    assert "already holds kit.yaml, client.crt, client.key; a kit is never replaced" in again.output
    assert {p.name: p.read_bytes() for p in folder.iterdir()} == before


def test_an_operator_kit_is_issued_only_for_its_own_consortium(
    copied: Path, tmp_path: Path
) -> None:
    folder = copied / "operator"
    for name in ("kit.yaml", "client.crt", "client.key"):
        (folder / name).unlink()
    provision(config(), tmp_path / "other")
    issue = ["issue-operator-kit", "--operator", str(folder)]
    issue += ["--coordinator-kit", str(tmp_path / "other" / "coordinator")]
    result = CliRunner().invoke(consortium_group, issue)
    assert result.exit_code == 1
    assert "its operator.key is not the operator key of" in result.output
    assert sorted(p.name for p in folder.iterdir()) == ["ca.crt", "ca.key", "operator.key"]


@pytest.mark.parametrize("name", ["operator", "coordinator", "Operator"])
def test_the_operator_and_coordinator_names_are_no_silo_names(copied: Path, name: str) -> None:
    with pytest.raises(PolicyError, match=f"silos.1.name: '{name}' is reserved"):
        config(silos=[{"name": "va"}, {"name": name}])
    with pytest.raises(ProvisionError, match=f"NAME: '{name}' is reserved"):
        add_silo(name, config(), copied / "operator", copied / "coordinator", copied)
