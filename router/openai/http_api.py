"""The router's OpenAI-compatible HTTP front end (FastAPI on uvicorn), over the same ``RouterCore`` as gRPC.

Lifecycle: ``HttpApi(core, host, port, api_keys)`` -> ``start()`` binds (port 0 = a free one) and
serves on a uvicorn thread of its own, or, with ``start(loop)``, as a task of the gRPC front end's loop
(``RouterConfig.one_loop``); ``stop()`` shuts it down. Endpoints, as vLLM's server
has them: ``GET /health`` (200 while the router serves, else 503), ``GET /metrics`` (the router's
Prometheus series), ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``, vLLM's
``POST /tokenize`` and ``POST /detokenize``, OpenAI's Responses API (``POST /v1/responses``, and ``GET`` /
``DELETE /v1/responses/{id}`` of stored ones: router/openai/responses_api.py, router/response_store.py) and
Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``:
router/openai/anthropic_api.py; its errors in Anthropic's shape), both served as chats. The constraint and tool
fields (``response_format``, ``structured_outputs``, ``tools``, ``tool_choice``) are planned by
``router.openai.structured`` before tokenizing:
the constraint rides in every ``GenerateRequest`` (compiled by the shared validation), and a tool-call parser
(``router.openai.tool_parsers``) reads each chat answer into ``tool_calls``.
A request body is parsed (pydantic), turned into the gRPC-shaped ``GenerateRequest`` and validated
by the same ``validate_generate`` as gRPC, then each choice runs as one ``RequestFlow`` through
``core.generate``, driven as the gRPC front end drives it (``router.flow_pump``: its blocking steps on the router's
flow pool, its streaming on the output streams' reader threads, a step's events reaching the event loop in one
wakeup); a beam search (not streamed) runs on a thread of its own. Its ``FlowEvent``s become a JSON response or
server-sent events ending in ``data: [DONE]``, rendered by ``router.openai.protocol`` (this module is the
transport: app, auth, flows, disconnects). A client that disconnects cancels its flows (the workers free its
blocks): the server's ``http.disconnect`` message wakes a watcher task at once, no polling. Events wait for the
client in the response's queue (at most a choice's ``max_tokens`` of them: a flow never blocks on a slow client,
as a reader thread must not), and a streaming response whose client has not read for ``stream_stall_timeout_s``
has its connection aborted (``router.stream_stall``), which cancels its flows like a disconnect. Errors are OpenAI's JSON
shape with the HTTP status matching the flow's status code. With API keys configured every ``/v1``,
``/tokenize`` and ``/detokenize`` call needs ``Authorization: Bearer <key>`` or ``x-api-key: <key>`` (as
Anthropic's SDK sends it; 401 otherwise); ``/health`` and ``/metrics`` stay open.

``n`` > 1 is one flow per prompt whose n choices share one prefill and one KV transfer (choice i
samples with ``seed + i``), as in gRPC. ``use_beam_search`` (vLLM's) makes ``n`` the beam width: the flow is a
beam search (``router.beam_search``) whose n best sequences are the choices, best first; not streamed.
"""
from __future__ import annotations

import asyncio
import functools
import concurrent.futures
import json
import logging
import re
import socket
import ssl
import threading
import time
import uuid
from concurrent.futures import Executor
from typing import Any, AsyncIterator, Callable, Iterable, Optional, Union

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.openai import anthropic_api as aa
from router.openai import embeddings_api as oemb
from router.openai import classify_api as ocls
from router.openai import score_api as oscore
from router.openai import schema as openai_schema
from router.openai import protocol as oa
from router.openai import responses as rs
from router.openai import responses_api as ora
from router.openai import structured as oas
from router.openai.reasoning import ReasoningPlan, opens_in_reasoning
from router.openai.structured import template_tools
from router.response_store import StoreUnavailable, StoredResponse, owner_of
from router.core import RouterCore
from router.quotas import Lease, QuotaBook, QuotaExceeded, max_output_tokens
from router.events import FlowError
from router.flow_pump import END, FlowPump, LoopInbox
from router.stream_stall import StallWatch, connection_abort
from router.validation import MAX_REQUEST_ID_LEN, validate_generate
from router.wire import structured_outputs_to_proto
from transport.tracing import Tracing
from transport.api_keys import ApiKey, KeySource, KeyTable, bearer_token
from transport.ports import check_port
from transport.tls import TlsFiles

log = logging.getLogger(__name__)

def _package_version() -> str:
    """pdserve's installed version ("0.1.0", pyproject's, from a checkout never installed)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("pdserve")
    except PackageNotFoundError:
        return "0.1.0"


_PROTECTED = ("/v1", "/tokenize", "/detokenize", "/reset_prefix_cache")
"""Paths that need the API key when keys are configured."""

_LORA_HTTP = {grpc.StatusCode.UNIMPLEMENTED: 404, grpc.StatusCode.NOT_FOUND: 404,
              grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.ALREADY_EXISTS: 400,
              grpc.StatusCode.FAILED_PRECONDITION: 400, grpc.StatusCode.UNAVAILABLE: 503,
              grpc.StatusCode.DEADLINE_EXCEEDED: 504, grpc.StatusCode.RESOURCE_EXHAUSTED: 429}
"""A runtime LoRA call's gRPC status as its HTTP status (vLLM answers 400 for a name already loaded, 404 for one
not found)."""

def _leading_field(message: str) -> Optional[str]:
    """The request field an error message starts with (its top-level name: ``input`` of ``input[0].role ...``), as
    the error body's ``param``; None for a message that starts with no name."""
    m = re.match(r"[A-Za-z_]+", message)
    return m.group(0) if m else None


_DISCONNECTED = object()
"""Put on a response's event queue when its client went away."""


