"""`fedsilo consortium renew`: the kits' TLS certificates issued again before they expire, from
the same CA, for the same parties.

A renewed certificate has the old one's subject, public key and extensions (names and uses), a
new serial number and a new validity (`renew_certificate` in privacy/certificates.py). The key
pairs stay, and so does every signing and sealing key of the envelopes: only certificates
change, and a certificate is public, so it travels to its party over any channel. Each file is
replaced atomically (a temporary file renamed over it, wire/durable.py), after the old one is
kept beside it as `<name>.<old serial in hex>.old` (a hard link: never overwritten, and nothing
is copied); the coordinator kit's roster (kit.yaml) gets the renewed silos' fingerprints, also
rewritten atomically. A running coordinator serves its renewed certificate to new connections,
and a running silo reconnects with its own, without a restart (ops/server_credentials.py,
silo/channel.py).

The certificates, where `fedsilo provision` put them: the operator's `client.crt` in its
folder, the coordinator's `server.crt` in its kit, each silo's `client.crt` in
`KITS/silos/<name>/` (the operator's copies; a silo whose kit folder is not there is left out,
and named). A silo the signed roster revokes is never renewed: left out and named, or, asked
for by name (`--party`), refused before anything is written.
"""

from __future__ import annotations

import contextlib
import os
import stat
from collections.abc import Collection
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import serialization

from fedsilo.ops.provision import (
    OPERATOR,
    ProvisionError,
    load_certificate_authority,
    read_roster,
    replace_kit_document,
    revoked_silos,
    sign_next_roster,
)
from fedsilo.privacy.certificate_files import CertificateError, days_left, read_certificate
from fedsilo.privacy.certificates import (
    CertifiedKey,
    certificate_fingerprint,
    renew_certificate,
    verify_issued_by,
)
from fedsilo.wire.durable import write_atomically

COORDINATOR = "coordinator"


@dataclass(frozen=True)
class RenewedCertificate:
    party: str
    path: Path
    backup: Path  # the certificate it replaced
    old_expiry: datetime
    new_expiry: datetime


@dataclass(frozen=True)
class Renewal:
    """What `renew_certificates` did: the certificates renewed, those not due (`within`), the
    silos whose kit folder was not found, the roster that lists the new fingerprints, and the
    revoked silos left out (each with the roster's reason)."""

    renewed: tuple[RenewedCertificate, ...]
    not_due: tuple[tuple[str, Path, datetime], ...]
    missing: tuple[str, ...]
    roster: Path | None
    revoked: tuple[tuple[str, str], ...] = ()


def certificate_files(operator: Path, coordinator: Path, kits: Path) -> dict[str, Path]:
    """Where each party's certificate is: the operator's (when its folder has one), the
    coordinator's, and each silo's of the roster (a path that may not exist here)."""
    roster = read_roster(coordinator)
    files: dict[str, Path] = {}
    if (operator / "client.crt").is_file():
        files[OPERATOR] = operator / "client.crt"
    files[COORDINATOR] = coordinator / "server.crt"
    for silo in sorted(roster.silos):
        files[silo] = kits / "silos" / silo / "client.crt"
    return files


