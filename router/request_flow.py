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
On any abnormal end ``run()`` aborts the request on its workers so they free their blocks, and
always releases the placement. Every worker call has a deadline, so nothing hangs.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator, Optional, Sequence

import grpc

from engine import OutputProcessor
from proto import worker_pb2
from router.config import RouterConfig
from router.events import FlowError, FlowEvent, Timings, Usage
from router.placement import PAIR, Placement, Placer, Recovery, recovery
from router.scope import RequestScope
from router.transfer_watch import TransferWatch
from router.validation import ValidatedRequest
from router.wire import logprobs_from_wire

log = logging.getLogger(__name__)


@dataclass
class FlowDeps:
    """What a flow uses from its router (shared by all requests)."""

    cfg: RouterConfig
    placer: Placer
    tokenizer: Any
    metrics: Any = None


class RequestFlow:
    """Drives one request (see module docstring)."""

    def __init__(self, deps: FlowDeps, vreq: ValidatedRequest, t0: float, deadline: float, seq: int = 0,
                 route: Optional[str] = None) -> None:
        """``route``: run it this way ("decode", "colocated": whole on a worker of that pool) instead of the
        placer's choice (a beam search step runs whole where its history is cached)."""
        self.deps = deps
        self._route = route
        self.scope = RequestScope(vreq, t0, deadline, seq)
        self.rid = vreq.request_id
        self.placement: Optional[Placement] = None
        """Where the current attempt runs (None between attempts)."""
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
        placer, ok = self.deps.placer, False
        try:
            yield from self._run()
            ok = True
            self.scope.finish()
        finally:
            if not ok:
                self.cancel()
                placer.abort(self.placement)
            placer.release(self.placement, self.scope)

    def _run(self) -> Iterator[FlowEvent]:
        placer, metrics = self.deps.placer, self.deps.metrics
        route = self._route or placer.route(self.scope)
        if route == "decode" and self._route is None and metrics is not None:
            log.debug("request %s: prefilled on a decode worker (conditional disaggregation)", self.rid)
            metrics.inc_local_prefill()
        waited = False
        while True:
            try:
                if route == PAIR:
                    yield from self._run_pair()
                else:
                    yield from self._run_whole(route, set(), self.deps.cfg.max_attempts)
                return
            except FlowError as e:
                if not e.degrade or self.streamed():
                    raise
                # a pool with no live worker: serve it whole elsewhere (slower, but served) ...
                pool = placer.fallback(e.degrade) if route == PAIR else None
                if pool is not None:
                    log.warning("request %s: %s; running it whole on a %s worker", self.rid, e.message, pool)
                    if metrics is not None:
                        metrics.inc_degraded(e.degrade)
                    route = pool
                    continue
                # ... or wait, bounded, for the supervisor to bring the pool back
                empty = e.degrade[len("no_"):]
                if waited or not placer.wait_for_pool(self.scope, empty):
                    raise
                log.info("request %s: the %s pool is back; going on", self.rid, empty)
                waited = True

    # ---- output ------------------------------------------------------------------------------
    def _first_token(self, t_call: float, worker_queue_s: float, prefill_s: float, cached: int) -> None:
        now = time.monotonic()
        self._t_first = now
        self._last_tok = [now] * len(self.procs)
        self.cached_tokens = cached
        t = self.timings
        t.queue_s, t.prefill_s, t.ttft_s = (t_call - self.scope.t0) + worker_queue_s, prefill_s, now - self.scope.t0
        if self.deps.metrics is not None:
            self.deps.metrics.observe_ttft(t.ttft_s)

    def _emit(self, index: int, token_ids: Sequence[int], wire_logprobs: Sequence[Any], finish_reason: str = "",
              always: bool = False) -> Optional[FlowEvent]:
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
            self._last_tok[index] = now
        ev = FlowEvent(self.rid, delta.token_ids, delta.text, delta.logprobs, index=index)
        if proc.finished and not was_finished:
            ev.finish_reason = proc.finish_reason
            if self.done():
                t = self.timings
                t.total_s, t.decode_s = now - self.scope.t0, now - self._t_first
                ev.usage = Usage(prompt_tokens=self.scope.num_prompt_tokens, completion_tokens=self.streamed(),
                                 cached_tokens=self.cached_tokens)
                ev.timings = t
            return ev
        return ev if (always or ev.token_ids or ev.text) else None

    # ---- pair: prefill on P, decode on D --------------------------------------------------------------
    def _start_pair(self) -> tuple[Any, worker_pb2.FirstToken, float]:
        """Reserve + prefill until the first token, retrying another pair on retriable failures."""
        cfg, placer, scope = self.deps.cfg, self.deps.placer, self.scope
        excluded: set[str] = set()
        for attempt in range(cfg.max_attempts):
            p_stream = None
            try:
                self.placement = pl = placer.place_pair(scope, excluded)
                p, resv = pl.prefill, pl.reservation
                t_call = time.monotonic()
                p_stream = scope.track(self.deps.placer.clients.prefill(p.grpc_address).Prefill(
                    worker_pb2.PrefillRequest(
                        request_id=pl.request_id, prompt_token_ids=scope.prompt_token_ids, params=scope.wire_params,
                        dest_kv_name=resv.kv_name, dest_block_ids=resv.block_ids, dest_block_size=resv.block_size),
                    timeout=scope.remaining(cfg.first_token_timeout_s + cfg.transfer_timeout_s)))
                try:
                    ev = next(p_stream)
                except grpc.RpcError as e:
                    raise scope.rpc_error(e, f"prefill on {p.worker_id}", p.worker_id) from None
                except StopIteration:
                    raise FlowError(grpc.StatusCode.UNAVAILABLE,
                                    f"request {self.rid}: prefill worker {p.worker_id} sent no first token",
                                    p.worker_id) from None
                if not ev.HasField("first_token"):
                    raise FlowError(grpc.StatusCode.UNAVAILABLE, f"request {self.rid}: prefill worker {p.worker_id} "
                                                                 f"sent {ev.WhichOneof('event')} first", p.worker_id)
                return p_stream, ev.first_token, t_call
            except FlowError as e:
                placer.failed(e)
                if p_stream is not None:
                    p_stream.cancel()
                placer.abort(self.placement)
                placer.release(self.placement, scope)
                self.placement = None
                if e.worker_id:
                    excluded.add(e.worker_id)
                if recovery(e, scope, 0, cfg.max_attempts - attempt - 1) is Recovery.FAIL:
                    raise
                log.warning("request %s: attempt %d failed: %s", self.rid, attempt + 1, e.message)
        raise FlowError(grpc.StatusCode.UNAVAILABLE, f"request {self.rid}: no attempt made")

    def _run_pair(self) -> Iterator[FlowEvent]:
        cfg, placer, scope, rid = self.deps.cfg, self.deps.placer, self.scope, self.rid
        p_stream, ft, t_call = self._start_pair()
        self._first_token(t_call, ft.queue_s, ft.prefill_s, ft.num_cached_tokens)
        ev = self._emit(0, [ft.token_id], [ft.logprob] if ft.HasField("logprob") else [], always=True)
        if self.done():  # a stop string in the very first token: D is not needed
            p_stream.cancel()
            placer.abort(self.placement)
            yield ev
            return
        yield ev

        pl = self.placement
        d, pid = pl.decode, pl.prefill.worker_id

        def transfer_error(e: Optional[grpc.RpcError], why: str) -> FlowError:
            if e is not None:
                return scope.rpc_error(e, f"KV transfer from {pid}")
            return FlowError(grpc.StatusCode.UNAVAILABLE, f"request {rid}: KV transfer from {pid}: {why}")

        watch = TransferWatch(p_stream, rid, lambda: placer.release(pl, scope, ("prefill",)), transfer_error)
        first_msg = worker_pb2.DecodeRequest(request_id=pl.request_id, first_token_id=ft.token_id,
                                             siblings=scope.sibling_wires)
        if ft.HasField("logprob"):
            first_msg.first_logprob.CopyFrom(ft.logprob)
        d_stream = scope.track(placer.clients.decode(d.grpc_address).Decode(
            first_msg, timeout=scope.remaining(cfg.request_timeout_s)))
        watch.guard(d_stream)

        def transfer_time() -> None:
            if watch.done():
                self.timings.kv_transfer_s = watch.kv_transfer_s or 0.0  # the last event's timings object

        try:
            if (yield from self._consume(d_stream, pl, transfer_time)):
                return
        except grpc.RpcError as e:
            if watch.error is not None:
                raise watch.error from None
            err = scope.rpc_error(e, f"decode on {d.worker_id}", d.worker_id)
            placer.failed(err)
            if recovery(err, scope, self.streamed(), cfg.max_attempts - 1) is not Recovery.MIGRATE:
                raise err from None
            log.warning("request %s: decode on %s failed after %d tokens, resuming on another decode worker: %s",
                        rid, d.worker_id, self.streamed(), err.message)
            if self.deps.metrics is not None:
                self.deps.metrics.inc_migration()
            placer.abort(pl)
            placer.release(pl, scope)
            self.placement = None
            yield from self._run_whole("decode", {d.worker_id}, cfg.max_attempts - 1)
            return
        if watch.error is not None:
            raise watch.error
        raise FlowError(grpc.StatusCode.UNAVAILABLE, f"request {rid}: decode stream from {d.worker_id} ended "
                                                  f"without a finish reason")

    def _consume(self, stream: Any, pl: Placement, on_done: Optional[Callable[[], None]] = None,
                 first_chunk: Optional[Callable[[Any], None]] = None) -> Generator[FlowEvent, None, bool]:
        """A worker's chunks as events until every choice finished (True), or the stream ended first (False).
        A stop string ends its choice: the last open one ends the request (the stream is cancelled and the
        workers abort it); another only has that choice aborted on the worker, and the rest go on."""
        placer = self.deps.placer
        for chunk in stream:
            if first_chunk is not None:
                first_chunk(chunk)
            if not chunk.token_ids and not chunk.finish_reason:
                continue  # the "KV arrived, decoding" marker
            i = chunk.index
            was = 0 <= i < len(self.procs) and self.procs[i].finished
            ev = self._emit(i, chunk.token_ids, chunk.logprobs, chunk.finish_reason)
            stopped_here = self.procs[i].finished and not was and not chunk.finish_reason
            if self.done():
                if on_done is not None:
                    on_done()
                if stopped_here:  # stopped by a stop string: the worker would go on
                    stream.cancel()
                    placer.abort(pl)
                if ev is not None:
                    yield ev
                return True
            if stopped_here:
                placer.abort_choice(pl, i)
            if ev is not None:
                yield ev
        return False

    # ---- whole requests on one worker: colocated mode, local prefill, migration -------------------------
    def _run_whole(self, pool: str, excluded: set[str], attempts: int) -> Iterator[FlowEvent]:
        """Run the request on one worker of ``pool`` (its colocated ``Generate``). Every attempt sends the
        tokens the client already has as ``resume_token_ids``, so a worker lost mid-stream is replaced by
        another that prefills prompt + outputs and goes on where the stream stopped (migration); a
        failure before any token is a plain retry."""
        cfg, placer, scope = self.deps.cfg, self.deps.placer, self.scope
        waited = False
        for attempt in range(attempts):
            try:
                self.placement = pl = placer.place_whole(scope, pool, excluded)
            except FlowError as e:
                # a migration (or retry) whose pool has no other live worker yet: wait, bounded, for the
                # supervisor's replacement instead of failing a request that is half streamed
                if e.degrade or not excluded or waited or not placer.wait_for_pool(scope, pool, frozenset(excluded)):
                    raise
                waited = True
                self.placement = pl = placer.place_whole(scope, pool, excluded)
            w = pl.decode
            t_call = time.monotonic()
            resume = self.proc.token_ids if scope.n == 1 else []  # several choices never migrate (recovery)
            stream = scope.track(placer.clients.colocated(w.grpc_address).Generate(
                worker_pb2.ColocatedRequest(request_id=pl.request_id, prompt_token_ids=scope.prompt_token_ids,
                                            params=scope.wire_params, resume_token_ids=resume,
                                            siblings=scope.sibling_wires),
                timeout=scope.remaining(cfg.request_timeout_s)))

            def first(chunk: Any) -> None:
                if not self.timings.ttft_s:
                    self._first_token(t_call, chunk.queue_s, chunk.prefill_s, chunk.num_cached_tokens)

            try:
                if (yield from self._consume(stream, pl, first_chunk=first)):
                    return
            except grpc.RpcError as e:
                err = scope.rpc_error(e, f"generate on {w.worker_id}", w.worker_id)
                placer.failed(err)
                placer.release(pl, scope)
                move = recovery(err, scope, self.streamed(), attempts - attempt - 1)
                if move is Recovery.FAIL:
                    raise err from None
                excluded.add(w.worker_id)
                log.warning("request %s: attempt %d on %s failed after %d tokens, %s: %s", self.rid, attempt + 1,
                            w.worker_id, self.streamed(), move.value, err.message)
                if move is Recovery.MIGRATE and self.deps.metrics is not None:
                    self.deps.metrics.inc_migration()
                continue
            raise FlowError(grpc.StatusCode.UNAVAILABLE,
                            f"request {self.rid}: stream from {w.worker_id} ended without a finish reason")
