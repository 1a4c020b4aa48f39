"""The router's end of the workers' output streams: one long-lived stream per worker, one message per step.

Why: a request's chunks used to arrive on its own ``Generate``/``Decode`` call, one gRPC message per token,
each waking the call's reader thread in the router; at 32 streams that was half of the router's CPU per token
(docs/benchmarks.md, serving overhead). The worker side and the protocol are in
``worker_common.output_stream`` and ``proto/worker.proto`` (``OpenOutputStream``).

Lifecycle: one ``OutputStreams`` per router (``RouterCore``), closed at router stop. The first request for a
worker address opens its stream (``stream_for``; waits, bounded, for the worker's empty first message); a
reader thread then hands each ``RequestOutput`` to the sink of its request id. ``WorkerCalls`` registers a
request's sink before sending its ``Generate``/``Decode`` with ``output_stream`` set and returns a
``StreamedCall``: it iterates like the call's own stream (chunks, then StopIteration after the request's last
one; a failure raises a ``grpc.RpcError``), and ``cancel()`` cancels the request's call, which the worker sees
as the abort it always was. The request's call still carries its deadline and its status: a failure status
reaches the sink through the call's done callback. When a stream breaks (the worker died, restarted or
closed it), every request on it gets the break as UNAVAILABLE (so the flow retries or migrates) and the
next request for that address reopens it; a worker without ``OpenOutputStream`` (an older version,
UNIMPLEMENTED) is streamed the old way, per call, and asked again after ``RETRY_UNSUPPORTED_S``. With
``use_loop`` (``RouterConfig.one_loop``) a stream is read by a task of the router's event loop over an asyncio
channel instead of by a reader thread: the same dispatch, on the loop.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from typing import Any, Callable, Optional

import grpc

from proto import worker_pb2
from transport.errors import StatusRpcError

log = logging.getLogger(__name__)

OPEN_TIMEOUT_S = 5.0
"""How long a request waits for a new stream's first message before it is streamed on its own call instead."""
RETRY_UNSUPPORTED_S = 60.0
"""A worker that answered UNIMPLEMENTED (older version) is asked again after this long (it may be replaced)."""
LAST_CHUNK_GRACE_S = 10.0
"""After a request's call ended OK, how long its last chunk may take to arrive on the stream."""

_CALL_OK = object()  # the request's call ended OK (its last chunk is on the stream, maybe still in flight)
NOT_PLAIN = object()
"""``StreamedCall.poll``: the next item is not a plain chunk (a status, an error, the last chunk): call ``next``."""


class _Sink:
    """One request's chunks (RequestOutput messages), its call's failure, or ``_CALL_OK``; and, for a flow driven
    by pushes (``router.flow_pump``), the callback to run when the next item comes instead of a thread waiting."""

    __slots__ = ("q", "_lock", "_waiter", "held")

    def __init__(self) -> None:
        self.q: "queue.SimpleQueue[Any]" = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._waiter: Optional[Callable[[bool], None]] = None
        self.held: Any = None
        """An item ``poll`` took but did not return (not a plain chunk): ``__next__`` returns it first."""

    def put(self, item: Any, plain: bool = False) -> None:
        """Queue ``item``; a registered waiter runs now, in this thread, told whether ``item`` is a ``plain``
        chunk (put by the stream's reader: the flow may process it right here) or not (a status: elsewhere)."""
        self.q.put(item)
        with self._lock:  # a waiter set after the put saw an empty queue would be lost without the lock
            w, self._waiter = self._waiter, None
        if w is not None:
            w(plain)

    def wait(self, waiter: Callable[[bool], None]) -> bool:
        """Run ``waiter(plain)`` when the next item comes: True; False (and ``waiter`` not kept) when an item is
        already queued."""
        with self._lock:
            if self.held is not None or not self.q.empty():
                return False
            self._waiter = waiter
            return True


