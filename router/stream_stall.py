"""Cutting off streaming clients that stop reading: the router's stall watch.

A client that opens a streaming request and never reads it is held back by flow control (HTTP/2 windows for
gRPC, TCP and uvicorn's write buffer for HTTP): the router stops sending, and its flow stops pulling tokens from
the worker, which keeps the request's KV blocks until the request's deadline, possibly forever. The watch cuts
such a stream off once one send has waited ``timeout_s`` for the client, which frees the request on the worker.

Lifecycle: both front ends are asyncio and bound each send by ``timeout_s`` (``None``: off) through a
``StallWatch`` of their own loop: one watch task, running while some send is pending, rather than a timer per
message. The gRPC front end (``router.server``) guards each message's ``write`` (no abort: the cut write raises
``ConnectionAbortedError``); past the timeout, the stream ends with
``CANCELLED`` (the status waits behind the messages the client has not read, so the client sees it after what it
had buffered, as from a reset) and the flow is cancelled at once, which frees the request on the worker. gRPC's
asyncio server has no reset of a server-side stream (its ``ServicerContext`` offers no ``cancel``), so the HTTP/2
stream itself stays open until the client reads or its deadline passes: no KV blocks, only that stream's
flow-control window of messages.

The HTTP API: ``StallWatch(timeout_s).guard(send, abort, on_cut)`` wraps an ASGI ``send`` so
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

import asyncio
import logging
import socket
import struct
import time
from typing import Any, Awaitable, Callable, Optional

log = logging.getLogger(__name__)


class StallWatch:
    """The stall cut of one front end's event loop: ``guard(send, abort, on_cut)`` wraps a send (an ASGI ``send``, a
    gRPC ``context.write``; see the module docstring). A guarded send marks when it started; one watch task, running only while some send is
    pending, looks every ``min(1, timeout_s / 4)`` s for one that has waited past ``timeout_s``, calls ``on_cut``,
    aborts the connection (``abort``) and cancels the wait. After a cut, later messages are dropped; without
    ``abort`` the cut send raises ``ConnectionAbortedError`` instead (the server closes the connection once its
    buffer drains). One task instead of an ``asyncio.wait_for`` per send: that timer (a task per message) was 13%
    of the router's samples at 128 HTTP streams (py-spy, 27 Nov), and cost gRPC more than the write at one stream."""

    def __init__(self, timeout_s: Optional[float]) -> None:
        self.timeout_s = timeout_s
        self._pending: set["_Guarded"] = set()
        self._task: Optional["asyncio.Task[None]"] = None

    def guard(self, send: Callable[[Any], Awaitable[None]], abort: Optional[Callable[[], None]],
              on_cut: Callable[[], None]) -> Callable[[Any], Awaitable[None]]:
        """``send`` cut off when one message waits past ``timeout_s`` (``timeout_s`` None: ``send`` itself)."""
        if self.timeout_s is None:
            return send
        return _Guarded(self, send, abort, on_cut)

    def _arm(self, g: "_Guarded") -> None:
        self._pending.add(g)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._watch())

    async def _watch(self) -> None:
        timeout = self.timeout_s
        assert timeout is not None
        try:
            while self._pending:
                await asyncio.sleep(min(1.0, timeout / 4))
                now = time.monotonic()
                for g in list(self._pending):
                    if not g.cut and g.since is not None and now - g.since > timeout:
                        g.cut_off(timeout)
        finally:
            self._task = None


class _Guarded:
    """One response's guarded ``send`` (``StallWatch.guard``)."""

    __slots__ = ("_watch", "_send", "_abort", "_on_cut", "since", "cut", "_task")

    def __init__(self, watch: StallWatch, send: Callable[[Any], Awaitable[None]],
                 abort: Optional[Callable[[], None]], on_cut: Callable[[], None]) -> None:
        self._watch, self._send, self._abort, self._on_cut = watch, send, abort, on_cut
        self.since: Optional[float] = None
        self.cut = False
        self._task: Optional["asyncio.Task[Any]"] = None

    async def __call__(self, message: Any) -> None:
        if self.cut:
            return
        self.since, self._task = time.monotonic(), asyncio.current_task()
        self._watch._arm(self)
        try:
            await self._send(message)
        except asyncio.CancelledError:
            if not self.cut:
                raise  # not ours: the server cancelled the response
            uncancel = getattr(self._task, "uncancel", None)
            if uncancel is not None:
                uncancel()
            if self._abort is None:
                raise ConnectionAbortedError("stalled HTTP stream cut off") from None
        finally:
            self.since = None
            self._watch._pending.discard(self)

    def cut_off(self, timeout_s: float) -> None:
        """Past the stall timeout (on the loop): count it, drop the connection, end the waiting send."""
        self.cut = True
        log.info("stream stalled: the client has not read for %.0f s; cutting it off", timeout_s)
        self._on_cut()
        if self._abort is not None:
            self._abort()
        if self._task is not None:
            self._task.cancel()


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
