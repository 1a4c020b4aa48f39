"""A tiny grpc.aio PDServe server for unit tests of the load-test client layer (not the real router).

It runs its own event loop on a thread, binds a free loopback port, and streams
fake tokens with fixed sleeps (first token after ``ttft_s``, then one token per
``itl_s``) so the client's measured latencies have known lower bounds.
"""
from __future__ import annotations

import asyncio
import threading
from dataclasses import dataclass, field

import grpc

from proto import pdserve_pb2 as pb
from proto import pdserve_pb2_grpc as pb_grpc


@dataclass
class FakeConfig:
    """Behaviour of the fake server."""

    ttft_s: float = 0.05
    itl_s: float = 0.02
    fail_every: int = 0
    """Requests whose index (the id's last part) is a multiple of this fail with RESOURCE_EXHAUSTED (0: none)."""
    vocab_size: int = 1000
    max_context_length: int = 256
    max_new_tokens: int = 8
    max_prompt_tokens: int = 200


@dataclass
class Seen:
    requests: list = field(default_factory=list)
    in_flight: int = 0
    peak_in_flight: int = 0


class _Servicer(pb_grpc.PDServeServicer):
    def __init__(self, cfg: FakeConfig, seen: Seen):
        self.cfg, self.seen = cfg, seen

    async def GetModelInfo(self, request, context):
        c = self.cfg
        return pb.ModelInfo(model_name="fake", vocab_size=c.vocab_size, max_context_length=c.max_context_length,
                            max_new_tokens=c.max_new_tokens, max_prompt_tokens=c.max_prompt_tokens,
                            mode="disaggregated")

    async def Generate(self, request, context):
        self.seen.requests.append(request)
        self.seen.in_flight += 1
        self.seen.peak_in_flight = max(self.seen.peak_in_flight, self.seen.in_flight)
        try:
            idx = int(request.request_id.rsplit("-", 1)[-1])
            if self.cfg.fail_every and idx % self.cfg.fail_every == 0:
                await context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, "fake overload")
            n = request.max_tokens
            await asyncio.sleep(self.cfg.ttft_s)
            for i in range(n):
                if i:
                    await asyncio.sleep(self.cfg.itl_s)
                last = i == n - 1
                yield pb.GenerateResponse(
                    request_id=request.request_id, token_ids=[7], text="x",
                    finish_reason="length" if last else "",
                    usage=pb.Usage(prompt_tokens=len(request.token_ids), completion_tokens=n) if last else None)
        finally:
            self.seen.in_flight -= 1


class FakePDServe:
    """Context manager: ``with FakePDServe(cfg) as srv: srv.target``."""

    def __init__(self, cfg: FakeConfig | None = None):
        self.cfg = cfg or FakeConfig()
        self.seen = Seen()
        self.target = ""
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: grpc.aio.Server | None = None

    async def _start(self) -> int:
        self._server = grpc.aio.server()
        pb_grpc.add_PDServeServicer_to_server(_Servicer(self.cfg, self.seen), self._server)
        port = self._server.add_insecure_port("127.0.0.1:0")
        await self._server.start()
        return port

    def __enter__(self) -> "FakePDServe":
        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(10)
        self.target = f"127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._server.stop(grace=None), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