class WorkerStream:
    """One worker's output stream in this router: the call, its reader (a thread, or a task of the router's loop)
    and the sinks by request id."""

    def __init__(self, stub: Any, address: str, stream_id: str,
                 loop: Optional[asyncio.AbstractEventLoop] = None) -> None:
        """``loop``: read the stream as a task on that event loop (``stub`` is then an asyncio stub, made on the
        loop by ``stub()``: ``stub`` is a callable), not on a reader thread of its own (see ``OutputStreams``)."""
        self.address, self.stream_id = address, stream_id
        self._lock = threading.Lock()
        self._sinks: dict[str, _Sink] = {}
        self._open = threading.Event()
        self.broken: Optional[grpc.RpcError] = None
        """Why the stream ended (None while it is opening or open)."""
        self.unsupported = False
        """The worker answered UNIMPLEMENTED: it predates output streams."""
        request = worker_pb2.OutputStreamRequest(stream_id=stream_id)
        self._task: Optional[concurrent.futures.Future] = None
        self.loop_task: Optional[asyncio.Task] = None
        """The reading task, on the loop (None on a reader thread, or before it ran)."""
        if loop is None:
            self._call = stub.OpenOutputStream(request)
            self._thread = threading.Thread(target=self._read, name=f"out-stream-{address}", daemon=True)
            self._thread.start()
        else:
            self._call = None
            self._task = asyncio.run_coroutine_threadsafe(self._read_on_loop(stub, request), loop)
            self._task.add_done_callback(self._cancelled_unread)

    def _cancelled_unread(self, fut: concurrent.futures.Future) -> None:
        """A stream cancelled before its task ever ran breaks here (nobody else would end its waits)."""
        if fut.cancelled() and self.loop_task is None and self.broken is None:
            self._break(StatusRpcError(grpc.StatusCode.UNAVAILABLE, f"output stream from {self.address} closed"))

    @property
    def usable(self) -> bool:
        return self._open.is_set() and self.broken is None

    def wait_open(self, timeout_s: float) -> bool:
        """Whether the worker's first message came (False: still opening after ``timeout_s``, or failed)."""
        self._open.wait(timeout_s)
        return self.usable

    def register(self, request_id: str) -> Optional[_Sink]:
        """A sink for ``request_id``'s outputs (None if the stream is broken)."""
        sink = _Sink()
        with self._lock:
            if self.broken is not None:
                return None
            self._sinks[request_id] = sink
        return sink

    def unregister(self, request_id: str, sink: _Sink) -> None:
        with self._lock:
            if self._sinks.get(request_id) is sink:
                del self._sinks[request_id]

    def __len__(self) -> int:
        return len(self._sinks)

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()  # thread-safe: the task ends at its next await, breaking its sinks
        elif self._call is not None:
            self._call.cancel()

    def _read(self) -> None:
        err: grpc.RpcError
        try:
            for msg in self._call:
                self._dispatch(msg)
            err = StatusRpcError(grpc.StatusCode.UNAVAILABLE, f"output stream from {self.address} ended")
        except Exception as e:
            err = self._failed(e)
        self._break(err)

    def _failed(self, e: Exception) -> grpc.RpcError:
        """Why a reader ended with ``e``: the call's own error, or a reader failure (never leave sinks waiting on a
        reader that died)."""
        if isinstance(e, grpc.RpcError):
            self.unsupported = e.code() == grpc.StatusCode.UNIMPLEMENTED
            return e
        log.error("output stream %s from %s: reader failed", self.stream_id, self.address, exc_info=e)
        return StatusRpcError(grpc.StatusCode.UNAVAILABLE, f"output stream from {self.address} failed: {e}")

    async def _read_on_loop(self, stub: Callable[[], Any], request: worker_pb2.OutputStreamRequest) -> None:
        """``_read`` as a task of the router's one event loop (``RouterConfig.one_loop``): each message's
        chunks go through their flows on the loop, whose front ends take the events without a thread hop."""
        err: grpc.RpcError
        self.loop_task = asyncio.current_task()
        try:
            self._call = stub().OpenOutputStream(request)
            async for msg in self._call:
                self._dispatch(msg)
            err = StatusRpcError(grpc.StatusCode.UNAVAILABLE, f"output stream from {self.address} ended")
        except asyncio.CancelledError:
            err = StatusRpcError(grpc.StatusCode.UNAVAILABLE, f"output stream from {self.address} closed")
            if self._call is not None:
                self._call.cancel()
        except Exception as e:
            err = self._failed(e)
        self._break(err)

    def _dispatch(self, msg: worker_pb2.StepOutputs) -> None:
        """One worker message: the first opens the stream; each output goes to its request's sink."""
        if not self._open.is_set():
            self._open.set()
            log.info("output stream %s from %s open", self.stream_id, self.address)
            return
        ready = []
        with self._lock:
            sinks = self._sinks
            for o in msg.outputs:
                sink = sinks.get(o.request_id)
                if sink is None:
                    continue  # the request was cancelled here, or ended
                if o.last:
                    del sinks[o.request_id]
                ready.append((sink, o))
        for sink, o in ready:  # each put may switch to its handler thread (or run its flow): not under the lock
            sink.put(o, not (o.error_code or o.last))

    def _break(self, err: Any) -> None:
        """The stream ended (``err`` says why): every request still on it gets the break."""
        with self._lock:
            self.broken = err
            sinks, self._sinks = self._sinks, {}
        self._open.set()
        if sinks:
            log.warning("output stream %s from %s broke with %d requests on it: %s", self.stream_id, self.address,
                        len(sinks), getattr(err, "code", lambda: err)())
        # the stream's failure reads as the worker's: UNAVAILABLE, which the flow retries or migrates
        lost = StatusRpcError(grpc.StatusCode.UNAVAILABLE, f"output stream from {self.address} broke: "
                                                           f"{_details(err)}")
        for sink in sinks.values():
            try:
                sink.put(lost)
            except RuntimeError as e:  # the router is stopping: its flow pool takes no more flows
                log.debug("output stream %s from %s: a flow not resumed at shutdown: %s", self.stream_id,
                          self.address, e)


