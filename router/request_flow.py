"""One request through the disaggregated path: reserve on D, prefill on P, decode on D.

Lifecycle: the router servicer builds ``DisaggregatedFlow(deps, vreq, t0)`` for a
validated request and iterates ``run()``, which yields the client's
``GenerateResponse``s:
1. pick a decode worker D (free blocks, load) and ``Reserve`` the prompt's blocks there
   (D posts its KV receive before any byte is sent); pick a prefill worker P (queued tokens).
   When no decode worker has the blocks free, the request waits in the router's
   ``AdmissionQueue`` (FIFO, woken as requests finish, backoff retries) up to
   ``queue_timeout_s``; a prompt larger than every decode worker's whole KV fails at once;
2. ``Prefill`` on P -> the first token, streamed to the client at once (TTFT);
   a failure before this point retries on another pair (``max_attempts``);
3. ``Decode`` on D at once (D starts when the KV has landed) streams the rest, while a
   ``TransferWatch`` reads P's ``TransferDone`` (or the transfer's failure, which cancels
   the decode call) on its own thread;
4. every token goes through one ``OutputProcessor`` (text deltas, stop strings: a stop
   string finishes the stream and aborts D); the last response carries usage and timings.
``cancel()`` (client cancel or deadline, from a gRPC callback thread) cancels the live
worker calls; on any abnormal end ``run()`` sends Abort to both workers so they free
their blocks. Failures end with ``FlowError`` (a gRPC status and a message with the
request id), never a hang: every worker call has a deadline.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Iterator, Optional

import grpc

from engine.detokenizer import OutputProcessor
from proto import pdserve_pb2, worker_pb2
from proto.convert import logprob_from_proto, logprobs_to_proto, params_to_wire
from proto.worker_pb2 import WorkerInfo
from router.admission import AdmissionQueue, QueueStop
from router.clients import WorkerClients
from router.config import RouterConfig
from router.prefix_index import PrefixIndex, prompt_block_hashes
from router.selection import WorkerSelector
from router.transfer_watch import TransferWatch
from router.validation import ValidatedRequest
from router.worker_source import WorkerSource

log = logging.getLogger(__name__)

# Worker failures worth another worker pair (only before the client saw a token).
_RETRIABLE = (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED)
# Backoff between reservation retries while queued; capacity freed by this router wakes the head sooner.
_FIRST_BACKOFF_S = 0.01
_MAX_BACKOFF_S = 0.25


class FlowError(Exception):
    """The request ends with this gRPC status."""

    def __init__(self, code: grpc.StatusCode, message: str, worker_id: str = "", final: bool = False) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.worker_id = worker_id
        """The worker whose call failed ("" when none did): a retry avoids it."""
        self.final = final
        """No other worker pair would do better (queue timeout, a prompt no decode worker can ever hold)."""


@dataclass
class FlowDeps:
    """What a flow uses from its router (shared by all requests)."""

    cfg: RouterConfig
    source: WorkerSource
    selector: WorkerSelector
    clients: WorkerClients
    tokenizer: Any
    metrics: Any = None
    admission: Optional[AdmissionQueue] = None
    """The router's wait queue for KV capacity; None: fail at once when no decode worker has room."""
    prefixes: Optional[PrefixIndex] = None
    """Which worker was sent which prompt prefix (prefix-aware routing); None: route by load only."""


