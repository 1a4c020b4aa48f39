"""Cache-aware routing from KV events in disaggregated mode: the prefill pool is scored on the index, and blocks
that arrive on a decode worker by KV transfer are published as stored there.

Two prefill workers and one decode worker (real engines on ``tiny``, real gRPC, KV over gloo) publish their events
to a real Redis and heartbeat into the real registry; a ``RouterServer`` reads both. A prompt's blocks show up in
the router's index under the prefill worker that computed them and under the decode worker that received them;
later prompts sharing the prefix go to that prefill worker and hit its cache; greedy output equals offline.
"""
from __future__ import annotations


import grpc
import pytest

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import prefix_block_hashes
from engine.sampling_params import SamplingParams
from prefill_worker import PrefillWorker, PrefillWorkerConfig
from proto import pdserve_pb2, pdserve_pb2_grpc
from tests.e2e.helpers import registry_deployment
from tests.roles.harness import engine_config, offline
from tests.waiting import wait_until

BS = 16


@pytest.fixture
def disagg(redis_url):
    def start(common: dict) -> list:
        ev = dict(common, serve_metrics=False)
        return [*(PrefillWorker(PrefillWorkerConfig(f"p{i}", engine=engine_config(), **ev)).start() for i in range(2)),
                DecodeWorker(DecodeWorkerConfig("d0", engine=engine_config(), **ev)).start()]

    with registry_deployment(redis_url, "test-kvdis", start, {"serve_metrics": False}) as deployment:
        yield deployment


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
