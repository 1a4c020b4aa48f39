"""The benchmark client: sends a workload to a PDServe endpoint and times every streamed message.

Lifecycle: ``run_benchmark(target, requests, ...)`` opens one ``grpc.aio``
channel (TLS and an API key per ``ClientConfig.auth``), starts the clock, and
launches one task per request; each task sleeps until its scheduled offset,
waits for a slot under ``max_concurrency`` (if any), sends ``Generate`` with
the prompt's token ids, ``max_tokens`` and ``ignore_eos=True`` (so the output
length is forced), and stamps each streamed message that carries tokens on the
client's monotonic clock. When every task has ended (a finished stream, an RPC
error or the per-request deadline), the channel is closed and the records plus
the wall duration are returned. A request error never ends the run; it is
recorded with its gRPC status.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass, field
from typing import AsyncIterator, Awaitable, Callable, Optional

import grpc

from transport.client_auth import ClientAuth
from loadtest.stats import RequestRecord
from loadtest.workload import BenchRequest, ModelLimits
from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc

log = logging.getLogger(__name__)


@dataclass
class ClientConfig:
    """How requests are sent."""

    target: str
    """HOST:PORT of the router (or any PDServe endpoint)."""
    temperature: float = 0.0
    """Sampling temperature sent with every request (0 = greedy)."""
    max_concurrency: Optional[int] = None
    """At most this many requests in flight; None = no cap beyond the arrival schedule."""
    request_timeout_s: float = 600.0
    """gRPC deadline of each Generate call."""
    auth: ClientAuth = field(default_factory=ClientAuth)
    """API key and TLS settings (``transport.client_auth``); the default is a plaintext channel without a key."""
    pdserve_timings: bool = False
    """OpenAI backend: ask pdserve's ``pdserve_timings`` extension for the server's TTFT phases (the gRPC API always
    sends them)."""


def check_target(target: str) -> str:
    """HOST:PORT with a numeric port, else ValueError naming --target."""
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"target must be HOST:PORT, got {target!r}")
    return target


async def fetch_model_info(target: str, timeout_s: float = 30.0, auth: Optional[ClientAuth] = None
                           ) -> pb.ModelInfo:
    """GetModelInfo, waiting up to ``timeout_s`` for the server to come up."""
    check_target(target)
    auth = auth or ClientAuth()
    async with auth.aio_channel(target) as channel:
        stub = pb_grpc.PDServeStub(channel)
        return await stub.GetModelInfo(pb.GetModelInfoRequest(), timeout=timeout_s, wait_for_ready=True,
                                       metadata=auth.metadata())


def limits_from_info(info: pb.ModelInfo) -> ModelLimits:
    """The limits a workload must respect, from the server's ModelInfo."""
    return ModelLimits(vocab_size=info.vocab_size, max_context_length=info.max_context_length,
                       max_prompt_tokens=info.max_prompt_tokens, max_new_tokens=info.max_new_tokens)


@contextlib.asynccontextmanager
async def scheduled(req: BenchRequest, t0: float, sem: Optional[asyncio.Semaphore]) -> AsyncIterator[RequestRecord]:
    """Wait for ``req``'s arrival time and a concurrency slot; yield its record; give the slot back.
    Both backends (gRPC here, OpenAI in loadtest.openai_client) send every request inside this."""
    rec = RequestRecord(request_id=req.request_id, prompt_len=len(req.prompt_token_ids),
                        expected_output_len=req.max_tokens, scheduled_s=req.arrival_s)
    delay = t0 + req.arrival_s - time.perf_counter()
    if delay > 0:
        await asyncio.sleep(delay)
    if sem is not None:
        await sem.acquire()
    try:
        yield rec
    finally:
        if sem is not None:
            sem.release()


