"""The consortium's X.509 certificates for mTLS: its CA, the coordinator's server certificate
and one client certificate per silo, all EC P-256 (what gRPC's BoringSSL accepts everywhere).

The CA signs only certificates (CA:TRUE, pathlen 0, keyCertSign); the server certificate names
the coordinator's host (plus localhost and 127.0.0.1) and is for serverAuth only; a silo's
client certificate carries the silo's name as its common name and is for clientAuth only.
`renew_certificate` re-issues a certificate from the same CA for the same name, key and uses,
with a fresh serial number and validity (`fedsilo consortium renew`, ops/renewal.py).
"""

from __future__ import annotations

import hashlib
import ipaddress
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone

from cryptography import x509
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

LOOPBACK_NAMES = ("localhost", "127.0.0.1")
CLOCK_SKEW = timedelta(minutes=5)


@dataclass(frozen=True)
class CertifiedKey:
    """A certificate and the private key of the public key it certifies."""

    certificate: x509.Certificate
    private_key: ec.EllipticCurvePrivateKey

    def certificate_pem(self) -> bytes:
        return self.certificate.public_bytes(serialization.Encoding.PEM)

    def private_key_pem(self) -> bytes:
        return self.private_key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )


def create_certificate_authority(consortium: str, days: int) -> CertifiedKey:
    """A self-signed CA for `consortium`, valid for `days` days."""
    key = ec.generate_private_key(ec.SECP256R1())
    name = _name(f"{consortium} consortium CA", consortium)
    builder = (
        _validity(x509.CertificateBuilder(), days)
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(_key_usage(cert_sign=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
    )
    return CertifiedKey(builder.sign(key, hashes.SHA256()), key)


def issue_server_certificate(authority: CertifiedKey, host: str, days: int) -> CertifiedKey:
    """The coordinator's TLS server certificate for `host` (a DNS name or an IP address)."""
    names = [_subject_alternative_name(n) for n in dict.fromkeys((host, *LOOPBACK_NAMES))]
    extensions = [
        x509.SubjectAlternativeName(names),
        x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]),
    ]
    return _issue(authority, "coordinator", days, extensions)


def issue_client_certificate(authority: CertifiedKey, silo: str, days: int) -> CertifiedKey:
    """A silo's TLS client certificate; its common name is the silo's name."""
    extensions = [x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH])]
    return _issue(authority, silo, days, extensions)


def renew_certificate(
    authority: CertifiedKey, certificate: x509.Certificate, days: int
) -> x509.Certificate:
    """`certificate` issued again by `authority`: its subject, public key and extensions (so its
    names and uses) unchanged, a fresh serial number, valid from now for `days` days. The key
    pair stays, so only the certificate, which is public, changes hands."""
    builder = (
        _validity(x509.CertificateBuilder(), days)
        .subject_name(certificate.subject)
        .issuer_name(authority.certificate.subject)
        .public_key(certificate.public_key())
    )
    for extension in certificate.extensions:
        builder = builder.add_extension(extension.value, critical=extension.critical)
    return builder.sign(authority.private_key, hashes.SHA256())


def certificate_fingerprint(certificate_pem: bytes) -> str:
    """The SHA-256 fingerprint (hex) of a PEM certificate's DER encoding."""
    certificate = x509.load_pem_x509_certificate(certificate_pem)
    return hashlib.sha256(certificate.public_bytes(serialization.Encoding.DER)).hexdigest()


def verify_issued_by(certificate_pem: bytes, authority_pem: bytes) -> bool:
    """Whether the authority's key signed this certificate and its issuer names the authority."""
    certificate = x509.load_pem_x509_certificate(certificate_pem)
    authority = x509.load_pem_x509_certificate(authority_pem)
    try:
        certificate.verify_directly_issued_by(authority)
    except (ValueError, TypeError, InvalidSignature):
        return False
    return True


def certificate_common_name(certificate_pem: bytes) -> str:
    """The subject common name of a PEM certificate."""
    certificate = x509.load_pem_x509_certificate(certificate_pem)
    return str(certificate.subject.get_attributes_for_oid(NameOID.COMMON_NAME)[0].value)


def certifies_private_key(certificate_pem: bytes, private_key_pem: bytes) -> bool:
    """Whether the certificate certifies the public half of this PEM private key."""
    certificate = x509.load_pem_x509_certificate(certificate_pem)
    private_key = serialization.load_pem_private_key(private_key_pem, password=None)
    return certificate.public_key() == private_key.public_key()


def _issue(
    authority: CertifiedKey, common_name: str, days: int, extensions: list[x509.ExtensionType]
) -> CertifiedKey:
    key = ec.generate_private_key(ec.SECP256R1())
    organisation = authority.certificate.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    builder = (
        _validity(x509.CertificateBuilder(), days)
        .subject_name(_name(common_name, str(organisation[0].value)))
        .issuer_name(authority.certificate.subject)
        .public_key(key.public_key())
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(_key_usage(digital_signature=True), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(authority.private_key.public_key()),
            critical=False,
        )
    )
    for extension in extensions:
        builder = builder.add_extension(extension, critical=False)
    return CertifiedKey(builder.sign(authority.private_key, hashes.SHA256()), key)


def _validity(builder: x509.CertificateBuilder, days: int) -> x509.CertificateBuilder:
    """A fresh serial number, and validity from a few minutes ago (clock skew) for `days` days."""
    now = datetime.now(timezone.utc)
    return (
        builder.serial_number(x509.random_serial_number())
        .not_valid_before(now - CLOCK_SKEW)
        .not_valid_after(now + timedelta(days=days))
    )


def _name(common_name: str, organisation: str) -> x509.Name:
    return x509.Name(
        [
            x509.NameAttribute(NameOID.COMMON_NAME, common_name),
            x509.NameAttribute(NameOID.ORGANIZATION_NAME, organisation),
        ]
    )


def _key_usage(*, cert_sign: bool = False, digital_signature: bool = False) -> x509.KeyUsage:
    return x509.KeyUsage(
        digital_signature=digital_signature,
        content_commitment=False,
        key_encipherment=False,
        data_encipherment=False,
        key_agreement=False,
        key_cert_sign=cert_sign,
        crl_sign=cert_sign,
        encipher_only=False,
        decipher_only=False,
    )


def _subject_alternative_name(host: str) -> x509.GeneralName:
    try:
        return x509.IPAddress(ipaddress.ip_address(host))
    except ValueError:
        return x509.DNSName(host)
