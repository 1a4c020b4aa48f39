"""gRPC channels from the router to its workers, one per worker address.

Lifecycle: one ``WorkerClients`` per router. Stubs are made on first use of an
address and reused by every request (a channel multiplexes many calls);
``close()`` at router stop closes them all. Addresses that vanish from the
registry keep an idle channel until then, which is cheap.
"""
from __future__ import annotations

import threading

import grpc

from proto import worker_pb2_grpc

# Worker streams carry few, small messages; keepalive notices a dead worker's connection.
_CHANNEL_OPTIONS = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 0),
]


class WorkerClients:
    """Cached channels and stubs keyed by worker gRPC address."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._channels: dict[str, grpc.Channel] = {}

    def _channel(self, address: str) -> grpc.Channel:
        if not address:
            raise ValueError("worker grpc_address is empty")
        with self._lock:
            ch = self._channels.get(address)
            if ch is None:
                ch = grpc.insecure_channel(address, options=_CHANNEL_OPTIONS)
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
