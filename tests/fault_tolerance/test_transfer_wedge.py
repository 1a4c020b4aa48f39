"""Transfers that never wedge: what users of other disaggregated systems hit, checked through real processes.

A prefill and a decode worker, each in a spawned process of its own (gloo KV over loopback, rendezvous on a
TCPStore this process serves), a router in the test process reading their live load over GetInfo:

- a transfer whose peer stops answering (the decode process SIGSTOPped between its reservation and the prefill)
  ends at its deadline on both sides, and both workers free its blocks; the pair carries the next request
  (a TensorRT-LLM transfer once spun until a 3-hour harness timeout);
- 200 requests cancelled at times spread over their queueing, prefill, KV transfer and decode leave no block
  and no request held on either worker, and the router holds nothing (an SGLang/vLLM class of leak);
- a reservation that its prefill never fills is reclaimed (the decode worker alone; see also
  tests/decode_worker's orphan test).

Waits are on conditions with deadlines; the fixed pauses are the stop itself and the cancels' timing.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import signal
import threading
import time

import grpc
import pytest
import torch

from engine.sampling_params import SamplingParams
from proto import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from router import RouterConfig, RouterServer, StaticWorkerSource
from router.wire import params_to_wire
from tests.roles.harness import collect, joined, offline
from tests.roles.proc_worker import run_worker
from tests.waiting import wait_until

TRANSFER_TIMEOUT_S = 3.0


class Proc:
    def __init__(self, proc, stop, address: str, kv_name: str, kind: str) -> None:
        self.proc, self.stop, self.address, self.kv_name, self.kind = proc, stop, address, kv_name, kind
        self.channel = grpc.insecure_channel(address)
        self.stub = (worker_pb2_grpc.PrefillWorkerStub if kind == "prefill" else
                     worker_pb2_grpc.DecodeWorkerStub)(self.channel)

    def info(self) -> worker_pb2.WorkerInfo:
        try:
            return self.stub.GetInfo(worker_pb2.GetInfoRequest(), timeout=5)
        except grpc.RpcError:
            return worker_pb2.WorkerInfo(role=self.kind, ready=False, worker_id=self.address)

    def free(self) -> bool:
        i = self.info()
        return i.ready and i.num_free_blocks == i.num_total_blocks and i.num_running == 0 and i.num_waiting == 0


@pytest.fixture(scope="module")
def cluster():
    torch.set_num_threads(1)
    store = torch.distributed.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    url = f"tcp://127.0.0.1:{store.port}"
    ctx = mp.get_context("spawn")
    procs: list[Proc] = []
    started = []
    try:
        pending = []
        for role, wid in (("prefill", "wedge-p0"), ("decode", "wedge-d0")):
            q, stop = ctx.Queue(), ctx.Event()
            p = ctx.Process(target=run_worker, daemon=True,
                            args=(role, wid, url, {}, q, stop, {"transfer_timeout_s": TRANSFER_TIMEOUT_S}))
            p.start()
            started.append((p, stop))
            pending.append((role, p, stop, q))
        for role, p, stop, q in pending:
            got = q.get(timeout=180)
            assert got[0] != "error", got[1]
            procs.append(Proc(p, stop, got[0], got[1], role))
        router = RouterServer(RouterConfig(serve_metrics=False, pool_wait_s=0),
                              StaticWorkerSource([w.info for w in procs])).start()
        ch = grpc.insecure_channel(router.address)
        try:
            yield procs[0], procs[1], router, pdserve_pb2_grpc.PDServeStub(ch)
        finally:
            ch.close()
            router.stop()
    finally:
        for p, stop in started:
            try:
                os.kill(p.pid, signal.SIGCONT)
            except (ProcessLookupError, TypeError):
                pass
            if p.is_alive():
                stop.set()
        for p, _ in started:
            p.join(30)
            if p.is_alive():
                p.kill()
                p.join(5)
        for w in procs:
            w.channel.close()


def _idle(p: Proc, d: Proc, router) -> None:
    wait_until(lambda: p.free() and d.free() and router.core.placer is not None
               and router.num_in_flight == 0, timeout=60, interval=0.05,
               message=lambda: f"not idle: prefill {p.info()}, decode {d.info()}, router {router.num_in_flight}")


def test_peer_that_stops_answering_fails_at_the_deadline_on_both_sides_and_frees_blocks(cluster):
    p, d, router, stub = cluster
    prompt = "def wedge(peer):"
    kw = dict(max_tokens=8, temperature=0.0, ignore_eos=True)
    want = offline([prompt], [SamplingParams(**kw)])[0]
    assert joined(collect(stub, prompt=prompt, **kw)) == want[:3]  # the pair is up
    _idle(p, d, router)
    ids = [5 + (j * 37) % 900 for j in range(120)]
    params = params_to_wire(SamplingParams(max_tokens=4, temperature=0.0))
    resv = d.stub.Reserve(worker_pb2.ReserveRequest(request_id="wedge-1", prompt_token_ids=ids, params=params,
                                                    prefill_kv_name=p.kv_name, kv_timeout_s=TRANSFER_TIMEOUT_S),
                          timeout=30)
    os.kill(d.proc.pid, signal.SIGSTOP)  # alive, its sockets open, nothing read or answered
    try:
        t0 = time.monotonic()
        events = p.stub.Prefill(worker_pb2.PrefillRequest(request_id="wedge-1", prompt_token_ids=ids, params=params,
                                                          dest_kv_name=d.kv_name, dest_block_ids=resv.block_ids,
                                                          dest_block_size=resv.block_size), timeout=120)
        first = next(events)
        assert first.HasField("first_token")
        with pytest.raises(grpc.RpcError) as ei:
            next(events)
        waited = time.monotonic() - t0
        assert ei.value.code() == grpc.StatusCode.UNAVAILABLE and "wedge-1" in ei.value.details()
        # it ended at its deadline (plus the ack grace), not before and not at the 120 s call deadline
        assert TRANSFER_TIMEOUT_S * 0.9 <= waited < 60, waited
        # the prefill worker freed the request's blocks while its peer is still stopped
        wait_until(p.free, timeout=30, interval=0.05, message=lambda: f"prefill still holds: {p.info()}")
    finally:
        os.kill(d.proc.pid, signal.SIGCONT)
    # the decode worker's receive is past its deadline: it fails, and its reservation is freed
    wait_until(d.free, timeout=60, interval=0.05, message=lambda: f"decode still holds: {d.info()}")
    # the pair recovers: the next request goes through it, equal to the offline engine
    got = collect(stub, prompt=prompt, **kw)
    assert joined(got) == want[:3] and got[-1].timings.kv_transfer_s > 0
    _idle(p, d, router)


def test_reservation_never_filled_is_reclaimed(cluster):
    p, d, router, _stub = cluster
    params = params_to_wire(SamplingParams(max_tokens=4, temperature=0.0))
    before = d.info().num_free_blocks
    d.stub.Reserve(worker_pb2.ReserveRequest(request_id="orphan-1", prompt_token_ids=list(range(5, 69)),
                                             params=params, prefill_kv_name=p.kv_name, kv_timeout_s=1.0), timeout=30)
    assert d.info().num_free_blocks < before  # taken
    wait_until(d.free, timeout=60, interval=0.05, message=lambda: f"the orphan reservation is held: {d.info()}")


def test_cancel_flood_timed_into_transfers_leaves_nothing_held(cluster):
    p, d, router, stub = cluster
    rng = random.Random(7)
    n, in_flight = 200, threading.Semaphore(12)
    outcomes: dict[str, int] = {}
    lock = threading.Lock()

    def one(i: int) -> None:
        with in_flight:
            ids = [5 + (i * 131 + j * 17) % 900 for j in range(rng.randint(16, 160))]
            call = stub.Generate(pdserve_pb2.GenerateRequest(token_ids=ids, max_tokens=rng.randint(2, 24),
                                                             temperature=0.0, ignore_eos=True,
                                                             request_id=f"flood-{i}"), timeout=120)
            # cancel somewhere between admission and the last token: queue, prefill, transfer or decode
            timer = threading.Timer(rng.uniform(0.0, 0.6), call.cancel)
            timer.start()
            try:
                for _ in call:
                    pass
                code = "OK"
            except grpc.RpcError as e:
                code = e.code().name
            timer.cancel()
            with lock:
                outcomes[code] = outcomes.get(code, 0) + 1

    threads = [threading.Thread(target=one, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(300)
    assert not any(t.is_alive() for t in threads), "a request hung"
    assert sum(outcomes.values()) == n and set(outcomes) <= {"OK", "CANCELLED"}, outcomes
    assert outcomes.get("CANCELLED", 0) >= n // 4, f"too few cancels landed to test anything: {outcomes}"
    _idle(p, d, router)
    print(f"\ncancel flood: {outcomes}")
