"""Cache-aware routing from KV events in disaggregated mode: the prefill pool is scored on the index, and blocks
that arrive on a decode worker by KV transfer are published as stored there.

Two prefill workers and one decode worker (real engines on ``tiny``, real gRPC, KV over gloo) publish their events
to a real Redis and heartbeat into the real registry; a ``RouterServer`` reads both. A prompt's blocks show up in
the router's index under the prefill worker that computed them and under the decode worker that received them;
later prompts sharing the prefix go to that prefill worker and hit its cache; greedy output equals offline.
"""
from __future__ import annotations

import threading
import uuid

import grpc
import pytest

from cluster.registry import Registry
from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import prefix_block_hashes
from engine.sampling_params import SamplingParams
from prefill_worker import PrefillWorker, PrefillWorkerConfig
from proto import pdserve_pb2, pdserve_pb2_grpc
from router import RouterConfig, RouterServer
from tests.roles.harness import engine_config, make_store, offline
from tests.waiting import wait_until

BS = 16


@pytest.fixture
def disagg(redis_url):
    ns = f"test-kvdis-{uuid.uuid4().hex[:8]}"
    store = make_store("gloo")
    ev = dict(kv_events_url=redis_url, kv_events_namespace=ns, kv_store=store, kv_backend="gloo",
              serve_metrics=False, transfer_timeout_s=10.0)
    workers = []
    registry = Registry(redis_url, ns, ttl_s=2.0)
    stop = threading.Event()
    router = None
    try:
        workers += [PrefillWorker(PrefillWorkerConfig(f"p{i}", engine=engine_config(), **ev)).start() for i in range(2)]
        workers.append(DecodeWorker(DecodeWorkerConfig("d0", engine=engine_config(), **ev)).start())
        for w in workers:
            registry.register(w.info())

        def beats() -> None:
            while not stop.wait(0.25):
                for w in workers:
                    registry.heartbeat(w.info())

        threading.Thread(target=beats, daemon=True).start()
        router = RouterServer(RouterConfig(serve_metrics=False, worker_view_refresh_s=0.1), registry).start()
        wait_until(lambda: router.core.kv_events.num_synced() == 3, timeout=20, message="router follows 3 workers")
        yield router, workers
    finally:
        stop.set()
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()
        registry.clear()
        registry.close()


def _generate(stub, tokens: list[int]) -> tuple[list[int], int]:
    resps = list(stub.Generate(pdserve_pb2.GenerateRequest(token_ids=tokens, max_tokens=6, temperature=0.0),
                               timeout=60))
    return [t for r in resps for t in r.token_ids], resps[-1].usage.cached_tokens


def test_prefill_pool_scored_on_the_index_and_transferred_blocks_are_stored_on_the_receiver(disagg):
    router, workers = disagg
    system = [(i * 11) % 800 + 30 for i in range(10 * BS)]  # 10 cached blocks outweigh a request (2) and ties
    prompts = [system + [(k * 13 + j) % 800 + 30 for j in range(12)] for k in range(6)]
    hashes = prefix_block_hashes(prompts[0], BS)
    index = router.core.kv_index
    with grpc.insecure_channel(router.address) as ch:
        stub = pdserve_pb2_grpc.PDServeStub(ch)
        outs = [_generate(stub, prompts[0])]
        wait_until(lambda: index.match(["p0", "p1", "d0"], hashes)["d0"] == len(hashes)
                   and max(index.match(["p0", "p1"], hashes).values()) == len(hashes), timeout=5,
                   message="the prompt's blocks under its prefill worker and, received, under the decode worker")
        holder = "p0" if index.match(["p0"], hashes)["p0"] == len(hashes) else "p1"
        before = {w.cfg.worker_id: w.info().requests_total for w in workers}
        outs += [_generate(stub, p) for p in prompts[1:]]
    after = {w.cfg.worker_id: w.info().requests_total for w in workers}
    assert after[holder] - before[holder] == len(prompts) - 1  # every later prompt went to the cached worker
    assert all(cached >= len(system) for _t, cached in outs[1:])  # and hit its cache
    ref = offline(prompts, [SamplingParams(max_tokens=6, temperature=0.0)] * len(prompts))
    assert [t for t, _c in outs] == [r[0] for r in ref]
