"""Driving a request flow without a thread per request: the gRPC front end's streaming path (issue 31).

Why: a flow that a handler thread iterates costs, per token and request, a wakeup of that thread (its output
stream sink), and gRPC's synchronous server two more (the send's completion on its ``_serve`` thread, then the
handler again). At 32 streams that was most of the router's CPU per token (docs/benchmarks.md, serving
overhead). Here a flow's steady streaming runs on the output stream's reader thread, which already holds the
step's message: each request's chunk goes through its flow (output processor, stop strings) right there, and
the events of the whole step reach the asyncio front end with one loop wakeup (``LoopInbox``).

Lifecycle: the front end makes a ``FlowPump(gen, pool, emit)`` per request over the core's generator
(``RouterCore.generate(..., push=True)``) and ``start``s it: a pool thread iterates the generator (admission,
placement, prefill and every other blocking step run there, as on a handler thread before). The generator
yields, besides ``FlowEvent``s (passed to ``emit``), two markers:
- ``Wait(stream)``: the flow has consumed every queued chunk of ``stream`` (a ``StreamedCall``). The pump
  registers a waiter on it and returns the thread. The next item wakes it on the putting thread: a plain chunk
  (put by the stream's reader) resumes the generator right there, anything else (a status, an error, the
  last chunk) on a pool thread;
- ``HANDOFF``: the flow is about to block (an abort call, a migration, the end of an attempt); on a reader
  thread the pump moves it to a pool thread, elsewhere it goes on.
So a reader thread only ever runs a flow between a ``Wait`` and the next ``Wait`` or ``HANDOFF``: processing
chunks, never a call. The generator's end (``END``) or exception is ``emit``ted last. The generator is never
resumed by two threads at once: only the one waiter registered at a time, or the pool task submitted, runs it.
"""
from __future__ import annotations

import asyncio
import logging
import threading
from concurrent.futures import Executor
from typing import Any, Callable, Iterator

log = logging.getLogger(__name__)


class Wait:
    """Marker: the flow waits for ``stream``'s next item (see module docstring)."""

    __slots__ = ("stream",)

    def __init__(self, stream: Any) -> None:
        self.stream = stream


HANDOFF = object()
"""Marker: the flow is about to block; resume it on a pool thread if it runs on a stream's reader."""

END = object()
"""Emitted after a flow's last event."""


class FlowPump:
    """Runs one flow's generator on pool threads and stream readers, emitting its events (module docstring)."""

    __slots__ = ("_gen", "_pool", "_emit")

    def __init__(self, gen: Iterator[Any], pool: Executor, emit: Callable[[Any], None]) -> None:
        """``emit(item)``: a ``FlowEvent``, then ``END`` or the exception that ended the flow (any thread)."""
        self._gen, self._pool, self._emit = gen, pool, emit

    def start(self) -> None:
        self._pool.submit(self._run, False)

    def _resume(self, plain: bool) -> None:
        if plain:
            self._run(True)
        else:
            self._pool.submit(self._run, False)

    def _run(self, on_reader: bool) -> None:
        gen, emit = self._gen, self._emit
        while True:
            try:
                item = next(gen)
            except StopIteration:
                emit(END)
                return
            except BaseException as e:  # the flow's failure (FlowError) or a bug: the front end answers it
                emit(e)
                return
            if type(item) is Wait:
                if item.stream.wait(self._resume):
                    return
                continue  # an item came meanwhile: go on here
            if item is HANDOFF:
                if on_reader:
                    self._pool.submit(self._run, False)
                    return
                continue
            emit(item)


class LoopInbox:
    """Items from any thread to asyncio queues on one loop, with one loop wakeup per burst: the first ``put``
    after a drain schedules the drain, the ones before it runs only append. A ``put`` made while the loop itself
    runs (a flow run by an output stream read on that loop, ``RouterConfig.one_loop``) goes straight into its queue
    when nothing is waiting to be drained (else behind what is, keeping each queue's order)."""

    __slots__ = ("_loop", "_lock", "_items")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._lock = threading.Lock()
        self._items: list[tuple["asyncio.Queue[Any]", Any]] = []

    def put(self, q: "asyncio.Queue[Any]", item: Any) -> None:
        with self._lock:
            first = not self._items
            if first and asyncio._get_running_loop() is self._loop:  # this thread runs the loop now
                q.put_nowait(item)
                return
            self._items.append((q, item))
        if first:
            try:
                self._loop.call_soon_threadsafe(self._drain)
            except RuntimeError:  # the loop is closed: the server stopped, nobody reads
                pass

    def _drain(self) -> None:
        with self._lock:
            items, self._items = self._items, []
        for q, item in items:
            q.put_nowait(item)


__all__ = ["END", "HANDOFF", "FlowPump", "LoopInbox", "Wait"]
