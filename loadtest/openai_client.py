"""The benchmark client of an OpenAI-compatible HTTP endpoint (``pdserve bench --backend openai``).

Lifecycle: ``fetch_openai_info(base_url, ...)`` polls ``GET /v1/models`` until the
server answers (up to ``--ready-timeout``) and returns the served model's name and
context length. ``run_openai_benchmark(cfg, requests, ...)`` then opens one
``httpx.AsyncClient`` (the API key as ``Authorization: Bearer``, TLS per
``ClientConfig.auth``), starts the clock and launches one task per request, exactly
as the gRPC client does: sleep until the scheduled offset, take a slot under
``max_concurrency``, then ``POST /v1/completions`` with the prompt as token ids (so
its length is exact), ``max_tokens`` plus ``ignore_eos`` (so the output length is
forced), ``stream: true`` and ``stream_options.include_usage``. Each server-sent
event that carries a choice is stamped on arrival, as the gRPC client stamps each
token-carrying message (vLLM's ``async_request_openai_completions`` does the same);
the final usage chunk gives the output token count, ``data: [DONE]`` ends the
stream. With ``embeddings`` (``--backend openai-embeddings``, vLLM's ``openai-embeddings``)
each request is one ``POST /v1/embeddings`` of its prompt's token ids instead: no tokens come
back, its one answer is stamped as its only chunk (so TTFT and E2EL are its latency) and the
report's request and input-token throughput are what an embedding server is measured by.
Records are the same ``RequestRecord``s, so stats and reports do not care
which front end was measured. A request error never ends the run: it is recorded
as ``HTTP <status>: <message>`` (or the transport's error).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
from typing import Callable, Optional
from urllib.parse import urlsplit

import httpx

from transport.client_auth import ClientAuth
from loadtest.client import ClientConfig, scheduled, send_all
from loadtest.stats import TTFT_PHASES, RequestRecord
from loadtest.workload import BenchRequest

log = logging.getLogger(__name__)

COMPLETIONS_PATH = "/v1/completions"
EMBEDDINGS_PATH = "/v1/embeddings"


def check_base_url(base_url: str) -> str:
    """``http(s)://host:port`` without a trailing slash, else ValueError naming --base-url."""
    parts = urlsplit(base_url or "")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise ValueError(f"--base-url must be http://HOST:PORT or https://HOST:PORT, got {base_url!r}")
    try:
        parts.port
    except ValueError:
        raise ValueError(f"--base-url has a bad port: {base_url!r}") from None
    if parts.query or parts.fragment:
        raise ValueError(f"--base-url must not carry a query or fragment, got {base_url!r}")
    url = base_url.rstrip("/")
    if url.endswith("/v1"):  # vLLM's --base-url is the server root; accept the OpenAI SDK's .../v1 too
        url = url[:-3]
    return url


def _client(cfg_auth: ClientAuth, timeout_s: float) -> httpx.AsyncClient:
    ctx = cfg_auth.ssl_context()
    # No pool cap: concurrency is the schedule's and --max-concurrency's business, as with one gRPC channel.
    return httpx.AsyncClient(headers=cfg_auth.http_headers(), verify=ctx if ctx is not None else True,
                             timeout=httpx.Timeout(timeout_s), trust_env=False,
                             limits=httpx.Limits(max_connections=None, max_keepalive_connections=None))


def _error_text(status: int, body: bytes) -> str:
    try:
        msg = json.loads(body)["error"]["message"]
    except (ValueError, KeyError, TypeError):
        msg = body.decode("utf-8", "replace")[:200]
    return f"HTTP {status}: {msg}"


async def fetch_openai_info(base_url: str, timeout_s: float = 30.0, auth: Optional[ClientAuth] = None
                            ) -> tuple[str, int]:
    """(model id, max_model_len or 0) from ``GET /v1/models``, retrying until ``timeout_s``.

    ConnectionError when the server never answered, ValueError on an answer that is not a model list
    (e.g. HTTP 401: a missing or wrong API key).
    """
    base_url = check_base_url(base_url)
    auth = auth or ClientAuth()
    deadline = time.monotonic() + timeout_s
    async with _client(auth, min(timeout_s, 10.0) if timeout_s > 0 else 10.0) as client:
        while True:
            try:
                resp = await client.get(f"{base_url}/v1/models")
            except httpx.TransportError as e:
                if time.monotonic() >= deadline:
                    raise ConnectionError(f"{type(e).__name__}: {e}") from None
                await asyncio.sleep(0.2)
                continue
            if resp.status_code == 503 and time.monotonic() < deadline:  # up but not serving yet
                await asyncio.sleep(0.2)
                continue
            if resp.status_code != 200:
                raise ValueError(f"GET /v1/models: {_error_text(resp.status_code, resp.content)}")
            data = resp.json().get("data") or []
            if not data:
                if time.monotonic() < deadline:
                    await asyncio.sleep(0.2)
                    continue
                raise ValueError("GET /v1/models: the server lists no model")
            return str(data[0]["id"]), int(data[0].get("max_model_len") or 0)


def completion_body(req: BenchRequest, model: str, temperature: float, pdserve_timings: bool = False) -> dict:
    """The ``/v1/completions`` body of one benchmark request (``pdserve_timings``: ask pdserve's extension for the
    server's breakdown of TTFT in the usage chunk; other servers would not know the field)."""
    body = {"model": req.model or model, "prompt": req.prompt_token_ids, "max_tokens": req.max_tokens, "ignore_eos": True,
            "temperature": temperature, "stream": True, "stream_options": {"include_usage": True}}
    if pdserve_timings:
        body["pdserve_timings"] = True
    return body


