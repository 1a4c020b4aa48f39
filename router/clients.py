"""gRPC channels from the router to its workers, one per worker address.

Lifecycle: one ``WorkerClients`` per router. Stubs are made on first use of an
address and reused by every request (a channel multiplexes many calls);
``close()`` at router stop closes them all. With a cluster secret, every call carries it
(``authorization: Bearer``), as the workers require; with the cluster's TLS (``transport.cluster_tls``) every
channel is mutual TLS. Addresses that vanish from the
registry keep an idle channel until then, which is cheap.
"""
from __future__ import annotations

import threading
from typing import Any, Optional

import grpc

from proto import worker_pb2_grpc
from transport.auth import bearer_metadata
from transport.cluster_tls import CHANNEL_OPTIONS, ClusterTls

# Worker streams carry few, small messages; keepalive notices a dead worker's connection.
_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
]


class _WithMetadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds fixed metadata (the cluster secret) to every call on a channel."""

    def __init__(self, metadata: tuple[tuple[str, str], ...]) -> None:
        self._metadata = metadata

    def _details(self, d: Any) -> Any:
        md = tuple(d.metadata or ()) + self._metadata
        return d._replace(metadata=md) if hasattr(d, "_replace") else _Details(d, md)

    def intercept_unary_unary(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)

    def intercept_unary_stream(self, continuation: Any, client_call_details: Any, request: Any) -> Any:
        return continuation(self._details(client_call_details), request)


class _Details(grpc.ClientCallDetails):
    def __init__(self, d: Any, metadata: tuple) -> None:
        self.method, self.timeout, self.credentials = d.method, d.timeout, d.credentials
        self.wait_for_ready, self.compression = getattr(d, "wait_for_ready", None), getattr(d, "compression", None)
        self.metadata = metadata


class WorkerClients:
    """Cached channels and stubs keyed by worker gRPC address."""

    def __init__(self, cluster_secret: Optional[str] = None, cluster_tls: Optional[ClusterTls] = None) -> None:
        """``cluster_tls``: dial every worker over mutual TLS with the cluster certificate."""
        self._tls = cluster_tls
        self._credentials = cluster_tls.channel_credentials() if cluster_tls is not None else None
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}
        self._metadata: tuple = bearer_metadata(cluster_secret) if cluster_secret else ()
        self._auth = _WithMetadata(self._metadata) if cluster_secret else None
        self._aio_channels: dict[str, grpc.aio.Channel] = {}

    def _dial(self, api: Any, address: str) -> Any:
        """A channel to ``address`` from ``api`` (``grpc`` or ``grpc.aio``: the same two calls), mutual TLS with the
        cluster's certificate when there is one."""
        if not address:
            raise ValueError("worker grpc_address is empty")
        if self._credentials is not None:
            return api.secure_channel(address, self._credentials, options=_CHANNEL_OPTIONS + CHANNEL_OPTIONS)
        return api.insecure_channel(address, options=_CHANNEL_OPTIONS)

    def _channel(self, address: str) -> grpc.Channel:
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = self._dial(grpc, address)
                if self._auth is not None:
                    ch = grpc.intercept_channel(ch, self._auth)
                self._channels[address] = ch
            return ch

    def prefill(self, address: str) -> worker_pb2_grpc.PrefillWorkerStub:
        return worker_pb2_grpc.PrefillWorkerStub(self._channel(address))

    def decode(self, address: str) -> worker_pb2_grpc.DecodeWorkerStub:
        return worker_pb2_grpc.DecodeWorkerStub(self._channel(address))

    def colocated(self, address: str) -> worker_pb2_grpc.ColocatedWorkerStub:
        return worker_pb2_grpc.ColocatedWorkerStub(self._channel(address))

    def close(self) -> None:
        with self._lock:
            channels, self._channels = list(self._channels.values()), {}
        for ch in channels:
            ch.close()

    # ---- asyncio channels, for the output streams read on the router's event loop (RouterConfig.one_loop) ----
    def aio_colocated(self, address: str) -> worker_pb2_grpc.ColocatedWorkerStub:
        """An asyncio stub of ``address`` (call on the loop it is bound to: ``grpc.aio`` channels are per loop).
        The cluster secret travels as each call's metadata (``_AioStub``) rather than by an interceptor."""
        with self._lock:
            ch = self._aio_channels.get(address)
            if ch is None:
                ch = self._aio_channels[address] = self._dial(grpc.aio, address)
        return _AioStub(worker_pb2_grpc.ColocatedWorkerStub(ch), self._metadata)

    async def aclose(self) -> None:
        """Close the asyncio channels (on their loop, before it ends)."""
        with self._lock:
            channels, self._aio_channels = list(self._aio_channels.values()), {}
        for ch in channels:
            await ch.close()


class _AioStub:
    """An asyncio stub whose ``OpenOutputStream`` carries the cluster secret."""

    __slots__ = ("_stub", "_metadata")

    def __init__(self, stub: Any, metadata: tuple) -> None:
        self._stub, self._metadata = stub, metadata

    def OpenOutputStream(self, request: Any) -> Any:
        return self._stub.OpenOutputStream(request, metadata=self._metadata or None)