def _details(e: Any) -> str:
    try:
        return f"{e.code().name}: {e.details()}"
    except Exception:
        return str(e)


class StreamedCall:
    """A request's ``Generate``/``Decode`` whose chunks come on its worker's output stream: iterates like the
    call's own response stream; ``cancel()`` cancels the call (the worker aborts the request)."""

    def __init__(self, stream: WorkerStream, request_id: str, sink: _Sink, start: Callable[[], Any]) -> None:
        self._stream, self._rid, self._sink = stream, request_id, sink
        self._ended = False
        self._cancelled = False  # cancelled before its iteration ended, CANCELLED not said yet
        try:
            self._call = start()
        except BaseException:
            stream.unregister(request_id, sink)
            raise
        self._call.add_done_callback(self._on_done)

    def _on_done(self, call: Any) -> None:
        code = call.code()
        self._sink.put(_CALL_OK if code == grpc.StatusCode.OK else call)

    def __iter__(self) -> "StreamedCall":
        return self

    def poll(self) -> Any:
        """The next chunk if one is queued and plain (no status, no error): ``None`` when nothing is queued,
        ``NOT_PLAIN`` when the next item needs ``__next__`` (which may block or raise); never blocks."""
        sink = self._sink
        if self._ended or sink.held is not None:
            return NOT_PLAIN
        try:
            item = sink.q.get_nowait()
        except queue.Empty:
            return None
        if item is _CALL_OK or isinstance(item, grpc.RpcError) or item.error_code or item.last:
            sink.held = item
            return NOT_PLAIN
        return item.chunk

    def wait(self, waiter: Callable[[bool], None]) -> bool:
        """``waiter(plain)`` runs when the next item comes (True), or an item is already here (False)."""
        return self._sink.wait(waiter)

    def __next__(self) -> worker_pb2.DecodeChunk:
        if self._ended:
            if self._cancelled:  # not "ended without a finish reason", which a flow reads as a lost worker
                self._cancelled = False
                raise StatusRpcError(grpc.StatusCode.CANCELLED, f"request {self._rid} cancelled")
            raise StopIteration
        timeout: Optional[float] = None
        while True:
            try:
                item = self._sink.held
                if item is not None:
                    self._sink.held = None
                else:
                    item = self._sink.q.get(timeout=timeout)
            except queue.Empty:
                self._end()
                raise StatusRpcError(grpc.StatusCode.UNAVAILABLE,
                                     f"request {self._rid}: its call on {self._stream.address} ended but its last "
                                     f"chunk did not come on the output stream within {LAST_CHUNK_GRACE_S:.0f} s")
            if item is _CALL_OK:
                timeout = LAST_CHUNK_GRACE_S  # the last chunk is queued on the stream: it is coming
                continue
            if isinstance(item, grpc.RpcError):  # the call failed, or the stream broke: end the call too
                self.cancel()
                self._cancelled = False  # (a cancel's CANCELLED is this one: said once)
                raise item
            if item.error_code:
                self.cancel()
                self._cancelled = False  # (the error is what ended it)
                raise StatusRpcError(_code(item.error_code), item.error_message)
            if item.last:
                self._end()
            return item.chunk

    def _end(self) -> None:
        self._ended = True
        self._stream.unregister(self._rid, self._sink)

    def cancel(self) -> None:
        """Cancel the request's call (the worker aborts it) and end the iteration: a reader waiting in
        ``__next__`` gets CANCELLED at once, as from a cancelled call (the call may have ended OK already, and
        then its cancel wakes nobody); a ``__next__`` that comes after the cancel gets it too, once (an iteration
        that had ended stays ended)."""
        if not self._ended:
            self._cancelled = True
        self._end()
        self._call.cancel()
        self._sink.put(StatusRpcError(grpc.StatusCode.CANCELLED, f"request {self._rid} cancelled"))


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def _code(value: int) -> grpc.StatusCode:
    """A status code from its number (UNAVAILABLE for a number gRPC does not define: the worker is odd)."""
    return _CODES.get(value, grpc.StatusCode.UNAVAILABLE)


