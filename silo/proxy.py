"""How a silo reaches its coordinator: directly, or through an HTTP CONNECT proxy (a hospital's
way out), mutual TLS end to end through the tunnel, so the proxy sees only the address.

gRPC's C core chooses the proxy itself (doc/core/default_http_proxy_mapper.md in gRPC): the
channel argument `grpc.http_proxy`, else the first of the environment variables `grpc_proxy`,
`https_proxy`, `http_proxy` that is set (an empty one: no proxy), only `http://` URLs
(`user:password@` becomes a Basic Proxy-Authorization), and then no proxy for a host that
`no_grpc_proxy` (else `no_proxy`) lists: an entry matches a host it ends with, or an IP
address in its CIDR range; loopback is not exempt unless listed, and `*` is no wildcard.
Only these lower-case names count.

`route` takes that same decision in Python, with silo.yaml's `coordinator.proxy` first (the
channel argument; `direct` turns proxies off), so that the silo says in its log which way it
goes and why, and refuses a malformed proxy URL naming where it came from: gRPC would log an
error and connect directly. Its `options` pin gRPC to the decision.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

DIRECT = "direct"  # silo.yaml's coordinator.proxy: connect directly, whatever the environment says
PROXY_KEY = "coordinator.proxy"
PROXY_VARIABLES = ("grpc_proxy", "https_proxy", "http_proxy")  # gRPC's order
NO_PROXY_VARIABLES = ("no_grpc_proxy", "no_proxy")


class ProxyError(ValueError):
    """A proxy setting gRPC cannot use; the message names the silo.yaml key or variable."""


def check_proxy_url(value: str) -> str:
    """`value` if it is a proxy URL gRPC takes (http://[user:password@]host:port[/]), else a
    ValueError saying what is wrong."""
    example = "e.g. http://proxy.hospital:3128"
    try:
        parts = urlsplit(value)
        port = parts.port
    except ValueError as exc:
        raise ValueError(f"{value!r} is not a proxy URL ({exc}); {example}") from None
    if parts.scheme != "http":
        raise ValueError(
            f"{value!r}: the proxy URL must start with http:// (gRPC tunnels through an HTTP "
            f"CONNECT proxy; TLS runs end to end inside the tunnel); {example}"
        )
    if not parts.hostname or port is None:
        raise ValueError(f"{value!r}: give the proxy's host and port, {example}")
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ValueError(f"{value!r}: a proxy URL is only http://host:port, {example}")
    return value


@dataclass(frozen=True)
class Route:
    """The way to the coordinator: through `proxy` (a URL) or directly (None), and why."""

    proxy: str | None
    reason: str

    def options(self) -> list[tuple[str, str | int]]:
        """gRPC channel arguments that take this route and no other."""
        if self.proxy is None:
            return [("grpc.enable_http_proxy", 0)]
        return [("grpc.http_proxy", self.proxy)]

    def describe(self) -> str:
        way = "directly" if self.proxy is None else f"through the proxy {_shown(self.proxy)}"
        return f"{way} ({self.reason})"


def route(address: str, configured: str | None, environ: Mapping[str, str]) -> Route:
    """The route to the coordinator at `address` (host:port): silo.yaml's `coordinator.proxy`
    (`configured`: a URL, `direct`, or None for the environment), then the environment, as
    gRPC decides it."""
    if configured == DIRECT:
        return Route(None, f"silo.yaml {PROXY_KEY}: {DIRECT}")
    if configured is not None:
        proxy, source = configured, f"silo.yaml {PROXY_KEY}"
    else:
        source = next((name for name in PROXY_VARIABLES if name in environ), None)
        if source is None:
            return Route(None, _unset_reason(environ))
        proxy = environ[source]
        if not proxy:
            return Route(None, f"{source} is set and empty")
        try:
            check_proxy_url(proxy)
        except ValueError as exc:
            raise ProxyError(
                f"{source}: {exc} (gRPC would ignore it and connect directly; correct it, or "
                f"set {PROXY_KEY} in silo.yaml, which takes precedence)"
            ) from None
    host = address.rpartition(":")[0].strip("[]")
    exempt = next((name for name in NO_PROXY_VARIABLES if name in environ), None)
    if exempt is not None and _listed(host, environ[exempt]):
        return Route(None, f"{exempt} lists {host}, which {source} would otherwise serve")
    return Route(proxy, source)


def _listed(host: str, entries: str) -> bool:
    """Whether a `no_proxy` list names `host`, as gRPC matches it: by suffix, or by CIDR range
    for an IP address."""
    try:
        address = ipaddress.ip_address(host)
    except ValueError:
        address = None
    for entry in (e.strip() for e in entries.split(",")):
        if not entry:
            continue
        if host.lower().endswith(entry.lower()):
            return True
        if address is not None and "/" in entry:
            try:
                if address in ipaddress.ip_network(entry, strict=False):
                    return True
            except ValueError:
                continue
    return False


def _unset_reason(environ: Mapping[str, str]) -> str:
    upper = [name.upper() for name in PROXY_VARIABLES if name.upper() in environ]
    if upper:
        return (
            f"no proxy set: gRPC reads only lower-case {', '.join(PROXY_VARIABLES)}, not "
            f"{', '.join(upper)}; set https_proxy or silo.yaml {PROXY_KEY}"
        )
    return f"no proxy set ({', '.join(PROXY_VARIABLES)} or silo.yaml {PROXY_KEY})"


def _shown(proxy: str) -> str:
    """The proxy URL without its password, for the log."""
    parts = urlsplit(proxy)
    if parts.password is None:
        return proxy
    return parts._replace(netloc=f"{parts.username}:***@{parts.netloc.rpartition('@')[2]}").geturl()
