"""Provisioning a consortium: from consortium.yaml to one startup kit per party, and reading a
kit back as typed keys and file paths.

```
out/operator/     kit.yaml, operator.key, ca.crt, ca.key,   stays with the operator
                  client.crt, client.key
out/coordinator/  kit.yaml, roster.json, ca.crt, server.crt, server.key, signing.key
out/silos/<name>/ kit.yaml, ca.crt, client.crt, client.key, signing.key, sealing.key
```

The operator's folder is also the operator's kit for administering a running coordinator
(`fedsilo job`, `fedsilo status --kit`): its TLS client certificate's common name is `operator`,
and it signs its requests with operator.key. `issue_operator_kit` adds that kit (kit.yaml and
the client certificate) to an operator folder provisioned before it existed.

roster.json is the consortium's membership signed by the operator (privacy/roster.py):
`provision` writes version 1, `add_silo` the next version. kit.yaml's `silos` keeps being written
beside it (so a kit stays readable as before), and it stays the coordinator's list of keys; when
roster.json is there the coordinator admits only the silos the signed roster lists (members,
or revoked, which it keeps refusing), and refuses a kit whose roster and kit.yaml disagree on a
member's keys. A coordinator kit without roster.json (provisioned before) works as before.

`add_silo` issues one more silo kit later, from the same CA and operator key, and enrols it in
the coordinator kit's roster (its kit.yaml, rewritten atomically, then the next signed roster);
no other kit is touched: the silos learn the new member from the signed roster.
`fedsilo consortium renew` re-issues the kits' certificates (ops/renewal.py) with
`load_certificate_authority`, `read_roster` and `replace_kit_document`.

Every private key exists in exactly one kit, in a 0600 file. All kits are written into a
temporary sibling of `out` (mode 0700) and renamed into place at the end, so a failure leaves
nothing half-written, and an existing non-empty `out` is refused so keys are never replaced.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Literal, TypeVar

import yaml
from cryptography import x509
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import load_pem_private_key
from nacl.public import PrivateKey, PublicKey
from nacl.signing import SigningKey, VerifyKey
from pydantic import ValidationError

from fedsilo.policies.base import PolicyModel
from fedsilo.policies.consortium import (
    EXAMPLE,
    CertificateLifetimes,
    ConsortiumConfig,
    SiloEntry,
)
from fedsilo.policies.loading import describe_errors
from fedsilo.privacy.certificates import (
    CertifiedKey,
    certificate_common_name,
    certificate_fingerprint,
    certifies_private_key,
    create_certificate_authority,
    issue_client_certificate,
    issue_server_certificate,
    verify_issued_by,
)
from fedsilo.privacy.identity import (
    IdentityError,
    parse_sealing_public_key,
    parse_verify_key,
    public_key_hex,
    read_sealing_key,
    read_secret_file,
    read_signing_key,
    write_private_key,
    write_secret_file,
)
from fedsilo.privacy.roster import (
    ROSTER_FILE,
    RosterDocument,
    RosterEntry,
    RosterError,
    SignedRoster,
    read_roster_file,
    sign_roster,
    write_roster_file,
)

KIT_FILE = "kit.yaml"
CA_CERTIFICATE = "ca.crt"
CA_KEY = "ca.key"
OPERATOR_KEY = "operator.key"
OPERATOR = "operator"  # the common name of the operator's TLS client certificate
SIGNING_KEY = "signing.key"
SEALING_KEY = "sealing.key"
KIT_FOLDER_MODE = 0o700

Document = TypeVar("Document", bound=PolicyModel)
Key = TypeVar("Key")
Kit = TypeVar("Kit", bound="CoordinatorKit | SiloKit")


class ProvisionError(ValueError):
    """Provisioning cannot go ahead; nothing was written."""


class KitError(ValueError):
    """A startup kit that cannot be used; the message names the kit's folder or file."""


# The kit.yaml documents: what provisioning writes and `load_kit` reads back.


class PeerEntry(PolicyModel):
    verify_key: str
    sealing_public_key: str


class EnrolledSiloEntry(PeerEntry):
    certificate_fingerprint: str


class CoordinatorKitDocument(PolicyModel):
    role: Literal["coordinator"]
    consortium: str
    address: str
    operator_verify_key: str
    coordinator_verify_key: str
    silos: dict[str, EnrolledSiloEntry]