class OutputStreams:
    """This router's output streams, one per worker address (see module docstring)."""

    def __init__(self, stub_for: Callable[[str], Any], router_id: str = "") -> None:
        """``stub_for(address)``: a stub with ``OpenOutputStream`` (the ColocatedWorker stub of that address)."""
        self._stub_for = stub_for
        self.router_id = router_id or uuid.uuid4().hex[:8]
        self._lock = threading.Lock()
        self._streams: dict[str, WorkerStream] = {}
        self._unsupported: dict[str, float] = {}  # address -> when it said UNIMPLEMENTED
        self._closed = False
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._aio_stub_for: Optional[Callable[[str], Any]] = None

    def use_loop(self, loop: asyncio.AbstractEventLoop, aio_stub_for: Callable[[str], Any]) -> None:
        """Read every stream opened from now on as a task of ``loop`` (``RouterConfig.one_loop``) instead of on a
        reader thread: ``aio_stub_for(address)``, called on the loop, gives an asyncio stub of that address."""
        self._loop, self._aio_stub_for = loop, aio_stub_for

    def _open_stream(self, address: str) -> WorkerStream:
        stream_id = f"{self.router_id}-{uuid.uuid4().hex[:12]}"
        loop, aio_stub_for = self._loop, self._aio_stub_for
        if loop is None or aio_stub_for is None:
            return WorkerStream(self._stub_for(address), address, stream_id)
        return WorkerStream(lambda: aio_stub_for(address), address, stream_id, loop)

    def stream_for(self, address: str) -> Optional[WorkerStream]:
        """The open stream of ``address``, opening it if needed (None: the worker cannot stream this way now).
        May wait up to ``OPEN_TIMEOUT_S`` for a new stream to open: never called on the loop that reads streams
        (a flow yields ``HANDOFF`` before any call), where it would wait for itself; there it answers None."""
        if self._loop is not None and asyncio._get_running_loop() is self._loop:  # (as LoopInbox.put asks)
            log.error("output stream of %s asked for on the event loop that reads it: streaming per call", address)
            return None
        with self._lock:
            if self._closed:
                return None
            s = self._streams.get(address)
            if s is not None and s.broken is not None:
                del self._streams[address]
                s = None
            if s is None:
                since = self._unsupported.get(address)
                if since is not None and time.monotonic() - since < RETRY_UNSUPPORTED_S:
                    return None
                self._unsupported.pop(address, None)
                s = self._streams[address] = self._open_stream(address)
        if s.wait_open(OPEN_TIMEOUT_S):
            return s
        with self._lock:
            if s.unsupported:  # an older worker: per call, and not asked again for a while
                self._unsupported[address] = time.monotonic()
            if s.broken is not None and self._streams.get(address) is s:
                del self._streams[address]
        return None

    def start(self, address: str, request_id: str, send: Callable[[str], Any]) -> Any:
        """Send a request with ``send(stream_id)`` (the stub call, "" = no stream) and return what iterates its
        chunks: a ``StreamedCall`` on the worker's stream, or the call itself when there is no stream."""
        s = self.stream_for(address)
        sink = s.register(request_id) if s is not None else None
        if s is None or sink is None:
            return send("")
        return StreamedCall(s, request_id, sink, lambda: send(s.stream_id))

    def close(self) -> list[WorkerStream]:
        """Cancel every stream (each breaks its requests); the streams closed."""
        with self._lock:
            self._closed = True
            streams, self._streams = list(self._streams.values()), {}
        for s in streams:
            s.cancel()
        return streams


__all__ = ["OutputStreams", "StreamedCall", "WorkerStream"]
