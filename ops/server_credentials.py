"""The coordinator's mTLS server credentials, renewed without a restart.

gRPC asks `grpc.dynamic_ssl_server_credentials`' fetcher before each new connection's
handshake; the fetcher hands it the kit's files again when they changed on disk (a certificate
renewed by `fedsilo consortium renew`, checked by `TlsFileWatch`), so new connections get the
renewed certificate while connections already open, the state and the running job go on.
Client certificates are required and must chain to the consortium CA, as before.
"""

from __future__ import annotations

import grpc

from fedsilo.privacy.certificate_files import TlsFileWatch, TlsMaterial


def reloading_server_credentials(files: TlsFileWatch) -> grpc.ServerCredentials:
    """Server credentials serving `files.current()` to every new connection."""
    in_use = files.current()

    def fetch() -> grpc.ServerCertificateConfiguration | None:
        nonlocal in_use
        latest = files.current()
        if latest is in_use:
            return None  # gRPC keeps the configuration it has
        in_use = latest
        return _configuration(latest)

    return grpc.dynamic_ssl_server_credentials(
        _configuration(in_use), fetch, require_client_authentication=True
    )


def _configuration(material: TlsMaterial) -> grpc.ServerCertificateConfiguration:
    return grpc.ssl_server_certificate_configuration(
        [(material.private_key_pem, material.certificate_pem)],
        root_certificates=material.ca_pem,
    )
