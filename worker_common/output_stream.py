"""Router output streams on a worker: one engine step's chunks for one router in one message (issue 31).

Why: streaming each request's chunks on its own call costs, per token, a wakeup of the request's handler
thread, a gRPC message and, in the router, a wakeup of the call's reader; at 32 streams that took a third of
the worker's CPU beside the engine and half of the router's (docs/benchmarks.md, serving overhead). vLLM's
engine core likewise sends one ``EngineCoreOutputs`` per step to its front end.

Lifecycle: a decode or colocated worker holds one ``OutputStreams``. A router calls
``OpenOutputStream(stream_id)`` once per worker (``OutputStreamServicer``): ``open`` makes an
``OutputStream`` and the call's handler thread runs ``serve`` for as long as the router keeps it, sending
an empty first message (the stream is open) and then one ``StepOutputs`` per wakeup with everything put
since the last one. A request whose ``Generate``/``Decode`` names the stream gets a ``StreamedOut`` as its
``out`` (``bind``): the loop thread's ``put``s append to the stream's pending list without waking anyone,
and the engine loop calls ``flush()`` after each pass (commands and polls, then the step), which wakes
each stream's sender once. The request's own handler waits (``StreamedOut.wait``) for its last chunk or
its error and ends its call with it, so the call stays the request's lifetime (cancelling it aborts the
request, as before). When the router cancels the stream, goes away, or the worker stops, ``serve`` ends,
the stream is closed, and the worker aborts the requests still bound to it (``on_closed``).
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Callable, Iterator, Optional

import grpc

from proto import worker_pb2
from worker_common.request import RequestError

log = logging.getLogger(__name__)

MAX_STREAMS = 64
"""Output streams one worker keeps open (one per router; a router reopens after a failure)."""


class OutputStream:
    """The chunks of one router's requests on this worker, waiting to be sent (see module docstring)."""

    def __init__(self, stream_id: str) -> None:
        self.stream_id = stream_id
        self._lock = threading.Lock()
        self._pending: list[tuple[str, Any, bool, int, str]] = []
        # a C-level queue as the sender's wakeup: a Condition's notify cost the loop thread 7% of its time at
        # one stream (py-spy, tiny, 26 Nov); one token per flush at most
        self._wake: "queue.SimpleQueue[bool]" = queue.SimpleQueue()
        self._woken = False
        self.closed = False
        self.bound: set[str] = set()
        """Ids of the requests whose last chunk or error is not yet put (aborted when the stream closes)."""

    def bind(self, request_id: str) -> None:
        """``request_id``'s chunks come here until its last one (aborted if the stream closes first)."""
        with self._lock:
            self.bound.add(request_id)

    def unbind(self, request_id: str) -> None:
        with self._lock:
            self.bound.discard(request_id)

    def put(self, request_id: str, chunk: Any, last: bool, code: int = 0, message: str = "") -> None:
        """Queue one chunk (or, with ``code``, the request's error) for the next message; wakes nobody."""
        with self._lock:
            self._pending.append((request_id, chunk, last, code, message))
            if last:
                self.bound.discard(request_id)

    def flush(self) -> None:
        """Wake the sender if anything is pending (the engine loop, once per pass)."""
        if self._pending and not self._woken:
            self._woken = True
            self._wake.put(True)

    def take(self, timeout_s: float) -> list[tuple[str, Any, bool, int, str]]:
        """What was put since the last take, after a ``flush`` (or ``timeout_s``: maybe nothing)."""
        try:
            self._wake.get(timeout=timeout_s)
        except queue.Empty:
            pass
        with self._lock:
            items, self._pending = self._pending, []
            self._woken = False
            return items

    @property
    def idle(self) -> bool:
        """Nothing put waits for the sender."""
        return not self._pending

    def close(self) -> None:
        """Stop sending: the sender wakes and ends (any thread, e.g. the call's termination callback); what it
        had not taken is not sent (a drain waits for ``OutputStreams.sent`` first)."""
        self.closed = True
        self._wake.put(True)

    def unbind_all(self) -> set[str]:
        """Close, and take the requests still bound (the caller aborts them)."""
        with self._lock:
            bound, self.bound = self.bound, set()
        self.close()
        return bound


class StreamedOut:
    """A request's ``out`` when its chunks travel on a router's output stream: the loop thread's ``put``s go
    to the stream; the request's own handler ``wait``s for the end (the last chunk, or ``error``)."""

    def __init__(self, stream: OutputStream, request_id: str,
                 is_last: Optional[Callable[[Any], bool]] = None) -> None:
        self.stream = stream
        self.request_id = request_id
        self.is_last: Callable[[Any], bool] = is_last or (lambda _c: False)
        """Whether a chunk ends the request (``decode_worker.choices.is_last`` of its record)."""
        self.error: Optional[RequestError] = None
        self._done = threading.Event()

    def put(self, item: Any) -> None:
        """A chunk or the RequestError that ends the request (loop thread); anything after the end is dropped."""
        if self._done.is_set():
            return
        if isinstance(item, RequestError):
            self.error = item
            self.stream.put(self.request_id, None, True, item.code.value[0], item.message)
            self._done.set()
            return
        last = self.is_last(item)
        self.stream.put(self.request_id, item, last)
        if last:
            self._done.set()

    def discard(self) -> None:
        """The request never started (refused): unbind it without sending anything."""
        self._done.set()
        self.stream.unbind(self.request_id)

    def get(self, timeout: float) -> Optional[RequestError]:
        """Wait for the request's end, as its handler reads a queue: ``queue.Empty`` while it runs; then its
        error, or None when its last chunk was put (its chunks went to the stream, none to the handler)."""
        if not self._done.wait(timeout):
            raise queue.Empty
        return self.error