class OperatorKitDocument(PolicyModel):
    role: Literal["operator"]
    consortium: str
    coordinator_address: str
    coordinator_verify_key: str
    operator_verify_key: str


class SiloKitDocument(PolicyModel):
    role: Literal["silo"]
    consortium: str
    name: str
    coordinator_address: str
    operator_verify_key: str
    coordinator_verify_key: str
    peers: dict[str, PeerEntry]


# Loaded kits: typed keys, and the paths of the TLS files gRPC reads.


@dataclass(frozen=True)
class TlsFiles:
    """PEM files for mTLS: the consortium CA, this party's certificate and its private key."""

    ca_certificate: Path
    certificate: Path
    private_key: Path


@dataclass(frozen=True)
class Peer:
    """Another silo as a silo knows it: how to check its signatures and seal models to it."""

    verify_key: VerifyKey
    sealing_public_key: PublicKey


@dataclass(frozen=True)
class EnrolledSilo(Peer):
    """A silo as the coordinator knows it; its TLS client certificate has this fingerprint."""

    certificate_fingerprint: str


@dataclass(frozen=True)
class CoordinatorKit:
    folder: Path
    consortium: str
    address: str
    tls: TlsFiles
    signing_key: SigningKey
    operator_verify_key: VerifyKey
    coordinator_verify_key: VerifyKey
    silos: Mapping[str, EnrolledSilo]
    roster: SignedRoster | None = None  # None: a kit provisioned before rosters were signed


@dataclass(frozen=True)
class SiloKit:
    folder: Path
    consortium: str
    name: str
    coordinator_address: str
    tls: TlsFiles
    signing_key: SigningKey
    sealing_key: PrivateKey
    operator_verify_key: VerifyKey
    coordinator_verify_key: VerifyKey
    peers: Mapping[str, Peer]


@dataclass(frozen=True)
class OperatorKit:
    """The operator's kit: mTLS as `operator`, requests signed with operator.key."""

    folder: Path
    consortium: str
    coordinator_address: str
    tls: TlsFiles
    signing_key: SigningKey
    coordinator_verify_key: VerifyKey


@dataclass(frozen=True)
class ProvisionedConsortium:
    """Where each kit was written, and what parties compare out of band (CA, operator key)."""

    operator: Path
    coordinator: Path
    silos: Mapping[str, Path]
    ca_fingerprint: str
    operator_verify_key: str


@dataclass(frozen=True)
class AddedSilo:
    """Where the new silo's kit was written and which coordinator roster now enrols it."""

    kit: Path
    coordinator_roster: Path
    existing_silos: tuple[str, ...]
    roster_version: int  # of the signed roster now in the coordinator kit


@dataclass(frozen=True)
class _SiloIdentity:
    name: str
    signing_key: SigningKey
    sealing_key: PrivateKey
    tls: CertifiedKey


@dataclass(frozen=True)
class _Identities:
    """Every key and certificate of one consortium, generated before anything is written."""

    authority: CertifiedKey
    operator_key: SigningKey
    operator_tls: CertifiedKey
    coordinator_key: SigningKey
    server: CertifiedKey
    silos: tuple[_SiloIdentity, ...]


def write_example_consortium(path: Path) -> None:
    """Write the commented example consortium.yaml to `path`; an existing file is never
    replaced (ProvisionError)."""
    try:
        with path.open("x", encoding="utf-8") as handle:
            handle.write(EXAMPLE)
    except FileExistsError:
        raise ProvisionError(f"--example: {path} exists; give a new path") from None


def provision(config: ConsortiumConfig, out: Path) -> ProvisionedConsortium:
    """Generate every identity of the consortium and write one kit per party under `out`."""
    _refuse_existing(out)
    identities = _generate(config)
    out.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{out.name}.", suffix=".partial", dir=out.parent))
    try:
        _write_operator_kit(staging / "operator", config, identities)
        _write_coordinator_kit(staging / "coordinator", config, identities)
        for silo in identities.silos:
            _write_silo_kit(staging / "silos" / silo.name, config, identities, silo)
        _move_into_place(staging, out)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ProvisionedConsortium(
        operator=out / "operator",
        coordinator=out / "coordinator",
        silos=MappingProxyType({name: out / "silos" / name for name in config.silo_names}),
        ca_fingerprint=certificate_fingerprint(identities.authority.certificate_pem()),
        operator_verify_key=public_key_hex(identities.operator_key.verify_key),
    )


