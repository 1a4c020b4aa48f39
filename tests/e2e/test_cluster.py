"""A whole cluster on real parts: Ray actors, the Redis registry, gRPC on loopback, KV over gloo.

One cluster serves the module (Ray and model loads are slow on 2 cores): it
starts as 1 prefill + 1 decode, then grows to 2 + 2 with ``scale_pool``. The
reference for every output is ``engine.LLM("tiny")`` offline.
"""
from __future__ import annotations

import threading
import time

import grpc
import pytest
import ray
import torch

from cluster.launcher import Cluster, ClusterConfig
from cluster.registry import Registry
from engine.sampling_params import SamplingParams
from proto import pdserve_pb2, pdserve_pb2_grpc
from tests.e2e.helpers import generate, metric_value, mixed_prompts, offline, run_concurrently
from tests.waiting import wait_until

N_REQUESTS = 32


@pytest.fixture(scope="module")
def cluster(ray_local, redis_url):
    torch.set_num_threads(1)
    cfg = ClusterConfig(model="tiny", num_prefill=1, num_decode=1, redis_url=redis_url,
                        engine_overrides=dict(num_kv_blocks=512, max_num_batched_tokens=512),
                        start_timeout_s=600)
    c = Cluster(cfg).start()
    try:
        yield c
    finally:
        c.stop()


def _greedy_batch(address: str) -> None:
    prompts = mixed_prompts(N_REQUESTS)
    max_tokens = [4 + (i * 7) % 21 for i in range(N_REQUESTS)]
    ref = offline(prompts, [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens])
    got = run_concurrently(lambda p, m: generate(address, prompt=p, max_tokens=m, temperature=0.0),
                           list(zip(prompts, max_tokens)))
    for i, ((ids, text, reason), (g_ids, g_text, g_reason, last)) in enumerate(zip(ref, got)):
        assert g_ids == ids, f"request {i}: tokens differ from offline"
        assert (g_text, g_reason) == (text, reason), f"request {i}"
        assert last.usage.completion_tokens == len(ids)


def _seeded_batch(address: str) -> None:
    prompts = mixed_prompts(8)
    seeds = list(range(100, 108))
    params = [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=s) for s in seeds]
    ref = offline(prompts, params)
    got = run_concurrently(lambda p, s: generate(address, prompt=p, max_tokens=12, temperature=0.9, top_p=0.95,
                                                 seed=s), list(zip(prompts, seeds)))
    assert [g[:2] for g in got] == [r[:2] for r in ref]
    # Same prompt, different seeds: the samples differ, so equality above is not vacuous.
    alt = offline([prompts[3]] * 2, [SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=s)
                                     for s in (1, 2)])
    assert alt[0][0] != alt[1][0]


def _workers(c: Cluster) -> list:
    return c.actors("prefill") + c.actors("decode")


def _idle(c: Cluster) -> bool:
    infos = ray.get([a.info.remote() for a in _workers(c)])
    return all(i.num_free_blocks == i.num_total_blocks and i.num_running == 0 for i in infos)


def _wait_idle(c: Cluster, timeout_s: float) -> None:
    """Every worker's record shows no running request and every block free (records refresh each loop pass)."""
    wait_until(lambda: _idle(c), timeout=timeout_s, interval=0.02,
               message=lambda: "workers idle: " + "; ".join(
                   f"{i.worker_id}: {i.num_running} running, {i.num_total_blocks - i.num_free_blocks} blocks in use"
                   for i in ray.get([a.info.remote() for a in _workers(c)])))


def test_1p1d_registered_and_serving(cluster, redis_url):
    reg = Registry(redis_url, cluster.namespace)
    assert [w.worker_id for w in reg.list("prefill")] == ["prefill-0"]
    assert [w.worker_id for w in reg.list("decode")] == ["decode-0"]
    assert all(w.ready and w.model_name for w in reg.list())
    with grpc.insecure_channel(cluster.router_address) as ch:
        info = pdserve_pb2_grpc.PDServeStub(ch).GetModelInfo(pdserve_pb2.GetModelInfoRequest(), timeout=10)
    assert info.num_prefill_workers == 1 and info.num_decode_workers == 1


def test_1p1d_32_concurrent_greedy_equal_offline(cluster, redis_url):
    _greedy_batch(cluster.router_address)
    _wait_idle(cluster, 2.0)
    # one host: the decode worker read every prompt's KV from the prefill worker's cache in place (kvtransfer/shm.py)
    [pw] = Registry(redis_url, cluster.namespace).list("prefill")
    by_link = {link: metric_value(pw.metrics_address, "pdserve:kv_transfers_total", link=link)
               for link in ("socket", "ring", "pull")}
    assert by_link["pull"] >= 32 and by_link["socket"] == by_link["ring"] == 0, by_link


def test_1p1d_seeded_sampling_equals_offline(cluster):
    _seeded_batch(cluster.router_address)


