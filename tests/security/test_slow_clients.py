"""Clients that abuse the transport rather than the fields: oversized bodies and headers, many idle connections.

A real router (gRPC and HTTP on free ports) in front of a real colocated worker. Each abuse must end in a clear
refusal (HTTP 413/400, gRPC RESOURCE_EXHAUSTED) without the router buffering what it refuses, and ordinary
requests must go on being served while it happens; the worker ends idle with every KV block free.
"""
from __future__ import annotations

import json
import socket
import time
import urllib.request

import grpc
import pytest
import torch

from proto import pdserve_pb2, pdserve_pb2_grpc
from router.openai.http_api import MAX_BODY_BYTES
from tests.loadtest.test_bench_real_cluster import Cluster
from tests.waiting import wait_until


@pytest.fixture(scope="module")
def cluster(redis_url):
    torch.set_num_threads(1)
    c = Cluster("colocated", redis_url, http=True)
    yield c
    c.close()


def _http_addr(cluster: Cluster) -> tuple[str, int]:
    host, port = cluster.router.http_address.rsplit(":", 1)
    return host, int(port)


def _read_response(sock: socket.socket, timeout: float = 10.0) -> tuple[int, bytes]:
    sock.settimeout(timeout)
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            break
        data += chunk
    head, _, rest = data.partition(b"\r\n\r\n")
    status = int(head.split(b" ", 2)[1])
    length = next((int(line.split(b":", 1)[1]) for line in head.split(b"\r\n")
                   if line.lower().startswith(b"content-length:")), None)
    while length is not None and len(rest) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        rest += chunk
    return status, rest


def _served(cluster: Cluster) -> None:
    req = urllib.request.Request(f"http://{cluster.router.http_address}/v1/completions", method="POST",
                                 data=json.dumps({"prompt": "import os", "max_tokens": 2}).encode(),
                                 headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert r.status == 200 and json.load(r)["usage"]["completion_tokens"] == 2
    with grpc.insecure_channel(cluster.target) as ch:
        resps = list(pdserve_pb2_grpc.PDServeStub(ch).Generate(
            pdserve_pb2.GenerateRequest(prompt="import os", max_tokens=2), timeout=120))
        assert resps[-1].usage.completion_tokens == 2


def test_an_announced_100_mb_body_is_refused_before_it_is_sent(cluster):
    with socket.create_connection(_http_addr(cluster)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 104857600\r\n\r\n{\"prompt\": \"")
        t0 = time.monotonic()
        status, body = _read_response(s)
    assert status == 413, body
    assert "body" in json.loads(body)["error"]["message"]
    assert time.monotonic() - t0 < 10  # answered at once, not after a 100 MB read
    _served(cluster)


def test_a_chunked_body_past_the_limit_is_cut_off(cluster):
    piece = b"a" * (1 << 20)
    with socket.create_connection(_http_addr(cluster)) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: t\r\nContent-Type: application/json\r\n"
                  b"Transfer-Encoding: chunked\r\n\r\n")
        sent = 0
        try:
            while sent <= MAX_BODY_BYTES + 2 * len(piece):
                s.sendall(b"%x\r\n" % len(piece) + piece + b"\r\n")
                sent += len(piece)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the router answered and closed while we were still sending: what it should do
        status, body = _read_response(s)
    assert status == 413, body
    _served(cluster)


def test_a_1_mb_header_is_refused_on_both_apis(cluster):
    with socket.create_connection(_http_addr(cluster)) as s:
        s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: t\r\nX-Big: " + b"a" * (1 << 20) + b"\r\n\r\n")
        status, _ = _read_response(s)
    assert status in (400, 431)
    with grpc.insecure_channel(cluster.target) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(pdserve_pb2_grpc.PDServeStub(ch).Generate(pdserve_pb2.GenerateRequest(prompt="x", max_tokens=1),
                                                           metadata=(("x-big", "a" * (1 << 20)),), timeout=30))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    _served(cluster)


def test_a_100_mb_grpc_message_is_refused(cluster):
    with grpc.insecure_channel(cluster.target) as ch:
        with pytest.raises(grpc.RpcError) as e:
            list(pdserve_pb2_grpc.PDServeStub(ch).Generate(
                pdserve_pb2.GenerateRequest(prompt="x" * (100 << 20), max_tokens=1), timeout=60))
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "larger than max" in e.value.details()
    _served(cluster)


def test_a_thousand_idle_connections_on_each_api_do_not_stop_service(cluster):
    host, port = _http_addr(cluster)
    ghost, gport = cluster.target.rsplit(":", 1)
    socks = []
    try:
        for _ in range(1000):
            socks.append(socket.create_connection((host, port)))
            socks.append(socket.create_connection((ghost, int(gport))))
        _served(cluster)
    finally:
        for s in socks:
            s.close()

    def idle() -> bool:
        info = cluster.workers[0].info()
        return info.num_running == 0 and info.num_waiting == 0 and info.num_free_blocks == info.num_total_blocks

    wait_until(idle, timeout=60, message="the worker idle with every KV block free")
