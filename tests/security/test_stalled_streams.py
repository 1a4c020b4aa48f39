"""A streaming client that stops reading is cut off after the router's stall timeout, and its request is freed.

A real router (gRPC and HTTP on free ports, ``stream_stall_timeout_s`` = 1 s) in front of a real colocated worker
on the tiny model. Each client asks for a long stream (2,000 tokens with 20 logprobs each, several seconds of
decoding and megabytes of responses) and stops reading after its first message:

- gRPC: a raw channel with a small HTTP/2 receive window (no BDP probing, 4 KiB lookahead), so the router's
  sends wait on flow control once the client stops reading. The client sees ``CANCELLED`` (the router reset
  the stream) when it reads again.
- HTTP: a raw socket with a 4 KiB receive buffer sends a ``stream: true`` completion, reads the response
  headers and stops. The router aborts the connection: reading on finds the end of the stream (or a reset)
  without ``data: [DONE]``.

In both, the request is cancelled on the worker before it could finish (fewer output tokens than asked), every
KV block comes back, the router holds nothing, ``pdserve:stream_stalls_total{api}`` counts one, and ordinary
requests served meanwhile equal the offline engine's output.
"""
from __future__ import annotations

import json
import socket
import threading
from typing import Optional

import grpc
import pytest
import torch

from proto import pdserve_pb2, pdserve_pb2_grpc
from tests.e2e.helpers import generate, offline
from tests.waiting import wait_until

MAX_TOKENS = 2000
STALL_S = 1.0
PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n"]


@pytest.fixture(scope="module")
def cluster():
    from decode_worker import ColocatedWorker, ColocatedWorkerConfig
    from engine.config import EngineConfig
    from router import RouterConfig, RouterServer, StaticWorkerSource

    torch.set_num_threads(1)
    worker = ColocatedWorker(ColocatedWorkerConfig("stall-c0", engine=EngineConfig(
        model="tiny", num_kv_blocks=320, num_threads=1))).start()
    router = None
    try:
        router = RouterServer(RouterConfig(mode="colocated", http_port=0, stream_stall_timeout_s=STALL_S),
                              StaticWorkerSource([worker.info])).start()
        yield router, worker
    finally:
        if router is not None:
            router.stop()
        worker.stop()


def _stalls(router, api: str) -> float:
    for line in router.core.metrics.render().decode().splitlines():
        if line.startswith("pdserve:stream_stalls_total{") and f'api="{api}"' in line:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _idle(router, worker) -> bool:
    i = worker.info()
    return router.num_in_flight == 0 and i.num_running == 0 and i.num_free_blocks == i.num_total_blocks


def _others_served(router) -> None:
    """Greedy requests on other connections, while the stalled one is held, equal the offline engine."""
    params = dict(max_tokens=16, temperature=0.0, ignore_eos=True)
    from engine.sampling_params import SamplingParams

    want = offline(PROMPTS, [SamplingParams(**params)] * len(PROMPTS))
    for prompt, (tokens, text, finish) in zip(PROMPTS, want):
        assert generate(router.address, prompt=prompt, **params)[:3] == (tokens, text, finish)


def _cut_and_freed(router, worker, api: str, before_stalls: float, before_out: Optional[int]) -> None:
    """Cut off (counted), then nothing held; with ``before_out``, the worker had not finished the request."""
    wait_until(lambda: _stalls(router, api) == before_stalls + 1, timeout=60, interval=0.1,
               message=f"the stalled {api} stream counted as cut off")
    wait_until(lambda: _idle(router, worker), timeout=60, interval=0.1,
               message=lambda: f"router and worker idle, every block free: {worker.info()}")
    if before_out is not None:  # cancelled on the worker before it finished: freed by the cut, not by running out
        assert worker.info().output_tokens_total - before_out < MAX_TOKENS, worker.info()


def test_a_grpc_stream_that_stops_reading_is_reset_and_its_request_freed(cluster):
    router, worker = cluster
    before_stalls, before_out = _stalls(router, "grpc"), worker.info().output_tokens_total
    small_window = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 4096)]
    with grpc.insecure_channel(router.address, options=small_window) as ch:
        stream = pdserve_pb2_grpc.PDServeStub(ch).Generate(pdserve_pb2.GenerateRequest(
            prompt="import os", max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=20), timeout=300)
        assert next(stream).token_ids  # the stream is open and serving; now the client stops reading
        _others_served(router)
        _cut_and_freed(router, worker, "grpc", before_stalls, before_out)
        with pytest.raises(grpc.RpcError) as err:
            for _ in stream:  # what the client had buffered, then the reset
                pass
        assert err.value.code() == grpc.StatusCode.CANCELLED, err.value
    _others_served(router)


def test_an_http_stream_that_stops_reading_is_closed_and_its_request_freed(cluster):
    router, worker = cluster
    before_stalls = _stalls(router, "http")
    host, port = router.http_address.rsplit(":", 1)
    body = json.dumps({"model": "tiny", "prompt": "import os", "max_tokens": MAX_TOKENS, "ignore_eos": True,
                       "logprobs": 20, "stream": True, "n": 2}).encode()
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)  # before connect: the window it announces
    s.settimeout(120)
    try:
        s.connect((host, int(port)))
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body)
        head = b""
        while b"\r\n\r\n" not in head:
            head += s.recv(1024)
        assert head.startswith(b"HTTP/1.1 200"), head[:200]
        _others_served(router)
        _cut_and_freed(router, worker, "http", before_stalls, None)
        rest = b""
        try:
            while chunk := s.recv(1 << 16):
                rest += chunk
        except ConnectionResetError:
            pass
        assert b"data: [DONE]" not in rest, "the stream ran to its end: it was never cut off"
    finally:
        s.close()
    _others_served(router)


def test_a_client_that_reads_slowly_but_steadily_is_not_cut_off(cluster):
    """Reading one message every few tenths of a second keeps every send under the stall timeout."""
    router, worker = cluster
    before = _stalls(router, "grpc")
    small_window = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 4096)]
    got = []
    done = threading.Event()
    with grpc.insecure_channel(router.address, options=small_window) as ch:
        stream = pdserve_pb2_grpc.PDServeStub(ch).Generate(pdserve_pb2.GenerateRequest(
            prompt="import os", max_tokens=200, ignore_eos=True, logprobs=20), timeout=300)
        for msg in stream:
            got.extend(msg.token_ids)
            done.wait(0.01)  # slow reader: ~10 ms per message, far below the 1 s stall timeout
    assert len(got) == 200 and _stalls(router, "grpc") == before


def test_the_stall_timeout_flag_reaches_the_router_config():
    from cluster.cli import build_parser
    from cluster.up_flags import router_overrides
    from router import RouterConfig

    def cfg(*argv: str) -> RouterConfig:
        return RouterConfig(**router_overrides(build_parser().parse_args(["router", "--namespace", "ns", *argv])))

    assert cfg().stream_stall_timeout_s == 60.0
    assert cfg("--stream-stall-timeout-s", "5").stream_stall_timeout_s == 5.0
    assert cfg("--stream-stall-timeout-s", "0").stream_stall_timeout_s is None  # never
    with pytest.raises(ValueError, match="--stream-stall-timeout-s"):
        cfg("--stream-stall-timeout-s", "-1")
