"""A party's TLS files as a long-running service holds them: read again whenever they change on
disk (a certificate renewed by `fedsilo consortium renew`), checked before they are used (the
key certified by the certificate, the consortium CA its issuer, valid now), the days the
certificate has left, and a warning in the log from `WARN_DAYS` days before it expires.

The coordinator serves what `TlsFileWatch.current` holds to each new connection
(ops/server_credentials.py), a silo opens a new channel with it when it changes
(silo/channel.py), and both export its days left as `fedsilo_certificate_expiry_days`
(ops/metrics.py). A certificate that is expired or not yet valid when a service starts is
refused with one message naming the file and the date (`CertificateError`); one that turns
out unusable while the service runs is logged and the files in use are kept.
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from cryptography import x509

from fedsilo.privacy.certificates import certifies_private_key, verify_issued_by
from fedsilo.privacy.identity import IdentityError, read_secret_file

WARN_DAYS = 30  # from this many days before expiry, a running service warns in its log
WARN_EVERY_S = 24 * 3600.0  # and repeats the warning once a day
SECONDS_PER_DAY = 86_400.0
RENEW_HINT = 'renew it with `fedsilo consortium renew` (docs/how-to/operator.md, "Certificates")'


class CertificateError(ValueError):
    """TLS files that cannot be used (expired, not yet valid, not of this key or of this CA);
    the message names the file."""


@dataclass(frozen=True)
class TlsMaterial:
    """What one read of the files gave: the PEM bytes gRPC takes and the parsed certificate."""

    ca_pem: bytes
    certificate_pem: bytes
    private_key_pem: bytes
    certificate: x509.Certificate


def expiry_date(certificate: x509.Certificate) -> str:
    return f"{certificate.not_valid_after_utc:%Y-%m-%d %H:%M} UTC"


def days_left(certificate: x509.Certificate, now: datetime | None = None) -> float:
    """Days until `certificate` expires (negative once it has)."""
    now = now or datetime.now(timezone.utc)
    return (certificate.not_valid_after_utc - now).total_seconds() / SECONDS_PER_DAY


def validity_problem(
    path: Path, certificate: x509.Certificate, now: datetime | None = None
) -> str | None:
    """Why the certificate in `path` is not valid at `now` (expired, or not valid yet)."""
    now = now or datetime.now(timezone.utc)
    if now > certificate.not_valid_after_utc:
        return f"{path}: the certificate expired on {expiry_date(certificate)}; {RENEW_HINT}"
    if now < certificate.not_valid_before_utc:
        return (
            f"{path}: the certificate is not valid before "
            f"{certificate.not_valid_before_utc:%Y-%m-%d %H:%M} UTC (is this host's clock "
            "right?)"
        )
    return None


def expiry_note(path: Path, certificate: x509.Certificate, now: datetime | None = None) -> str:
    """One line on how long the certificate in `path` lives, with a hint to renew from
    `WARN_DAYS` days before it expires."""
    left = days_left(certificate, now)
    if left < 0:
        return f"{path} expired on {expiry_date(certificate)}; {RENEW_HINT}"
    note = f"{path} is valid until {expiry_date(certificate)} ({left:.0f} days left)"
    return f"{note}; {RENEW_HINT}" if left < WARN_DAYS else note


def read_certificate(path: Path) -> x509.Certificate:
    try:
        return parse_certificate(path, path.read_bytes())
    except OSError as exc:
        raise CertificateError(f"{path}: not a readable PEM certificate: {exc}") from None


def parse_certificate(path: Path, pem: bytes) -> x509.Certificate:
    """The certificate `pem` read from `path` (named in the error)."""
    try:
        return x509.load_pem_x509_certificate(pem)
    except ValueError as exc:
        raise CertificateError(f"{path}: not a readable PEM certificate: {exc}") from None


class TlsFileWatch:
    """The CA certificate, this party's certificate and its private key, as files that may be
    replaced while the service runs. `current()` is what to use now: the files as last read,
    read again when one of them changed (their size, modification time or inode)."""

    def __init__(
        self,
        ca_certificate: Path,
        certificate: Path,
        private_key: Path,
        party: str,
        log: logging.Logger,
    ) -> None:
        """Read and check the files now: a `CertificateError` (naming the file) when they do
        not go together or the certificate is not valid today."""
        self.paths = (ca_certificate, certificate, private_key)
        self.certificate_path = certificate
        self.party = party
        self.log = log
        self._lock = threading.Lock()
        self._signature = self._stat()
        self._material = self._read()
        self._refused: tuple | None = None  # the files last found unusable, logged once
        self._warned_at: float | None = None

    def current(self) -> TlsMaterial:
        """The files to use now; when they changed and do not check, the ones in use stay
        (logged once per change)."""
        with self._lock:
            signature = self._stat()
            if signature in (self._signature, self._refused):
                return self._material
            try:
                material = self._read()
            except CertificateError as exc:
                self._refused = signature
                self.log.warning("%s: keeping the certificate in use: %s", self.party, exc)
                return self._material
            self._signature, self._material = signature, material
            self.log.info(
                "%s: read the renewed certificate %s (serial %x), valid until %s",
                self.party,
                self.certificate_path,
                material.certificate.serial_number,
                expiry_date(material.certificate),
            )
            return material

    def days_left(self) -> float:
        return days_left(self.current().certificate)

    def sync(self) -> None:
        """Warn in the log, once a day, from `WARN_DAYS` days before the certificate expires
        (a `Watcher` of ops/coordinator_process.py)."""
        self.warn_if_due(self.current().certificate)

    def warn_if_due(self, certificate: x509.Certificate) -> None:
        """`sync` for the certificate of files just read (`current()`)."""
        now = time.monotonic()
        if days_left(certificate) >= WARN_DAYS or (
            self._warned_at is not None and now - self._warned_at < WARN_EVERY_S
        ):
            return
        self._warned_at = now
        self.log.warning(
            "%s's certificate %s", self.party, expiry_note(self.certificate_path, certificate)
        )

    def _stat(self) -> tuple:
        signature = []
        for path in self.paths:
            try:
                status = path.stat()
            except OSError:
                signature.append(None)
                continue
            signature.append((status.st_ino, status.st_size, status.st_mtime_ns))
        return tuple(signature)

    def _read(self) -> TlsMaterial:
        ca, certificate_path, key = self.paths
        try:
            ca_pem, certificate_pem = ca.read_bytes(), certificate_path.read_bytes()
            key_pem = read_secret_file(key)
        except (OSError, IdentityError) as exc:
            raise CertificateError(str(exc)) from None
        certificate = parse_certificate(certificate_path, certificate_pem)
        try:
            certified, issued = (
                certifies_private_key(certificate_pem, key_pem),
                verify_issued_by(certificate_pem, ca_pem),
            )
        except ValueError as exc:
            raise CertificateError(f"{ca} or {key}: not readable PEM: {exc}") from None
        if not certified:
            raise CertificateError(f"{certificate_path} does not certify {key}")
        if not issued:
            raise CertificateError(f"{certificate_path} was not issued by {ca}")
        problem = validity_problem(certificate_path, certificate)
        if problem is not None:
            raise CertificateError(problem)
        return TlsMaterial(ca_pem, certificate_pem, key_pem, certificate)