class DisaggregatedFlow:
    """Drives one request (see module docstring)."""

    def __init__(self, deps: FlowDeps, vreq: ValidatedRequest, t0: float, deadline: float) -> None:
        self.deps = deps
        self.req = vreq
        self.rid = vreq.request_id
        self.t0 = t0
        self.deadline = deadline
        self._lock = threading.Lock()
        self._calls: list[Any] = []
        self._cancelled = False
        self._succeeded = False
        self.decode_worker: Optional[WorkerInfo] = None
        self.prefill_worker: Optional[WorkerInfo] = None
        self._d_held = False
        self._p_held = False
        self._hashes_by_bs: dict[int, list[int]] = {}  # the prompt's prefix-cache block hashes, by block size
        # arrival order in the admission queue, fixed now so racing requests queue as they arrived
        self._seq = deps.admission.next_seq() if deps.admission is not None else 0

    # ---- cancellation (any thread) ---------------------------------------------------
    def cancel(self) -> None:
        with self._lock:
            if self._succeeded:
                # gRPC runs this callback after a normal end too: the prefill stream may still be
                # about to deliver TransferDone, and cancelling it would abort a finished transfer
                return
            self._cancelled = True
            calls = list(self._calls)
        for c in calls:
            c.cancel()
        if self.deps.admission is not None:
            self.deps.admission.wake()  # a queued request leaves the queue at once

    def _track(self, call: Any) -> Any:
        with self._lock:
            self._calls.append(call)
            cancelled = self._cancelled
        if cancelled:
            call.cancel()
        return call

    def _remaining(self, cap: float) -> float:
        left = self.deadline - time.monotonic()
        if left <= 0:
            raise FlowError(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {self.rid}: deadline exceeded")
        return min(cap, left)

    def _rpc_error(self, e: grpc.RpcError, what: str, worker_id: str = "") -> FlowError:
        if self._cancelled:
            return FlowError(grpc.StatusCode.CANCELLED, f"request {self.rid} cancelled")
        code = e.code() if hasattr(e, "code") else grpc.StatusCode.UNKNOWN
        details = e.details() if hasattr(e, "details") else str(e)
        if code == grpc.StatusCode.DEADLINE_EXCEEDED and time.monotonic() >= self.deadline:
            return FlowError(code, f"request {self.rid}: deadline exceeded during {what}")
        if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN):
            code = grpc.StatusCode.UNAVAILABLE  # the worker went away mid-call
        return FlowError(code, f"request {self.rid}: {what} failed: {details}", worker_id)

    # ---- worker choice ---------------------------------------------------------------
    def _prefix_hashes(self, block_size: int) -> list[int]:
        if block_size not in self._hashes_by_bs:
            self._hashes_by_bs[block_size] = prompt_block_hashes(self.req.prompt_token_ids, block_size)
        return self._hashes_by_bs[block_size]

    def _route_by_prefix(self, ranked: list[WorkerInfo]) -> list[WorkerInfo]:
        """Prefix-aware routing over ``ranked`` (best first by load); unchanged when it is off."""
        deps = self.deps
        if deps.prefixes is None or not deps.cfg.prefix_aware_routing or len(ranked) < 2:
            return ranked
        matches = {w.worker_id: deps.prefixes.match(w.worker_id, self._prefix_hashes(w.block_size)) for w in ranked}
        return deps.selector.prefer_cached(ranked, matches, deps.cfg.prefix_balance_tokens)

    def _record_prefix(self, w: WorkerInfo) -> None:
        """``w`` is about to prefill this prompt, so its prefix cache will hold the prompt's blocks."""
        if self.deps.prefixes is not None and self.deps.cfg.prefix_aware_routing:
            self.deps.prefixes.record(w.worker_id, self._prefix_hashes(w.block_size))

    def _reserve(self, excluded: set[str]) -> worker_pb2.ReserveResponse:
        """Reserve the prompt's blocks on a decode worker, waiting in the admission queue while none has room."""
        adm = self.deps.admission
        if adm is None or not adm.has_waiters():  # nobody ahead: try at once
            resp = self._try_reserve(excluded)
            if resp is not None:
                return resp
            if adm is None:
                raise FlowError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"request {self.rid}: no decode worker can "
                                                                    f"hold {len(self.req.prompt_token_ids)} prompt tokens")
        ticket = adm.enter(self._seq, self.rid)
        log.info("request %s: queued for decode KV capacity (%d waiting)", self.rid, len(adm))
        until = min(ticket.entered_at + self.deps.cfg.queue_timeout_s, self.deadline)
        backoff = _FIRST_BACKOFF_S
        try:
            while True:
                adm.wait_turn(ticket, until, self._stop_reason)
                epoch = adm.epoch
                resp = self._try_reserve(excluded)
                if resp is not None:
                    log.info("request %s: left the queue after %.3f s", self.rid, time.monotonic() - ticket.entered_at)
                    return resp
                adm.wait_capacity(epoch, backoff, until, self._stop_reason)
                backoff = min(2 * backoff, _MAX_BACKOFF_S)
        except QueueStop as e:
            raise self._queue_error(e.reason, time.monotonic() - ticket.entered_at) from None
        finally:
            adm.leave(ticket)

    def _stop_reason(self) -> Optional[str]:
        return "cancelled" if self._cancelled else None

    def _queue_error(self, reason: str, waited: float) -> FlowError:
        if reason == "cancelled":
            return FlowError(grpc.StatusCode.CANCELLED, f"request {self.rid} cancelled after {waited:.2f} s "
                                                        f"queued for decode KV capacity", final=True)
        if time.monotonic() >= self.deadline:
            return FlowError(grpc.StatusCode.DEADLINE_EXCEEDED, f"request {self.rid}: deadline exceeded after "
                                                                f"{waited:.2f} s queued for decode KV capacity",
                             final=True)
        return FlowError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                         f"request {self.rid}: waited {waited:.2f} s in the router queue for decode KV capacity "
                         f"(queue_timeout_s={self.deps.cfg.queue_timeout_s:g}); no decode worker freed "
                         f"{len(self.req.prompt_token_ids)} prompt tokens' blocks", final=True)

    def _try_reserve(self, excluded: set[str]) -> Optional[worker_pb2.ReserveResponse]:
        """One pass over the decode workers: their reservation, or None if every reachable one is full."""
        deps, n = self.deps, len(self.req.prompt_token_ids)
        decodes = [w for w in deps.source.list("decode") if w.worker_id not in excluded]
        ready = [w for w in decodes if w.ready]
        if not ready:
            raise FlowError(grpc.StatusCode.UNAVAILABLE, f"request {self.rid}: no ready decode worker")
        needed = -(-n // max(1, ready[0].block_size or 16))
        totals = [w.num_total_blocks for w in ready]
        if all(t > 0 for t in totals) and needed > max(totals):  # waiting would never help
            raise FlowError(grpc.StatusCode.RESOURCE_EXHAUSTED,
                            f"request {self.rid}: prompt of {n} tokens needs {needed} KV blocks, more than any "
                            f"decode worker holds in total (largest: {max(totals)})", final=True)
        ranked = deps.selector.ranked_decode(ready, needed)
        prefills = [w for w in deps.source.list("prefill") if w.worker_id not in excluded]
        ranked_p = self._route_by_prefix(deps.selector.ranked_prefill(prefills))
        if not ranked_p:
            raise FlowError(grpc.StatusCode.UNAVAILABLE, f"request {self.rid}: no ready prefill worker")
        p = ranked_p[0]
        exhausted = 0
        for d in ranked:
            # count the request against d before the call, so concurrent requests rank d as busier now
            deps.selector.acquire(d.worker_id)
            try:
                resp = deps.clients.decode(d.grpc_address).Reserve(
                    worker_pb2.ReserveRequest(request_id=self.rid, prompt_token_ids=self.req.prompt_token_ids,
                                              params=params_to_wire(self.req.params), prefill_kv_name=p.kv_name,
                                              kv_timeout_s=self._remaining(deps.cfg.first_token_timeout_s
                                                                           + deps.cfg.transfer_timeout_s)),
                    timeout=self._remaining(deps.cfg.reserve_timeout_s))
            except grpc.RpcError as e:
                deps.selector.release(d.worker_id)
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                    exhausted += 1
                elif e.code() != grpc.StatusCode.UNAVAILABLE:
                    raise self._rpc_error(e, f"reserve on decode worker {d.worker_id}") from None
                log.debug("request %s: decode worker %s refused reserve: %s", self.rid, d.worker_id, e.details())
                continue
            self.decode_worker, self.prefill_worker = d, p
            self._d_held = True
            return resp
        if exhausted:
            return None
        raise FlowError(grpc.StatusCode.UNAVAILABLE, f"request {self.rid}: no decode worker reachable")

    def _release_workers(self) -> None:
        if self._d_held and self.decode_worker is not None:
            self.deps.selector.release(self.decode_worker.worker_id)
            self._d_held = False
            if self.deps.admission is not None:
                self.deps.admission.capacity_freed()  # its blocks are free (or being freed) on the decode worker
        self._release_prefill()

    def _release_prefill(self) -> None:
        with self._lock:  # the transfer watch's thread and the flow's both call this
            if not (self._p_held and self.prefill_worker is not None):
                return
            self._p_held = False
            wid = self.prefill_worker.worker_id
        self.deps.selector.release(wid, len(self.req.prompt_token_ids))

    def _abort_workers(self) -> None:
        """Best effort: both workers drop the request and free its blocks."""
        msg = worker_pb2.AbortRequest(request_id=self.rid)
        for w, stub in ((self.decode_worker, self.deps.clients.decode),
                        (self.prefill_worker, self.deps.clients.prefill)):
            if w is None:
                continue
            try:
                stub(w.grpc_address).Abort(msg, timeout=1.0)
            except grpc.RpcError as e:
                log.info("request %s: abort on %s failed: %s", self.rid, w.worker_id, e.code())

    # ---- the request -------------------------------------------------------------------
    def _start(self) -> tuple[Any, worker_pb2.FirstToken, float]:
        """Reserve + prefill until the first token, retrying other workers on retriable failures."""
        excluded: set[str] = set()
        last: Optional[FlowError] = None
        cfg = self.deps.cfg
        for attempt in range(cfg.max_attempts):
            p_stream = None
            try:
                resv = self._reserve(excluded)
                p = self.prefill_worker
                self._record_prefix(p)
                self.deps.selector.acquire(p.worker_id, len(self.req.prompt_token_ids))
                self._p_held = True
                t_call = time.monotonic()
                p_stream = self._track(self.deps.clients.prefill(p.grpc_address).Prefill(
                    worker_pb2.PrefillRequest(
                        request_id=self.rid, prompt_token_ids=self.req.prompt_token_ids,
                        params=params_to_wire(self.req.params), dest_kv_name=resv.kv_name,
                        dest_block_ids=resv.block_ids, dest_block_size=resv.block_size),
                    timeout=self._remaining(cfg.first_token_timeout_s + cfg.transfer_timeout_s)))
                try:
                    ev = next(p_stream)
                except grpc.RpcError as e:
                    raise self._rpc_error(e, f"prefill on {p.worker_id}", p.worker_id) from None
                except StopIteration:
                    raise FlowError(grpc.StatusCode.INTERNAL,
                                    f"request {self.rid}: prefill worker {p.worker_id} sent no first token") from None
                if not ev.HasField("first_token"):
                    raise FlowError(grpc.StatusCode.INTERNAL,
                                    f"request {self.rid}: prefill worker {p.worker_id} sent {ev.WhichOneof('event')} first")
                return p_stream, ev.first_token, t_call
            except FlowError as e:
                last = e
                if p_stream is not None:
                    p_stream.cancel()
                self._abort_workers()
                if e.worker_id:
                    excluded.add(e.worker_id)
                self._release_workers()
                self.decode_worker = self.prefill_worker = None
                if e.code not in _RETRIABLE or e.final or self._cancelled:
                    raise
                log.warning("request %s: attempt %d failed: %s", self.rid, attempt + 1, e.message)
        raise last or FlowError(grpc.StatusCode.UNAVAILABLE, f"request {self.rid}: no attempt made")

    def run(self) -> Iterator[pdserve_pb2.GenerateResponse]:
        ok = False
        try:
            yield from self._run()
            ok = True
            with self._lock:
                self._succeeded = True
        finally:
            if not ok:
                self.cancel()
                self._abort_workers()
            self._release_workers()

    def _run(self) -> Iterator[pdserve_pb2.GenerateResponse]:
        deps, cfg, rid = self.deps, self.deps.cfg, self.rid
        params = self.req.params
        want_lp = params.logprobs is not None
        proc = OutputProcessor(deps.tokenizer, self.req.prompt_token_ids, params)
        p_stream, ft, t_call = self._start()

        t_first = time.monotonic()
        timings = pdserve_pb2.Timings(queue_s=(t_call - self.t0) + ft.queue_s, prefill_s=ft.prefill_s,
                                      ttft_s=t_first - self.t0)
        first_lp = logprob_from_proto(ft.logprob) if ft.HasField("logprob") else None
        delta = proc.process([ft.token_id], [first_lp] if want_lp and first_lp is not None else None)
        if deps.metrics is not None:
            deps.metrics.observe_ttft(timings.ttft_s)
        last_tok = t_first
        if proc.finished:  # a stop string in the very first token: D is not needed
            p_stream.cancel()
            self._abort_workers()
            yield self._final(delta, proc, timings, ft, t_first)
            return
        yield self._response(delta)

        pid = self.prefill_worker.worker_id

        def transfer_error(e: Optional[grpc.RpcError], why: str) -> FlowError:
            if e is not None:
                return self._rpc_error(e, f"KV transfer from {pid}")
            return FlowError(grpc.StatusCode.INTERNAL, f"request {rid}: KV transfer from {pid}: {why}")

        watch = TransferWatch(p_stream, rid, self._release_prefill, transfer_error)
        d = self.decode_worker
        first_msg = worker_pb2.DecodeRequest(request_id=rid, first_token_id=ft.token_id)
        if ft.HasField("logprob"):
            first_msg.first_logprob.CopyFrom(ft.logprob)
        d_stream = self._track(deps.clients.decode(d.grpc_address).Decode(
            first_msg, timeout=self._remaining(cfg.request_timeout_s)))
        watch.guard(d_stream)
        try:
            for chunk in d_stream:
                if not chunk.token_ids and not chunk.finish_reason:
                    continue  # the "KV arrived, decoding" marker
                lps = [logprob_from_proto(m) for m in chunk.logprobs] if want_lp and chunk.logprobs else None
                delta = proc.process(list(chunk.token_ids), lps, chunk.finish_reason or None)
                now = time.monotonic()
                if deps.metrics is not None and chunk.token_ids:
                    deps.metrics.observe_itl(now - last_tok)
                last_tok = now
                if proc.finished:
                    if not chunk.finish_reason:  # stopped by a stop string: D would go on
                        d_stream.cancel()
                        self._abort_workers()
                    if watch.done():
                        timings.kv_transfer_s = watch.kv_transfer_s or 0.0
                    yield self._final(delta, proc, timings, ft, t_first)
                    return
                if delta.token_ids or delta.text:
                    yield self._response(delta)
        except grpc.RpcError as e:
            if watch.error is not None:
                raise watch.error from None
            err = self._rpc_error(e, f"decode on {d.worker_id}", d.worker_id)
            if err.code not in _RETRIABLE or self._cancelled or cfg.max_attempts < 2:
                raise err from None
            # migration: the decode worker is gone mid-stream; another one prefills prompt + the
            # tokens already streamed and goes on from there (no prefill worker, no KV transfer)
            log.warning("request %s: decode on %s failed after %d tokens, resuming on another decode worker: %s",
                        rid, d.worker_id, len(proc.token_ids), err.message)
            if deps.metrics is not None:
                deps.metrics.inc_migration()
            self._abort_workers()
            self._release_workers()
            self.prefill_worker = None
            yield from self._run_whole("decode", proc, timings, {d.worker_id}, cfg.max_attempts - 1, t_first,
                                       ft.num_cached_tokens)
            return
        if watch.error is not None:
            raise watch.error
        raise FlowError(grpc.StatusCode.INTERNAL, f"request {rid}: decode stream from {d.worker_id} ended "
                                                  f"without a finish reason")

    # ---- whole requests on one worker: colocated mode, local prefill, migration ----------------
    def _pick_whole(self, pool: str, excluded: set[str]) -> WorkerInfo:
        ws = [w for w in self.deps.source.list(pool) if w.ready and w.worker_id not in excluded]
        if not ws:
            raise FlowError(grpc.StatusCode.UNAVAILABLE, f"request {self.rid}: no ready {pool} worker")
        sel = self.deps.selector
        ranked = sorted(ws, key=lambda w: (w.num_running + w.num_waiting + sel.in_flight(w.worker_id),
                                           w.queued_prompt_tokens, w.worker_id))
        return self._route_by_prefix(ranked)[0]

    def _run_whole(self, pool: str, proc: OutputProcessor, timings: pdserve_pb2.Timings, excluded: set[str],
                   attempts: int, t_first: float = 0.0, cached: int = 0) -> Iterator[pdserve_pb2.GenerateResponse]:
        """Run the request on one worker of ``pool`` (its colocated ``Generate``), passing every chunk
        through ``proc``. Every attempt sends the output tokens the client already has as
        ``resume_token_ids``, so a worker lost mid-stream (UNAVAILABLE) is replaced by another that
        prefills prompt + outputs and goes on exactly where the stream stopped (migration); a failure
        before any token is a plain retry. ``timings.ttft_s`` set means the first token is out already."""
        deps, cfg = self.deps, self.deps.cfg
        want_lp = self.req.params.logprobs is not None
        for attempt in range(attempts):
            w = self._pick_whole(pool, excluded)
            self._record_prefix(w)
            self.decode_worker = w
            deps.selector.acquire(w.worker_id)
            self._d_held = True
            t_call = time.monotonic()
            stream = self._track(deps.clients.colocated(w.grpc_address).Generate(
                worker_pb2.ColocatedRequest(request_id=self.rid, prompt_token_ids=self.req.prompt_token_ids,
                                            params=params_to_wire(self.req.params),
                                            resume_token_ids=proc.token_ids),
                timeout=self._remaining(cfg.request_timeout_s)))
            try:
                for chunk in stream:
                    now = time.monotonic()
                    if not timings.ttft_s:
                        t_first = now
                        cached = chunk.num_cached_tokens
                        timings.queue_s = (t_call - self.t0) + chunk.queue_s
                        timings.prefill_s = chunk.prefill_s
                        timings.ttft_s = now - self.t0
                        if deps.metrics is not None:
                            deps.metrics.observe_ttft(timings.ttft_s)
                    lps = [logprob_from_proto(m) for m in chunk.logprobs] if want_lp and chunk.logprobs else None
                    delta = proc.process(list(chunk.token_ids), lps, chunk.finish_reason or None)
                    if proc.finished:
                        if not chunk.finish_reason:
                            stream.cancel()
                            self._abort_workers()
                        timings.total_s = now - self.t0
                        timings.decode_s = now - t_first
                        resp = self._response(delta)
                        resp.finish_reason = proc.finish_reason or ""
                        resp.usage.CopyFrom(pdserve_pb2.Usage(prompt_tokens=len(self.req.prompt_token_ids),
                                                              completion_tokens=len(proc.token_ids),
                                                              cached_tokens=cached))
                        resp.timings.CopyFrom(timings)
                        yield resp
                        return
                    if delta.token_ids or delta.text:
                        yield self._response(delta)
            except grpc.RpcError as e:
                err = self._rpc_error(e, f"generate on {w.worker_id}", w.worker_id)
                self._release_workers()
                if err.code not in _RETRIABLE or self._cancelled or attempt + 1 == attempts:
                    raise err from None
                excluded.add(w.worker_id)
                log.warning("request %s: attempt %d on %s failed after %d tokens, %s: %s", self.rid, attempt + 1,
                            w.worker_id, len(proc.token_ids), "resuming elsewhere" if proc.token_ids else "retrying",
                            err.message)
                if proc.token_ids and deps.metrics is not None:
                    deps.metrics.inc_migration()
                continue
            raise FlowError(grpc.StatusCode.INTERNAL,
                            f"request {self.rid}: stream from {w.worker_id} ended without a finish reason")

    def _response(self, delta: Any) -> pdserve_pb2.GenerateResponse:
        return pdserve_pb2.GenerateResponse(request_id=self.rid, token_ids=delta.token_ids, text=delta.text,
                                            logprobs=logprobs_to_proto(delta.logprobs))

    def _final(self, delta: Any, proc: OutputProcessor, timings: pdserve_pb2.Timings,
               ft: worker_pb2.FirstToken, t_first: float) -> pdserve_pb2.GenerateResponse:
        now = time.monotonic()
        timings.total_s = now - self.t0
        timings.decode_s = now - t_first
        resp = self._response(delta)
        resp.finish_reason = proc.finish_reason or ""
        resp.usage.CopyFrom(pdserve_pb2.Usage(prompt_tokens=len(self.req.prompt_token_ids),
                                              completion_tokens=len(proc.token_ids),
                                              cached_tokens=ft.num_cached_tokens))
        resp.timings.CopyFrom(timings)
        return resp
