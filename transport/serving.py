"""The gRPC server shell every role shares: port binding, health, reflection.

Lifecycle: ``GrpcServing(name, host, port)`` -> ``start(register)`` binds the
port (0 = a free one), lets the role add its servicers, adds grpc.health.v1
health (NOT_SERVING until the role calls ``set_serving(True)``, i.e. once its
model is loaded) and server reflection, and starts serving, over TLS when given
``tls`` and behind the ``auth`` interceptor when given (health and reflection stay open). ``set_serving(False)``
while draining; ``stop(grace)`` ends it. Used by the prefill, decode and
colocated workers and by the router (hence here, below both).
"""
from __future__ import annotations

import logging
from concurrent import futures
from typing import Callable, Optional, Union

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from transport.ports import check_port
from transport.tls import TlsFiles, server_credentials

log = logging.getLogger(__name__)


def add_health_reflection_and_bind(server: object, health_servicer: object, service_names: list[str], name: str,
                                   host: str, port: int, credentials: Optional[grpc.ServerCredentials]) -> int:
    """Add health and reflection to a sync or asyncio ``server`` and bind ``host:port`` (TLS with
    ``credentials``); the bound port (RuntimeError if none)."""
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        [*service_names, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME], server)
    where = f"{host}:{port}"
    bound = (server.add_secure_port(where, credentials) if credentials is not None  # type: ignore[attr-defined]
             else server.add_insecure_port(where))  # type: ignore[attr-defined]
    if bound == 0:
        raise RuntimeError(f"{name}: could not bind {host}:{port}")
    return bound


class GrpcServing:
    """One gRPC server with health and reflection, owned by one role instance."""

    def __init__(self, name: str, host: str = "127.0.0.1", port: int = 0, max_workers: int = 128,
                 auth: Optional[grpc.ServerInterceptor] = None,
                 tls: Union[TlsFiles, grpc.ServerCredentials, None] = None) -> None:
        """``auth``: an interceptor that refuses unauthenticated calls (``BearerAuth``); ``tls``: serve TLS, from
        files (``TlsFiles``) or ready credentials (the cluster plane's, ``transport.cluster_tls``)."""
        check_port(port, "port")
        if max_workers < 1:
            raise ValueError(f"max_workers must be >= 1, got {max_workers}")
        self.name = name
        self.host = host
        self._port = port
        self._max_workers = max_workers
        self._auth = auth
        # files are read now, so a wrong path fails before anything binds
        self._credentials = server_credentials(tls) if isinstance(tls, TlsFiles) else tls
        self._server: Optional[grpc.Server] = None
        self._health = health.HealthServicer(experimental_non_blocking=True)
        self._service_names: list[str] = []
        self.address = ""

    def start(self, register: Callable[[grpc.Server], list[str]]) -> str:
        """Bind, add the role's servicers (``register`` returns their full service names), serve."""
        if self._server is not None:
            raise RuntimeError(f"{self.name}: already started")
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self._max_workers,
                                                        thread_name_prefix=f"{self.name}-rpc"),
                             interceptors=[self._auth] if self._auth is not None else None,
                             options=[("grpc.so_reuseport", 0)])
        self._service_names = list(register(server))
        port = add_health_reflection_and_bind(server, self._health, self._service_names, self.name, self.host,
                                              self._port, self._credentials)
        self.set_serving(False)
        server.start()
        self._server = server
        self.address = f"{self.host}:{port}"
        log.info("%s: gRPC on %s", self.name, self.address)
        return self.address

    def set_serving(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for svc in ("", *self._service_names):
            self._health.set(svc, status)

    def stop(self, grace_s: Optional[float] = 0.5) -> None:
        if self._server is None:
            return
        self.set_serving(False)
        self._server.stop(grace_s).wait()
        self._server = None
