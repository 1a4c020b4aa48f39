"""Cutting off streaming clients that stop reading: the router's stall watch.

A client that opens a streaming request and never reads it is held back by flow control (HTTP/2 windows for
gRPC, TCP and uvicorn's write buffer for HTTP): the router stops sending, and its flow stops pulling tokens from
the worker, which keeps the request's KV blocks until the request's deadline, possibly forever. The watch cuts
such a stream off once one send has waited ``timeout_s`` for the client, which frees the request on the worker.

Lifecycle: both front ends are asyncio and bound each send by ``timeout_s`` (``None``: off). The gRPC front end
(``router.server``) awaits each message's write for at most ``timeout_s``; past it, the stream ends with
``CANCELLED`` (the status waits behind the messages the client has not read, so the client sees it after what it
had buffered, as from a reset) and the flow is cancelled at once, which frees the request on the worker. gRPC's
asyncio server has no reset of a server-side stream (its ``ServicerContext`` offers no ``cancel``), so the HTTP/2
stream itself stays open until the client reads or its deadline passes: no KV blocks, only that stream's
flow-control window of messages.

The HTTP API: ``send_within(send, timeout_s, abort, on_cut)`` wraps an ASGI ``send`` so
that one that waits past the timeout aborts the connection (uvicorn's send waits for its write buffer to drain
below the high water mark, and the kernel's socket buffer is full by then, so a wait means the client has not read
for that long); the server then sees the client gone and the response's flows are cancelled as for any
disconnect. ``connection_abort(send)`` finds uvicorn's abort behind its own ``send`` (the HTTP API records it in the
request's scope at the outermost ASGI layer, before any wrapper).

The client sees ``CANCELLED`` (gRPC) or a connection closed mid-body (HTTP), after whatever it had already
buffered. (Until 27 Nov the gRPC front end was gRPC's synchronous server, which resets a stalled stream outright,
from one watch thread per router.)
"""
from __future__ import annotations

import logging
import socket
import struct
from typing import Any, Awaitable, Callable, Optional

log = logging.getLogger(__name__)


def send_within(send: Callable[[Any], Awaitable[None]], timeout_s: Optional[float],
                abort: Optional[Callable[[], None]], on_cut: Callable[[], None]) -> Callable[[Any], Awaitable[None]]:
    """An ASGI ``send`` that calls ``abort`` (drop the connection at once) when one message waits past
    ``timeout_s`` for the client (``timeout_s`` None: ``send`` itself). After a cut, later messages are dropped;
    the server then reports ``http.disconnect``, which cancels the response's flows. Without ``abort`` the send
    raises ``ConnectionAbortedError`` instead (the server closes the connection once its buffer drains)."""
    if timeout_s is None:
        return send
    import asyncio

    cut = False

    async def guarded(message: Any) -> None:
        nonlocal cut
        if cut:
            return
        try:
            await asyncio.wait_for(send(message), timeout_s)
        except asyncio.TimeoutError:
            cut = True
            log.info("HTTP stream stalled: the client has not read for %.0f s; closing its connection", timeout_s)
            on_cut()
            if abort is None:
                raise ConnectionAbortedError("stalled HTTP stream cut off") from None
            abort()

    return guarded


def connection_abort(send: Callable[[Any], Awaitable[None]]) -> Optional[Callable[[], None]]:
    """A reset of the connection behind uvicorn's own ASGI ``send`` (its protocol object owns the transport); None
    for another server or a wrapped ``send``. The reset (``SO_LINGER`` 0, then the transport's ``abort()``) drops
    what the kernel and the transport still buffer for the client at once: a plain close would keep up to the
    socket's send buffer (megabytes) until the client read it or TCP gave up."""
    transport = getattr(getattr(send, "__self__", None), "transport", None)
    if transport is None or not hasattr(transport, "abort"):
        return None

    def reset() -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None:
            try:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            except OSError:  # already closed, or not a TCP socket: abort() alone
                pass
        transport.abort()

    return reset
