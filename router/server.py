"""The router's gRPC front end: the public ``pdserve.v1.PDServe`` service in front of the worker pools.

Lifecycle: ``RouterServer(cfg, workers)`` -> ``start()`` = ``bind()`` (an asyncio gRPC server on a loop thread of
its own, ``transport.aio_serving``; port 0 = free; health NOT_SERVING, reflection) + ``load()`` (the
``RouterCore`` reads the tokenizer and limits, no weights; metrics endpoint; the OpenAI-compatible HTTP API when
``cfg.http_port`` is set; health SERVING; with ``cfg.health_port`` a second, plaintext server offers only health,
mirroring it, for probes that speak no TLS). Each ``Generate`` is validated on the loop (INVALID_ARGUMENT naming
the field; a text prompt is tokenized on the flow pool), admitted against its key's quota, then run by the core
(admission, the request flow) under a ``FlowPump`` (``router.flow_pump``): the flow's blocking steps run on the
flow pool (``cfg.max_rpc_threads`` threads), its streaming on the output streams' reader threads (with
``cfg.one_loop``: on this loop, which then serves the HTTP API too and reads the streams itself), and its
front-end-neutral ``FlowEvent``s reach this handler through one ``LoopInbox``, which renders them as
``GenerateResponse``s; its ``FlowError`` becomes the call's status. When the call ends early (client cancel,
deadline, or a client that took no message for ``cfg.stream_stall_timeout_s``: ``router.stream_stall``) the
flow's cancel runs, which frees the request on its workers. ``drain()`` turns health NOT_SERVING, refuses new
requests, waits for in-flight ones and stops; ``stop()`` ends serving at once.

Why asyncio (issue 31): gRPC's synchronous server held a thread per open stream and woke three threads per
streamed token and request; here no thread is held while a request streams and the events of a whole engine step
reach the loop in one wakeup. Measured: less router CPU and faster decoding at 32 to 128 streams, no change at
one (docs/benchmarks/history.md, "The asyncio front end"). Every thread, loop and lock of the router, and what one
event loop would change: docs/router_concurrency.md.
"""
from __future__ import annotations

import asyncio
import functools
import logging
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, Optional

import grpc
from google.protobuf.message import DecodeError

from proto import pdserve_pb2, pdserve_pb2_grpc
from router.config import RouterConfig
from router.core import RouterCore
from router.events import FlowError, FlowEvent
from router.flow_pump import END, FlowPump, LoopInbox
from router.validation import MAX_REQUEST_ID_LEN, ModelLimits, validate_generate
from router.wire import logprobs_to_public
from router.worker_source import Pool, WorkerList
from router.quotas import Lease, QuotaBook, QuotaExceeded, max_output_tokens
from router.stream_stall import StallWatch
from transport.tracing import Tracing
from transport.aio_serving import AioGrpcServing
from transport.api_keys import bearer_token, key_source
from transport.auth import AioBearerAuth
from transport.serving import GrpcServing
from transport.tls import TlsFiles

log = logging.getLogger(__name__)


def render(ev: FlowEvent) -> pdserve_pb2.GenerateResponse:
    """One flow event as the public gRPC response."""
    resp = pdserve_pb2.GenerateResponse(request_id=ev.request_id, token_ids=ev.token_ids, text=ev.text,
                                        logprobs=logprobs_to_public(ev.logprobs), index=ev.index)
    if ev.prompt_logprobs:
        resp.prompt_logprobs.extend(logprobs_to_public(ev.prompt_logprobs[1:]))
    if ev.finish_reason:
        resp.finish_reason = ev.finish_reason
    if isinstance(ev.stop_reason, str):
        resp.stop_string = ev.stop_reason
    elif isinstance(ev.stop_reason, int):
        resp.stop_token_id = ev.stop_reason
    if ev.score is not None:
        resp.score, resp.cum_logprob = ev.score, ev.cum_logprob
    if ev.usage is not None:
        u = ev.usage
        resp.usage.CopyFrom(pdserve_pb2.Usage(prompt_tokens=u.prompt_tokens, completion_tokens=u.completion_tokens,
                                              cached_tokens=u.cached_tokens))
    if ev.timings is not None:
        t = ev.timings
        resp.timings.CopyFrom(pdserve_pb2.Timings(queue_s=t.queue_s, prefill_s=t.prefill_s,
                                                  kv_transfer_s=t.kv_transfer_s, decode_s=t.decode_s,
                                                  ttft_s=t.ttft_s, total_s=t.total_s, placement_s=t.placement_s,
                                                  worker_queue_s=t.worker_queue_s))
    return resp


