"""The asyncio gRPC server shell: ``GrpcServing``'s port binding, health, reflection, TLS and auth, on a loop
thread of its own (the router's public API, issue 31).

Why: gRPC's synchronous server spends a thread per call and, per streamed message, two thread wakeups (the
send's completion on its ``_serve`` thread, then the handler's); its asyncio server writes from one event loop
and holds no thread per call. What it saves in the router is measured in docs/benchmarks/history.md ("The asyncio
front end"): a third of the router's CPU per token at 128 streams, nothing at one.

Lifecycle: ``AioGrpcServing(name, host, port, auth=, tls=)`` -> ``start(register)`` starts an event loop on a
daemon thread, builds the ``grpc.aio`` server there, lets the role add its handlers (``register(server)``
returns their full service names), adds grpc.health.v1 health (NOT_SERVING until ``set_serving(True)``) and
reflection, binds (port 0 = a free one) and serves; ``loop`` is the loop the handlers run on.
``set_serving(bool)`` and ``stop(grace_s)`` are called from other threads (never from the loop); ``stop`` also
ends the loop and its thread.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any, Awaitable, Callable, Optional, Union

import grpc
from grpc_health.v1 import health, health_pb2

from transport.ports import check_port
from transport.serving import add_health_reflection_and_bind
from transport.tls import TlsFiles, server_credentials

log = logging.getLogger(__name__)

START_TIMEOUT_S = 30.0


class AioGrpcServing:
    """One asyncio gRPC server with health and reflection, on its own loop thread (see module docstring)."""

    def __init__(self, name: str, host: str = "127.0.0.1", port: int = 0, auth: Optional[Any] = None,
                 tls: Union[TlsFiles, grpc.ServerCredentials, None] = None) -> None:
        """``auth``: a ``grpc.aio.ServerInterceptor`` that refuses unauthenticated calls (``AioBearerAuth``)."""
        check_port(port, "port")
        self.name, self.host, self._port, self._auth = name, host, port, auth
        self._credentials = server_credentials(tls) if isinstance(tls, TlsFiles) else tls
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None
        self._server: Optional[grpc.aio.Server] = None
        self._health: Any = None
        self._service_names: list[str] = []
        self.address = ""
        self.at_stop: list[Callable[[], Awaitable[None]]] = []
        """Coroutines ``stop`` runs on the loop after the server stopped, before the loop ends (the role's own
        asyncio resources bound to this loop: channels, tasks)."""

    def start(self, register: Callable[[grpc.aio.Server], list[str]]) -> str:
        """Start the loop thread, add the role's handlers, bind, serve (NOT_SERVING); the address."""
        if self.loop is not None:
            raise RuntimeError(f"{self.name}: already started")
        loop = self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=loop.run_forever, name=f"{self.name}-aio", daemon=True)
        self._thread.start()
        try:
            return asyncio.run_coroutine_threadsafe(self._start(register), loop).result(START_TIMEOUT_S)
        except BaseException:
            self._end_loop()
            raise

    async def _start(self, register: Callable[[grpc.aio.Server], list[str]]) -> str:
        server = grpc.aio.server(interceptors=[self._auth] if self._auth is not None else None,
                                 options=[("grpc.so_reuseport", 0)])
        self._service_names = list(register(server))
        self._health = health.aio.HealthServicer()
        port = add_health_reflection_and_bind(server, self._health, self._service_names, self.name, self.host,
                                              self._port, self._credentials)
        await self._set(False)
        await server.start()
        self._server = server
        self.address = f"{self.host}:{port}"
        log.info("%s: gRPC (asyncio) on %s", self.name, self.address)
        return self.address

    async def _set(self, serving: bool) -> None:
        status = (health_pb2.HealthCheckResponse.SERVING if serving
                  else health_pb2.HealthCheckResponse.NOT_SERVING)
        for svc in ("", *self._service_names):
            await self._health.set(svc, status)

    def set_serving(self, serving: bool) -> None:
        if self.loop is None or self._health is None:
            return
        asyncio.run_coroutine_threadsafe(self._set(serving), self.loop).result(START_TIMEOUT_S)

    def stop(self, grace_s: Optional[float] = 0.5) -> None:
        if self.loop is None:
            return
        if self._server is not None:
            try:
                self.set_serving(False)
                asyncio.run_coroutine_threadsafe(self._server.stop(grace_s), self.loop).result(
                    (grace_s or 0.0) + START_TIMEOUT_S)
            except Exception:  # a loop already stopping: nothing left to stop
                log.debug("%s: stop", self.name, exc_info=True)
            self._server = None
        for at_stop in self.at_stop:
            try:
                asyncio.run_coroutine_threadsafe(at_stop(), self.loop).result(START_TIMEOUT_S)
            except Exception:
                log.warning("%s: a stop step failed", self.name, exc_info=True)
        self._end_loop()

    def _end_loop(self) -> None:
        loop, thread = self.loop, self._thread
        self.loop = self._thread = None
        if loop is None:
            return
        try:  # the role's own tasks (a watch loop, a handler still finishing) end before their loop does
            asyncio.run_coroutine_threadsafe(_cancel_tasks(), loop).result(10.0)
        except Exception:
            log.debug("%s: cancelling the loop's tasks", self.name, exc_info=True)
        loop.call_soon_threadsafe(loop.stop)
        if thread is not None:
            thread.join(10.0)
        if not loop.is_running():
            loop.close()


async def _cancel_tasks() -> None:
    me = asyncio.current_task()
    tasks = [t for t in asyncio.all_tasks() if t is not me]
    for t in tasks:
        t.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)