class OutputStreams:
    """A worker's open output streams by id (any thread)."""

    def __init__(self, worker_id: str) -> None:
        self.worker_id = worker_id
        self._lock = threading.Lock()
        self._streams: dict[str, OutputStream] = {}
        self.messages_total = 0
        """StepOutputs messages sent on every stream so far (senders' threads; for tests and the benchmark)."""
        self.outputs_total = 0
        """Request outputs (chunks and errors) they carried."""

    def open(self, stream_id: str) -> OutputStream:
        """A new stream (RESOURCE_EXHAUSTED past ``MAX_STREAMS``; ALREADY_EXISTS for an id that is open)."""
        with self._lock:
            if stream_id in self._streams:
                raise RequestError(grpc.StatusCode.ALREADY_EXISTS,
                                   f"stream_id: output stream {stream_id!r} is already open on worker {self.worker_id}")
            if len(self._streams) >= MAX_STREAMS:
                raise RequestError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                   f"worker {self.worker_id}: {MAX_STREAMS} output streams are open")
            s = self._streams[stream_id] = OutputStream(stream_id)
            return s

    def drop(self, stream: OutputStream) -> set[str]:
        """Close ``stream`` and forget it (if still the one under its id); the requests still bound to it."""
        with self._lock:
            if self._streams.get(stream.stream_id) is stream:
                del self._streams[stream.stream_id]
        return stream.unbind_all()

    def bind(self, stream_id: str, request_id: str) -> StreamedOut:
        """A ``StreamedOut`` for ``request_id`` on the open stream ``stream_id`` (UNAVAILABLE if there is none:
        the router retries elsewhere or reopens)."""
        with self._lock:
            s = self._streams.get(stream_id)
        if s is None or s.closed:
            raise RequestError(grpc.StatusCode.UNAVAILABLE, f"worker {self.worker_id}: output stream {stream_id!r} "
                                                            f"is not open here (request {request_id})")
        s.bind(request_id)
        return StreamedOut(s, request_id)

    def flush(self) -> None:
        """Wake every stream with something pending (the engine loop, after each pass)."""
        for s in list(self._streams.values()):
            s.flush()

    def sent(self) -> bool:
        """Whether every stream's put chunks were taken by its sender (nothing waits to be sent)."""
        with self._lock:
            streams = list(self._streams.values())
        return all(s.idle for s in streams)

    def close_all(self) -> None:
        """Close every stream (the worker stops): each sender ends, and with it the router's stream."""
        with self._lock:
            streams = list(self._streams.values())
        for s in streams:
            s.close()

    def __len__(self) -> int:
        return len(self._streams)


def step_message(items: list[tuple[str, Any, bool, int, str]]) -> worker_pb2.StepOutputs:
    """One ``StepOutputs`` from what a stream's ``take`` returned."""
    msg = worker_pb2.StepOutputs()
    for rid, chunk, last, code, message in items:
        o = msg.outputs.add(request_id=rid, last=last)
        if code:
            o.error_code, o.error_message = code, message
        else:
            o.chunk.CopyFrom(chunk)
    return msg


class OutputStreamServicer:
    """The ``OpenOutputStream`` RPC, for a ``WorkerBase`` with ``output_streams`` (decode and colocated roles)."""

    def OpenOutputStream(self, request: worker_pb2.OutputStreamRequest,
                         context: grpc.ServicerContext) -> Iterator[worker_pb2.StepOutputs]:
        w: Any = self
        sid = request.stream_id
        if not sid or len(sid) > 256:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, f"stream_id: must be 1 to 256 characters, got {len(sid)}")
        try:
            stream = w.output_streams.open(sid)
        except RequestError as e:
            context.abort(e.code, e.message)
        return self._serve_stream(stream, context)

    def _serve_stream(self, stream: OutputStream, context: grpc.ServicerContext) -> Iterator[worker_pb2.StepOutputs]:
        w: Any = self
        context.add_callback(stream.close)  # the router went away: the sender wakes and ends
        log.info("%s %s: output stream %s open", w.role, w.cfg.worker_id, stream.stream_id)
        try:
            yield worker_pb2.StepOutputs()
            while not stream.closed:
                items = stream.take(0.25)
                if items:
                    streams = w.output_streams
                    streams.messages_total += 1
                    streams.outputs_total += len(items)
                    yield step_message(items)
                elif not context.is_active() or w.loop is None or not w.loop.alive:
                    return
        finally:
            bound = w.output_streams.drop(stream)
            log.info("%s %s: output stream %s closed (%d requests on it aborted)", w.role, w.cfg.worker_id,
                     stream.stream_id, len(bound))
            if bound and w.loop is not None and w.loop.alive:
                w.loop.post(lambda _e: [w.abort(rid) for rid in bound])


__all__ = ["MAX_STREAMS", "OutputStream", "OutputStreamServicer", "OutputStreams", "StreamedOut", "step_message"]