def add_silo(
    name: str, config: ConsortiumConfig, operator: Path, coordinator: Path, out: Path
) -> AddedSilo:
    """Issue silo `name` a kit in `out/silos/<name>` from the CA and operator key in `operator`,
    and enrol it in the roster of the coordinator kit `coordinator`. Refused (ProvisionError,
    nothing written) when the name is enrolled already, its folder exists, or the operator
    folder, coordinator kit and consortium.yaml are not of one consortium."""
    _check_silo_name(name)
    authority, operator_key = _load_operator(operator)
    roster_path = coordinator / KIT_FILE
    try:
        roster = _validate(CoordinatorKitDocument, _read_kit_document(coordinator), coordinator)
    except KitError as exc:
        raise ProvisionError(f"--coordinator-kit: {exc}") from None
    _check_same_consortium(config, roster, authority, operator_key, operator, coordinator)
    current = _current_roster(coordinator, roster, operator_key)
    revoked = current.revoked if current is not None else {}
    if name.lower() in {silo.lower() for silo in (*roster.silos, *revoked)}:
        raise ProvisionError(f"{name}: already enrolled in {roster_path}; choose another name")
    folder = out / "silos" / name
    if folder.exists():
        raise ProvisionError(f"{folder}: already exists; a kit is never replaced")
    silo = _SiloIdentity(
        name=name,
        signing_key=SigningKey.generate(),
        sealing_key=PrivateKey.generate(),
        tls=issue_client_certificate(authority, name, config.certificates.client_days),
    )
    document = SiloKitDocument(
        role="silo",
        consortium=roster.consortium,
        name=name,
        coordinator_address=roster.address,
        operator_verify_key=roster.operator_verify_key,
        coordinator_verify_key=roster.coordinator_verify_key,
        peers={
            peer: PeerEntry(**entry.model_dump(exclude={"certificate_fingerprint"}))
            for peer, entry in roster.silos.items()
        },
    )
    enrolled = roster.model_copy(
        update={
            "silos": {
                **roster.silos,
                name: EnrolledSiloEntry(
                    **_peer_entry(silo).model_dump(),
                    certificate_fingerprint=certificate_fingerprint(silo.tls.certificate_pem()),
                ),
            }
        }
    )
    folder.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".partial", dir=folder.parent))
    try:
        _write_kit_document(staging, document)
        _write_tls(staging, authority, silo.tls, "client")
        write_private_key(staging / SIGNING_KEY, silo.signing_key)
        write_private_key(staging / SEALING_KEY, silo.sealing_key)
        _move_into_place(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    replace_kit_document(coordinator, enrolled)
    if current is None:  # a kit provisioned before rosters were signed: its first roster
        following = _roster_document(roster.consortium, 1, enrolled.silos)
    else:
        entry = RosterEntry(**enrolled.silos[name].model_dump())
        following = current.following({**current.silos, name: entry}, current.revoked)
    write_roster_file(coordinator, sign_roster(following, operator_key))
    return AddedSilo(folder, roster_path, tuple(sorted(roster.silos)), following.version)


def load_certificate_authority(operator: Path, option: str = "--ca-kit") -> CertifiedKey:
    """The consortium CA (certificate and key) in the operator's folder, given as `option`."""
    return _load_operator(operator, option)[0]


def sign_next_roster(operator: Path, coordinator: Path) -> int | None:
    """After kit.yaml's silo entries changed (`consortium renew`: new certificate fingerprints):
    sign the next roster with its members as kit.yaml now has them and the same revocations;
    its version, or None for a kit provisioned before rosters were signed."""
    _, operator_key = _load_operator(operator)
    document = read_roster(coordinator)
    current = _current_roster(coordinator, document, operator_key)
    if current is None:
        return None
    members = {name: RosterEntry(**document.silos[name].model_dump()) for name in current.silos}
    following = current.following(members, current.revoked)
    write_roster_file(coordinator, sign_roster(following, operator_key))
    return following.version


def revoked_silos(operator: Path, coordinator: Path) -> dict[str, str]:
    """The silos the coordinator kit's signed roster revokes, each with its reason ({} for a
    kit provisioned before rosters were signed)."""
    _, operator_key = _load_operator(operator)
    current = _current_roster(coordinator, read_roster(coordinator), operator_key)
    return {} if current is None else dict(current.revoked)


def read_roster(coordinator: Path) -> CoordinatorKitDocument:
    """The coordinator kit's kit.yaml as written, or a ProvisionError naming --coordinator-kit."""
    try:
        return _validate(CoordinatorKitDocument, _read_kit_document(coordinator), coordinator)
    except KitError as exc:
        raise ProvisionError(f"--coordinator-kit: {exc}") from None


def load_kit(folder: Path) -> CoordinatorKit | SiloKit:
    """The kit in `folder`, with its keys loaded and its files checked against each other."""
    document = _read_kit_document(folder)
    role = document.get("role")
    if role == "coordinator":
        return _load_coordinator_kit(folder, _validate(CoordinatorKitDocument, document, folder))
    if role == "silo":
        return _load_silo_kit(folder, _validate(SiloKitDocument, document, folder))
    if role == OPERATOR:
        raise KitError(
            f"{folder}: this is the operator's kit, for `fedsilo job` and `fedsilo status`; "
            "a coordinator or silo needs its own kit"
        )
    raise KitError(
        f"{folder / KIT_FILE}: role must be 'coordinator', 'silo' or 'operator', got {role!r}"
    )


def kit_role(folder: Path) -> str:
    """The role kit.yaml in `folder` names ('coordinator', 'silo', 'operator'), unchecked; an
    operator folder without kit.yaml gets the KitError of `load_operator_kit`."""
    if (folder / OPERATOR_KEY).is_file() and not (folder / KIT_FILE).exists():
        raise KitError(_missing_operator_kit(folder))
    return str(_read_kit_document(folder).get("role"))


def load_operator_kit(folder: Path) -> OperatorKit:
    """The operator's kit in `folder`: its client certificate (issued to `operator` by the
    kit's CA, certifying client.key), operator.key (the key of kit.yaml's operator_verify_key),
    the coordinator's address and verify key."""
    if folder.is_dir() and not (folder / KIT_FILE).exists():
        raise KitError(_missing_operator_kit(folder))
    document = _read_kit_document(folder)
    if document.get("role") != OPERATOR:
        raise KitError(
            f"{folder}: this is the kit of {document.get('role')!r}, not the operator's; give "
            "the operator's folder from `fedsilo provision` (OUT/operator)"
        )
    checked = _validate(OperatorKitDocument, document, folder)
    tls = _load_tls(folder, "client")
    common_name = certificate_common_name(tls.certificate.read_bytes())
    if common_name != OPERATOR:
        raise KitError(f"{tls.certificate}: issued to {common_name!r}, not to {OPERATOR!r}")
    signing_key = _load_key(read_signing_key, folder / OPERATOR_KEY)
    if signing_key.verify_key != _verify_key(checked.operator_verify_key, folder, OPERATOR):
        raise KitError(f"{folder / OPERATOR_KEY}: not the key of this kit's operator_verify_key")
    return OperatorKit(
        folder=folder,
        consortium=checked.consortium,
        coordinator_address=checked.coordinator_address,
        tls=tls,
        signing_key=signing_key,
        coordinator_verify_key=_verify_key(checked.coordinator_verify_key, folder, "coordinator"),
    )


def issue_operator_kit(
    operator: Path, coordinator: Path, days: int = CertificateLifetimes().client_days
) -> None:
    """Add the operator's kit (kit.yaml, a client certificate for `operator` from ca.key) to an
    operator folder provisioned without one, for the coordinator kit `coordinator`. Refused
    (ProvisionError, nothing written) when any of those files exists, or the folders are not of
    one consortium."""
    authority, operator_key = _load_operator(operator, "--operator")
    try:
        roster = _validate(CoordinatorKitDocument, _read_kit_document(coordinator), coordinator)
    except KitError as exc:
        raise ProvisionError(f"--coordinator-kit: {exc}") from None
    if public_key_hex(operator_key.verify_key) != roster.operator_verify_key:
        raise ProvisionError(
            f"--operator {operator}: its operator.key is not the operator key of {coordinator}"
        )
    if (coordinator / CA_CERTIFICATE).read_bytes() != authority.certificate_pem():
        raise ProvisionError(f"--operator {operator}: its CA is not the CA of {coordinator}")
    existing = [
        name for name in (KIT_FILE, "client.crt", "client.key") if (operator / name).exists()
    ]
    if existing:
        raise ProvisionError(
            f"--operator {operator}: already holds {', '.join(existing)}; a kit is never replaced"
        )
    tls = issue_client_certificate(authority, OPERATOR, days)
    document = _operator_document(
        roster.consortium, roster.address, roster.coordinator_verify_key, operator_key
    )
    files = {
        "client.key": tls.private_key_pem(),
        "client.crt": tls.certificate_pem(),
        KIT_FILE: yaml.safe_dump(document.model_dump(), sort_keys=False).encode(),
    }
    written: list[Path] = []
    try:
        for name, content in files.items():
            _write_new_file(operator / name, content, secret=name == "client.key")
            written.append(operator / name)
    except BaseException:
        for path in written:
            path.unlink(missing_ok=True)
        raise


def _write_new_file(path: Path, content: bytes, secret: bool) -> None:
    """Create `path` (0600 when `secret`); an existing file is never replaced."""
    if secret:
        write_secret_file(path, content)
        return
    with path.open("xb") as handle:
        handle.write(content)


def load_coordinator_kit(folder: Path) -> CoordinatorKit:
    return _expect(load_kit(folder), CoordinatorKit, folder)


def install_roster(folder: Path, roster: SignedRoster) -> CoordinatorKit:
    """Write the verified `roster` into the coordinator kit `folder` and return the kit read
    again; a roster whose members are not as in kit.yaml is a KitError, and nothing is written."""
    document = _validate(CoordinatorKitDocument, _read_kit_document(folder), folder)
    _listed({}, document, roster, folder)
    write_roster_file(folder, roster)
    return load_coordinator_kit(folder)


def load_silo_kit(folder: Path) -> SiloKit:
    return _expect(load_kit(folder), SiloKit, folder)


def _check_silo_name(name: str) -> None:
    try:
        SiloEntry(name=name)
    except ValidationError as exc:
        raise ProvisionError(
            f"NAME: {exc.errors()[0]['msg'].removeprefix('Value error, ')}"
        ) from None


def _missing_operator_kit(folder: Path) -> str:
    return (
        f"{folder}: an operator folder without {KIT_FILE} (provisioned before the operator had a "
        "kit); add it with `fedsilo consortium issue-operator-kit --operator "
        f"{folder} --coordinator-kit COORDINATOR_KIT`"
    )


def _load_operator(folder: Path, option: str = "--ca-kit") -> tuple[CertifiedKey, SigningKey]:
    """The CA (certificate and key) and the operator's signing key from the operator folder
    (given as `option`)."""
    try:
        certificate_pem = (folder / CA_CERTIFICATE).read_bytes()
        key_pem = read_secret_file(folder / CA_KEY)
        operator_key = read_signing_key(folder / OPERATOR_KEY)
        ca_key = load_pem_private_key(key_pem, password=None)
        certificate = x509.load_pem_x509_certificate(certificate_pem)
    except (OSError, ValueError) as exc:
        raise ProvisionError(f"{option} {folder}: not the operator's folder: {exc}") from None
    if not isinstance(ca_key, ec.EllipticCurvePrivateKey) or not certifies_private_key(
        certificate_pem, key_pem
    ):
        raise ProvisionError(f"{option} {folder}: ca.key is not the key of ca.crt")
    return CertifiedKey(certificate, ca_key), operator_key


def _check_same_consortium(
    config: ConsortiumConfig,
    roster: CoordinatorKitDocument,
    authority: CertifiedKey,
    operator_key: SigningKey,
    operator: Path,
    coordinator: Path,
) -> None:
    if config.consortium != roster.consortium:
        raise ProvisionError(
            f"--consortium names consortium {config.consortium!r}, the coordinator kit "
            f"{coordinator} is of {roster.consortium!r}"
        )
    if public_key_hex(operator_key.verify_key) != roster.operator_verify_key:
        raise ProvisionError(
            f"--ca-kit {operator}: its operator.key is not the operator key of {coordinator}"
        )
    if (coordinator / CA_CERTIFICATE).read_bytes() != authority.certificate_pem():
        raise ProvisionError(f"--ca-kit {operator}: its CA is not the CA of {coordinator}")


def _current_roster(
    coordinator: Path, document: CoordinatorKitDocument, operator_key: SigningKey
) -> RosterDocument | None:
    """The coordinator kit's signed roster (None: a kit provisioned before rosters were signed),
    checked under the operator's key."""
    try:
        signed = read_roster_file(coordinator, operator_key.verify_key, document.consortium)
    except RosterError as exc:
        raise ProvisionError(f"--coordinator-kit: {exc}") from None
    return None if signed is None else signed.document


def _roster_document(
    consortium: str, version: int, silos: Mapping[str, EnrolledSiloEntry]
) -> RosterDocument:
    entries = {name: RosterEntry(**entry.model_dump()) for name, entry in silos.items()}
    return RosterDocument(consortium=consortium, version=version, silos=entries)


def replace_kit_document(folder: Path, document: PolicyModel) -> None:
    """Rewrite `folder`'s kit.yaml atomically (a temporary file renamed over it)."""
    staging = folder / f".{KIT_FILE}.partial"
    staging.write_text(yaml.safe_dump(document.model_dump(), sort_keys=False))
    os.replace(staging, folder / KIT_FILE)


def _refuse_existing(out: Path) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ProvisionError(
            f"{out}: already exists and is not an empty folder; provisioning never replaces "
            "keys. Choose another --out, or move the old kits away first."
        )


def _move_into_place(staging: Path, out: Path) -> None:
    try:
        os.replace(staging, out)  # POSIX rename: atomic, and refuses a non-empty `out`
    except OSError as exc:
        raise ProvisionError(f"{out}: cannot move the kits into place: {exc.strerror}") from exc


def _generate(config: ConsortiumConfig) -> _Identities:
    lifetimes = config.certificates
    authority = create_certificate_authority(config.consortium, lifetimes.ca_days)
    silos = tuple(
        _SiloIdentity(
            name=name,
            signing_key=SigningKey.generate(),
            sealing_key=PrivateKey.generate(),
            tls=issue_client_certificate(authority, name, lifetimes.client_days),
        )
        for name in config.silo_names
    )
    return _Identities(
        authority=authority,
        operator_key=SigningKey.generate(),
        operator_tls=issue_client_certificate(authority, OPERATOR, lifetimes.client_days),
        coordinator_key=SigningKey.generate(),
        server=issue_server_certificate(authority, config.coordinator.host, lifetimes.server_days),
        silos=silos,
    )


def _write_operator_kit(folder: Path, config: ConsortiumConfig, ids: _Identities) -> None:
    document = _operator_document(
        config.consortium,
        config.coordinator.address,
        public_key_hex(ids.coordinator_key.verify_key),
        ids.operator_key,
    )
    _new_folder(folder)
    _write_kit_document(folder, document)
    write_private_key(folder / OPERATOR_KEY, ids.operator_key)
    _write_tls(folder, ids.authority, ids.operator_tls, "client")
    write_secret_file(folder / CA_KEY, ids.authority.private_key_pem())


def _operator_document(
    consortium: str, address: str, coordinator_verify_key: str, operator_key: SigningKey
) -> OperatorKitDocument:
    return OperatorKitDocument(
        role=OPERATOR,
        consortium=consortium,
        coordinator_address=address,
        coordinator_verify_key=coordinator_verify_key,
        operator_verify_key=public_key_hex(operator_key.verify_key),
    )


def _write_coordinator_kit(folder: Path, config: ConsortiumConfig, ids: _Identities) -> None:
    document = CoordinatorKitDocument(
        role="coordinator",
        consortium=config.consortium,
        address=config.coordinator.address,
        operator_verify_key=public_key_hex(ids.operator_key.verify_key),
        coordinator_verify_key=public_key_hex(ids.coordinator_key.verify_key),
        silos={
            silo.name: EnrolledSiloEntry(
                **_peer_entry(silo).model_dump(),
                certificate_fingerprint=certificate_fingerprint(silo.tls.certificate_pem()),
            )
            for silo in ids.silos
        },
    )
    _new_folder(folder)
    _write_kit_document(folder, document)
    roster = _roster_document(config.consortium, 1, document.silos)
    write_roster_file(folder, sign_roster(roster, ids.operator_key))
    _write_tls(folder, ids.authority, ids.server, "server")
    write_private_key(folder / SIGNING_KEY, ids.coordinator_key)


def _write_silo_kit(
    folder: Path, config: ConsortiumConfig, ids: _Identities, silo: _SiloIdentity
) -> None:
    document = SiloKitDocument(
        role="silo",
        consortium=config.consortium,
        name=silo.name,
        coordinator_address=config.coordinator.address,
        operator_verify_key=public_key_hex(ids.operator_key.verify_key),
        coordinator_verify_key=public_key_hex(ids.coordinator_key.verify_key),
        peers={peer.name: _peer_entry(peer) for peer in ids.silos if peer.name != silo.name},
    )
    _new_folder(folder)
    _write_kit_document(folder, document)
    _write_tls(folder, ids.authority, silo.tls, "client")
    write_private_key(folder / SIGNING_KEY, silo.signing_key)
    write_private_key(folder / SEALING_KEY, silo.sealing_key)


def _peer_entry(silo: _SiloIdentity) -> PeerEntry:
    return PeerEntry(
        verify_key=public_key_hex(silo.signing_key.verify_key),
        sealing_public_key=public_key_hex(silo.sealing_key.public_key),
    )


def _new_folder(folder: Path) -> None:
    folder.mkdir(mode=KIT_FOLDER_MODE, parents=True)


def _write_kit_document(folder: Path, document: PolicyModel) -> None:
    (folder / KIT_FILE).write_text(yaml.safe_dump(document.model_dump(), sort_keys=False))


def _write_tls(folder: Path, authority: CertifiedKey, own: CertifiedKey, stem: str) -> None:
    (folder / CA_CERTIFICATE).write_bytes(authority.certificate_pem())
    (folder / f"{stem}.crt").write_bytes(own.certificate_pem())
    write_secret_file(folder / f"{stem}.key", own.private_key_pem())


def _read_kit_document(folder: Path) -> dict:
    path = folder / KIT_FILE
    if not folder.is_dir():
        raise KitError(f"{folder}: kit folder not found")
    if not path.is_file():
        raise KitError(f"{folder}: no {KIT_FILE}, so not a coordinator, silo or operator kit")
    try:
        document = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise KitError(f"{path}: not valid YAML: {exc}") from exc
    if not isinstance(document, dict):
        raise KitError(f"{path}: a kit file is a mapping, got {type(document).__name__}")
    return document


def _validate(kind: type[Document], document: dict, folder: Path) -> Document:
    try:
        return kind.model_validate(document)
    except ValidationError as exc:
        raise KitError(describe_errors(exc, document, str(folder / KIT_FILE))) from None


def _load_coordinator_kit(folder: Path, document: CoordinatorKitDocument) -> CoordinatorKit:
    tls = _load_tls(folder, "server")
    signing_key = _load_key(read_signing_key, folder / SIGNING_KEY)
    coordinator_verify_key = _verify_key(document.coordinator_verify_key, folder, "coordinator")
    if signing_key.verify_key != coordinator_verify_key:
        raise KitError(f"{folder / SIGNING_KEY}: not the key of this kit's coordinator_verify_key")
    silos = {
        name: EnrolledSilo(
            verify_key=_verify_key(entry.verify_key, folder, f"silos.{name}"),
            sealing_public_key=_sealing_key(entry.sealing_public_key, folder, f"silos.{name}"),
            certificate_fingerprint=entry.certificate_fingerprint,
        )
        for name, entry in document.silos.items()
    }
    operator_verify_key = _verify_key(document.operator_verify_key, folder, "operator")
    try:
        roster = read_roster_file(folder, operator_verify_key, document.consortium)
    except RosterError as exc:
        raise KitError(str(exc)) from None
    if roster is not None:
        silos = _listed(silos, document, roster, folder)
    return CoordinatorKit(
        folder=folder,
        consortium=document.consortium,
        address=document.address,
        tls=tls,
        signing_key=signing_key,
        operator_verify_key=operator_verify_key,
        coordinator_verify_key=coordinator_verify_key,
        silos=MappingProxyType(silos),
        roster=roster,
    )


def _listed(
    silos: dict[str, EnrolledSilo],
    document: CoordinatorKitDocument,
    roster: SignedRoster,
    folder: Path,
) -> dict[str, EnrolledSilo]:
    """The silos of kit.yaml the signed roster lists, as members or revoked: one kit.yaml lists
    and the roster not yet (`add-silo` writes kit.yaml first) is not admitted. A member whose
    keys or certificate differ from kit.yaml's is a KitError."""
    for name, entry in roster.document.silos.items():
        enrolled = document.silos.get(name)
        if enrolled is None or RosterEntry(**enrolled.model_dump()) != entry:
            raise KitError(
                f"{folder / ROSTER_FILE}: silo {name!r} of roster version {roster.version} "
                f"is {'not in' if enrolled is None else 'not as in'} {folder / KIT_FILE}"
            )
    listed = set(roster.document.silos) | set(roster.document.revoked)
    return {name: silo for name, silo in silos.items() if name in listed}


def _load_silo_kit(folder: Path, document: SiloKitDocument) -> SiloKit:
    tls = _load_tls(folder, "client")
    common_name = certificate_common_name(tls.certificate.read_bytes())
    if common_name != document.name:
        raise KitError(
            f"{tls.certificate}: issued to {common_name!r}, but this kit is silo {document.name!r}"
        )
    peers = {
        name: Peer(
            verify_key=_verify_key(entry.verify_key, folder, f"peers.{name}"),
            sealing_public_key=_sealing_key(entry.sealing_public_key, folder, f"peers.{name}"),
        )
        for name, entry in document.peers.items()
    }
    return SiloKit(
        folder=folder,
        consortium=document.consortium,
        name=document.name,
        coordinator_address=document.coordinator_address,
        tls=tls,
        signing_key=_load_key(read_signing_key, folder / SIGNING_KEY),
        sealing_key=_load_key(read_sealing_key, folder / SEALING_KEY),
        operator_verify_key=_verify_key(document.operator_verify_key, folder, "operator"),
        coordinator_verify_key=_verify_key(document.coordinator_verify_key, folder, "coordinator"),
        peers=MappingProxyType(peers),
    )


def _load_tls(folder: Path, stem: str) -> TlsFiles:
    """The kit's TLS files, after checking the key is private, certified, and CA-issued."""
    tls = TlsFiles(folder / CA_CERTIFICATE, folder / f"{stem}.crt", folder / f"{stem}.key")
    for path in (tls.ca_certificate, tls.certificate):
        if not path.is_file():
            raise KitError(f"{path}: missing from the kit")
    key_pem = _load_key(read_secret_file, tls.private_key)
    certificate_pem = tls.certificate.read_bytes()
    if not certifies_private_key(certificate_pem, key_pem):
        raise KitError(
            f"{tls.certificate} does not certify {tls.private_key}: files from two kits?"
        )
    if not verify_issued_by(certificate_pem, tls.ca_certificate.read_bytes()):
        raise KitError(f"{tls.certificate} was not issued by {tls.ca_certificate}")
    return tls


def _load_key(read: Callable[[Path], Key], path: Path) -> Key:
    try:
        return read(path)
    except IdentityError as exc:
        raise KitError(str(exc)) from None


def _verify_key(text: str, folder: Path, owner: str) -> VerifyKey:
    try:
        return parse_verify_key(text, f"{folder / KIT_FILE}: {owner} verify key")
    except IdentityError as exc:
        raise KitError(str(exc)) from None


def _sealing_key(text: str, folder: Path, owner: str) -> PublicKey:
    try:
        return parse_sealing_public_key(text, f"{folder / KIT_FILE}: {owner} sealing public key")
    except IdentityError as exc:
        raise KitError(str(exc)) from None


def _expect(kit: CoordinatorKit | SiloKit, kind: type[Kit], folder: Path) -> Kit:
    if not isinstance(kit, kind):
        role = "coordinator" if isinstance(kit, CoordinatorKit) else f"silo '{kit.name}'"
        wanted = "the coordinator" if kind is CoordinatorKit else "a silo"
        raise KitError(f"{folder}: this is the kit of {role}; {wanted} needs its own kit")
    return kit
