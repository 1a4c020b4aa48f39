"""The router's OpenAI-compatible HTTP front end (FastAPI on uvicorn), over the same ``RouterCore`` as gRPC.

Lifecycle: ``HttpApi(core, host, port, api_keys)`` -> ``start()`` binds (port 0 = a free one) and
serves on a uvicorn thread of its own; ``stop()`` shuts it down. Endpoints, as vLLM's server
has them: ``GET /health`` (200 while the router serves, else 503), ``GET /metrics`` (the router's
Prometheus series), ``GET /v1/models``, ``POST /v1/completions``, ``POST /v1/chat/completions``.
A request body is parsed (pydantic), turned into the gRPC-shaped ``GenerateRequest`` and validated
by the same ``validate_generate`` as gRPC, then each choice runs as one ``RequestFlow`` through
``core.generate`` on a worker thread (the flows block on gRPC calls to the workers); its
``FlowEvent``s become a JSON response or server-sent events ending in ``data: [DONE]``. A client
that disconnects cancels its flows (the workers free its blocks). Errors are OpenAI's JSON shape
with the HTTP status matching the flow's status code. With API keys configured every ``/v1``
call needs ``Authorization: Bearer <key>`` (401 otherwise); ``/health`` and ``/metrics`` stay open.

``n`` > 1 is one flow per prompt whose n choices share one prefill and one KV transfer (choice i
samples with ``seed + i``), as in gRPC. ``use_beam_search`` (vLLM's) makes ``n`` the beam width: the flow is a
beam search (``router.beam_search``) whose n best sequences are the choices, best first; not streamed.
"""
from __future__ import annotations

import asyncio
import hmac
import json
import logging
import socket
import ssl
import threading
import time
from typing import Any, AsyncIterator, Callable, Iterable, Optional

import grpc
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from router import openai_protocol as oa
from router.core import RouterCore
from router.events import FlowError
from router.validation import MAX_BEAM_WIDTH, validate_generate
from transport.tls import TlsFiles

log = logging.getLogger(__name__)