class _Choice:
    """One flow (one prompt, its ``n`` choices), its events pushed to an asyncio queue as (choice index over the
    whole request, item): prompt ``index`` owns choices ``index * n ..``; ``None`` after its last item. With a
    ``pool`` the flow is driven by a ``FlowPump`` (no thread of its own); a beam search, or no pool, runs it on a
    thread of its own. Nothing here blocks on the client."""

    def __init__(self, core: RouterCore, index: int, greq: Any, inbox: LoopInbox,
                 out: "asyncio.Queue[tuple[int, Any]]", timeout_s: Optional[float], n: int = 1,
                 pool: Optional[Executor] = None, trace_carrier: Optional[dict] = None) -> None:
        self.index = index
        self._carrier = trace_carrier
        self.n = n
        self._cancel: list[Callable[[], None]] = []
        self._cancelled = False
        self._core, self._inbox, self._out, self._timeout_s = core, inbox, out, timeout_s
        self._pool = pool
        self.vreq = validate_generate(greq, core.limits, core.tokenize,  # ValueError -> 400, before any work
                                      allow_priority=core.cfg.scheduling_policy == "priority",
                                      reasoning=core.reasoning_markers)

    def start(self) -> None:
        if self._pool is not None and self.vreq.beam is None:
            gen = self._core.generate(self.vreq, time.monotonic(), self._timeout_s, self._on_cancel, push=True,
                                      trace_carrier=self._carrier)
            FlowPump(gen, self._pool, self._emit).start()
        else:
            threading.Thread(target=self._run, name=f"http-{self.vreq.request_id}", daemon=True).start()

    def _on_cancel(self, cb: Callable[[], None]) -> None:
        self._cancel.append(cb)
        if self._cancelled:
            cb()

    def cancel(self) -> None:
        self._cancelled = True
        for cb in list(self._cancel):
            cb()

    def _put(self, item: Any, choice: int = 0) -> None:
        self._inbox.put(self._out, (self.index * self.n + choice, item))

    def _emit(self, item: Any) -> None:
        """The pump's output (any thread, never blocks): a ``FlowEvent``, then ``END`` or what ended the flow."""
        if item is END:
            self._put(None)
        elif isinstance(item, BaseException):
            self._fail(item)
        else:
            self._put(item, item.index)

    def _fail(self, e: BaseException) -> None:
        if isinstance(e, FlowError):
            if not self._cancelled:  # a client that went away is no error of the service (nor is it on gRPC)
                self._core.count_error(e.code)
            self._put(e)
        else:  # a bug: logged whole, answered without internals
            log.error("request %s: unexpected router error", self.vreq.request_id, exc_info=e)
            self._core.count_error(grpc.StatusCode.UNAVAILABLE)
            self._put(FlowError(grpc.StatusCode.UNAVAILABLE, f"request {self.vreq.request_id}: the router "
                                                             f"failed to serve it (logged); retry"))
        self._put(None)

    def _run(self) -> None:
        try:
            for ev in self._core.generate(self.vreq, time.monotonic(), self._timeout_s, self._on_cancel,
                                          trace_carrier=self._carrier):
                self._put(ev, ev.index)
        except Exception as e:  # noqa: BLE001 - FlowError or a bug: both answered (``_fail``)
            self._fail(e)
            return
        self._put(None)


class _StallCutResponse(StreamingResponse):
    """A streaming response whose connection is aborted when one send waits the stall timeout for the client."""

    def __init__(self, content: Any, watch: StallWatch, on_cut: Callable[[], None], **kw: Any) -> None:
        super().__init__(content, **kw)
        self._watch, self._on_cut = watch, on_cut

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        await super().__call__(scope, receive, self._watch.guard(send, scope.get(_ABORT), self._on_cut))


_ABORT = "pdserve.abort"
"""Scope key of the connection's abort (``router.stream_stall.connection_abort``), set by ``_ExposeAbort``."""