def test_bad_inputs_get_status_naming_the_field_then_serve(cluster):
    cases = [
        (dict(), grpc.StatusCode.INVALID_ARGUMENT, "prompt"),
        (dict(prompt="a", token_ids=[1]), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
        (dict(token_ids=[1, 10**7]), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
        (dict(prompt="a", max_tokens=0), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (dict(prompt="a", max_tokens=10**6), grpc.StatusCode.INVALID_ARGUMENT, "max_tokens"),
        (dict(prompt="a", temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "temperature"),
        (dict(prompt="a", top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "top_p"),
        (dict(prompt="a", top_k=-5), grpc.StatusCode.INVALID_ARGUMENT, "top_k"),
        (dict(prompt="a", logprobs=1000), grpc.StatusCode.INVALID_ARGUMENT, "logprobs"),
        (dict(prompt="a", stop=[""]), grpc.StatusCode.INVALID_ARGUMENT, "stop"),
    ]
    for fields, code, name in cases:
        with pytest.raises(grpc.RpcError) as ei:
            generate(cluster.router_address, timeout=15, **fields)
        assert ei.value.code() == code, (fields, ei.value.details())
        assert name in ei.value.details(), (fields, ei.value.details())
    ref = offline(["def f():"], [SamplingParams(max_tokens=5, temperature=0.0)])[0]
    assert generate(cluster.router_address, prompt="def f():", max_tokens=5, temperature=0.0)[:3] == ref
    _wait_idle(cluster, 1.0)


def test_cancel_midway_frees_both_workers_blocks_within_1s(cluster):
    _wait_idle(cluster, 2.0)
    with grpc.insecure_channel(cluster.router_address) as ch:
        stream = pdserve_pb2_grpc.PDServeStub(ch).Generate(
            pdserve_pb2.GenerateRequest(prompt=mixed_prompts(32)[5], max_tokens=1500, ignore_eos=True,
                                        temperature=0.0), timeout=120)
        first = [next(stream) for _ in range(3)]
        assert sum(len(r.token_ids) for r in first) >= 3
        assert not _idle(cluster), "the running sequence should hold decode blocks"
        t0 = time.monotonic()
        stream.cancel()
        _wait_idle(cluster, 1.0)
        assert time.monotonic() - t0 < 1.0
    ref = offline(["x = 1"], [SamplingParams(max_tokens=3, temperature=0.0)])[0]
    assert generate(cluster.router_address, prompt="x = 1", max_tokens=3, temperature=0.0)[:3] == ref


def test_2p2d_32_concurrent_greedy_and_seeded_equal_offline(cluster, redis_url):
    cluster.scale_pool("prefill", 2)
    cluster.scale_pool("decode", 2)
    reg = Registry(redis_url, cluster.namespace)
    assert len(reg.list("prefill")) == 2 and len(reg.list("decode")) == 2
    _greedy_batch(cluster.router_address)
    _seeded_batch(cluster.router_address)
    # Every worker of both pools serves. The router ranks by load that lags a heartbeat, so one burst
    # may land on one worker of a pool; a few more concurrent waves must reach all of them.
    for _wave in range(4):
        if all(_served_counts(reg).values()):
            break
        run_concurrently(lambda p: generate(cluster.router_address, prompt=p, max_tokens=4, temperature=0.0),
                         [(p,) for p in mixed_prompts(16)])
    counts = _served_counts(reg)
    assert len(counts) == 4 and all(counts.values()), f"a worker never served: {counts}"
    _wait_idle(cluster, 2.0)


def _served_counts(reg: Registry) -> dict[str, float]:
    """worker id -> requests it completed, from its own /metrics."""
    sample = {"prefill": "pdserve:request_prefill_time_seconds_count",
              "decode": "pdserve:request_decode_time_seconds_count"}
    return {w.worker_id: metric_value(w.metrics_address, sample[w.role]) for w in reg.list()}


def test_draining_a_busy_decode_worker_lets_its_stream_finish(cluster, redis_url):
    if len(cluster.worker_ids("decode")) < 2:
        cluster.scale_pool("decode", 2)
    _wait_idle(cluster, 2.0)
    reg = Registry(redis_url, cluster.namespace)
    prompt = mixed_prompts(32)[7]
    ref = offline([prompt], [SamplingParams(max_tokens=200, temperature=0.0, ignore_eos=True)])[0]
    with grpc.insecure_channel(cluster.router_address) as ch:
        stream = pdserve_pb2_grpc.PDServeStub(ch).Generate(
            pdserve_pb2.GenerateRequest(prompt=prompt, max_tokens=200, ignore_eos=True, temperature=0.0), timeout=120)
        got = [next(stream) for _ in range(3)]  # past the first token: the decode worker is streaming
        busy = [i.worker_id for i in ray.get([a.info.remote() for a in cluster.actors("decode")])
                if i.num_free_blocks < i.num_total_blocks]
        assert len(busy) == 1, busy
        result: dict = {}
        drainer = threading.Thread(target=lambda: result.update(clean=cluster.remove_worker(busy[0])))
        drainer.start()
        # Out of routing at once, while its stream goes on.
        wait_until(lambda: busy[0] not in [w.worker_id for w in reg.list("decode")], timeout=2.0, interval=0.02,
                   message=f"{busy[0]} out of the registry's decode pool")
        rest = list(stream)
        drainer.join(60)
    # Tokens kept coming after the worker left routing: the drain overlapped a live stream.
    assert sum(len(r.token_ids) for r in rest) > 0
    got += rest
    assert [t for r in got for t in r.token_ids] == ref[0] and got[-1].finish_reason == "length"
    assert result == {"clean": True}
    assert busy[0] not in cluster.worker_ids("decode")


def test_scale_down_drains_and_cluster_keeps_serving(cluster, redis_url):
    if len(cluster.worker_ids("decode")) < 2:
        cluster.scale_pool("decode", 2)
    cluster.scale_pool("decode", 1)
    reg = Registry(redis_url, cluster.namespace)
    assert [w.worker_id for w in reg.list("decode")] == cluster.worker_ids("decode")
    ref = offline(["import os"], [SamplingParams(max_tokens=6, temperature=0.0)])[0]
    assert generate(cluster.router_address, prompt="import os", max_tokens=6, temperature=0.0)[:3] == ref