class RouterServer(pdserve_pb2_grpc.PDServeServicer):
    """Public gRPC front end (see module docstring)."""

    def __init__(self, cfg: RouterConfig, workers: WorkerList) -> None:
        self.core = RouterCore(cfg, workers)
        self.cfg = cfg
        self.workers = workers
        self.keys = key_source(cfg.api_keys, cfg.api_keys_file)
        """The accepted API keys (a table, or a keys file re-read on change); None: the API is open."""
        self.quotas = QuotaBook(cfg.quota_routers, on_refuse=self._count_quota_rejection)
        """Each key name's share of its limits (``router.quotas``)."""
        auth = AioBearerAuth(self.keys, "router") if self.keys is not None else None
        tls = TlsFiles(cfg.ssl_certfile, cfg.ssl_keyfile, cfg.ssl_ca_certs) if cfg.ssl_certfile else None
        self._serving = AioGrpcServing("router", cfg.host, cfg.port, auth=auth, tls=tls)
        self._pool = ThreadPoolExecutor(max_workers=cfg.max_rpc_threads, thread_name_prefix="router-flow")
        """Where flows run between their streaming stretches (``router.flow_pump``), and blocking handlers."""
        self._inbox: Optional[LoopInbox] = None
        """The flows' events to the serving loop (set at ``bind``)."""
        self._stalls = StallWatch(cfg.stream_stall_timeout_s)
        """Cuts off Generate streams whose client stopped reading (``router.stream_stall``)."""
        self.metrics_address = ""
        self._health_serving: Optional[GrpcServing] = None
        self.health_address = ""
        """"host:port" of the plaintext health-only server (``cfg.health_port``; "" when off)."""
        self._metrics_stop: Optional[Callable[[], None]] = None
        self.http: Optional[Any] = None
        """The OpenAI-compatible HTTP front end (``router.openai.http_api.HttpApi``) when ``cfg.http_port`` is set."""

    @property
    def http_address(self) -> str:
        """"host:port" of the HTTP API ("" when off)."""
        return self.http.address if self.http is not None else ""

    @property
    def address(self) -> str:
        return self._serving.address

    @property
    def selector(self) -> Any:
        return self.core.selector

    @property
    def admission(self) -> Any:
        return self.core.admission

    @property
    def metrics(self) -> Any:
        return self.core.metrics

    @property
    def tokenizer(self) -> Any:
        return self.core.tokenizer

    @property
    def limits(self) -> Optional[ModelLimits]:
        return self.core.limits

    @property
    def num_in_flight(self) -> int:
        return self.core.num_in_flight

    @property
    def num_waiting(self) -> int:
        """Requests waiting in the admission queue for decode KV capacity."""
        return len(self.core.admission)

    def start(self) -> "RouterServer":
        self.bind()
        self.load()
        return self

    def bind(self) -> str:
        """Start the gRPC server (health NOT_SERVING until ``load`` finishes)."""
        address = self._serving.start(self._register)
        loop = self._serving.loop
        assert loop is not None
        self._inbox = LoopInbox(loop)
        if self.cfg.one_loop and self.core.streams is not None:  # the workers' output streams read on this loop
            self.core.streams.use_loop(loop, self.core.clients.aio_colocated)
            self._serving.at_stop.append(self._close_loop_streams)
        if self.cfg.health_port is not None:
            self._health_serving = GrpcServing("router-health", self.cfg.host, self.cfg.health_port, max_workers=4)
            self.health_address = self._health_serving.start(lambda server: [])
        return address

    async def _close_loop_streams(self) -> None:
        """At stop, before the loop ends: the output streams read on it, then their asyncio channels. The flow pool
        closes first, so a request whose stream breaks here is not resumed (to retry elsewhere) during the stop."""
        self._pool.shutdown(wait=False, cancel_futures=True)
        tasks = [s.loop_task for s in self.core.streams.close() if s.loop_task is not None]
        if tasks:  # each reader ends (breaking its requests) before its channel closes
            await asyncio.wait(tasks, timeout=5.0)
        await self.core.clients.aclose()

    def _set_serving(self, serving: bool) -> None:
        self._serving.set_serving(serving)
        if self._health_serving is not None:
            self._health_serving.set_serving(serving)

    def load(self) -> None:
        """Load the tokenizer and limits, start metrics, then report SERVING."""
        self.core.load()
        if self.cfg.serve_metrics:
            self.metrics_address, self._metrics_stop = self.core.metrics.serve(host=self.cfg.host, port=0)
        if self.cfg.http_port is not None:
            from router.openai.http_api import HttpApi

            tls = (TlsFiles(self.cfg.ssl_certfile, self.cfg.ssl_keyfile, self.cfg.ssl_ca_certs)
                   if self.cfg.ssl_certfile else None)
            self.http = HttpApi(self.core, self.cfg.host, self.cfg.http_port, self.keys, tls, quotas=self.quotas,
                                stream_stall_timeout_s=self.cfg.stream_stall_timeout_s, pool=self._pool)
            self.http.start(self._serving.loop if self.cfg.one_loop else None)
        if not self.core.draining:
            self._set_serving(True)
        log.info("router on %s (%s mode)", self.address, self.cfg.mode)

    def _register(self, server: grpc.aio.Server) -> list[str]:
        # The handlers take raw bytes and parse them themselves: a message grpc's own deserializer cannot
        # read (invalid UTF-8 in a string, a truncated message) would otherwise end as INTERNAL.
        P = pdserve_pb2
        handlers = {
            "Generate": grpc.unary_stream_rpc_method_handler(
                self._parsed(self._generate, P.GenerateRequest), response_serializer=P.GenerateResponse.SerializeToString),
            "Tokenize": grpc.unary_unary_rpc_method_handler(
                self._parsed(self._in_pool(self.Tokenize), P.TokenizeRequest),
                response_serializer=P.TokenizeResponse.SerializeToString),
            "Embed": grpc.unary_unary_rpc_method_handler(
                self._parsed(self._in_pool(self.Embed), P.EmbedRequest),
                response_serializer=P.EmbedResponse.SerializeToString),
            "GetModelInfo": grpc.unary_unary_rpc_method_handler(
                self._parsed(self._in_pool(self.GetModelInfo), P.GetModelInfoRequest),
                response_serializer=P.ModelInfo.SerializeToString),
            "LoadLoRAAdapter": grpc.unary_unary_rpc_method_handler(
                self._parsed(self._in_pool(self.LoadLoRAAdapter), P.LoadLoRAAdapterRequest),
                response_serializer=P.LoRAAdapterResponse.SerializeToString),
            "UnloadLoRAAdapter": grpc.unary_unary_rpc_method_handler(
                self._parsed(self._in_pool(self.UnloadLoRAAdapter), P.UnloadLoRAAdapterRequest),
                response_serializer=P.LoRAAdapterResponse.SerializeToString),
        }
        name = P.DESCRIPTOR.services_by_name["PDServe"].full_name
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(name, handlers),))
        return [name]

    def _parsed(self, method: Callable[[Any, Any], Awaitable[Any]], msg_cls: Any) -> Callable:
        async def handler(raw: bytes, context: Any) -> Any:
            try:
                try:
                    request = msg_cls.FromString(raw)
                except DecodeError as e:
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                                 f"the request is not a valid {msg_cls.DESCRIPTOR.full_name} message (a string field "
                                 f"that is not UTF-8, or a truncated message): {e}") from None
                return await method(request, context)
            except _Abort as a:
                code, message = a.code, a.message
            except grpc.aio.AbortError:
                raise
            except Exception:  # a bug, not the client's fault: logged whole, answered without internals
                log.exception("%s: unexpected router error", msg_cls.DESCRIPTOR.name)
                code, message = grpc.StatusCode.UNAVAILABLE, "the router failed to serve the call (logged); retry"
            self.core.count_error(code)
            await context.abort(code, message)

        return handler

    def _in_pool(self, method: Callable[[Any, Any], Any]) -> Callable[[Any, Any], Awaitable[Any]]:
        """A blocking handler (tokenizer, the worker view) run on the flow pool, off the event loop."""
        async def run(request: Any, context: Any) -> Any:
            return await asyncio.get_running_loop().run_in_executor(self._pool, method, request, context)
        return run

    def drain(self, timeout_s: float = 30.0) -> bool:
        """NOT_SERVING, refuse new requests, wait for in-flight ones, stop. True if all finished."""
        self.core.draining = True
        self._set_serving(False)
        deadline = time.monotonic() + timeout_s
        while self.core.num_in_flight and time.monotonic() < deadline:
            time.sleep(0.02)
        clean = self.core.num_in_flight == 0
        self.stop()
        return clean

    def stop(self) -> None:
        if self.http is not None:
            self.http.stop()
        self._serving.stop(0.5)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self._health_serving is not None:
            self._health_serving.stop(0)
        self.core.close()
        if self._metrics_stop is not None:
            self._metrics_stop()
            self._metrics_stop = None

    # ---- public RPCs ----------------------------------------------------------------
    async def _generate(self, request: pdserve_pb2.GenerateRequest, context: Any) -> None:
        """Validate, admit, then stream the flow's events as they come (see ``router.flow_pump``)."""
        t0 = time.monotonic()
        core, loop = self.core, asyncio.get_running_loop()
        if core.limits is None or core.draining:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "router is not serving")
        if core.lora_admin.resolvable(request.model):  # an adapter loaded on first use (router/lora_admin.py)
            from router.lora_admin import LoRAAdminError

            try:
                await loop.run_in_executor(self._pool, core.lora_admin.resolve, request.model)
            except LoRAAdminError as e:
                raise _Abort(e.code, e.message) from None
        try:
            # the tokenizer (a prompt, bad words), or a structured_outputs grammar to compile (a JSON schema's can
            # take a while): off the loop, which streams every other request meanwhile
            check = functools.partial(validate_generate, request, core.limits, core.tokenize,
                                      allow_priority=core.cfg.scheduling_policy == "priority",
                                      reasoning=core.reasoning_markers)
            if request.prompt or request.bad_words or request.HasField("structured_outputs"):
                vreq = await loop.run_in_executor(self._pool, check)
            else:
                vreq = check()
        except ValueError as e:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except LookupError as e:  # a model (LoRA adapter) no worker serves
            raise _Abort(grpc.StatusCode.NOT_FOUND, str(e)) from None
        lease = self._admit(vreq, context)
        failure: Optional[FlowError] = None
        completion: Optional[int] = None
        cancels = _Cancels()
        events: "asyncio.Queue[Any]" = asyncio.Queue()
        inbox = self._inbox
        assert inbox is not None
        ended = False
        write = self._stalls.guard(context.write, None, lambda: self._count_stall("grpc"))
        try:
            carrier = Tracing.carrier(context.invocation_metadata()) if core.tracing.enabled else None
            gen = core.generate(vreq, t0, context.time_remaining(), cancels.register, push=True,
                                trace_carrier=carrier)
            FlowPump(gen, self._pool, lambda item: inbox.put(events, item)).start()
            while True:
                item = await events.get()
                if item is END:
                    ended = True
                    break
                if isinstance(item, BaseException):
                    ended = True
                    if isinstance(item, FlowError):
                        failure = item
                    else:  # a bug, not the client's fault: logged whole, answered without internals
                        log.error("request %s: unexpected router error", vreq.request_id, exc_info=item)
                        failure = FlowError(grpc.StatusCode.UNAVAILABLE, f"request {vreq.request_id}: the router "
                                                                         f"failed to serve it (logged); retry")
                    break
                if item.usage is not None:
                    completion = (completion or 0) + item.usage.completion_tokens
                await self._send(write, render(item), vreq.request_id)
        finally:
            if not ended:  # the client cancelled, the deadline passed, or the stream was cut: free the workers
                cancels.fire()
            lease.release(completion)
        if failure is not None:
            raise _Abort(failure.code, failure.message)

    async def _send(self, write: Callable[[Any], Awaitable[None]], msg: pdserve_pb2.GenerateResponse,
                    rid: str) -> None:
        """One message to the client through ``write`` (``context.write`` under the stall watch); a client that has
        not taken one for ``stream_stall_timeout_s`` is cut off: the stream ends CANCELLED and the flow is
        cancelled (``router.stream_stall``)."""
        try:
            await write(msg)
        except ConnectionAbortedError:
            log.warning("request %s: the client took no message for %.0f s; cutting its stream off", rid,
                        self.cfg.stream_stall_timeout_s or 0)
            raise _Abort(grpc.StatusCode.CANCELLED, f"request {rid}: the client took no message for "
                                                    f"{self.cfg.stream_stall_timeout_s:.0f} s; the stream was cut "
                                                    f"off") from None

    def _count_stall(self, api: str) -> None:
        if self.core.metrics is not None:
            self.core.metrics.inc_stream_stall(api)

    def _count_quota_rejection(self, name: str, limit: str) -> None:
        if self.core.metrics is not None:
            self.core.metrics.inc_quota_rejection(name, limit)

    def _admit(self, vreq: Any, context: Any) -> Lease:
        """The request's hold on its key's quota; RESOURCE_EXHAUSTED (with ``retry-after`` trailing metadata, in
        seconds) when the key is over one of its limits."""
        return self._admit_tokens(len(vreq.prompt_token_ids), max_output_tokens(vreq), context)

    def _admit_tokens(self, prompt_tokens: int, output_tokens: int, context: Any) -> Lease:
        key = None
        if self.keys is not None:
            token = next((bearer_token(v) for k, v in context.invocation_metadata() or () if k == "authorization"), b"")
            key = self.keys.identify(token)
        try:
            return self.quotas.admit(key, prompt_tokens, output_tokens)
        except QuotaExceeded as e:
            if e.retry_after_header is not None:
                context.set_trailing_metadata((("retry-after", e.retry_after_header),))
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, e.message) from None

    def Tokenize(self, request: pdserve_pb2.TokenizeRequest, context: grpc.ServicerContext) -> pdserve_pb2.TokenizeResponse:
        tok = self.core.tokenizer
        if tok is None:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, "text: this model has no tokenizer")
        ids = tok.encode(request.text, add_special_tokens=request.add_special_tokens)
        toks = tok.convert_ids_to_tokens(ids)
        return pdserve_pb2.TokenizeResponse(token_ids=ids, tokens=[t or "" for t in toks])

    def Embed(self, request: pdserve_pb2.EmbedRequest, context: grpc.ServicerContext) -> pdserve_pb2.EmbedResponse:
        """Embeddings (router/embeddings.py): validated, admitted against the key's quota, then every input on the
        least-loaded prefill (or colocated) worker."""
        from router.embeddings import EmbedInvalid, prepare_job, run_embed

        core = self.core
        rid = request.request_id or uuid.uuid4().hex
        if len(rid) > MAX_REQUEST_ID_LEN - 24 or not rid.isprintable():
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT,
                         f"request_id must be printable and at most {MAX_REQUEST_ID_LEN - 24} characters")
        if request.texts and request.inputs:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "give texts or inputs, not both")
        try:
            job = prepare_job(core, rid, request.model or None, list(request.texts) if request.texts else None,
                              [list(i.token_ids) for i in request.inputs],
                              request.dimensions if request.HasField("dimensions") else None,
                              request.normalize if request.HasField("normalize") else None,
                              request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None,
                              request.add_special_tokens if request.HasField("add_special_tokens") else True)
        except EmbedInvalid as e:
            raise _Abort(e.code, e.message) from None
        lease = self._admit_tokens(sum(len(ids) for ids in job.inputs), 0, context)
        remaining = context.time_remaining()
        budget = core.cfg.request_timeout_s if remaining is None else min(remaining, core.cfg.request_timeout_s)
        gone = threading.Event()  # (a client that cancels its call cancels its inputs on the workers)
        context.add_done_callback(lambda _ctx: gone.set())  # (grpc.aio: run on the loop when the call ends)
        try:
            got = run_embed(core, job, time.monotonic() + budget, cancelled=gone)
        except FlowError as e:
            raise _Abort(e.code, e.message) from None
        finally:
            lease.release(0)
        return pdserve_pb2.EmbedResponse(
            request_id=rid, model=request.model or core.limits.model_name, prompt_tokens=sum(g.num_prompt_tokens
                                                                                           for g in got),
            data=[pdserve_pb2.Embedding(values=g.embedding, num_prompt_tokens=g.num_prompt_tokens) for g in got])

    def GetModelInfo(self, request: pdserve_pb2.GetModelInfoRequest, context: grpc.ServicerContext) -> pdserve_pb2.ModelInfo:
        lim = self.core.limits
        if lim is None:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, "router is not serving")
        from engine import SamplingParams

        pools = (Pool.COLOCATED, Pool.COLOCATED) if self.cfg.mode == "colocated" else (Pool.PREFILL, Pool.DECODE)
        view = self.core.view
        n_p = len([w for w in view.list(pools[0].value) if w.ready])
        n_d = n_p if self.cfg.mode == "colocated" else len([w for w in view.list(pools[1].value) if w.ready])
        return pdserve_pb2.ModelInfo(
            model_name=lim.model_name, max_context_length=lim.max_context_length, vocab_size=lim.vocab_size,
            max_new_tokens=lim.max_tokens_limit, max_prompt_tokens=lim.max_context_length - 1,
            max_logprobs=SamplingParams.MAX_LOGPROBS, eos_token_id=lim.eos_token_id,
            num_prefill_workers=n_p, num_decode_workers=n_d, mode=self.cfg.mode, lora_adapters=lim.lora_adapters)

    def LoadLoRAAdapter(self, request: pdserve_pb2.LoadLoRAAdapterRequest,
                        context: grpc.ServicerContext) -> pdserve_pb2.LoRAAdapterResponse:
        """Load a LoRA adapter on every worker (router/lora_admin.py)."""
        from router.lora_admin import LoRAAdminError

        try:
            return pdserve_pb2.LoRAAdapterResponse(message=self.core.lora_admin.load(request.lora_name,
                                                                                     request.lora_path))
        except LoRAAdminError as e:
            raise _Abort(e.code, e.message) from None

    def UnloadLoRAAdapter(self, request: pdserve_pb2.UnloadLoRAAdapterRequest,
                          context: grpc.ServicerContext) -> pdserve_pb2.LoRAAdapterResponse:
        """Unload a runtime LoRA adapter once its requests are done (router/lora_admin.py)."""
        from router.lora_admin import LoRAAdminError

        try:
            return pdserve_pb2.LoRAAdapterResponse(message=self.core.lora_admin.unload(request.lora_name))
        except LoRAAdminError as e:
            raise _Abort(e.code, e.message) from None


class _Abort(Exception):
    """The status a public RPC ends with (counted in ``request_errors_total``)."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class _Cancels:
    """A flow's cancel, registered by its pump thread; ``fire`` (the RPC ended early) runs it once, at once if the
    flow registers it later. Without that, a request that yields nothing until it is done (beam search) would
    run to its end after a client cancel that came before its flow existed."""

    __slots__ = ("_lock", "_cbs", "_fired")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cbs: list[Callable[[], None]] = []
        self._fired = False

    def register(self, cb: Callable[[], None]) -> None:
        with self._lock:
            if not self._fired:
                self._cbs.append(cb)
                return
        cb()

    def fire(self) -> None:
        with self._lock:
            self._fired = True
            cbs, self._cbs = self._cbs, []
        for cb in cbs:
            cb()
