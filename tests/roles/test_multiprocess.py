"""Prefill and decode workers in separate processes, real gloo KV transfer between them.

The router runs in the test process and reads each worker's live load over its
GetInfo RPC. Greedy output equals the offline engine; killing the decode process
mid-stream ends the client stream with UNAVAILABLE, not a hang.
"""
from __future__ import annotations

import multiprocessing as mp
import time

import grpc
import pytest
import torch

from engine.sampling_params import SamplingParams
from proto import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from router import RouterConfig, RouterServer, StaticWorkerSource
from tests.roles.harness import collect, joined, offline
from tests.roles.proc_worker import run_worker
from tests.waiting import wait_until


def _live_info(address: str, kind: str):
    ch = grpc.insecure_channel(address)
    stub = (worker_pb2_grpc.PrefillWorkerStub if kind == "prefill" else worker_pb2_grpc.DecodeWorkerStub)(ch)

    def info():
        try:
            return stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=2)
        except grpc.RpcError:  # a dead worker drops out of routing, like an expired registry key
            return worker_pb2.WorkerInfo(role=kind, ready=False, worker_id=address)
    return info, ch


@pytest.fixture(scope="module")
def procs():
    torch.set_num_threads(1)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    url = f"tcp://127.0.0.1:{store.port}"
    ctx = mp.get_context("spawn")
    # one stop event per child: setting an Event a killed child was waiting on blocks forever
    stops = [ctx.Event(), ctx.Event()]
    ps, addrs = [], {}
    try:
        qs = []
        for i, (role, wid) in enumerate((("prefill", "mp-p0"), ("decode", "mp-d0"))):
            q = ctx.Queue()
            p = ctx.Process(target=run_worker, args=(role, wid, url, {}, q, stops[i]), daemon=True)
            p.start()  # both children load their engines at the same time
            ps.append(p)
            qs.append((role, q))
        for role, q in qs:
            got = q.get(timeout=120)
            assert got[0] != "error", got[1]
            addrs[role] = got[0]
        infos, chans = zip(*(_live_info(addrs[k], k) for k in ("prefill", "decode")))
        # no supervisor here: nothing replaces a killed worker, so the router must not wait for one
        router = RouterServer(RouterConfig(serve_metrics=False, pool_wait_s=0), StaticWorkerSource(list(infos))).start()
        ch = grpc.insecure_channel(router.address)
        yield pdserve_pb2_grpc.PDServeStub(ch), ps, infos
        ch.close()
        router.stop()
        for c in chans:
            c.close()
    finally:
        for p, ev in zip(ps, stops):
            if p.is_alive():
                ev.set()
        for p in ps:
            p.join(20)
            if p.is_alive():
                p.kill()
                p.join(5)


def test_greedy_across_processes_equals_offline(procs):
    stub, _ps, infos = procs
    prompts = ["def add(a, b):", "# " + "the quick brown fox jumps over the lazy dog " * 10, "import os"]
    ref = offline(prompts, [SamplingParams(max_tokens=12, temperature=0.0)] * 3)
    for p, (ids, text, reason, _) in zip(prompts, ref):
        assert joined(collect(stub, prompt=p, max_tokens=12, temperature=0.0)) == (ids, text, reason)
    # load records refresh on each engine-loop pass
    wait_until(lambda: all(i().num_free_blocks == i().num_total_blocks for i in infos), timeout=1.0, interval=0.01,
               message="both workers' records show every block free")
    assert [(i().num_free_blocks, i().num_running) for i in infos] == [(256, 0), (256, 0)]


def test_decode_process_killed_midstream_is_unavailable(procs):
    stub, ps, _infos = procs
    s = stub.Generate(pdserve_pb2.GenerateRequest(prompt="a", max_tokens=1800, ignore_eos=True, temperature=0.0,
                                                  request_id="req-kill"), timeout=60)
    next(s)
    next(s)
    t = time.monotonic()
    ps[1].kill()
    with pytest.raises(grpc.RpcError) as ei:
        list(s)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "req-kill" in ei.value.details()
    assert time.monotonic() - t < 10
    with pytest.raises(grpc.RpcError) as ei:
        collect(stub, timeout=10, prompt="a", max_tokens=2)
    assert ei.value.code() == grpc.StatusCode.UNAVAILABLE
