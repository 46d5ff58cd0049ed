"""Consortium certificates: the CA only signs, the server certificate names the coordinator's
host and loopback, a client certificate names its silo, everything chains to the consortium CA
(never to another), and gRPC's TLS accepts them for a mutually authenticated channel."""

import ipaddress
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta

import grpc
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

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


@pytest.fixture(scope="module")
def authority() -> CertifiedKey:
    return create_certificate_authority("heart-consortium", days=3650)


@pytest.fixture(scope="module")
def other_authority() -> CertifiedKey:
    return create_certificate_authority("heart-consortium", days=3650)


def extension(certified: CertifiedKey, kind: type) -> x509.ExtensionType:
    return certified.certificate.extensions.get_extension_for_class(kind).value


def lifetime(certified: CertifiedKey) -> timedelta:
    cert = certified.certificate
    return cert.not_valid_after_utc - cert.not_valid_before_utc


def test_the_ca_is_self_signed_and_may_only_sign_certificates(authority: CertifiedKey) -> None:
    pem = authority.certificate_pem()
    assert verify_issued_by(pem, pem)
    constraints = extension(authority, x509.BasicConstraints)
    assert constraints.ca and constraints.path_length == 0
    usage = extension(authority, x509.KeyUsage)
    assert usage.key_cert_sign and not usage.digital_signature
    assert certificate_common_name(pem) == "heart-consortium consortium CA"


def test_the_server_certificate_names_the_host_and_loopback(authority: CertifiedKey) -> None:
    server = issue_server_certificate(authority, "coord.example.org", days=365)
    names = extension(server, x509.SubjectAlternativeName)
    assert names.get_values_for_type(x509.DNSName) == ["coord.example.org", "localhost"]
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]
    assert list(extension(server, x509.ExtendedKeyUsage)) == [ExtendedKeyUsageOID.SERVER_AUTH]
    assert not extension(server, x509.BasicConstraints).ca


def test_an_ip_host_becomes_an_ip_address_name(authority: CertifiedKey) -> None:
    server = issue_server_certificate(authority, "::1", days=365)
    names = extension(server, x509.SubjectAlternativeName)
    assert set(names.get_values_for_type(x509.IPAddress)) == {
        ipaddress.ip_address("::1"),
        ipaddress.ip_address("127.0.0.1"),
    }
    loopback = issue_server_certificate(authority, "127.0.0.1", days=365)
    names = extension(loopback, x509.SubjectAlternativeName)
    assert names.get_values_for_type(x509.IPAddress) == [ipaddress.ip_address("127.0.0.1")]


def test_a_client_certificate_names_its_silo(authority: CertifiedKey) -> None:
    client = issue_client_certificate(authority, "cleveland", days=365)
    assert certificate_common_name(client.certificate_pem()) == "cleveland"
    organisation = client.certificate.subject.get_attributes_for_oid(NameOID.ORGANIZATION_NAME)
    assert organisation[0].value == "heart-consortium"
    assert list(extension(client, x509.ExtendedKeyUsage)) == [ExtendedKeyUsageOID.CLIENT_AUTH]


def test_lifetimes_are_the_days_asked_for_plus_clock_skew(authority: CertifiedKey) -> None:
    client = issue_client_certificate(authority, "va", days=30)
    assert timedelta(days=30) < lifetime(client) <= timedelta(days=30, minutes=5)
    assert lifetime(authority) > timedelta(days=3650)


def test_certificates_chain_to_their_ca_and_not_to_another(
    authority: CertifiedKey, other_authority: CertifiedKey
) -> None:
    ca_pem, other_pem = authority.certificate_pem(), other_authority.certificate_pem()
    for certified in (
        issue_server_certificate(authority, "127.0.0.1", days=365),
        issue_client_certificate(authority, "va", days=365),
    ):
        assert verify_issued_by(certified.certificate_pem(), ca_pem)
        assert not verify_issued_by(certified.certificate_pem(), other_pem)
    foreign = issue_client_certificate(other_authority, "va", days=365)
    assert not verify_issued_by(foreign.certificate_pem(), ca_pem)


def test_the_fingerprint_is_the_sha256_of_the_der_encoding(authority: CertifiedKey) -> None:
    client = issue_client_certificate(authority, "hungary", days=365)
    expected = client.certificate.fingerprint(hashes.SHA256()).hex()
    assert certificate_fingerprint(client.certificate_pem()) == expected
    other = issue_client_certificate(authority, "hungary", days=365)
    assert certificate_fingerprint(other.certificate_pem()) != expected


def test_a_certificate_certifies_only_its_own_key(authority: CertifiedKey) -> None:
    va = issue_client_certificate(authority, "va", days=365)
    hungary = issue_client_certificate(authority, "hungary", days=365)
    assert certifies_private_key(va.certificate_pem(), va.private_key_pem())
    assert not certifies_private_key(va.certificate_pem(), hungary.private_key_pem())


def echo_over_mtls(authority: CertifiedKey, client: CertifiedKey) -> bytes:
    """One unary call over gRPC on loopback, the server requiring a client certificate."""
    server_identity = issue_server_certificate(authority, "127.0.0.1", days=1)
    server = grpc.server(ThreadPoolExecutor(max_workers=1))
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("t", {"Echo": echo}),))
    credentials = grpc.ssl_server_credentials(
        [(server_identity.private_key_pem(), server_identity.certificate_pem())],
        root_certificates=authority.certificate_pem(),
        require_client_auth=True,
    )
    port = server.add_secure_port("127.0.0.1:0", credentials)
    server.start()
    try:
        channel_credentials = grpc.ssl_channel_credentials(
            root_certificates=authority.certificate_pem(),
            private_key=client.private_key_pem(),
            certificate_chain=client.certificate_pem(),
        )
        with grpc.secure_channel(f"127.0.0.1:{port}", channel_credentials) as channel:
            return channel.unary_unary("/t/Echo")(b"ping", timeout=10)
    finally:
        server.stop(None)


def test_grpc_accepts_the_consortium_certificates_for_mutual_tls(
    authority: CertifiedKey,
) -> None:
    client = issue_client_certificate(authority, "cleveland", days=1)
    assert echo_over_mtls(authority, client) == b"ping"


@pytest.mark.parametrize("impostor", ["client of another CA", "server certificate"])
def test_grpc_refuses_a_client_without_a_consortium_client_certificate(
    authority: CertifiedKey, other_authority: CertifiedKey, impostor: str
) -> None:
    if impostor == "client of another CA":
        client = issue_client_certificate(other_authority, "cleveland", days=1)
    else:  # right CA, but certified for serverAuth only
        client = issue_server_certificate(authority, "127.0.0.1", days=1)
    with pytest.raises(grpc.RpcError) as err:
        echo_over_mtls(authority, client)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