async def send_all(requests: list[BenchRequest],
                   send: Callable[[BenchRequest, float], Awaitable[RequestRecord]],
                   on_done: Optional[Callable[[RequestRecord], None]] = None) -> tuple[list[RequestRecord], float]:
    """Send every request at once (each waits for its own arrival time inside ``send(req, t0)``); returns the
    records and the wall time from the common start ``t0``. Shared by both backends."""
    t0 = time.perf_counter()

    async def one(req: BenchRequest) -> RequestRecord:
        rec = await send(req, t0)
        if on_done is not None:
            on_done(rec)
        return rec

    records = await asyncio.gather(*(one(r) for r in requests))
    return list(records), time.perf_counter() - t0


async def _send_one(stub: pb_grpc.PDServeStub, req: BenchRequest, cfg: ClientConfig, t0: float,
                    sem: Optional[asyncio.Semaphore]) -> RequestRecord:
    async with scheduled(req, t0, sem) as rec:
        message = pb.GenerateRequest(request_id=req.request_id, token_ids=req.prompt_token_ids,
                                     max_tokens=req.max_tokens, temperature=cfg.temperature, ignore_eos=True,
                                     model=req.model)
        rec.start_s = time.perf_counter() - t0
        usage_tokens = 0
        call = stub.Generate(message, timeout=cfg.request_timeout_s, metadata=cfg.auth.metadata())
        try:
            last_msg_s = rec.start_s
            async for resp in call:
                now = last_msg_s = time.perf_counter() - t0
                rec.generated_text += resp.text
                if resp.token_ids:
                    rec.chunk_times_s.append(now)
                    rec.chunk_tokens.append(len(resp.token_ids))
                    rec.token_ids.extend(resp.token_ids)
                if resp.finish_reason:
                    rec.finish_reason = resp.finish_reason
                if resp.HasField("usage"):
                    usage_tokens = resp.usage.completion_tokens
                if resp.HasField("timings"):
                    tm = resp.timings
                    rec.ttft_phases_s = {"placement": tm.placement_s, "worker_queue": tm.worker_queue_s,
                                         "prefill": tm.prefill_s,
                                         "delivery": max(0.0, tm.ttft_s - tm.placement_s - tm.worker_queue_s
                                                         - tm.prefill_s)}
            # E2EL ends at the last message, not at the stream's trailing status (vLLM: most_recent_timestamp).
            rec.end_s = last_msg_s
            rec.output_tokens = usage_tokens or sum(rec.chunk_tokens)
            if rec.finish_reason == "abort":
                rec.error = "finish_reason=abort"
            elif not rec.chunk_times_s:
                rec.error = "stream ended without tokens"
            else:
                rec.success = True
        except grpc.aio.AioRpcError as e:
            rec.end_s = time.perf_counter() - t0
            rec.output_tokens = sum(rec.chunk_tokens)
            rec.error = f"{e.code().name}: {e.details()}"
            log.warning("request %s failed: %s", req.request_id, rec.error)
        except asyncio.CancelledError:
            call.cancel()
            raise
    return rec


async def run_benchmark(cfg: ClientConfig, requests: list[BenchRequest],
                        on_done: Optional[Callable[[RequestRecord], None]] = None
                        ) -> tuple[list[RequestRecord], float]:
    """Send ``requests`` on their schedule; returns (records in request order, wall duration in s)."""
    check_target(cfg.target)
    if cfg.max_concurrency is not None and cfg.max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {cfg.max_concurrency}")
    if not cfg.request_timeout_s > 0:
        raise ValueError(f"request_timeout must be > 0 s, got {cfg.request_timeout_s}")
    sem = asyncio.Semaphore(cfg.max_concurrency) if cfg.max_concurrency else None
    # Many concurrent streams share one HTTP/2 connection, as a real client's would.
    async with cfg.auth.aio_channel(cfg.target) as channel:
        stub = pb_grpc.PDServeStub(channel)
        return await send_all(requests, lambda req, t0: _send_one(stub, req, cfg, t0, sem), on_done)
