"""One request through the cluster, from admission to the last token, as front-end-neutral events.

Lifecycle: a front end (gRPC today, HTTP next) validates a request and asks the router core
for a ``RequestFlow``; it registers ``flow.cancel`` with its transport (client cancel or
deadline) and iterates ``flow.run()``, rendering each ``FlowEvent``; a failure ends the
iteration with ``FlowError`` (a status and a message naming the request). The flow:
1. asks the ``Placer`` for the route: a prefill/decode **pair**, or the **whole** request on one
   worker (colocated mode; conditional disaggregation on a decode worker);
2. pair: ``place_pair`` reserves the prompt's blocks on a decode worker D (queueing while none
   has room) and picks a prefill worker P; ``Prefill`` on P returns the first token, sent to the
   client at once (TTFT); a failure before it retries on another pair (``recovery``);
3. pair: ``Decode`` on D at once (D starts when the KV has landed) streams the rest while a
   ``TransferWatch`` reads P's TransferDone (a failed transfer cancels the decode call); if D
   is lost mid-stream the request **migrates**: step 4 on another decode worker, resuming from
   the tokens already streamed;
4. whole: ``Generate`` on one worker, with ``resume_token_ids`` = what the client already has,
   so a retry before the first token and a migration after it are the same call;
5. every token passes through one ``OutputProcessor`` (text deltas, stop strings: a stop
   string finishes the stream and aborts the workers); the last event has usage and timings.
Each placement runs inside an ``Attempt`` (router/attempt.py), which owns its cleanup: an
abnormal end (a failure not recovered from, a cancel, the front end closing the stream) aborts
the request on its workers so they free their blocks; every end releases the placement's load
counts. The messages, stubs and deadlines of the worker calls are ``WorkerCalls``'; every call
has a deadline, so nothing hangs.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator, Optional, Sequence

import grpc

from engine import OutputProcessor
from proto import worker_pb2
from router.attempt import Attempt
from router.config import RouterConfig
from router.events import FlowError, FlowEvent, Timings, Usage
from router.flow_pump import HANDOFF, Wait
from router.output_streams import NOT_PLAIN
from router.placement import Placer
from router.placement_records import RETRIABLE, Hold, Placement, Recovery, Route, recovery
from router.scope import RequestScope
from router.transfer_watch import TransferWatch
from router.validation import ValidatedRequest
from router.wire import logprobs_from_wire
from router.worker_calls import WorkerCalls
from transport.tracing import Tracing

log = logging.getLogger(__name__)


@dataclass
class FlowDeps:
    """What a flow uses from its router (shared by all requests)."""

    cfg: RouterConfig
    placer: Placer
    calls: WorkerCalls
    tokenizer: Any
    metrics: Any = None


class RequestFlow:
    """Drives one request (see module docstring)."""

    def __init__(self, deps: FlowDeps, vreq: ValidatedRequest, t0: float, deadline: float, seq: int = 0,
                 route: Optional[Route] = None, push: bool = False) -> None:
        """``route``: run it this way (``Route.DECODE``, ``Route.COLOCATED``: whole on a worker of that pool) instead
        of the placer's choice (a beam search step runs whole where its history is cached). ``push``: ``run``
        also yields the ``router.flow_pump`` markers (``Wait``, ``HANDOFF``) for a ``FlowPump`` to drive it."""
        self.deps = deps
        self.push = push
        self._route = None if route is None else Route(route)
        self.scope = RequestScope(vreq, t0, deadline, seq)
        self.rid = vreq.request_id
        self.attempt: Optional[Attempt] = None
        """The attempt running now (None before the first)."""
        self.procs = [OutputProcessor(deps.tokenizer, vreq.prompt_token_ids, p) for p in self.scope.choice_params]
        """One output processor per choice (n > 1: one prefill, n decoded sequences)."""
        self.timings = Timings()
        self.cached_tokens = 0
        self._want_lp = vreq.params.logprobs is not None
        self._t_first = 0.0
        self._last_tok = [0.0] * len(self.procs)

    @property
    def proc(self) -> OutputProcessor:
        """Choice 0's output processor (the only one when n = 1)."""
        return self.procs[0]

    @property
    def placement(self) -> Optional[Placement]:
        """Where the current attempt runs (None before the first)."""
        return self.attempt.placement if self.attempt is not None else None

    def streamed(self) -> int:
        """Output tokens the client has, over all choices."""
        return sum(len(p.token_ids) for p in self.procs)

    def done(self) -> bool:
        return all(p.finished for p in self.procs)

    def cancel(self) -> None:
        """Client cancel or deadline (any thread): stop every worker call; a queued request leaves the queue."""
        if self.scope.cancel() and self.deps.placer.admission is not None:
            self.deps.placer.admission.wake()

    def run(self) -> Iterator[FlowEvent]:
        ok = False
        try:
            yield from self._run()
            ok = True
            self.scope.finish()
        finally:
            if not ok:
                self.cancel()

    def _run(self) -> Iterator[FlowEvent]:
        placer, metrics = self.deps.placer, self.deps.metrics
        route = self._route or placer.route(self.scope)
        if route is Route.DECODE and self._route is None and metrics is not None:
            log.debug("request %s: prefilled on a decode worker (conditional disaggregation)", self.rid)
            metrics.inc_local_prefill()
        waited = False
        while True:
            try:
                if route is Route.PAIR:
                    yield from self._run_pair()
                else:
                    yield from self._run_whole(route, set(), self.deps.cfg.max_attempts)
                return
            except FlowError as e:
                empty = e.empty_pool
                if empty is None or self.streamed():
                    raise
                # a pool with no live worker: serve it whole elsewhere (slower, but served) ...
                whole = placer.fallback(empty) if route is Route.PAIR else None
                if whole is not None:
                    log.warning("request %s: %s; running it whole on a %s worker", self.rid, e.message, whole.pool)
                    if metrics is not None:
                        metrics.inc_degraded(e.fallback_reason or f"no_{empty.value}")
                    route = whole
                    continue
                # ... or wait, bounded, for the supervisor to bring the pool back
                if waited or not placer.wait_for_pool(self.scope, empty):
                    raise
                log.info("request %s: the %s pool is back; going on", self.rid, empty)
                waited = True

    def _attempt(self, placement: Placement) -> Attempt:
        self.attempt = Attempt(self.deps.placer, self.deps.calls, self.scope, placement)
        return self.attempt

    def _retry(self, e: FlowError, excluded: set[str], attempts_left: int, attempt_no: int) -> bool:
        """A failed attempt before any token: note it (a worker that looked gone leaves routing, and this
        request avoids it); True when another attempt should be made."""
        self.deps.placer.failed(e)
        if e.worker_id:
            excluded.add(e.worker_id)
        if recovery(e, self.scope, 0, attempts_left) is Recovery.FAIL:
            return False
        log.warning("request %s: attempt %d failed: %s", self.rid, attempt_no + 1, e.message)
        Tracing.event(self.scope.trace_span, "retry", {"pdserve.attempt": attempt_no + 1,
                                                       "pdserve.error": f"{e.code.name}: {e.message}"})
        return True

    # ---- output ------------------------------------------------------------------------------
    def _first_token(self, t_call: float, worker_queue_s: float, prefill_s: float, cached: int) -> None:
        now = time.monotonic()
        self._t_first = now
        self._last_tok = [now] * len(self.procs)
        self.cached_tokens = cached
        t = self.timings
        t.queue_s, t.prefill_s, t.ttft_s = (t_call - self.scope.t0) + worker_queue_s, prefill_s, now - self.scope.t0
        t.placement_s, t.worker_queue_s = max(0.0, t_call - self.scope.t0), max(0.0, worker_queue_s)
        if self.deps.metrics is not None:
            self.deps.metrics.observe_ttft(t.ttft_s)
            self.deps.metrics.observe_ttft_phases(t.phases())

    def _emit(self, index: int, token_ids: Sequence[int], wire_logprobs: Sequence[Any], finish_reason: str = "",
              always: bool = False, wire_prompt_logprobs: Sequence[Any] = ()) -> Optional[FlowEvent]:
        """Pass a worker's tokens for choice ``index`` through its output processor: the event to send (None:
        nothing new yet). The choice's last event has its finish reason; the request's last, usage and timings."""
        if not 0 <= index < len(self.procs):
            raise FlowError(grpc.StatusCode.UNAVAILABLE, f"request {self.rid}: a worker sent choice {index} of "
                                                         f"{len(self.procs)}")
        proc = self.procs[index]
        was_finished = proc.finished
        lps = logprobs_from_wire(wire_logprobs) if self._want_lp and wire_logprobs else None
        not_first = bool(proc.token_ids)
        delta = proc.process(list(token_ids), lps, finish_reason or None)
        now = time.monotonic()
        if token_ids and not was_finished:
            if not_first and self.deps.metrics is not None:
                self.deps.metrics.observe_itl(now - self._last_tok[index])
            # the request's first token counts from its TTFT stamp (TPOT's base too), not from this later clock
            # read: a request's ITLs then sum to its decode time exactly, however long the TTFT metrics took
            self._last_tok[index] = self._t_first if index == 0 and not not_first and self._t_first else now
        ev = FlowEvent(self.rid, delta.token_ids, delta.text, delta.logprobs, index=index)
        if index == 0 and token_ids and not not_first and self.scope.choice_params[0].prompt_logprobs is not None:
            ev.prompt_logprobs = [None, *logprobs_from_wire(wire_prompt_logprobs)]
            always = True  # the event carries them even when its token completes no text yet
        if proc.finished and not was_finished:
            ev.finish_reason = proc.finish_reason
            ev.stop_reason = proc.stop_reason
            if self.done():
                t = self.timings
                t.total_s, t.decode_s = now - self.scope.t0, now - self._t_first
                ev.usage = Usage(prompt_tokens=self.scope.num_prompt_tokens, completion_tokens=self.streamed(),
                                 cached_tokens=self.cached_tokens)
                ev.timings = t
            return ev
        return ev if (always or ev.token_ids or ev.text) else None

    # ---- pair: prefill on P, decode on D --------------------------------------------------------------
    def _run_pair(self) -> Iterator[FlowEvent]:
        """Reserve + prefill until the first token, retrying another pair on retriable failures; then decode
        (migrating to another decode worker, whole, if D is lost mid-stream)."""
        cfg, placer, scope = self.deps.cfg, self.deps.placer, self.scope
        excluded: set[str] = set()
        for attempt_no in range(cfg.max_attempts):
            left = cfg.max_attempts - attempt_no - 1
            try:
                placement = placer.place_pair(scope, excluded)
            except FlowError as e:
                if not self._retry(e, excluded, left, attempt_no):
                    raise
                continue
            with self._attempt(placement) as at:
                try:
                    p_stream, ft, t_call = self._prefill(at)
                except FlowError as e:
                    if not self._retry(e, excluded, left, attempt_no):
                        raise
                    at.abort()
                    continue
                lost = yield from self._decode(at, p_stream, ft, t_call)
            if lost is not None:  # another decode worker (D too, when only the KV transfer failed) prefills
                yield from self._run_whole(Route.DECODE, lost, cfg.max_attempts - 1)  # prompt + outputs, goes on
            return
        raise FlowError(grpc.StatusCode.UNAVAILABLE, f"request {self.rid}: no attempt made")

    def _prefill(self, at: Attempt) -> tuple[Any, worker_pb2.FirstToken, float]:
        """``Prefill`` on the pair's P until its first token (FlowError naming P if it fails)."""
        pl, scope = at.placement, self.scope
        p = pl.prefill
        t_call = time.monotonic()
        p_stream = at.track(self.deps.calls.prefill(scope, pl))
        ev = self._next_prefill_event(p_stream, p.worker_id)
        if ev.HasField("prefix_fetch"):  # P fetches the prompt prefix D holds: D sends it, then P goes on
            d = pl.decode
            try:
                self.deps.calls.send_prefix(scope, pl, ev.prefix_fetch)
            except grpc.RpcError as e:  # D cannot serve its own reservation: the pair cannot go on, another may
                err = scope.rpc_error(e, f"prefix send on {d.worker_id}", d.worker_id)
                if e.code() == grpc.StatusCode.UNIMPLEMENTED:  # an older D, mid-upgrade: retry, never fetching from it
                    self.deps.calls.lacks_send_prefix(d.worker_id)
                    err = FlowError(grpc.StatusCode.UNAVAILABLE, err.message)
                elif err.code not in RETRIABLE and err.code != grpc.StatusCode.CANCELLED:
                    # D refused: it lost the reservation it just made (restarted, expired), so it is treated as lost
                    err = FlowError(grpc.StatusCode.UNAVAILABLE, err.message, d.worker_id)
                raise err from None
            ev = self._next_prefill_event(p_stream, p.worker_id)
        if not ev.HasField("first_token"):
            raise FlowError(grpc.StatusCode.UNAVAILABLE, f"request {self.rid}: prefill worker {p.worker_id} "
                                                         f"sent {ev.WhichOneof('event')} first", p.worker_id)
        return p_stream, ev.first_token, t_call

    def _next_prefill_event(self, p_stream: Any, pid: str) -> worker_pb2.PrefillEvent:
        try:
            return next(p_stream)
        except grpc.RpcError as e:
            raise self.scope.rpc_error(e, f"prefill on {pid}", pid) from None
        except StopIteration:
            raise FlowError(grpc.StatusCode.UNAVAILABLE,
                            f"request {self.rid}: prefill worker {pid} sent no first token", pid) from None

    def _decode(self, at: Attempt, p_stream: Any, ft: worker_pb2.FirstToken,
                t_call: float) -> Generator[FlowEvent, None, Optional[set[str]]]:
        """The first token, then ``Decode`` on D while the transfer watch reads P's TransferDone. Returns None when
        the request is done, or the workers to avoid when it should go on whole on a decode worker: {D} when D
        was lost mid-stream, none when only the KV transfer failed (D is fine and may prefill it itself)."""
        cfg, placer, scope, rid = self.deps.cfg, self.deps.placer, self.scope, self.rid
        self._first_token(t_call, ft.queue_s, ft.prefill_s, ft.num_cached_tokens)
        ev = self._emit(0, [ft.token_id], [ft.logprob] if ft.HasField("logprob") else [], always=True,
                        wire_prompt_logprobs=ft.prompt_logprobs)
        if self.done():  # a stop string in the very first token: D is not needed
            at.abort()
            yield ev
            return None
        yield ev

        pl = at.placement
        d, pid = pl.decode, pl.prefill.worker_id

        def transfer_error(e: Optional[grpc.RpcError], why: str) -> FlowError:
            if e is not None:
                return scope.rpc_error(e, f"KV transfer from {pid}")
            return FlowError(grpc.StatusCode.UNAVAILABLE, f"request {rid}: KV transfer from {pid}: {why}")

        watch = TransferWatch(p_stream, rid, lambda: at.release(Hold.PREFILL), transfer_error,
                              on_ok=lambda: placer.pair_result(pid, d.worker_id, True))
        d_stream = at.track(self.deps.calls.decode(scope, pl, ft))
        watch.guard(d_stream)

        def transfer_time() -> None:
            if watch.done():
                self.timings.kv_transfer_s = watch.kv_transfer_s or 0.0  # the last event's timings object

        def transfer_failed(err: FlowError) -> set[str]:
            """The KV did not reach D (store away, pair broken, P lost): D resumes the request itself."""
            placer.pair_result(pid, d.worker_id, False)
            if recovery(err, scope, self.streamed(), cfg.max_attempts - 1) is not Recovery.MIGRATE:
                raise err
            log.warning("request %s: KV transfer %s -> %s failed after %d tokens; resuming whole on a decode "
                        "worker: %s", rid, pid, d.worker_id, self.streamed(), err.message)
            if self.deps.metrics is not None:
                self.deps.metrics.inc_degraded("kv_transfer_failed")
            at.abort()
            return set()

        try:
            if (yield from self._consume(d_stream, at, transfer_time)):
                return None
        except grpc.RpcError as e:
            if watch.error is not None:
                return transfer_failed(watch.error)
            if e.code() == grpc.StatusCode.ABORTED:  # D's receive failed: the transfer's fault, not D's
                return transfer_failed(FlowError(grpc.StatusCode.UNAVAILABLE,
                                                 f"request {rid}: KV transfer from {pid} to {d.worker_id} failed: "
                                                 f"{e.details()}"))
            err = scope.rpc_error(e, f"decode on {d.worker_id}", d.worker_id)
            placer.failed(err)
            if recovery(err, scope, self.streamed(), cfg.max_attempts - 1) is not Recovery.MIGRATE:
                raise err from None
            log.warning("request %s: decode on %s failed after %d tokens, resuming on another decode worker: %s",
                        rid, d.worker_id, self.streamed(), err.message)
            if self.deps.metrics is not None:
                self.deps.metrics.inc_migration()
            Tracing.event(self.scope.trace_span, "migration", {"pdserve.from_worker": d.worker_id,
                                                               "pdserve.streamed_tokens": self.streamed()})
            at.abort()
            return {d.worker_id}
        if watch.error is not None:
            return transfer_failed(watch.error)
        raise FlowError(grpc.StatusCode.UNAVAILABLE, f"request {rid}: decode stream from {d.worker_id} ended "
                                                  f"without a finish reason")

    def _consume(self, stream: Any, at: Attempt, on_done: Optional[Callable[[], None]] = None,
                 first_chunk: Optional[Callable[[Any], None]] = None) -> Generator[Any, None, bool]:
        """A worker's chunks as events until every choice finished (True), or the stream ended first (False).
        A stop string ends its choice: the last open one ends the request (the attempt is aborted: its calls
        cancelled, its workers drop the request); another only has that choice aborted on the worker, and the
        rest go on. Pushed (``push``, a stream that can ``poll``): yields ``Wait`` when no chunk is queued and
        ``HANDOFF`` before anything that may block (``router.flow_pump``), so a stream's reader thread may run
        it between two chunks."""
        push = self.push and hasattr(stream, "poll")
        it = iter(stream)
        while True:
            if push:
                chunk = stream.poll()
                if chunk is None:
                    yield Wait(stream)
                    continue
                if chunk is NOT_PLAIN:  # a status, an error or the last chunk: may block, may end the stream
                    yield HANDOFF
                    chunk = next(it, None)
            else:
                chunk = next(it, None)
            if chunk is None:
                return False
            if first_chunk is not None:
                try:
                    first_chunk(chunk)
                except Exception:
                    if push:
                        yield HANDOFF  # the flow's end aborts its workers: not on a stream's reader
                    raise
            if not chunk.token_ids and not chunk.finish_reason:
                continue  # the "KV arrived, decoding" marker
            i = chunk.index
            was = 0 <= i < len(self.procs) and self.procs[i].finished
            try:
                ev = self._emit(i, chunk.token_ids, chunk.logprobs, chunk.finish_reason,
                                wire_prompt_logprobs=chunk.prompt_logprobs)
            except Exception:
                if push:
                    yield HANDOFF  # the flow's end aborts its workers: not on a stream's reader
                raise
            stopped_here = self.procs[i].finished and not was and not chunk.finish_reason
            if self.done():
                if push:
                    yield HANDOFF
                if on_done is not None:
                    on_done()
                if stopped_here:  # stopped by a stop string: the worker would go on
                    at.abort()
                if ev is not None:
                    yield ev
                return True
            if stopped_here:
                if push:
                    yield HANDOFF
                at.abort_choice(i)
            if ev is not None:
                yield ev

    # ---- whole requests on one worker: colocated mode, local prefill, migration -------------------------
    def _run_whole(self, route: Route, excluded: set[str], attempts: int) -> Iterator[FlowEvent]:
        """Run the request on one worker of ``route``'s pool (its colocated ``Generate``). Every attempt sends the
        tokens the client already has as ``resume_token_ids``, so a worker lost mid-stream is replaced by
        another that prefills prompt + outputs and goes on where the stream stopped (migration); a
        failure before any token is a plain retry (no abort: the worker's stream already broke)."""
        placer, scope, pool = self.deps.placer, self.scope, route.pool
        waited = False
        for attempt_no in range(attempts):
            try:
                placement = placer.place_whole(scope, pool, excluded)
            except FlowError as e:
                # a migration (or retry) whose pool has no other live worker yet: wait, bounded, for the
                # supervisor's replacement instead of failing a request that is half streamed
                if e.empty_pool or not excluded or waited or not placer.wait_for_pool(scope, pool,
                                                                                      frozenset(excluded)):
                    raise
                waited = True
                placement = placer.place_whole(scope, pool, excluded)
            with self._attempt(placement) as at:
                w = placement.decode
                t_call = time.monotonic()
                resume = self.proc.token_ids if scope.n == 1 else []  # several choices never migrate (recovery)
                stream = at.track(self.deps.calls.generate(scope, placement, resume))

                def first(chunk: Any) -> None:
                    if not self.timings.ttft_s:
                        self._first_token(t_call, chunk.queue_s, chunk.prefill_s, chunk.num_cached_tokens)

                try:
                    if (yield from self._consume(stream, at, first_chunk=first)):
                        return
                except grpc.RpcError as e:
                    err = scope.rpc_error(e, f"generate on {w.worker_id}", w.worker_id)
                    placer.failed(err)
                    move = recovery(err, scope, self.streamed(), attempts - attempt_no - 1)
                    if move is Recovery.FAIL:
                        raise err from None
                    excluded.add(w.worker_id)
                    log.warning("request %s: attempt %d on %s failed after %d tokens, %s: %s", self.rid,
                                attempt_no + 1, w.worker_id, self.streamed(), move.value, err.message)
                    if move is Recovery.MIGRATE and self.deps.metrics is not None:
                        self.deps.metrics.inc_migration()
                    Tracing.event(self.scope.trace_span, move.value, {"pdserve.from_worker": w.worker_id,
                                                                      "pdserve.streamed_tokens": self.streamed()})
                    continue
                raise FlowError(grpc.StatusCode.UNAVAILABLE,
                                f"request {self.rid}: stream from {w.worker_id} ended without a finish reason")