class _ExposeAbort:
    """The outermost ASGI layer: records the server's abort of the request's connection in its scope, where the
    ``send`` is still the server's own (middleware wraps it further in)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http":
            scope[_ABORT] = connection_abort(send)
        await self.app(scope, receive, send)


_ANTHROPIC = "/v1/messages"
"""Anthropic's Messages API (router/openai/anthropic_api.py): its errors come in Anthropic's shape."""


def _anthropic_error(response: Response, request: Optional[Request] = None) -> Response:
    """An OpenAI-shaped error answer of a Messages API call (``request`` None: it is one) in Anthropic's shape
    (``{"type": "error", "error": {"type", "message"}}``), same status and headers; anything else as it is."""
    if response.status_code < 400 or not isinstance(response, JSONResponse) or (
            request is not None and not request.url.path.startswith(_ANTHROPIC)):
        return response
    message = json.loads(response.body).get("error", {}).get("message", "")
    headers = {k: v for k, v in response.headers.items() if k.lower() not in ("content-length", "content-type")}
    return JSONResponse(aa.error_body(response.status_code, message), status_code=response.status_code,
                        headers=headers or None)


class _Auth:
    """ASGI wrapper: with API keys configured, a request for a protected path (``/v1``, ``/tokenize``,
    ``/detokenize``) without a valid ``Authorization: Bearer`` key is answered 401 before its body is read or the
    app sees it. A plain ASGI layer on purpose: Starlette's ``@app.middleware("http")`` pipes every chunk of a
    streamed response through an anyio memory stream and a task switch (21% of the router's samples at 128 HTTP
    streams, py-spy, 27 Nov)."""

    def __init__(self, app: Any, authorized: Callable[[Request], bool]) -> None:
        self.app, self._authorized = app, authorized

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith(_PROTECTED) and not self._authorized(Request(scope)):
            msg = "missing or invalid API key (send 'Authorization: Bearer <key>' or 'x-api-key: <key>')"
            body = json.dumps(aa.error_body(401, msg) if scope["path"].startswith(_ANTHROPIC)
                              else rs.error_body(401, msg))
            await send({"type": "http.response.start", "status": 401,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})
            await send({"type": "http.response.body", "body": body.encode()})
            return
        await self.app(scope, receive, send)


MAX_BODY_BYTES = 32 << 20
"""Largest request body read (32 MiB): a context's worth of prompt text JSON-escaped, a full logit_bias and
tool schemas fit many times over; more is refused with 413 before it is read, so a client cannot make the
router buffer 100 MB."""


class _BodyLimit:
    """ASGI wrapper: a request body past ``limit`` bytes is answered 413 (OpenAI's error shape) as soon as its
    ``Content-Length`` says so, or as soon as a chunked body has sent that much; otherwise the body, read
    whole, is handed on to the app (which reads it whole anyway)."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    async def _refuse(self, send: Any, status: int, message: str) -> None:
        body = json.dumps(rs.error_body(status, message)).encode()
        await send({"type": "http.response.start", "status": status,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": body})

    async def __call__(self, scope: dict, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope.get("method") in ("GET", "HEAD"):
            return await self.app(scope, receive, send)
        length = next((v for k, v in scope.get("headers", ()) if k == b"content-length"), None)
        too_big = f"body: the request body is larger than {self.limit} bytes"
        if length is not None:
            if not length.isdigit():
                return await self._refuse(send, 400, "body: Content-Length is not a number")
            if int(length) > self.limit:
                return await self._refuse(send, 413, too_big)
        body, more = bytearray(), True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            body += msg.get("body", b"")
            more = msg.get("more_body", False)
            if len(body) > self.limit:
                return await self._refuse(send, 413, too_big)
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()  # after the body: the disconnect the response's watcher waits for

        await self.app(scope, replay, send)


class HttpApi:
    """OpenAI-compatible HTTP server in the router process (see module docstring)."""

    def __init__(self, core: RouterCore, host: str = "127.0.0.1", port: int = 0,
                 api_keys: Union[Iterable[str], KeySource, None] = (), tls: Optional[TlsFiles] = None,
                 max_body_bytes: int = MAX_BODY_BYTES, quotas: Optional[QuotaBook] = None,
                 stream_stall_timeout_s: Optional[float] = 60.0, pool: Optional[Executor] = None) -> None:
        """``api_keys``: plain keys or a key source (``transport.api_keys``; the router's, shared with gRPC);
        ``tls``: serve HTTPS with the same certificate (and client CA, for mutual TLS) as the gRPC API;
        ``max_body_bytes``: larger request bodies get 413 before they are read; ``quotas``: each key name's share
        of its limits (the router's, shared with gRPC; None: no limits); ``stream_stall_timeout_s``: a streaming
        response whose client has not read for this long is cut off (``router.stream_stall``; None: never);
        ``pool``: the router's flow pool, where flows run their blocking steps (None: a thread per flow)."""
        check_port(port, "http_port")
        if max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {max_body_bytes}")
        self.max_body_bytes = max_body_bytes
        self._stalls = StallWatch(stream_stall_timeout_s)
        self.core = core
        self.host, self._port = host, port
        if api_keys is None or hasattr(api_keys, "identify"):
            self._keys: Optional[KeySource] = api_keys  # type: ignore[assignment]
        else:
            plain = KeyTable.plain(api_keys)  # type: ignore[arg-type]
            self._keys = plain if len(plain) else None
        self.quotas = quotas if quotas is not None else QuotaBook()
        self._pool = pool
        self._inbox: Optional[LoopInbox] = None
        """Flow events to the server's loop (made on the loop, at its first request)."""
        self._tls = tls
        self.app = self._build_app()
        self._server: Optional[uvicorn.Server] = None
        self._thread: Optional[threading.Thread] = None
        self._task: Optional[concurrent.futures.Future] = None
        self.address = ""

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self, loop: Optional[asyncio.AbstractEventLoop] = None) -> str:
        """Bind and serve; ``loop``: serve as a task of that running event loop (the gRPC front end's, with
        ``RouterConfig.one_loop``) instead of on a ``router-http`` thread with a loop of its own."""
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._port))
        tls_kw: dict = {}
        if self._tls is not None:
            tls_kw = dict(ssl_certfile=self._tls.certfile, ssl_keyfile=self._tls.keyfile)
            if self._tls.ca_certs:
                tls_kw.update(ssl_ca_certs=self._tls.ca_certs, ssl_cert_reqs=ssl.CERT_REQUIRED)
        asgi = _ExposeAbort(_Auth(_BodyLimit(self.app, self.max_body_bytes), self._authorized))
        config = uvicorn.Config(asgi, log_level="warning", access_log=False,
                                lifespan="off",
                                timeout_graceful_shutdown=1, **tls_kw)
        self._server = uvicorn.Server(config)
        if loop is None:
            self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                            name="router-http", daemon=True)
            self._thread.start()
            alive: Callable[[], bool] = self._thread.is_alive
        else:
            self._task = asyncio.run_coroutine_threadsafe(self._server.serve(sockets=[sock]), loop)
            alive = lambda: not self._task.done()  # noqa: E731
        deadline = time.monotonic() + 30.0
        while not self._server.started:
            if not alive() or time.monotonic() > deadline:
                raise RuntimeError(f"HTTP server on {self.host}:{self._port} did not start")
            time.sleep(0.01)
        self.address = f"{self.host}:{sock.getsockname()[1]}"
        log.info("router HTTP (OpenAI-compatible) on http://%s", self.address)
        return self.address

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
        if self._thread is not None:
            self._thread.join(timeout=10.0)
        if self._task is not None:
            try:
                self._task.result(timeout=10.0)
            except Exception:  # (a loop that stopped first cancelled it)
                log.debug("HTTP server's task on the shared loop", exc_info=True)
        self._server = self._thread = self._task = None

    # ---- the app -----------------------------------------------------------------------------------
    def _key(self, request: Request) -> Optional[ApiKey]:
        """The key the request presents (None: none, a wrong one, or an open API)."""
        if self._keys is None:
            return None
        token = bearer_token(request.headers.get("authorization", "")) or \
            request.headers.get("x-api-key", "").strip().encode()  # (Anthropic's SDK sends its key so)
        return self._keys.identify(token)

    def _authorized(self, request: Request) -> bool:
        return self._keys is None or self._key(request) is not None

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url="/openapi.json")
        openai_schema.install(app, oa.CompletionRequest, oa.ChatCompletionRequest,
                              (oa.TokenizeCompletionRequest, oa.TokenizeChatRequest), oa.DetokenizeRequest,
                              {"/v1/embeddings": oemb.EmbeddingRequest, "/v1/score": oscore.ScoreRequest,
                               "/v1/rerank": oscore.RerankRequest, "/v1/classify": ocls.ClassifyRequest})

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
            first = exc.errors()[0] if exc.errors() else {}
            where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
            # a body that is not an object at all (JSON null, a list, a number) has no field to name: the body
            return _anthropic_error(JSONResponse(rs.error_body(400, f"{where or 'body'}: "
                                                                    f"{first.get('msg', 'invalid request')}",
                                                               where or None), status_code=400), request)

        @app.exception_handler(StarletteHTTPException)
        async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            # FastAPI's own refusals (a body that is not JSON, an unknown path, a wrong method) in OpenAI's shape
            msg = str(exc.detail)
            if exc.status_code == 400:
                msg = f"the request body could not be read as JSON ({msg})"
            return _anthropic_error(JSONResponse(rs.error_body(exc.status_code, msg), status_code=exc.status_code,
                                                 headers=getattr(exc, "headers", None)), request)

        @app.exception_handler(Exception)
        async def unexpected(request: Request, exc: Exception) -> JSONResponse:
            log.error("HTTP %s %s: unexpected router error", request.method, request.url.path, exc_info=exc)
            return _anthropic_error(JSONResponse(rs.error_body(503, "the router failed to serve this request "
                                                                    "(logged); retry"), status_code=503), request)

        @app.get("/health")
        async def health() -> Response:
            ok = self.core.limits is not None and not self.core.draining
            return Response(status_code=200 if ok else 503)

        @app.get("/ping")
        async def ping() -> Response:  # vLLM's (SageMaker's health check): /health's answer
            return await health()

        @app.post("/ping", include_in_schema=False)  # (the same, as SageMaker may POST it; no body to document)
        async def ping_post() -> Response:
            return await health()

        @app.get("/version")
        async def version() -> JSONResponse:  # vLLM's shape: the serving package's version
            return JSONResponse({"version": _package_version()})

        @app.get("/metrics")
        async def metrics() -> Response:
            from prometheus_client import CONTENT_TYPE_LATEST

            body = self.core.metrics.render() if self.core.metrics is not None else b""
            return Response(body, media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models(request: Request) -> JSONResponse:
            lim = self.core.limits
            data = [] if lim is None else [{"id": lim.model_name, "object": "model", "created": rs.created(),
                                            "owned_by": "pdserve", "root": lim.model_name, "parent": None,
                                            "max_model_len": lim.max_context_length}]
            if lim is not None:  # LoRA adapters, as vLLM lists them: their base model is the parent
                data += [{"id": name, "object": "model", "created": rs.created(), "owned_by": "pdserve",
                          "root": name, "parent": lim.model_name, "max_model_len": lim.max_context_length}
                         for name in lim.lora_adapters]
            if "anthropic-version" in request.headers and lim is not None:  # Anthropic's SDK asking: its list
                return JSONResponse(aa.models_json([m["id"] for m in data], lim.max_context_length,
                                                   lim.max_tokens_limit))
            return JSONResponse({"object": "list", "data": data})

        @app.post("/v1/completions")
        async def completions(body: oa.CompletionRequest, request: Request) -> Response:
            return await self._serve(request, body, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(body: oa.ChatCompletionRequest, request: Request) -> Response:
            return await self._serve(request, body, chat=True)

        @app.post("/v1/responses")
        async def responses(body: ora.ResponsesRequest, request: Request) -> Response:
            history = None
            if body.previous_response_id is not None and self.core.responses is not None:
                found = await self._stored(body.previous_response_id, request, "previous_response_id")
                if isinstance(found, Response):
                    return found
                history = found.conversation
            try:
                translation = ora.to_chat_request(body, history)
            except ValueError as e:  # (a pydantic ValidationError is one too: a field's value the chat body refuses)
                self.core.count_error(grpc.StatusCode.INVALID_ARGUMENT)
                return self._error(400, str(e), _leading_field(str(e)))
            lim = self.core.limits
            if body.truncation == "auto" and lim is not None and self.core.tokenizer is not None:
                translation = await asyncio.to_thread(ora.truncate, translation, self._prompt_length,
                                                      lim.max_context_length)
            return await self._serve(request, translation.chat, chat=True, responses=translation)

        @app.post("/v1/messages")
        async def messages(body: aa.MessagesRequest, request: Request) -> Response:
            try:
                translation = aa.to_chat_request(body, self.core.reasoning is not None)
            except ValueError as e:
                self.core.count_error(grpc.StatusCode.INVALID_ARGUMENT)
                return _anthropic_error(self._error(400, str(e), _leading_field(str(e))))
            return _anthropic_error(await self._serve(request, translation.chat, chat=True, messages=translation))

        @app.post("/v1/messages/count_tokens")
        async def count_tokens(body: aa.CountTokensRequest) -> Response:
            return _anthropic_error(await self._count_tokens(body))

        @app.get("/v1/responses/{response_id}")
        async def get_response(response_id: str, request: Request) -> Response:
            found = await self._stored(response_id, request, "response_id")
            return found if isinstance(found, Response) else JSONResponse(found.response)

        @app.get("/v1/responses/{response_id}/input_items")
        async def response_input_items(response_id: str, request: Request, limit: int = 20, order: str = "desc",
                                       after: Optional[str] = None) -> Response:
            found = await self._stored(response_id, request, "response_id")
            if isinstance(found, Response):
                return found
            inputs = found.conversation[:len(found.conversation) - len(found.response.get("output", []))]
            try:
                return JSONResponse(ora.page_items(inputs, limit, order, after))
            except ValueError as e:
                return self._error(400, str(e), _leading_field(str(e)))

        @app.delete("/v1/responses/{response_id}")
        async def delete_response(response_id: str, request: Request) -> Response:
            found = await self._stored(response_id, request, "response_id", delete=True)
            return found if isinstance(found, Response) else JSONResponse(
                {"id": response_id, "object": "response", "deleted": True})

        @app.post("/v1/load_lora_adapter")
        async def load_lora_adapter(body: oa.LoadLoRAAdapterRequest) -> Response:
            return await self._lora_admin("load", body.lora_name, body.lora_path)

        @app.post("/v1/unload_lora_adapter")
        async def unload_lora_adapter(body: oa.UnloadLoRAAdapterRequest) -> Response:
            return await self._lora_admin("unload", body.lora_name)

        @app.post("/reset_prefix_cache", include_in_schema=False)  # (an operator's route, not the API's)
        async def reset_prefix_cache() -> Response:
            return await self._reset_prefix_cache()

        @app.post("/v1/embeddings")
        async def embeddings(request: Request) -> Response:
            return await self._scored(request, await self._body(request, oemb.EmbeddingRequest), oemb.serve)

        @app.post("/v1/classify")
        @app.post("/classify", include_in_schema=False)  # (vLLM's path; documented once)
        async def classify(request: Request) -> Response:
            return await self._scored(request, await self._body(request, ocls.ClassifyRequest), ocls.serve)

        @app.post("/v1/score")
        @app.post("/score", include_in_schema=False)  # (aliases, as vLLM serves them; documented once)
        async def score(request: Request) -> Response:
            return await self._scored(request, await self._body(request, oscore.ScoreRequest), oscore.score)

        @app.post("/v1/rerank")
        @app.post("/rerank", include_in_schema=False)
        @app.post("/v2/rerank", include_in_schema=False)
        async def rerank(request: Request) -> Response:
            return await self._scored(request, await self._body(request, oscore.RerankRequest), oscore.rerank)

        @app.post("/tokenize")
        async def tokenize(request: Request) -> Response:
            return await self._tokenize(await self._body(request, oa.TokenizeCompletionRequest,
                                                         oa.TokenizeChatRequest))

        @app.post("/detokenize")
        async def detokenize(request: Request) -> Response:
            return await self._detokenize(await self._body(request, oa.DetokenizeRequest))

        return app

    # ---- requests ----------------------------------------------------------------------------------
    def _error(self, status: int, message: str, param: Optional[str] = None) -> JSONResponse:
        return JSONResponse(rs.error_body(status, message, param), status_code=status)

    async def _serve(self, request: Request, body: Any, chat: bool,
                     responses: Optional["ora.ChatTranslation"] = None,
                     messages: Optional["aa.MessagesTranslation"] = None) -> Response:
        """``_answer`` under the request's id (vLLM's): the body's ``request_id``, else the ``X-Request-Id`` header,
        else a new one; the response (errors too) carries it back as ``X-Request-Id``, the completion's ``id`` is
        built from it, and every worker log line of the request starts with it (each prompt's id adds a short
        unique suffix, so two requests with the same header never collide on a worker)."""
        base = self._request_id(request, body)
        if isinstance(base, Response):
            return base
        response = await self._answer(request, body, chat, base, responses, messages)
        response.headers["X-Request-Id"] = base
        return response

    def _request_id(self, request: Request, body: Any) -> Union[str, Response]:
        """The request's id (the body's ``request_id``, else the ``X-Request-Id`` header, else a new one), or the
        400 that refuses a bad one."""
        base = getattr(body, "request_id", None) or request.headers.get("x-request-id")
        # (24 characters left for the suffixes: "-<prompt>-<8 hex>" here, "~<n>" for a retried placement)
        if base is not None and (not base or len(base) > MAX_REQUEST_ID_LEN - 24 or not base.isprintable()):
            self.core.count_error(grpc.StatusCode.INVALID_ARGUMENT)
            return self._error(400, f"request_id (or the X-Request-Id header) must be 1 to "
                                    f"{MAX_REQUEST_ID_LEN - 24} printable characters", "request_id")
        return base or uuid.uuid4().hex

    async def _scored(self, request: Request, body: Any, serve: Callable[..., Any]) -> Response:
        """An embeddings, score, rerank or classify request (``serve``: its module's) under the request's id as
        ``_serve``, admitted against the key's quota for its prompt tokens; a client that disconnects meanwhile
        cancels its inputs on the workers (``run_embed``'s ``cancelled``)."""
        base = self._request_id(request, body)
        if isinstance(base, Response):
            return base
        gone = threading.Event()

        async def blocking(fn: Callable[..., Any], *args: Any) -> Any:  # (``run_embed``, told when the client left)
            return await self._blocking(functools.partial(fn, cancelled=gone), *args)

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            log.info("HTTP client went away: cancelling request %s's inputs", base)
            gone.set()

        watcher = asyncio.ensure_future(watch())
        try:
            response = await serve(self.core, body, base, lambda n: self.quotas.admit(self._key(request), n, 0),
                                   blocking)
        finally:
            watcher.cancel()
        response.headers["X-Request-Id"] = base
        return response

    async def _blocking(self, fn: Callable[..., Any], *args: Any) -> Any:
        """``fn(*args)`` on the router's flow pool (a thread of its own without one), awaited."""
        if self._pool is None:
            return await asyncio.to_thread(fn, *args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args))

    async def _answer(self, request: Request, body: Any, chat: bool, base: str,
                      responses: Optional["ora.ChatTranslation"] = None,
                      messages: Optional["aa.MessagesTranslation"] = None) -> Response:
        """A completion or chat request (``chat``); with ``responses``, the Responses API request it came from
        (router/openai/responses_api.py): served as a chat, answered as a ``response``, its errors naming the
        Responses API's fields; with ``messages`` likewise the Messages API's (router/openai/anthropic_api.py),
        answered as a ``message`` (its errors are put in Anthropic's shape by the route)."""
        core = self.core
        if core.limits is None or core.draining:
            return self._error(503, "router is not serving")
        if self._inbox is None:
            self._inbox = LoopInbox(asyncio.get_running_loop())
        inbox, pool = self._inbox, self._pool
        queue: asyncio.Queue = asyncio.Queue()
        carrier = Tracing.carrier(request.headers.items()) if core.tracing.enabled else None

        if chat:
            self._template_defaults(body)
        reasoning: Optional[ReasoningPlan] = None

        def prepare() -> tuple[list[_Choice], oas.Plan]:  # tokenizing, compiling a constraint: off the event loop
            nonlocal reasoning
            lim = core.limits
            plan = oas.plan(body, chat, core.cfg.tool_call_parser)
            greqs = oa.to_generate_requests(body, chat, lim,
                                            lambda b: oa.chat_prompt_ids(b, core.tokenizer, lim, plan.tools))
            for i, g in enumerate(greqs):  # (the client's id first, so the logs find it)
                tag = f"{i}-" if len(greqs) > 1 else ""
                g.request_id = f"{base}-{tag}{uuid.uuid4().hex[:8]}"
            if chat:
                reasoning = self._reasoning_of(body, greqs)
            if chat and body.max_tokens is None and body.max_completion_tokens is None and not body.use_beam_search:
                for g in greqs:  # vLLM's chat default: the answer may take the rest of the context
                    room = min(lim.max_tokens_limit, lim.max_context_length - len(g.token_ids))
                    if room >= 1:
                        g.max_tokens = room
            if plan.constraint is not None:
                so = structured_outputs_to_proto(plan.constraint)
                for g in greqs:
                    g.structured_outputs.CopyFrom(so)
            try:
                return [_Choice(core, i, g, inbox, queue, None, body.n, pool, carrier)
                        for i, g in enumerate(greqs)], plan
            except ValueError as e:
                msg = plan.relabel(str(e))
                if msg.startswith("token_ids"):  # the gRPC field's name; the client wrote prompt (or messages)
                    msg = ("messages" if chat else "prompt") + msg[len("token_ids"):]
                raise ValueError(msg) from None

        if isinstance(body.model, str) and core.lora_admin.resolvable(body.model):  # loaded on first use
            from router.lora_admin import LoRAAdminError

            try:
                await asyncio.to_thread(core.lora_admin.resolve, body.model)
            except LoRAAdminError as e:
                core.count_error(e.code)
                return self._error(_LORA_HTTP.get(e.code, 503), e.message, "model")
        try:
            choices, plan = await asyncio.to_thread(prepare)
        except LookupError as e:
            core.count_error(grpc.StatusCode.NOT_FOUND)
            return self._error(404, str(e), "model")
        except ValueError as e:
            core.count_error(grpc.StatusCode.INVALID_ARGUMENT)
            api = responses or messages
            if api is not None:
                msg = api.relabel(str(e))
                return self._error(400, msg, _leading_field(msg))
            return self._error(400, str(e))
        n_prompt = sum(len(c.vreq.prompt_token_ids) for c in choices)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{base}"
        model, detok = body.model or core.limits.model_name, rs.detokenizer(core.tokenizer)
        if body.return_tokens_as_token_ids:  # vLLM's: logprobs name each token "token_id:<id>"
            detok = rs.token_id_strings
        echo = None
        if not chat and body.echo:  # each choice's answer follows its prompt's text
            echo = [c.vreq.prompt if c.vreq.prompt is not None else core.tokenizer.decode(c.vreq.prompt_token_ids, False)
                    for c in choices for _ in range(body.n)]
        echo_first = None  # echo with logprobs: the prompt's logprobs block goes first (from its first token)
        if echo is not None and body.logprobs is not None and not body.use_beam_search:
            echo_first = [c.vreq.prompt_token_ids[0] for c in choices for _ in range(body.n)]
        try:  # the key's quota, before any worker works
            lease = self.quotas.admit(self._key(request), n_prompt, sum(max_output_tokens(c.vreq) for c in choices))
        except QuotaExceeded as e:
            core.count_error(grpc.StatusCode.RESOURCE_EXHAUSTED)
            headers = {"Retry-After": e.retry_after_header} if e.retry_after_header is not None else None
            return JSONResponse(rs.error_body(429, e.message), status_code=429, headers=headers)
        try:
            for c in choices:
                c.start()
            events = self._events(choices, queue, request, lease)
        except BaseException:
            lease.release(None)
            raise
        if messages is not None or responses is not None:  # another API's answer, rendered by its module
            answer: Any
            if messages is not None:
                answer = (aa.MessageEventStream if body.stream else aa.ResponseMessage)(
                    messages.request, model, n_prompt, plan.parser, reasoning)
            else:
                answer = (ora.ResponseEventStream if body.stream else ora.ResponseCollector)(
                    responses.request, model, n_prompt, plan.parser, reasoning)
                if self.core.responses is not None and responses.request.store is not False:  # OpenAI's default
                    owner = self._owner(request)
                    answer.keep = lambda: self._keep(answer, responses, owner)
            if body.stream:
                return _StallCutResponse(self._sse(events, answer), self._stalls, self._count_stall,
                                         media_type="text/event-stream")
            async for _, item in events:
                if isinstance(item, FlowError):
                    await events.aclose()
                    return self._flow_error(item)
                answer.add(item)
            if getattr(answer, "keep", None) is not None:
                await answer.keep()
            return JSONResponse(answer.json_body())
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            out = rs.EventStream(rid, chat, model, n_prompt, detok, include_usage, plan.parser, echo,
                                 1 if body.use_beam_search else body.n, echo_first, reasoning)
            out.with_timings = body.pdserve_timings
            if include_usage and body.stream_options.continuous_usage_stats:
                out.prompt_lens = [len(c.vreq.prompt_token_ids) for c in choices
                                   for _ in range(1 if body.use_beam_search else body.n)]
            return _StallCutResponse(self._sse(events, out), self._stalls, self._count_stall,
                                     media_type="text/event-stream")
        whole = rs.ResponseBody(rid, chat, model, len(choices) * body.n, n_prompt, detok,
                                plan.parser, echo, 1 if body.use_beam_search else body.n, echo_first, reasoning)
        whole.with_timings = body.pdserve_timings
        return await self._collect(events, whole)

    @staticmethod
    async def _watch_disconnect(request: Request, queue: asyncio.Queue) -> None:
        """Wait for the server's ``http.disconnect`` (the request body is already read, so the next ASGI message
        is that one: it comes when the client goes away, or once the response is complete), then tell the
        response's event loop. Cancelled when the response ends first."""
        while (await request.receive())["type"] != "http.disconnect":
            pass
        queue.put_nowait((-1, _DISCONNECTED))

    def _count_stall(self) -> None:
        if self.core.metrics is not None:
            self.core.metrics.inc_stream_stall("http")

    async def _events(self, choices: list[_Choice], queue: asyncio.Queue, request: Request,
                      lease: Lease) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, FlowEvent | FlowError) until every choice ended; a disconnect cancels them all. The
        quota ``lease`` is released at the end, however it comes, with the tokens the flows reported."""
        live = len(choices)
        completion: Optional[int] = None
        watcher = asyncio.ensure_future(self._watch_disconnect(request, queue))
        try:
            while live:
                idx, item = await queue.get()
                if item is _DISCONNECTED:
                    log.info("HTTP client went away: cancelling %d choice(s)", live)
                    return
                if item is None:
                    live -= 1
                    continue
                usage = getattr(item, "usage", None)
                if usage is not None:
                    completion = (completion or 0) + usage.completion_tokens
                yield idx, item
        finally:
            lease.release(completion)
            watcher.cancel()
            if live:
                for c in choices:
                    c.cancel()

    async def _collect(self, events: AsyncIterator, whole: rs.ResponseBody) -> Response:
        async for idx, item in events:
            if isinstance(item, FlowError):
                await events.aclose()
                return self._flow_error(item)
            whole.add(idx, item)
        return JSONResponse(whole.json())

    async def _sse(self, events: AsyncIterator, out: Any) -> AsyncIterator[str]:
        """``out``: an ``rs.EventStream`` (completions, chat) or ``ora.ResponseEventStream`` (/v1/responses)."""
        try:
            async for idx, item in events:
                if isinstance(item, FlowError):
                    yield out.error(item)
                    break
                data = out.chunk(idx, item)
                if data:
                    yield data
            keep = getattr(out, "keep", None)  # a Responses answer to keep: before its last event says it is kept
            if keep is not None:
                await keep()
            for tail in out.end():
                yield tail
        finally:
            await events.aclose()

    # ---- tokenizer endpoints (vLLM's) -------------------------------------------------------------------
    async def _body(self, request: Request, *models: Any) -> Any:
        """The JSON body as the first of ``models`` whose required fields it has (RequestValidationError -> 400)."""
        from pydantic import ValidationError

        try:
            raw = await request.json()
        except ValueError:
            raise RequestValidationError([{"loc": ("body",), "msg": "the body is not valid JSON"}]) from None
        if not isinstance(raw, dict):
            raise RequestValidationError([{"loc": ("body",), "msg": "the body must be a JSON object"}])
        model = models[-1] if "messages" in raw and len(models) > 1 else models[0]
        try:
            return model.model_validate(raw)
        except ValidationError as e:
            raise RequestValidationError(e.errors()) from None

    async def _count_tokens(self, body: "aa.CountTokensRequest") -> Response:
        """Anthropic's ``count_tokens``: the prompt's length as the Messages request would render it."""
        core = self.core
        lim = core.limits
        if lim is None or core.draining:
            return self._error(503, "router is not serving")
        if core.tokenizer is None:
            return self._error(400, "this model has no tokenizer")
        try:
            lim.lora_of(body.model)  # an adapter's tokenizer is its base model's
        except LookupError as e:
            return self._error(404, str(e), "model")
        try:
            chat, translation = aa.count_tokens_chat(body)
        except ValueError as e:
            return self._error(400, str(e), _leading_field(str(e)))
        self._template_defaults(chat)
        try:
            ids = await asyncio.to_thread(oa.chat_prompt_ids, chat, core.tokenizer, lim, template_tools(chat))
        except ValueError as e:
            msg = translation.relabel(str(e))
            return self._error(400, msg, _leading_field(msg))
        return JSONResponse({"input_tokens": len(ids)})

    def _template_defaults(self, body: Any) -> None:
        """The server's ``default_chat_template_kwargs`` under a chat body's own ``chat_template_kwargs``."""
        defaults = self.core.cfg.default_chat_template_kwargs
        if defaults and hasattr(body, "chat_template_kwargs"):
            body.chat_template_kwargs = {**defaults, **(body.chat_template_kwargs or {})}

    def _reasoning_of(self, body: Any, greqs: list) -> Optional[ReasoningPlan]:
        """With a reasoning parser: the request's ``ReasoningPlan`` for its renderers, each GenerateRequest marked
        (``reasoning``, ``thinking_token_budget``) when the answer opens in a block; None without one (a
        ``thinking_token_budget`` is then refused by name). The budget is checked here even where the prompt closed
        the block and it goes unused."""
        budget = getattr(body, "thinking_token_budget", None)
        if self.core.reasoning is None:
            if budget is not None:
                raise ValueError("thinking_token_budget needs a router started with --reasoning-parser; this one "
                                 "has none")
            return None
        fmt = self.core.reasoning[0]
        if budget is not None and not 0 <= budget < 2**31:
            raise ValueError(f"thinking_token_budget must be in [0, 2**31), got {budget}")
        continued = None
        if body.continue_final_message:
            final = body.messages[-1].content
            continued = final if isinstance(final, str) else ""
        tail = self.core.tokenizer.decode(list(greqs[0].token_ids[-32:]), False) if greqs[0].token_ids else ""
        open_ = opens_in_reasoning(fmt, tail, body.chat_template_kwargs, continued)
        if open_:
            for g in greqs:
                g.reasoning = True
                if budget is not None:
                    g.thinking_token_budget = budget
        return ReasoningPlan(fmt, open_, body.include_reasoning, self.core.reasoning[1].end)

    def _prompt_length(self, chat: oa.ChatCompletionRequest) -> Optional[int]:
        """A chat's prompt length in tokens as the chat path renders it (None: it cannot be rendered within the
        context, or at all)."""
        self._template_defaults(chat)
        try:
            return len(oa.chat_prompt_ids(chat, self.core.tokenizer, self.core.limits, template_tools(chat)))
        except ValueError:
            return None

    def _owner(self, request: Request) -> str:
        key = self._key(request)
        return owner_of(key.secret if key is not None else None)

    async def _stored(self, rid: str, request: Request, field: str,
                      delete: bool = False) -> Union[Response, StoredResponse]:
        """The stored response ``rid`` of the request's key (router/response_store.py), deleted with ``delete``;
        or the error answer naming ``field``: 404 when the router keeps none or has none of that id for this key,
        503 when the store is unreachable."""
        store = self.core.responses
        if store is None:
            self.core.count_error(grpc.StatusCode.NOT_FOUND if field == "response_id"
                                  else grpc.StatusCode.INVALID_ARGUMENT)
            return self._error(404 if field == "response_id" else 400,
                               f"{field}: this router keeps no responses (start it with --responses-store-ttl-s)",
                               field)
        owner = self._owner(request)
        try:
            found = await asyncio.to_thread(store.get, rid, owner)
            if found is not None and delete and not await asyncio.to_thread(store.delete, rid, owner):
                found = None  # (deleted meanwhile)
        except StoreUnavailable as e:
            self.core.count_error(grpc.StatusCode.UNAVAILABLE)
            return self._error(503, str(e))
        if found is None:
            self.core.count_error(grpc.StatusCode.NOT_FOUND)
            return self._error(404, f"{field}: no response {rid[:80]!r} is kept for this key (never made, expired "
                                    "or deleted)", field)
        return found

    async def _keep(self, collected: "ora.ResponseCollector", translation: "ora.ChatTranslation",
                    owner: str) -> None:
        """Store a finished response with its conversation (router/response_store.py); a failure is logged and
        the answer says ``store: false``."""
        if collected.reason is None or self.core.responses is None:
            return
        collected.stored = True
        stored = StoredResponse(collected.json_body(), ora.kept_items(translation.conversation) + collected.output(),
                                owner)
        try:
            await asyncio.to_thread(self.core.responses.put, collected.id, stored)
        except StoreUnavailable as e:
            collected.stored = False
            log.warning("response %s answered but not kept: %s", collected.id, e)

    async def _lora_admin(self, op: str, *args: str) -> Response:
        """A runtime LoRA load or unload (router/lora_admin.py): vLLM's plain-text success message, or the error
        with its HTTP status (off: 404, as vLLM without ``VLLM_ALLOW_RUNTIME_LORA_UPDATING``)."""
        from router.lora_admin import LoRAAdminError

        admin = self.core.lora_admin
        try:
            msg = await asyncio.to_thread(admin.load if op == "load" else admin.unload, *args)
        except LoRAAdminError as e:
            status = _LORA_HTTP.get(e.code, 400)
            param = _leading_field(e.message)
            return self._error(status, e.message, param if param in ("lora_name", "lora_path") else None)
        return PlainTextResponse(msg)

    async def _reset_prefix_cache(self) -> Response:
        """vLLM's ``POST /reset_prefix_cache`` on every ready worker (router/cache_reset.py): 200 with the workers
        reset; 409 naming those whose requests held blocks (the rest were reset); 503 naming those that did not
        answer; 404 unless ``allow_prefix_cache_reset``."""
        from router.cache_reset import reset_all

        if not self.core.cfg.allow_prefix_cache_reset:
            return self._error(404, "POST /reset_prefix_cache is off: start the cluster with "
                                    "--allow-prefix-cache-reset (RouterConfig.allow_prefix_cache_reset)")
        out = await asyncio.to_thread(reset_all, self.core)
        if out.failed:
            return self._error(503, "prefix cache reset: no answer from " + ", ".join(
                f"{w} ({why})" for w, why in out.failed.items()) + f"; reset: {', '.join(out.reset) or 'none'}")
        if out.busy:
            return self._error(409, "prefix cache reset refused while requests hold blocks on " + ", ".join(
                f"{w} ({n} blocks)" for w, n in out.busy.items()) + f"; reset: {', '.join(out.reset) or 'none'}; "
                "retry when they finish")
        log.info("prefix cache reset on %s", ", ".join(out.reset) or "no worker")
        return JSONResponse({"reset": out.reset})

    async def _tokenize(self, body: Any) -> Response:
        core = self.core
        if core.limits is None or core.draining:
            return self._error(503, "router is not serving")
        if core.tokenizer is None:
            return self._error(400, "this model has no tokenizer")
        try:
            core.limits.lora_of(body.model)  # an adapter's tokenizer is its base model's
        except LookupError as e:
            return self._error(404, str(e), "model")
        self._template_defaults(body)
        try:
            out = await asyncio.to_thread(oa.tokenize_json, body, core.tokenizer, core.limits)
        except ValueError as e:
            return self._error(400, str(e))
        return JSONResponse(out)

    async def _detokenize(self, body: Any) -> Response:
        core = self.core
        if core.limits is None or core.draining:
            return self._error(503, "router is not serving")
        try:
            core.limits.lora_of(body.model)  # an adapter's tokenizer is its base model's
        except LookupError as e:
            return self._error(404, str(e), "model")
        if core.tokenizer is None:
            return self._error(400, "this model has no tokenizer")
        if len(body.tokens) > core.limits.max_context_length:
            return self._error(400, f"tokens has {len(body.tokens)} ids; the context length is "
                                    f"{core.limits.max_context_length}", "tokens")
        for i, t in enumerate(body.tokens):
            if not 0 <= t < core.limits.vocab_size:
                return self._error(400, f"tokens[{i}] = {t} is outside the vocabulary [0, {core.limits.vocab_size})",
                                   "tokens")
        text = await asyncio.to_thread(core.tokenizer.decode, body.tokens, False)
        return JSONResponse({"prompt": text})

    def _flow_error(self, e: FlowError) -> JSONResponse:
        status, body = rs.flow_error(e)
        return JSONResponse(body, status_code=status)
