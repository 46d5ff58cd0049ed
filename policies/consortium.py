"""The consortium file (consortium.yaml): who takes part in a deployment, where the coordinator
listens, and how long its certificates live. Provisioning turns it into startup kits.

`EXAMPLE` is a commented file documenting every key (`fedsilo provision --example PATH` writes
it); `tests/test_silo_check.py` checks that provisioning accepts it.
"""

from __future__ import annotations

import ipaddress
import re
from collections import Counter
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

from pydantic import AfterValidator, Field, ValidationError, field_validator, model_validator

from fedsilo.policies.base import PolicyModel
from fedsilo.policies.loading import PolicyError, describe_errors, read_text_file, read_yaml

EXAMPLE = """\
# consortium.yaml: who takes part, where the coordinator listens, how long certificates live.
# `fedsilo provision --consortium consortium.yaml --out kits/` turns it into one startup kit
# per party (the operator, the coordinator, each silo).

# The consortium's name: letters, digits, '-', '_' and '.', at most 64, starting with a letter
# or digit. It names the CA and every certificate.
consortium: heart-consortium

# Where the silos reach the coordinator: host:port (a DNS name or an IPv4 address; an IPv6
# address in brackets, as in "[::1]:50051"). The coordinator's certificate is issued for this
# host. Silos connect out to it: no hospital opens an inbound port.
coordinator:
  address: "127.0.0.1:50051"

# The silos, one entry per institution; each name (same rules as `consortium`, unique ignoring
# case) becomes its kit folder kits/silos/<name> and its certificate's common name.
silos:
  - name: cleveland
  - name: hungary
  - name: va

# Certificate lifetimes in days (optional; these are the defaults). No certificate may outlive
# the CA that issued it: server_days and client_days are at most ca_days.
certificates:
  ca_days: 3650      # the consortium's CA
  server_days: 365   # the coordinator's TLS certificate
  client_days: 365   # each silo's TLS client certificate
"""

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
DNS_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def _check_name(name: str) -> str:
    """Letters, digits, '-', '_' and '.', starting with a letter or digit, at most 64: safe as a
    folder name and within X.509's limit on a certificate's common name."""
    if not NAME.match(name):
        raise ValueError(
            f"{name!r} is not a valid name: use at most 64 letters, digits, '-', '_' or '.', "
            "starting with a letter or digit"
        )
    return name


Name = Annotated[str, AfterValidator(_check_name)]

# The common names of the coordinator's and the operator's certificates: no silo may take one.
RESERVED_SILO_NAMES = ("coordinator", "operator")


def _check_silo_name(name: str) -> str:
    if name.lower() in RESERVED_SILO_NAMES:
        raise ValueError(
            f"{name!r} is reserved (the common name of the {name.lower()}'s certificate); "
            "give the silo another name"
        )
    return name


class CoordinatorEndpoint(PolicyModel):
    """Where silos reach the coordinator: `host:port`, an IPv6 host in brackets (`[::1]:50051`)."""

    address: str

    @field_validator("address")
    @classmethod
    def _host_and_port(cls, address: str) -> str:
        split_address(address)
        return address

    @property
    def host(self) -> str:
        return split_address(self.address)[0]


class SiloEntry(PolicyModel):
    name: Annotated[Name, AfterValidator(_check_silo_name)]


class CertificateLifetimes(PolicyModel):
    """Validity in days; no certificate may outlive the CA that issued it."""

    ca_days: int = Field(default=3650, ge=1)
    server_days: int = Field(default=365, ge=1)
    client_days: int = Field(default=365, ge=1)

    @model_validator(mode="after")
    def _within_ca_lifetime(self) -> CertificateLifetimes:
        leaves = {"server_days": self.server_days, "client_days": self.client_days}
        too_long = [f"{field} ({days})" for field, days in leaves.items() if days > self.ca_days]
        if too_long:
            raise ValueError(
                f"{' and '.join(too_long)} must not exceed ca_days ({self.ca_days}): "
                "a certificate cannot outlive the CA that issued it"
            )
        return self


class ConsortiumConfig(PolicyModel):
    consortium: Name
    coordinator: CoordinatorEndpoint
    silos: list[SiloEntry] = Field(min_length=1)
    certificates: CertificateLifetimes = CertificateLifetimes()

    @field_validator("silos")
    @classmethod
    def _unique_names(cls, silos: list[SiloEntry]) -> list[SiloEntry]:
        # Case-insensitive: silo names become kit folder names, and some file systems fold case.
        counts = Counter(silo.name.lower() for silo in silos)
        repeated = sorted(name for name, count in counts.items() if count > 1)
        if repeated:
            raise ValueError(f"silo names must be unique (ignoring case); repeated: {repeated}")
        return silos

    @property
    def silo_names(self) -> list[str]:
        return [silo.name for silo in self.silos]


def split_address(address: str) -> tuple[str, int]:
    """The host (brackets of an IPv6 host removed) and port of `host:port`, or a ValueError."""
    bracketed = address.startswith("[")
    if bracketed:
        host, separator, port = address[1:].partition("]:")
    else:
        host, separator, port = address.rpartition(":")
    if not separator or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise ValueError(
            f"address {address!r} is not host:port with a port from 1 to 65535, "
            "as in '127.0.0.1:50051'"
        )
    if bracketed:
        _check_ipv6(host)
    elif ":" in host:
        raise ValueError(f"address {address!r}: an IPv6 host needs brackets, as in '[::1]:50051'")
    else:
        _check_host(host)
    return host, int(port)


def load_consortium_file(path: str | Path) -> ConsortiumConfig:
    """Read and validate consortium.yaml; every problem is reported in one `PolicyError`."""
    path = Path(path)
    document = read_yaml(read_text_file(path, "consortium file"), str(path))
    return parse_consortium(document, source=str(path))


def parse_consortium(document: Any, source: str = "<consortium>") -> ConsortiumConfig:
    if not isinstance(document, Mapping):
        raise PolicyError(
            f"{source}: a consortium file is a mapping (consortium, coordinator, silos, "
            f"certificates), got {type(document).__name__}"
        )
    try:
        return ConsortiumConfig.model_validate(dict(document))
    except ValidationError as exc:
        raise PolicyError(describe_errors(exc, document, source)) from None


def _check_ipv6(host: str) -> None:
    try:
        ipaddress.IPv6Address(host)
    except ValueError:
        raise ValueError(f"{host!r} in brackets is not an IPv6 address") from None


def _check_host(host: str) -> None:
    labels = host.split(".")
    if labels[-1].isdigit():
        _check_ipv4(host)
    elif len(host) > 253 or not all(DNS_LABEL.match(label) for label in labels):
        raise ValueError(f"host {host!r} is neither an IPv4 address nor a DNS name")


def _check_ipv4(host: str) -> None:
    try:
        ipaddress.IPv4Address(host)
    except ValueError:
        raise ValueError(f"host {host!r} is not an IPv4 address") from None
