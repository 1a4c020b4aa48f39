"""Who may call a pdserve gRPC server: bearer keys, for the public API and the cluster plane.

Lifecycle: a server (the router's public API, each worker's internal API) builds a
``BearerAuth(keys, realm)`` once from its config and hands it to ``GrpcServing`` as an
interceptor; every call then carries ``authorization: Bearer <key>`` metadata or ends with
UNAUTHENTICATED before its handler runs (so a refused Reserve reserves nothing). Keys are
compared in constant time (``hmac.compare_digest``) and never logged or echoed. Health and
reflection stay open so probes and grpcurl work. On the calling side ``bearer_metadata(key)``
is what a client attaches (the router to its workers: the cluster secret; clients to the
router: an API key, through ``transport.client_auth.ClientAuth``). TLS files: ``transport.tls``.

Why bearer metadata and not mTLS alone for the cluster plane: the secret travels by
environment or file to every process (Ray actors, pods) with no certificate authority to run,
and it guards the workers' plaintext loopback/pod-network ports the same way vLLM's
``--api-key`` guards its server. It is a shared secret, not encryption: see docs/security.md.
"""
from __future__ import annotations

import logging
from typing import Any, Callable, Iterable, Optional, Union

import grpc

from transport.api_keys import KeySource, KeyTable, bearer_token

log = logging.getLogger(__name__)

OPEN_SERVICES = ("grpc.health.v1.Health", "grpc.reflection.v1alpha.ServerReflection",
                 "grpc.reflection.v1.ServerReflection")
"""Services every caller may reach (probes, grpcurl's discovery)."""


def bearer_metadata(key: str) -> tuple[tuple[str, str], ...]:
    """The call metadata that presents ``key``."""
    return (("authorization", f"Bearer {key}"),)


def _refusal(realm: str) -> str:
    return f"{realm}: missing or invalid credentials (send 'authorization: Bearer <key>' metadata)"


def _deny_table(deny: Callable[[Any, Any], Any]) -> dict[tuple[bool, bool], Any]:
    """One refusing handler per (request streaming, response streaming) shape."""
    return {
        (False, False): grpc.unary_unary_rpc_method_handler(deny),
        (False, True): grpc.unary_stream_rpc_method_handler(deny),
        (True, False): grpc.stream_unary_rpc_method_handler(deny),
        (True, True): grpc.stream_stream_rpc_method_handler(deny),
    }


class BearerAuth(grpc.ServerInterceptor):
    """Refuses calls without one of ``keys`` as a bearer token (constant-time compare)."""

    def __init__(self, keys: Union[Iterable[str], KeySource], realm: str,
                 open_services: Iterable[str] = OPEN_SERVICES) -> None:
        """``keys``: plain keys, or a key source (``transport.api_keys``: a table, or a file re-read on change)."""
        self._source = keys if hasattr(keys, "identify") else KeyTable.plain(keys)  # type: ignore[arg-type]
        if not len(self._source):
            raise ValueError(f"{realm}: BearerAuth needs at least one non-empty key")
        self._open = tuple(f"/{s}/" for s in open_services)
        self._realm = realm

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, _refusal(realm))

        self._deny = _deny_table(deny)

    def permits(self, handler_call_details: Any) -> bool:
        """Whether the call may go on: an open service, or a valid bearer key (every key compared, constant
        time)."""
        if (handler_call_details.method or "").startswith(self._open):
            return True
        presented = b""
        for k, v in handler_call_details.invocation_metadata or ():
            if k == "authorization":
                presented = bearer_token(v)
                break
        return self._source.identify(presented) is not None

    def refuse(self, handler: Any, method: str, table: Optional[dict] = None) -> Any:
        """The refusing handler for ``handler``'s shape (None: unknown method, gRPC answers UNIMPLEMENTED)."""
        if handler is None:
            return None
        log.info("%s: refused %s (no valid credentials)", self._realm, method)
        return (table or self._deny)[(handler.request_streaming, handler.response_streaming)]

    def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        if self.permits(handler_call_details):
            return continuation(handler_call_details)
        return self.refuse(continuation(handler_call_details), handler_call_details.method or "")


class AioBearerAuth(grpc.aio.ServerInterceptor):
    """``BearerAuth`` for an asyncio server (``transport.aio_serving``): the same keys, realm and open services."""

    def __init__(self, keys: Union[Iterable[str], KeySource], realm: str,
                 open_services: Iterable[str] = OPEN_SERVICES) -> None:
        self._check = BearerAuth(keys, realm, open_services)

        async def deny(request: Any, context: Any) -> Any:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, _refusal(realm))

        self._deny = _deny_table(deny)

    async def intercept_service(self, continuation: Callable[[Any], Any], handler_call_details: Any) -> Any:
        if self._check.permits(handler_call_details):
            return await continuation(handler_call_details)
        return self._check.refuse(await continuation(handler_call_details), handler_call_details.method or "",
                                  self._deny)
