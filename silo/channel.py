"""The silo's gRPC channel to its coordinator: mutual TLS with the kit's files, over the route
silo/proxy.py chose (directly or through an HTTP CONNECT proxy), and a new channel when the
certificate files change (a renewed certificate, `fedsilo consortium renew`), so a running
agent reconnects with it without losing its job.

The files are checked for a change (their size, modification time and inode: a few `stat`
calls) each time the silo is about to send, and the certificate's expiry is warned about from
30 days ahead (privacy/certificate_files.py). A replaced channel is closed only once no call
on it can still be running (after the longest call's deadline), so a call in flight on another
thread is never cut short.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import NamedTuple

import grpc
import grpc.experimental

from fedsilo.privacy.certificate_files import TlsFileWatch, TlsMaterial
from fedsilo.silo.proxy import Route
from fedsilo.wire.framing import exchange_call, exchange_one_call

KEEPALIVE = [("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000)]
# A channel of its own connections: a renewed certificate needs a new TLS handshake, never a
# connection shared with the channel it replaces.
OWN_CONNECTIONS = [("grpc.use_local_subchannel_pool", 1)]
# A unary request's streamed reply read on the calling thread (`ExchangeOne`): gRPC's Python
# client otherwise hands each reply to it from its channel's polling thread, woken per call.
# An experimental option of gRPC's; it changes which thread reads, not what is read.
READ_REPLIES_IN_CALLER = [(grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1)]


@dataclass(frozen=True)
class ChannelSettings:
    address: str
    tls: TlsFileWatch
    route: Route
    poll_seconds: float = 5.0
    max_payload_bytes: int = 2**31
    backoff_initial_s: float = 0.2
    backoff_max_s: float = 10.0

    @property
    def call_timeout_s(self) -> float:
        """How long one exchange may go without a frame moving either way: the long poll and
        a margin (silo/call_progress.py)."""
        return self.poll_seconds + 60


class ExchangeCalls(NamedTuple):
    """The coordinator's two ways to exchange one message (wire/framing.py)."""

    stream: grpc.StreamStreamMultiCallable  # `Exchange`: the request in frames
    one: grpc.UnaryStreamMultiCallable  # `ExchangeOne`: a request of one chunk, as one message


class CoordinatorChannel:
    """The channel to the coordinator, opened again with renewed TLS files."""

    def __init__(self, settings: ChannelSettings) -> None:
        self.settings = settings
        self._lock = threading.Lock()
        self._material = settings.tls.current()
        self._channel = self._open(self._material)
        self._exchange = _calls(self._channel)
        self._retired: list[tuple[float, grpc.Channel]] = []  # (close after, channel)

    def exchange(self) -> ExchangeCalls:
        """The exchange methods to call now: on a new channel when the certificate files
        changed."""
        material = self.settings.tls.current()
        self.settings.tls.warn_if_due(material.certificate)
        with self._lock:
            now = time.monotonic()
            if material is not self._material:
                self._retired.append((now + self.settings.call_timeout_s, self._channel))
                self._material = material
                self._channel = self._open(material)
                self._exchange = _calls(self._channel)
            while self._retired and self._retired[0][0] <= now:
                self._retired.pop(0)[1].close()
            return self._exchange

    def close(self) -> None:
        with self._lock:
            for _, channel in self._retired:
                channel.close()
            self._retired.clear()
            self._channel.close()

    def _open(self, material: TlsMaterial) -> grpc.Channel:
        credentials = grpc.ssl_channel_credentials(
            material.ca_pem, material.private_key_pem, material.certificate_pem
        )
        return grpc.secure_channel(
            self.settings.address,
            credentials,
            options=[
                *KEEPALIVE,
                *OWN_CONNECTIONS,
                *READ_REPLIES_IN_CALLER,
                *self.settings.route.options(),
            ],
        )


def _calls(channel: grpc.Channel) -> ExchangeCalls:
    return ExchangeCalls(exchange_call(channel), exchange_one_call(channel))
