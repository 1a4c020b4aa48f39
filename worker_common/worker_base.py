"""What every worker role shares: gRPC shell, engine, engine loop, KV endpoint, metrics, drain.

Lifecycle: ``Worker(cfg)`` builds nothing heavy; the role's ``__init__`` lists the
``RequestSet``s that will hold its requests (``self.request_sets``), each built on the
worker's ``RequestContext`` (``self.ctx``). ``start()`` = ``bind()`` (gRPC server up,
health NOT_SERVING) + ``load()`` (engine, kvtransfer endpoint, metrics into the context,
engine loop; health SERVING). While serving, the role's RPC handlers (gRPC threads) check
and stream here and talk to the engine only through ``self.loop``; on the loop thread
each engine output, poll and abort goes to the request set that holds the request's id.
``drain(timeout_s)`` flips health to NOT_SERVING, refuses new requests
(UNAVAILABLE), waits until no set holds a request, then ``stop()``s: server,
loop, KV event publisher (its stream deleted), KV endpoint, metrics. With ``cfg.kv_events_url`` the engine
records its prefix cache's events and the loop hands each pass's to the publisher (``_poll``).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator, Optional

import grpc

from proto import worker_pb2
from transport.auth import BearerAuth
from transport.serving import GrpcServing
from worker_common.config import WorkerConfig
from worker_common.engine_loop import EngineLoop
from worker_common.output_stream import OutputStreams, StreamedOut
from worker_common.request import RequestContext, RequestError, RequestSet, engine_tp, request_params

if TYPE_CHECKING:
    from engine.client import EngineCore, StepResult

__all__ = ["RequestError", "WorkerBase", "request_params"]  # the errors and params check, re-exported

log = logging.getLogger(__name__)


class WorkerBase:
    """Base of PrefillWorker, DecodeWorker and ColocatedWorker (see module docstring).

    It serves the ``Abort`` and ``GetInfo`` RPCs every worker service has; a role adds its own RPCs
    and registers itself as the servicer of its services (no generated servicer base classes, so
    no base class order decides which ``Abort`` gRPC calls)."""

    role = "worker"
    needs_kv = True

    def __init__(self, cfg: WorkerConfig) -> None:
        self.cfg = cfg
        auth = (BearerAuth([cfg.cluster_secret], f"{self.role} worker {cfg.worker_id}")
                if cfg.cluster_secret else None)
        tls = cfg.cluster_tls.server_credentials() if cfg.cluster_tls is not None else None
        self._serving = GrpcServing(f"{self.role}-{cfg.worker_id}", cfg.host, cfg.port, cfg.rpc_threads,
                                    auth=auth, tls=tls)
        self.ctx = RequestContext(cfg.worker_id)
        """Engine, KV endpoint and metrics: all a request set sees of this worker (filled by ``load``)."""
        self.loop: Optional[EngineLoop] = None
        self.lora: Any = None
        """Its ``worker_common.lora_sync.LoRASync`` (the adapters loaded at run time), after ``load``."""
        self.kv_events: Any = None
        """The KV event publisher (``worker_common.kv_events``) when ``cfg.kv_events_url`` is set, after ``load``."""
        self.metrics_address = ""
        self._metrics_stop: Optional[Callable[[], None]] = None
        self.request_sets: list[RequestSet] = []  # the role fills it: one set per kind of request
        self.output_streams = OutputStreams(cfg.worker_id)
        """Routers' output streams (``worker_common.output_stream``: decode and colocated roles serve them)."""
        self._ready = False
        self._draining = False
        self._stopped = False
        self._calls_lock = threading.Lock()
        self._request_calls = 0
        """Request calls (Prefill, Decode, Generate) in progress: each holds a gRPC handler thread (``guard``)."""
        self.refused_calls = 0
        """Request calls refused because ``cfg.max_request_calls`` were held."""
        # load snapshot refreshed by the loop thread, so info() never touches the engine
        self._load = worker_pb2.WorkerInfo()
        self._load_lock = threading.Lock()
        # progress watch (``stalled``): the engine's scheduled-token total and when it last moved (or had no work)
        self._progress_tokens = -1
        self._progress_at = time.monotonic()
        self._has_work = False
        self._stall_logged = False
        self.output_tokens_total = 0
        """Tokens the engine sampled for held requests (loop thread; WorkerInfo's counter)."""
        self.requests_finished_total = 0
        """Requests (choice 0) whose last token the engine sampled here (loop thread; WorkerInfo's counter)."""

    # ---- lifecycle ----------------------------------------------------------------
    @property
    def address(self) -> str:
        return self._serving.address

    @property
    def engine(self) -> Optional["EngineCore"]:
        """The engine (``engine.client``: an ``EngineCore``, a ``KVEngine`` for the prefill and decode roles; None
        before ``load``)."""
        return self.ctx.engine

    @property
    def kv(self) -> Any:
        """The kvtransfer endpoint (None before ``load``, and for roles without KV)."""
        return self.ctx.kv

    @property
    def metrics(self) -> Any:
        """The worker's metrics (None before ``load``)."""
        return self.ctx.metrics

    def start(self) -> "WorkerBase":
        self.bind()
        self.load()
        return self

    def bind(self) -> str:
        """Start the gRPC server (health NOT_SERVING until ``load`` finishes)."""
        return self._serving.start(self.register_services)

    def load(self) -> None:
        """Build the engine, KV endpoint, metrics and loop; then report SERVING."""
        from engine.llm_engine import LLMEngine
        from metrics import WorkerMetrics

        tp = getattr(self.cfg.engine, "tensor_parallel_size", 1)
        if tp > 1 and self.cfg.engine_process:
            raise ValueError(f"tensor_parallel_size={tp} with engine_process: the engine process is daemonic and "
                             "cannot start rank processes: run the tensor-parallel engine "
                             "in the worker's own process")
        if self.cfg.engine_process:
            from worker_common.engine_process import RemoteEngine

            remote = RemoteEngine(self.cfg.engine, f"{self.role}-{self.cfg.worker_id}", kv=self.needs_kv).start()
            remote.on_error = self._on_refused
            self.ctx.engine = remote
        else:
            self.ctx.engine = LLMEngine(self.cfg.engine)
        if self.needs_kv:
            self.ctx.kv = self.make_kv_endpoint()
        self.ctx.metrics = WorkerMetrics(self.cfg.served_model_name, self.role, self.cfg.worker_id)
        from transport.tracing import Tracing

        self.ctx.tracing = Tracing(self.cfg.otlp_traces_endpoint, f"pdserve-{self.role}",
                                   {"pdserve.worker_id": self.cfg.worker_id})
        if self.cfg.serve_metrics:
            self.metrics_address, self._metrics_stop = self.metrics.serve(host=self.cfg.host,
                                                                          port=self.cfg.metrics_port)
        self.setup_engine(self.engine)
        self._start_kv_events(self.engine)
        self.loop = EngineLoop(self.engine, f"{self.role}-{self.cfg.worker_id}", self.on_outputs, self._poll,
                               on_death=lambda _e: self._serving.set_serving(False), after=self.output_streams.flush,
                               on_step=self._on_step)
        from worker_common.lora_sync import LoRASync

        self.lora = LoRASync(self)
        self.ctx.lora_roots = self.lora.roots
        self._snapshot(self.engine)
        self.loop.start()
        self._ready = True
        if not self._draining:
            self._serving.set_serving(True)
        log.info("%s %s ready on %s (kv %s)", self.role, self.cfg.worker_id, self.address, self.cfg.kv_name)

    def drain(self, timeout_s: float = 30.0) -> bool:
        """Stop taking requests, finish in-flight ones (up to ``timeout_s``), stop. True if all finished."""
        self._draining = True
        self._serving.set_serving(False)
        deadline = time.monotonic() + timeout_s
        while self.num_requests() and time.monotonic() < deadline and self.loop is not None and self.loop.alive:
            time.sleep(0.02)
        clean = not self.num_requests()
        # the last chunks of the requests just finished may still wait on their output streams: let the senders
        # take them (at most 2 s) before the streams close, so no router sees its stream end a token early
        self.output_streams.flush()
        sent_by = min(deadline, time.monotonic() + 2.0)
        while not self.output_streams.sent() and time.monotonic() < sent_by:
            time.sleep(0.01)
        self.stop()
        return clean

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        self._ready = False
        self.output_streams.close_all()
        if self.lora is not None:
            self.lora.stop()
        self._serving.stop(0.5)
        if self.loop is not None:
            self.loop.stop()
        if self.kv_events is not None:
            self.kv_events.stop()
        if self.kv is not None:
            self.kv.shutdown()
        if self.engine is not None and hasattr(self.engine, "shutdown"):  # an engine process
            self.engine.shutdown()
        elif self.engine is not None and hasattr(self.engine, "close"):  # an engine's tensor-parallel ranks
            self.engine.close()
        if self._metrics_stop is not None:
            self._metrics_stop()
        if self.ctx.tracing is not None:
            self.ctx.tracing.shutdown()

    def _start_kv_events(self, eng: EngineCore) -> None:
        """Publish the prefix cache's events (stored, evicted, cleared; received blocks are stored too)."""
        if not self.cfg.kv_events_url or not eng.block_manager.enable_caching:
            return
        from worker_common.kv_events import KVEventPublisher

        eng.block_manager.enable_events()
        medium = "GPU" if str(getattr(self.cfg.engine, "device", "cpu")).startswith("cuda") else "CPU"
        self.kv_events = KVEventPublisher(self.cfg.kv_events_url, self.cfg.kv_events_namespace, self.cfg.worker_id,
                                          eng.block_size, medium=medium, metrics=self.metrics,
                                          lora_roots=eng.lora_event_ids()).start()

    def make_kv_endpoint(self) -> Any:
        """This worker's kvtransfer endpoint (one per worker, named ``cfg.kv_name``)."""
        from kvtransfer import KVEndpoint

        return KVEndpoint(self.cfg.kv_name, self.cfg.kv_store, backend=self.cfg.kv_backend,
                          timeout_s=self.cfg.transfer_timeout_s, shm=self.cfg.kv_shm)

    # ---- load reporting -----------------------------------------------------------
    def refresh_load(self, beside: bool = False) -> None:
        """Re-read the engine's load now (loop thread): before replying to an RPC that changed it,
        so ``info()`` agrees with the reply instead of lagging one loop pass behind. ``beside``: from a thread
        running beside the step (``EngineLoop.beside``): the load only, not the per-pass metrics."""
        self._snapshot(self.engine, record=not beside)

    def _snapshot(self, eng: EngineCore, record: bool = True) -> None:
        load = eng.load()
        info = worker_pb2.WorkerInfo(
            num_total_blocks=load.num_total_blocks, num_free_blocks=load.num_free_blocks,
            num_running=load.num_running, num_waiting=load.num_waiting,
            queued_prompt_tokens=self.queued_prompt_tokens(), block_size=eng.block_size,
            kv_cache_dtype=eng.kv_cache_dtype, tensor_parallel_size=engine_tp(eng),
            max_model_len=getattr(self.cfg.engine, "max_model_len", None) or 0,  # as set: a short KV cache is capacity
            requests_total=sum(rs.requests_total for rs in self.request_sets),
            prompt_tokens_total=sum(rs.prompt_tokens_total for rs in self.request_sets),
            output_tokens_total=self.output_tokens_total, requests_finished_total=self.requests_finished_total)
        stats = load.stats
        now = time.monotonic()
        with self._load_lock:
            self._load = info
            work = stats.num_running + stats.num_waiting > 0
            if not work or stats.num_scheduled_tokens != self._progress_tokens:
                self._progress_tokens, self._progress_at = stats.num_scheduled_tokens, now
            self._has_work = work
        if record and self.metrics is not None:
            # once per loop pass, so each engine step is one iteration_tokens_total observation
            self.metrics.record_engine(stats)
            ranks_up = getattr(eng, "ranks_up", None)
            self.metrics.set_ranks_up(ranks_up() if callable(ranks_up) else [True])

    def engine_failed(self) -> Optional[str]:
        """Why the engine loop died (an engine step, a hook or the engine process failed), once it has; None
        while it runs or after a clean stop. Such a worker never serves again: the cluster replaces it."""
        loop = self.loop
        if loop is None or loop.alive or loop.error is None or self._stopped:
            return None
        return f"{type(loop.error).__name__}: {loop.error}"

    def stalled(self) -> float:
        """Seconds the engine has had work (running or waiting requests) without scheduling a token, once that is
        past ``cfg.stall_timeout_s``; else 0. A step that hangs counts too: the loop then stops refreshing the
        snapshot, so the last progress ages while the work it saw stays. A stalled worker reports not ready (it
        leaves routing) until its engine schedules again."""
        with self._load_lock:
            since = time.monotonic() - self._progress_at if self._has_work else 0.0
        stalled = since if since > self.cfg.stall_timeout_s else 0.0
        if bool(stalled) != self._stall_logged:
            self._stall_logged = bool(stalled)
            if stalled:
                log.warning("%s %s: engine has work but scheduled nothing for %.1f s (stall_timeout_s=%g): "
                            "reporting not ready", self.role, self.cfg.worker_id, since, self.cfg.stall_timeout_s)
            else:
                log.info("%s %s: engine scheduling again: ready", self.role, self.cfg.worker_id)
        return stalled

    def info(self) -> worker_pb2.WorkerInfo:
        """This worker's registry record with its live load."""
        with self._load_lock:
            info = worker_pb2.WorkerInfo()
            info.CopyFrom(self._load)
        info.worker_id = self.cfg.worker_id
        info.role = self.role
        info.grpc_address = self.address
        info.kv_name = self.cfg.kv_name or ""
        info.metrics_address = self.metrics_address
        info.model_name = self.cfg.served_model_name
        info.ready = (self._ready and not self._draining and self.loop is not None and self.loop.alive
                      and not self.stalled())
        info.updated_at = time.time()
        info.node_id = self.cfg.node_id
        info.lora_adapters[:] = sorted(self.ctx.lora_roots)  # (as served now: a load changes it between steps)
        if self.lora is not None:
            info.lora_status.extend(self.lora.status())
        return info

    def sync_lora(self, entries: Any, wait: bool = False) -> None:
        """Follow the cluster's runtime LoRA set (``cluster.registry.Registry.lora_entries``), in the background
        (worker_common/lora_sync.py), or at once with ``wait``; before ``load`` it does nothing."""
        if self.lora is not None and not self._stopped:
            self.lora.sync(entries, wait)

    def GetInfo(self, request: Any, context: grpc.ServicerContext) -> worker_pb2.WorkerInfo:
        return self.info()

    def Abort(self, request: worker_pb2.AbortRequest, context: grpc.ServicerContext) -> worker_pb2.AbortResponse:
        if self.loop is None or not self.loop.alive:
            return worker_pb2.AbortResponse(found=False)

        def abort(eng: EngineCore) -> bool:
            found = self.abort(request.request_id)
            self.refresh_load()  # the caller's next info() already sees the blocks freed
            return found

        return worker_pb2.AbortResponse(found=bool(self.loop.call(abort)))

    def ResetPrefixCache(self, request: worker_pb2.ResetPrefixCacheRequest,
                         context: grpc.ServicerContext) -> worker_pb2.ResetPrefixCacheResponse:
        """vLLM's reset_prefix_cache on this worker's engine, between two of its steps (``EngineCore``'s
        ``reset_prefix_cache``: refused while a request holds blocks). UNAVAILABLE when the engine is not running."""
        if self.loop is None or not self.loop.alive:
            context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.cfg.worker_id}: its engine is not running")
        try:
            ok, held = self.loop.call(lambda eng: eng.reset_prefix_cache())
        except (RuntimeError, TimeoutError) as e:  # the loop stopped meanwhile, or no step boundary in 30 s
            context.abort(grpc.StatusCode.UNAVAILABLE, f"worker {self.cfg.worker_id}: no prefix cache reset ({e})")
        if ok:
            log.info("worker %s: prefix cache reset", self.cfg.worker_id)
        return worker_pb2.ResetPrefixCacheResponse(reset=bool(ok), blocks_in_use=int(held))

    # ---- helpers for handlers -------------------------------------------------------
    def check_accepting(self, request_id: str) -> None:
        if not request_id:
            raise RequestError(grpc.StatusCode.INVALID_ARGUMENT, "request_id is empty")
        if self._draining or not self._ready or self.loop is None or not self.loop.alive:
            raise RequestError(grpc.StatusCode.UNAVAILABLE,
                               f"{self.role} worker {self.cfg.worker_id} is not serving (request {request_id})")

    def stream_events(self, request_id: str, q: "queue.Queue", context: grpc.ServicerContext,
                      is_last: Callable[[Any], bool]) -> Iterator[Any]:
        """Yield items the loop puts in ``q`` until ``is_last(item)``; a RequestError ends the RPC. A request
        whose items go to a router's output stream (``q`` a ``StreamedOut``) yields nothing here: the call waits
        for the request's end and ends with it."""
        streamed = isinstance(q, StreamedOut)
        while True:
            try:
                item = q.get(timeout=0.25)
            except queue.Empty:
                if self.loop is None or not self.loop.alive:
                    # UNAVAILABLE: this worker can no longer serve (its engine died); the router migrates or
                    # retries the request on another worker while the supervisor replaces this one
                    raise RequestError(grpc.StatusCode.UNAVAILABLE,
                                       f"{self.role} worker {self.cfg.worker_id}: engine loop stopped "
                                       f"({self.engine_failed() or 'stopped'}) (request {request_id})")
                if not context.is_active():  # the caller went away: free what the request holds
                    self.loop.post(lambda e: self.abort(request_id))
                    return
                continue
            if isinstance(item, RequestError):
                raise item
            if streamed:  # the request's last chunk went to the stream
                return
            yield item
            if is_last(item):
                return

    def bind_output(self, stream_id: str, request_id: str) -> Optional[StreamedOut]:
        """The request's ``out`` on the router's output stream ``stream_id`` (None for ""); UNAVAILABLE if that
        stream is not open here (gRPC thread, before the request is added)."""
        return self.output_streams.bind(stream_id, request_id) if stream_id else None

    def trace_start(self, name: str, context: grpc.ServicerContext, request_id: str) -> Any:
        """A request's span on this worker, under the trace context its RPC carried (None while tracing is off)."""
        tr = self.ctx.tracing
        if tr is None or not tr.enabled:
            return None
        return tr.start(name, tr.carrier(context.invocation_metadata()),
                        attributes={"gen_ai.request.id": request_id, "pdserve.worker_id": self.cfg.worker_id})

    def guard(self, request_id: str, context: grpc.ServicerContext, body: Iterator[Any]) -> Iterator[Any]:
        """Run a streaming handler body: map RequestError to a status; abort the request if the RPC ends early.
        A request call beyond ``cfg.max_request_calls`` is refused with RESOURCE_EXHAUSTED before any work, so
        the handler threads kept for control calls stay free (see ``WorkerConfig.max_rpc_threads``)."""
        with self._calls_lock:
            held = self._request_calls
            if held < self.cfg.max_request_calls:
                self._request_calls += 1
        if held >= self.cfg.max_request_calls:
            self._count_refused_call()
            log.warning("%s %s: request %s refused: %d request calls held (max %d)", self.role, self.cfg.worker_id,
                        request_id, held, self.cfg.max_request_calls)
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"{self.role} worker {self.cfg.worker_id} holds {held} request calls, its limit "
                          f"(max_rpc_threads {self.cfg.rpc_threads} less {self.cfg.control_rpc_threads} kept for "
                          f"control calls); request {request_id} was not started: retry on another worker")
        try:
            yield from self._guarded(request_id, context, body)
        finally:
            with self._calls_lock:
                self._request_calls -= 1

    def _count_refused_call(self) -> None:
        with self._calls_lock:
            self.refused_calls += 1

    @property
    def request_calls(self) -> int:
        """Request calls in progress (each holding a handler thread)."""
        return self._request_calls

    def _guarded(self, request_id: str, context: grpc.ServicerContext, body: Iterator[Any]) -> Iterator[Any]:
        done = False

        def on_end() -> None:
            if not done and self.loop is not None and self.loop.alive:
                self.loop.post(lambda e: self.abort(request_id))

        if not context.add_callback(on_end):  # the RPC already ended; the body's waits see it inactive too
            on_end()
        try:
            yield from body
            done = True
        except RequestError as e:
            done = True  # the loop already dropped the request
            log.warning("%s %s: request %s failed: %s", self.role, self.cfg.worker_id, request_id, e.message)
            context.abort(e.code, e.message)

    # ---- the requests held, by set ----------------------------------------------------
    def num_requests(self) -> int:
        """How many requests the worker holds (any thread; drain waits for 0)."""
        return sum(len(rs) for rs in self.request_sets)

    @property
    def requests(self) -> dict[str, Any]:
        """A snapshot of every held request by id, whatever its set (tests, debugging)."""
        held: dict[str, Any] = {}
        for rs in self.request_sets:
            held.update(rs.snapshot())
        return held

    def holder(self, request_id: str) -> Optional[RequestSet]:
        """The set holding ``request_id``, or None."""
        for rs in self.request_sets:
            if request_id in rs:
                return rs
        return None

    def check_new(self, request_id: str, state: str) -> None:
        """ALREADY_EXISTS if any set holds ``request_id`` (``state``: what the new request would be)."""
        if self.holder(request_id) is not None:
            raise RequestError(grpc.StatusCode.ALREADY_EXISTS, f"request {request_id} is already {state} here")

    # ---- loop thread: route to the holding set ----------------------------------------
    def on_outputs(self, outs: list) -> None:
        now = time.monotonic()
        for o in outs:
            for rs in self.request_sets:
                req = rs.get(o.request_id)
                if req is not None:
                    self.output_tokens_total += len(o.new_token_ids)
                    if o.finish_reason and o.finish_reason != "prefill_done" and rs.ends_request(req):
                        self.requests_finished_total += 1
                    rs.on_output(req, o, now)
                    break

    def _on_refused(self, request_id: str, message: str) -> None:
        """An engine in its own process refused a request it was sent (its ``add_request`` ValueError, which an
        in-process engine raises to the handler): end that request as INVALID_ARGUMENT (loop thread)."""
        rs = self.holder(request_id)
        req = rs.get(request_id) if rs is not None else None
        if req is not None:
            rs.drop(req, RequestError(grpc.StatusCode.INVALID_ARGUMENT, f"{message} (request {request_id})"))

    def poll(self) -> bool:
        """Advance KV transfers and deadlines of every set; True while something is pending."""
        now = time.monotonic()
        busy = False
        for rs in self.request_sets:
            busy = rs.poll(now) or busy
        return busy

    def abort(self, request_id: str) -> bool:
        """Drop the request, free its blocks, end its stream as CANCELLED; True if it was known."""
        rs = self.holder(request_id)
        if rs is None:
            return False
        log.info("%s %s: abort request %s", self.role, self.cfg.worker_id, request_id)
        return rs.abort(request_id)

    def queued_prompt_tokens(self) -> int:
        return sum(rs.queued_prompt_tokens() for rs in self.request_sets)

    # ---- role hooks -------------------------------------------------------------------
    def register_services(self, server: grpc.Server) -> list[str]:
        """Add the role's servicers (this object, or ones it holds); return their full service names."""
        raise NotImplementedError

    def setup_engine(self, engine: EngineCore) -> None:
        """Install engine callbacks before the loop starts (loop thread from then on)."""

    def _on_step(self, res: StepResult) -> None:
        """A step's prefix-cache events go out with the load after it (what commands record between steps goes out
        from ``_poll``)."""
        if self.kv_events is not None and res.events:
            load = res.load
            self.kv_events.submit(res.events, (load.num_running, load.num_waiting, self.queued_prompt_tokens()))

    def _poll(self) -> bool:
        busy = self.poll()
        self._snapshot(self.engine)
        if self.kv_events is not None:  # this pass's prefix-cache changes and load, off the step path (a queue put)
            load = self._load
            self.kv_events.submit(self.engine.block_manager.take_events(),
                                  (load.num_running, load.num_waiting, load.queued_prompt_tokens))
        return busy