class _Choice:
    """One flow (one prompt, its ``n`` choices) running on its own thread, its events pushed to an asyncio queue
    as (choice index over the whole request, item): prompt ``index`` owns choices ``index * n ..``."""

    def __init__(self, core: RouterCore, index: int, greq: Any, loop: asyncio.AbstractEventLoop,
                 out: "asyncio.Queue[tuple[int, Any]]", timeout_s: Optional[float], n: int = 1) -> None:
        self.index = index
        self.n = n
        self._cancel: list[Callable[[], None]] = []
        self._cancelled = False
        self._core, self._greq, self._loop, self._out, self._timeout_s = core, greq, loop, out, timeout_s
        self.vreq = validate_generate(greq, core.limits, core.tokenize)  # ValueError -> 400, before any work
        self._thread = threading.Thread(target=self._run, name=f"http-{self.vreq.request_id}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _on_cancel(self, cb: Callable[[], None]) -> None:
        self._cancel.append(cb)
        if self._cancelled:
            cb()

    def cancel(self) -> None:
        self._cancelled = True
        for cb in list(self._cancel):
            cb()

    def _put(self, item: Any, choice: int = 0) -> None:
        self._loop.call_soon_threadsafe(self._out.put_nowait, (self.index * self.n + choice, item))

    def _run(self) -> None:
        try:
            for ev in self._core.generate(self.vreq, time.monotonic(), self._timeout_s, self._on_cancel):
                self._put(ev, ev.index)
        except FlowError as e:
            self._core.count_error(e.code)
            self._put(e)
        except Exception:  # a bug: logged whole, answered without internals
            log.exception("request %s: unexpected router error", self.vreq.request_id)
            self._core.count_error(grpc.StatusCode.UNAVAILABLE)
            self._put(FlowError(grpc.StatusCode.UNAVAILABLE, f"request {self.vreq.request_id}: the router "
                                                             f"failed to serve it (logged); retry"))
        self._put(None)


class HttpApi:
    """OpenAI-compatible HTTP server in the router process (see module docstring)."""

    def __init__(self, core: RouterCore, host: str = "127.0.0.1", port: int = 0,
                 api_keys: Iterable[str] = (), tls: Optional[TlsFiles] = None) -> None:
        """``tls``: serve HTTPS with the same certificate (and client CA, for mutual TLS) as the gRPC API."""
        if not 0 <= port < 65536:
            raise ValueError(f"http port must be in [0, 65535], got {port}")
        self.core = core
        self.host, self._port = host, port
        self._keys = [k.encode() for k in api_keys if k]
        self._tls = tls
        self.app = self._build_app()
        self._server: Optional[uvicorn.Server] = None
        self._thread: Optional[threading.Thread] = None
        self.address = ""

    # ---- lifecycle ---------------------------------------------------------------------------------
    def start(self) -> str:
        sock = socket.socket(socket.AF_INET6 if ":" in self.host else socket.AF_INET)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((self.host, self._port))
        tls_kw: dict = {}
        if self._tls is not None:
            tls_kw = dict(ssl_certfile=self._tls.certfile, ssl_keyfile=self._tls.keyfile)
            if self._tls.ca_certs:
                tls_kw.update(ssl_ca_certs=self._tls.ca_certs, ssl_cert_reqs=ssl.CERT_REQUIRED)
        config = uvicorn.Config(self.app, log_level="warning", access_log=False, lifespan="off",
                                timeout_graceful_shutdown=1, **tls_kw)
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]},
                                        name="router-http", daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30.0
        while not self._server.started:
            if not self._thread.is_alive() or time.monotonic() > deadline:
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
        self._server = self._thread = None

    # ---- the app -----------------------------------------------------------------------------------
    def _authorized(self, request: Request) -> bool:
        if not self._keys:
            return True
        raw = request.headers.get("authorization", "").encode()
        presented = raw[7:].strip() if raw[:7].lower() == b"bearer " else b""
        ok = False
        for key in self._keys:
            ok |= hmac.compare_digest(presented, key)
        return ok

    def _build_app(self) -> FastAPI:
        app = FastAPI(title="pdserve", docs_url=None, redoc_url=None, openapi_url=None)

        @app.middleware("http")
        async def auth(request: Request, call_next: Any) -> Response:
            if request.url.path.startswith("/v1") and not self._authorized(request):
                return JSONResponse(oa.error_body(401, "missing or invalid API key (send 'Authorization: Bearer "
                                                       "<key>')"), status_code=401)
            return await call_next(request)

        @app.exception_handler(RequestValidationError)
        async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
            first = exc.errors()[0] if exc.errors() else {}
            where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
            return JSONResponse(oa.error_body(400, f"{where}: {first.get('msg', 'invalid request')}", where or None),
                                status_code=400)

        @app.exception_handler(Exception)
        async def unexpected(request: Request, exc: Exception) -> JSONResponse:
            log.error("HTTP %s %s: unexpected router error", request.method, request.url.path, exc_info=exc)
            return JSONResponse(oa.error_body(503, "the router failed to serve this request (logged); retry"),
                                status_code=503)

        @app.get("/health")
        async def health() -> Response:
            ok = self.core.limits is not None and not self.core.draining
            return Response(status_code=200 if ok else 503)

        @app.get("/metrics")
        async def metrics() -> Response:
            from prometheus_client import CONTENT_TYPE_LATEST

            body = self.core.metrics.render() if self.core.metrics is not None else b""
            return Response(body, media_type=CONTENT_TYPE_LATEST)

        @app.get("/v1/models")
        async def models() -> JSONResponse:
            lim = self.core.limits
            data = [] if lim is None else [{"id": lim.model_name, "object": "model", "created": oa.created(),
                                            "owned_by": "pdserve", "max_model_len": lim.max_context_length}]
            return JSONResponse({"object": "list", "data": data})

        @app.post("/v1/completions")
        async def completions(body: oa.CompletionRequest, request: Request) -> Response:
            return await self._serve(request, body, chat=False)

        @app.post("/v1/chat/completions")
        async def chat(body: oa.ChatCompletionRequest, request: Request) -> Response:
            return await self._serve(request, body, chat=True)

        return app

    # ---- requests ----------------------------------------------------------------------------------
    def _error(self, status: int, message: str, param: Optional[str] = None) -> JSONResponse:
        return JSONResponse(oa.error_body(status, message, param), status_code=status)

    def _generate_requests(self, body: Any, chat: bool) -> list[Any]:
        """One GenerateRequest per choice (prompts x n); ValueError names the bad field."""
        lim = self.core.limits
        if body.model is not None and body.model != lim.model_name:
            raise LookupError(f"model {body.model!r} does not exist; this server serves {lim.model_name!r}")
        if not 1 <= body.n <= 16:
            raise ValueError(f"n must be in [1, 16], got {body.n}")
        if chat:
            max_tokens = body.max_completion_tokens if body.max_completion_tokens is not None else body.max_tokens
            lp = (body.top_logprobs or 0) if body.logprobs else None
            if body.top_logprobs is not None and not body.logprobs:
                raise ValueError("top_logprobs needs logprobs: true")
            prompts = [self._render_chat(body)]
        else:
            if body.echo or body.suffix or (body.best_of not in (None, 1, body.n)):
                raise ValueError("echo, suffix and best_of are not supported")
            max_tokens, lp = body.max_tokens, body.logprobs
            p = body.prompt
            prompts = [p] if isinstance(p, str) or (p and isinstance(p[0], int)) else list(p)
            if not prompts:
                raise ValueError("prompt is empty")
        out = []
        for prompt in prompts:  # one flow per prompt; its n choices share one prefill (choice i: seed + i)
            kw = dict(prompt=prompt) if isinstance(prompt, str) else dict(token_ids=list(prompt))
            g = oa.to_generate_request(body, logprobs=lp, max_tokens=max_tokens, seed=body.seed, **kw)
            if body.use_beam_search:
                if body.n > MAX_BEAM_WIDTH:
                    raise ValueError(f"n (the beam width, with use_beam_search) must be in [1, {MAX_BEAM_WIDTH}], "
                                     f"got {body.n}")
            else:
                g.n = body.n
            out.append(g)
        return out

    def _render_chat(self, body: oa.ChatCompletionRequest) -> list[int]:
        tok = self.core.tokenizer
        if tok is None or tok.chat_template is None:
            raise ValueError("messages: this model has no chat template; use /v1/completions")
        text = tok.apply_chat_template(oa.message_dicts(body), add_generation_prompt=True)
        lim = self.core.limits
        if lim.max_prompt_bytes is not None and len(text.encode("utf-8", "surrogatepass")) > lim.max_prompt_bytes:
            raise ValueError(f"messages: the conversation is longer than the context length "
                             f"({lim.max_context_length} tokens) can hold")
        return tok.encode(text, add_special_tokens=False)  # the template already has the special tokens

    async def _serve(self, request: Request, body: Any, chat: bool) -> Response:
        core = self.core
        if core.limits is None or core.draining:
            return self._error(503, "router is not serving")
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()

        def prepare() -> list[_Choice]:  # tokenizing: off the event loop
            return [_Choice(core, i, g, loop, queue, None, body.n)
                    for i, g in enumerate(self._generate_requests(body, chat))]

        try:
            choices = await asyncio.to_thread(prepare)
        except LookupError as e:
            core.count_error(grpc.StatusCode.NOT_FOUND)
            return self._error(404, str(e), "model")
        except ValueError as e:
            core.count_error(grpc.StatusCode.INVALID_ARGUMENT)
            return self._error(400, str(e))
        n_prompt = sum(len(c.vreq.prompt_token_ids) for c in choices)
        rid = oa.new_id("chatcmpl" if chat else "cmpl")
        for c in choices:
            c.start()
        events = self._events(choices, queue, request)
        if body.stream:
            include_usage = bool(body.stream_options and body.stream_options.include_usage)
            return StreamingResponse(self._sse(events, rid, chat, body.model or core.limits.model_name,
                                               include_usage, n_prompt), media_type="text/event-stream")
        return await self._collect(events, rid, chat, len(choices) * body.n, n_prompt)

    async def _events(self, choices: list[_Choice], queue: asyncio.Queue,
                      request: Request) -> AsyncIterator[tuple[int, Any]]:
        """(choice index, FlowEvent | FlowError) until every choice ended; a disconnect cancels them all."""
        live = len(choices)
        try:
            while live:
                try:
                    idx, item = await asyncio.wait_for(queue.get(), timeout=0.5)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        log.info("HTTP client went away: cancelling %d choice(s)", live)
                        return
                    continue
                if item is None:
                    live -= 1
                    continue
                yield idx, item
        finally:
            if live:
                for c in choices:
                    c.cancel()

    async def _collect(self, events: AsyncIterator, rid: str, chat: bool, n: int, n_prompt: int) -> Response:
        texts, reasons, lps, usages = [""] * n, [None] * n, [None] * n, []
        detok = self._detok()
        async for idx, item in events:
            if isinstance(item, FlowError):
                await events.aclose()
                return self._flow_error(item)
            texts[idx] += item.text
            if item.logprobs is not None:
                block = oa.chat_logprobs(item, detok) if chat else oa.completion_logprobs(item, detok, len(texts[idx]))
                if lps[idx] is None:
                    lps[idx] = block
                else:
                    for k, v in block.items():
                        lps[idx][k] = lps[idx][k] + v
            if item.finish_reason:
                reasons[idx] = item.finish_reason
            if item.usage is not None:  # the last event of a flow: its choices' tokens together
                usages.append(item.usage)
        model = self.core.limits.model_name
        if chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": texts[i]}, "logprobs": lps[i],
                        "finish_reason": reasons[i]} for i in range(n)]
            obj = "chat.completion"
        else:
            choices = [{"index": i, "text": texts[i], "logprobs": lps[i], "finish_reason": reasons[i]}
                       for i in range(n)]
            obj = "text_completion"
        return JSONResponse({"id": rid, "object": obj, "created": oa.created(), "model": model, "choices": choices,
                             "usage": oa.usage_json(usages, n_prompt)})

    async def _sse(self, events: AsyncIterator, rid: str, chat: bool, model: str, include_usage: bool,
                   n_prompt: int) -> AsyncIterator[str]:
        obj = "chat.completion.chunk" if chat else "text_completion"
        started: set[int] = set()
        usages = []
        detok = self._detok()
        offsets: dict[int, int] = {}

        def chunk(choices: list, usage: Optional[dict] = None) -> str:
            body = {"id": rid, "object": obj, "created": oa.created(), "model": model, "choices": choices}
            if include_usage:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        try:
            async for idx, item in events:
                if isinstance(item, FlowError):
                    status = oa.HTTP_STATUS.get(item.code, 500)
                    yield f"data: {json.dumps(oa.error_body(status, item.message))}\n\n"
                    break
                if chat:
                    delta: dict = {} if idx in started else {"role": "assistant"}
                    started.add(idx)
                    if item.text:
                        delta["content"] = item.text
                    choice = {"index": idx, "delta": delta, "logprobs": oa.chat_logprobs(item, detok),
                              "finish_reason": item.finish_reason}
                else:
                    choice = {"index": idx, "text": item.text, "finish_reason": item.finish_reason,
                              "logprobs": oa.completion_logprobs(item, detok, offsets.get(idx, 0))}
                    offsets[idx] = offsets.get(idx, 0) + len(item.text)
                if item.usage is not None:
                    usages.append(item.usage)
                yield chunk([choice])
            if include_usage:
                yield chunk([], oa.usage_json(usages, n_prompt))
            yield "data: [DONE]\n\n"
        finally:
            await events.aclose()

    def _flow_error(self, e: FlowError) -> JSONResponse:
        return self._error(oa.HTTP_STATUS.get(e.code, 500), e.message)

    def _detok(self) -> Callable[[int], str]:
        tok = self.core.tokenizer
        return (lambda t: tok.decode([t], skip_special_tokens=False)) if tok is not None else str
