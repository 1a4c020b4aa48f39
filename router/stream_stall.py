"""Cutting off streaming clients that stop reading: the router's stall watch.

A client that opens a streaming request and never reads it is held back by flow control (HTTP/2 windows for
gRPC, TCP and uvicorn's write buffer for HTTP): the router stops sending, and its flow stops pulling tokens from
the worker, which keeps the request's KV blocks until the request's deadline, possibly forever. The watch cuts
such a stream off once one send has waited ``timeout_s`` for the client, which frees the request on the worker.

Lifecycle: ``StallWatch(timeout_s, on_cut)`` (``timeout_s`` None: off) -> ``start()`` runs one daemon thread per
router that scans the open sends every ``min(1, timeout_s / 4)`` s -> each gRPC stream takes a ``StreamWatch``
(``watch(cut)``) and brackets every message it hands to gRPC with ``sending()`` / ``sent()``; a send still
pending after ``timeout_s`` calls the stream's ``cut`` once (the servicer resets the HTTP/2 stream, which also
runs its flow's cancel) and ``on_cut("grpc")`` -> ``close()`` when the stream ends -> ``stop()``.

The HTTP API does not need the thread: ``send_within(send, timeout_s, abort, on_cut)`` wraps an ASGI ``send`` so
that one that waits past the timeout aborts the connection (uvicorn's send waits for its write buffer to drain
below the high water mark, and the kernel's socket buffer is full by then, so a wait means the client has not read
for that long); the server then sees the client gone and the response's flows are cancelled as for any
disconnect. ``connection_abort(send)`` finds uvicorn's abort behind its own ``send`` (the HTTP API records it in the
request's scope at the outermost ASGI layer, before any wrapper).

Why a reset, not a status: a stalled stream's window is full, and gRPC sends a call's status (trailers) only
after the messages queued before it, so an abort with a status would wait for the same client; Envoy's
``stream_idle_timeout`` also ends such a stream with a reset. The client sees ``CANCELLED`` (gRPC) or a
connection closed mid-body (HTTP), after whatever it had already buffered.
"""
from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from typing import Any, Awaitable, Callable, Optional

log = logging.getLogger(__name__)


class StreamWatch:
    """One stream's open send, if any (see module docstring)."""

    def __init__(self, watch: "StallWatch", cut: Callable[[], None]) -> None:
        self._watch, self._cut = watch, cut
        self.since: Optional[float] = None
        """When the pending send began (monotonic); None while none is pending."""
        self.was_cut = False

    def sending(self) -> None:
        self.since = time.monotonic()

    def sent(self) -> None:
        self.since = None

    def close(self) -> None:
        self.since = None
        self._watch._forget(self)

    def cut(self) -> None:
        if not self.was_cut:
            self.was_cut = True
            self._cut()


class StallWatch:
    """Every open gRPC stream's pending send; cuts the ones pending past ``timeout_s`` (module docstring)."""

    def __init__(self, timeout_s: Optional[float], on_cut: Callable[[str], None] = lambda api: None) -> None:
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"stream_stall_timeout_s must be > 0 or None (off), got {timeout_s}")
        self.timeout_s = timeout_s
        self._on_cut = on_cut
        self._streams: set[StreamWatch] = set()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    def start(self) -> "StallWatch":
        if self.timeout_s is not None and self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="router-stall-watch", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

    def watch(self, cut: Callable[[], None]) -> StreamWatch:
        """A new stream's watch; ``cut`` runs (once, on the watch's thread) if one of its sends stalls."""
        w = StreamWatch(self, cut)
        if self.timeout_s is not None:
            with self._lock:
                self._streams.add(w)
        return w

    def _forget(self, w: StreamWatch) -> None:
        with self._lock:
            self._streams.discard(w)

    def _loop(self) -> None:
        assert self.timeout_s is not None
        interval = min(1.0, self.timeout_s / 4)
        while not self._stop.wait(interval):
            now = time.monotonic()
            with self._lock:
                stalled = [w for w in self._streams
                           if w.since is not None and not w.was_cut and now - w.since > self.timeout_s]
            for w in stalled:
                log.info("gRPC stream stalled: the client has not read for %.0f s; cutting it off", self.timeout_s)
                try:
                    w.cut()
                    self._on_cut("grpc")
                except Exception:  # one stream's cut must not stop the watch
                    log.exception("cutting off a stalled stream failed")


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