def renew_certificates(
    operator: Path,
    coordinator: Path,
    kits: Path,
    days: int,
    parties: Collection[str] = (),
    within: float | None = None,
) -> Renewal:
    """Renew the certificates of `parties` (every party when empty, but a revoked silo) for
    `days` days; with `within`, only those expiring within that many days. Refused before
    anything is written (ProvisionError, naming the option or file) when a party is unknown or
    a revoked silo, a certificate is not of this CA, or `days` would outlive the CA."""
    authority = load_certificate_authority(operator)
    files = certificate_files(operator, coordinator, kits)
    unknown = sorted(set(parties) - set(files))
    if unknown:
        raise ProvisionError(
            f"--party: no party {', '.join(map(repr, unknown))}; parties: {', '.join(files)}"
        )
    revoked = revoked_silos(operator, coordinator)
    if refused := [party for party in parties if party in revoked]:
        raise ProvisionError(
            f"--party {refused[0]}: silo {refused[0]!r} is revoked ({revoked[refused[0]]}); a "
            "revoked silo's certificate is not renewed"
        )
    chosen = {
        party: path
        for party, path in files.items()
        if (not parties or party in parties) and party not in revoked
    }
    missing = tuple(party for party, path in chosen.items() if not path.is_file())
    if missing and (parties or COORDINATOR in missing):
        raise ProvisionError(
            f"{chosen[missing[0]]}: not found, so the certificate of {missing[0]!r} cannot be "
            "renewed"
        )
    _check_within_authority(authority, days)
    due: dict[str, tuple[Path, x509.Certificate]] = {}
    not_due: list[tuple[str, Path, datetime]] = []
    for party, path in chosen.items():
        if party in missing:
            continue
        certificate = _issued_by(authority, path)
        if within is not None and days_left(certificate) > within:
            not_due.append((party, path, certificate.not_valid_after_utc))
        else:
            due[party] = (path, certificate)
    renewed = tuple(
        _replace(party, path, certificate, renew_certificate(authority, certificate, days))
        for party, (path, certificate) in due.items()
    )
    roster = _update_roster(operator, coordinator, renewed)
    left_out = tuple((silo, reason) for silo, reason in revoked.items() if silo in files)
    return Renewal(renewed, tuple(not_due), missing, roster, left_out)


def _check_within_authority(authority: CertifiedKey, days: int) -> None:
    ca_expiry = authority.certificate.not_valid_after_utc
    if datetime.now(timezone.utc) + timedelta(days=days) > ca_expiry:
        raise ProvisionError(
            f"--days {days}: a certificate cannot outlive the CA that issues it, valid until "
            f"{ca_expiry:%Y-%m-%d}; give at most {int(days_left(authority.certificate))} days"
        )


def _issued_by(authority: CertifiedKey, path: Path) -> x509.Certificate:
    try:
        certificate = read_certificate(path)
    except CertificateError as exc:
        raise ProvisionError(str(exc)) from None
    pem = certificate.public_bytes(serialization.Encoding.PEM)
    if not verify_issued_by(pem, authority.certificate_pem()):
        raise ProvisionError(f"{path}: not issued by the CA of --ca-kit; is it of this consortium?")
    return certificate


def _replace(
    party: str, path: Path, old: x509.Certificate, new: x509.Certificate
) -> RenewedCertificate:
    """Keep `old` beside `path` as a hard link, then replace `path` with `new` atomically, in
    the old file's mode."""
    backup = path.with_name(f"{path.name}.{old.serial_number:x}.old")
    mode = stat.S_IMODE(path.stat().st_mode)
    with contextlib.suppress(FileExistsError):  # the same certificate was kept before
        os.link(path, backup)
    write_atomically(path, [new.public_bytes(serialization.Encoding.PEM)])
    os.chmod(path, mode)
    return RenewedCertificate(party, path, backup, old.not_valid_after_utc, new.not_valid_after_utc)


def _update_roster(
    operator: Path, coordinator: Path, renewed: tuple[RenewedCertificate, ...]
) -> Path | None:
    """Write the renewed silos' certificate fingerprints into the coordinator kit's roster:
    kit.yaml, then the next operator-signed roster (which lists the fingerprints too)."""
    roster = read_roster(coordinator)
    fingerprints = {
        item.party: certificate_fingerprint(item.path.read_bytes())
        for item in renewed
        if item.party in roster.silos
    }
    if not fingerprints:
        return None
    silos = {
        name: entry.model_copy(update={"certificate_fingerprint": fingerprints[name]})
        if name in fingerprints
        else entry
        for name, entry in roster.silos.items()
    }
    replace_kit_document(coordinator, roster.model_copy(update={"silos": silos}))
    sign_next_roster(operator, coordinator)
    return coordinator / "kit.yaml"