async def _send_one(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest, cfg: ClientConfig,
                    t0: float, sem: Optional[asyncio.Semaphore]) -> RequestRecord:
    async with scheduled(req, t0, sem) as rec:
        body = completion_body(req, model, cfg.temperature, cfg.pdserve_timings)
        rec.start_s = time.perf_counter() - t0
        usage_tokens = 0
        texts: list[str] = []

        async def stream() -> None:
            nonlocal usage_tokens
            async with client.stream("POST", url, json=body, headers={"X-Request-Id": req.request_id}) as resp:
                if resp.status_code != 200:
                    rec.error = _error_text(resp.status_code, await resp.aread())
                    return
                async for line in resp.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments
                    payload = line[5:].strip()
                    if payload == "[DONE]":
                        return
                    now = time.perf_counter() - t0
                    data = json.loads(payload)
                    if "error" in data:  # an error after the stream began (OpenAI's shape, in band)
                        err = data["error"]
                        rec.error = f"HTTP {err.get('code', 500)}: {err.get('message', '')}"
                        return
                    for choice in data.get("choices") or []:
                        rec.chunk_times_s.append(now)
                        rec.chunk_tokens.append(1)  # SSE does not say; vLLM counts a chunk as one
                        rec.end_s = now  # E2EL ends at the last chunk with a choice (vLLM's rule)
                        texts.append(choice.get("text") or "")
                        if choice.get("finish_reason"):
                            rec.finish_reason = choice["finish_reason"]
                    if data.get("usage"):
                        usage_tokens = int(data["usage"].get("completion_tokens") or 0)
                        timings = data["usage"].get("pdserve_timings") or []
                        if timings and isinstance(timings[0], dict):
                            rec.ttft_phases_s = {ph: float(timings[0].get(f"{ph}_s", 0.0)) for ph in TTFT_PHASES}

        try:
            await asyncio.wait_for(stream(), cfg.request_timeout_s)
        except asyncio.TimeoutError:
            rec.error = f"DEADLINE_EXCEEDED: no complete answer within {cfg.request_timeout_s} s"
        except httpx.HTTPError as e:
            rec.error = f"{type(e).__name__}: {e}"
        except ValueError as e:  # a data line that is not JSON
            rec.error = f"BAD_STREAM: {e}"
        rec.generated_text = "".join(texts)
        rec.output_tokens = usage_tokens or len(rec.chunk_times_s)
        if rec.error:
            rec.end_s = time.perf_counter() - t0
            rec.output_tokens = len(rec.chunk_times_s)
            log.warning("request %s failed: %s", req.request_id, rec.error)
        elif rec.finish_reason == "abort":
            rec.error = "finish_reason=abort"
        elif not rec.chunk_times_s:
            rec.end_s = time.perf_counter() - t0
            rec.error = "stream ended without tokens"
        else:
            rec.success = True
    return rec


async def _embed_one(client: httpx.AsyncClient, url: str, model: str, req: BenchRequest, cfg: ClientConfig,
                     t0: float, sem: Optional[asyncio.Semaphore]) -> RequestRecord:
    """One ``POST /v1/embeddings`` of ``req``'s prompt (see module docstring)."""
    async with scheduled(req, t0, sem) as rec:
        body = {"model": req.model or model, "input": req.prompt_token_ids, "encoding_format": "base64"}
        rec.start_s = time.perf_counter() - t0
        try:
            resp = await client.post(url, json=body, headers={"X-Request-Id": req.request_id},
                                     timeout=cfg.request_timeout_s)
            now = time.perf_counter() - t0
            if resp.status_code != 200:
                rec.error = _error_text(resp.status_code, resp.content)
            elif not (resp.json().get("data") or [{}])[0].get("embedding"):
                rec.error = "BAD_ANSWER: no embedding in the answer"
            else:
                rec.chunk_times_s.append(now)
                rec.chunk_tokens.append(0)
                rec.success, rec.finish_reason = True, "stop"
            rec.end_s = now
        except httpx.TimeoutException:
            rec.error = f"DEADLINE_EXCEEDED: no answer within {cfg.request_timeout_s} s"
        except (httpx.HTTPError, ValueError) as e:
            rec.error = f"{type(e).__name__}: {e}"
        if rec.error:
            rec.end_s = time.perf_counter() - t0
            log.warning("request %s failed: %s", req.request_id, rec.error)
    return rec


async def run_openai_benchmark(cfg: ClientConfig, base_url: str, model: str, requests: list[BenchRequest],
                               on_done: Optional[Callable[[RequestRecord], None]] = None,
                               embeddings: bool = False) -> tuple[list[RequestRecord], float]:
    """Send ``requests`` to ``base_url``'s ``/v1/completions`` (``embeddings``: ``/v1/embeddings``) on their
    schedule; (records, wall duration s)."""
    url = check_base_url(base_url) + (EMBEDDINGS_PATH if embeddings else COMPLETIONS_PATH)
    if cfg.max_concurrency is not None and cfg.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {cfg.max_concurrency}")
    if not cfg.request_timeout_s > 0:
        raise ValueError(f"request_timeout must be > 0 s, got {cfg.request_timeout_s}")
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    async with _client(cfg.auth, cfg.request_timeout_s) as client:
        one = _embed_one if embeddings else _send_one
        return await send_all(requests, lambda req, t0: one(client, url, model, req, cfg, t0, sem), on_done)
