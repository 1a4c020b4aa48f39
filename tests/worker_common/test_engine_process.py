"""The engine core in its own process (``WorkerConfig.engine_process``): a colocated worker serving through it
equals the offline engine, frees blocks on cancel, refuses what the engine refuses with INVALID_ARGUMENT and goes
on serving, fails its requests (never hangs) when the engine process dies, and leaves no process behind."""
from __future__ import annotations

import os
import signal

import grpc
import psutil
import pytest
import torch

from decode_worker import ColocatedWorker, ColocatedWorkerConfig
from decode_worker.config import DecodeWorkerConfig
from engine.sampling_params import SamplingParams
from proto import pdserve_pb2, worker_pb2, worker_pb2_grpc
from router.wire import params_to_wire
from tests.roles.harness import collect, engine_config, joined, offline, start_colocated
from tests.waiting import wait_until

PROMPTS = ["def add(a, b):", "x", "# " + "the quick brown fox jumps over the lazy dog " * 12, "return None"]


@pytest.fixture(scope="module")
def colo():
    torch.set_num_threads(1)
    r = start_colocated(n=1, tag="ep-", worker={"engine_process": True})
    yield r
    r.close()


def _engine_pid(w: ColocatedWorker) -> int:
    pid = w.engine.pid
    assert pid is not None and pid != os.getpid()
    return pid


def test_the_engine_steps_in_a_child_process(colo):
    """(Greedy equality with the offline engine, cancel and load: tests/roles/test_colocated.py, both ways.)"""
    w = colo.decodes[0]
    child = psutil.Process(_engine_pid(w))
    assert child.ppid() == os.getpid() and child.is_running()
    before = w.engine.make_stats().num_steps
    resps = collect(colo.stub, prompt=PROMPTS[1], max_tokens=5, temperature=0.0)
    assert sum(len(r.token_ids) for r in resps) == 5
    # the worker process never built an engine of its own: the steps ran in the child, whose stats came back
    assert type(w.engine).__name__ == "RemoteEngine" and w.engine.make_stats().num_steps >= before + 5
    assert colo.wait_idle(5.0)


def test_seeded_sampling_and_logprobs_equal_offline(colo):
    sp = SamplingParams(max_tokens=12, temperature=0.9, seed=11, logprobs=2)
    ref = offline([PROMPTS[0]], [sp])[0]
    resps = collect(colo.stub, prompt=PROMPTS[0], max_tokens=12, temperature=0.9, seed=11, logprobs=2)
    assert joined(resps)[:2] == ref[:2]
    got_lp = [lp.logprob for r in resps for lp in r.logprobs]
    assert got_lp == pytest.approx([lp.logprob for lp in ref[3]], abs=1e-5)
    assert colo.wait_idle(5.0)


def test_cancel_frees_blocks_and_load_reaches_info(colo):
    w = colo.decodes[0]
    s = colo.stub.Generate(pdserve_pb2.GenerateRequest(prompt="a", max_tokens=1500, ignore_eos=True,
                                                       temperature=0.0), timeout=60)
    next(s)
    next(s)
    wait_until(lambda: w.info().num_running == 1 and w.info().num_free_blocks < w.info().num_total_blocks,
               timeout=10, interval=0.01, message="the running request in the worker's load snapshot")
    s.cancel()
    assert colo.wait_idle(5.0)


def test_a_request_the_engine_refuses_is_invalid_argument_and_the_worker_goes_on(colo):
    w = colo.decodes[0]
    max_len = w.engine.max_model_len
    with grpc.insecure_channel(w.address) as ch:
        stub = worker_pb2_grpc.ColocatedWorkerStub(ch)
        params = params_to_wire(SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(worker_pb2.ColocatedRequest(request_id="too-long", prompt_token_ids=[5] * (max_len + 8),
                                                           params=params), timeout=60))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "too-long" in e.value.details()
        ok = list(stub.Generate(worker_pb2.ColocatedRequest(request_id="after", prompt_token_ids=[5, 6, 7],
                                                            params=params), timeout=60))
        assert sum(len(c.token_ids) for c in ok) == 4
    assert colo.wait_idle(5.0)


def test_engine_process_death_fails_requests_and_stop_leaves_no_process():
    torch.set_num_threads(1)
    # the router waits pool_wait_s for a ready worker to migrate to; there is none here
    r = start_colocated(n=1, tag="epd-", worker={"engine_process": True}, router={"pool_wait_s": 2.0})
    try:
        w = r.decodes[0]
        pid = _engine_pid(w)
        s = r.stub.Generate(pdserve_pb2.GenerateRequest(prompt="a", max_tokens=1500, ignore_eos=True,
                                                        temperature=0.0), timeout=60)
        next(s)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(grpc.RpcError) as e:
            for _ in s:
                pass
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "no ready colocated worker" in e.value.details()
        wait_until(lambda: not w.info().ready, timeout=10, interval=0.02, message="the worker reports not ready")
    finally:
        r.close()
    r2 = start_colocated(n=1, tag="eps-", worker={"engine_process": True})
    pid = _engine_pid(r2.decodes[0])
    r2.close()
    wait_until(lambda: not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE,
               timeout=10, interval=0.05, message="the engine process gone after stop()")


def test_prefix_cache_events_travel_from_the_engine_process_to_redis(redis_url):
    """The engine process records its prefix cache's events; the worker publishes them (real Redis): a prompt's
    full blocks appear as BlockStored with the hashes a router computes for that prompt."""
    import redis

    from engine import prefix_block_hashes
    from engine.kv_events import KV_ENTRY_BATCH, BlockStored, decode_kv_batch, kv_stream_key

    torch.set_num_threads(1)
    ns = f"ep-{os.getpid()}"
    w = ColocatedWorker(ColocatedWorkerConfig("epk0", engine=engine_config(enable_prefix_caching=True),
                                              serve_metrics=False, engine_process=True, kv_events_url=redis_url,
                                              kv_events_namespace=ns)).start()
    r = redis.Redis.from_url(redis_url)
    try:
        prompt = list(range(5, 5 + 3 * w.engine.block_size + 2))
        want = set(prefix_block_hashes(prompt, w.engine.block_size))
        assert len(want) == 3
        with grpc.insecure_channel(w.address) as ch:
            stub = worker_pb2_grpc.ColocatedWorkerStub(ch)
            params = params_to_wire(SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
            list(stub.Generate(worker_pb2.ColocatedRequest(request_id="k", prompt_token_ids=prompt, params=params),
                               timeout=60))

        def stored() -> set:
            got = set()
            for _id, fields in r.xrange(kv_stream_key(ns, "epk0")):
                if KV_ENTRY_BATCH in fields:
                    for ev in decode_kv_batch(fields[KV_ENTRY_BATCH]).events:
                        if isinstance(ev, BlockStored):
                            got.update(ev.block_hashes)
            return got

        wait_until(lambda: want <= stored(), timeout=15, interval=0.05,
                   message=lambda: f"the prompt's block hashes in the worker's event stream (got {stored()})")
    finally:
        w.stop()
        r.delete(kv_stream_key(ns, "epk0"))
        r.close()


def test_the_proxy_alone_equals_the_engine_and_wake_never_blocks():
    """``RemoteEngine`` driven as the loop drives it: greedy outputs equal an in-process engine's; 70,000 wakes
    while idle (more than a pipe holds) return at once; an abort of an unknown id is harmless; a refused add is
    reported through ``on_error``."""
    from engine.llm_engine import LLMEngine
    from worker_common.engine_process import RemoteEngine

    torch.set_num_threads(1)
    cfg = engine_config()
    remote = RemoteEngine(cfg, "proxy-test").start()
    refused: list = []
    remote.on_error = lambda rid, msg: refused.append((rid, msg))
    try:
        for _ in range(70_000):
            remote.wake()
        remote.abort_request("nobody")
        params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
        prompts = {"a": [5, 6, 7, 8, 9], "b": [11, 12, 13]}

        def drive(eng) -> dict:
            got: dict = {k: [] for k in prompts}
            for rid, ids in prompts.items():
                eng.add_request(rid, ids, params)
            while eng.has_unfinished_requests():
                for o in eng.step():
                    got[o.request_id].extend(o.new_token_ids)
            return got

        assert drive(remote) == drive(LLMEngine(cfg))
        remote.add_request("long", [5] * (remote.max_model_len + 4), params)
        while remote.has_unfinished_requests():
            remote.step()
        assert [rid for rid, _ in refused] == ["long"]
        assert remote.num_free_blocks == remote.num_total_blocks
    finally:
        remote.shutdown()


def test_the_kv_proxy_maps_the_childs_cache_and_hands_over_each_layer_as_it_completes():
    """``RemoteEngine(kv=True)`` as a prefill worker's loop drives it: one ``layer`` call per layer, in order, for
    the prompt whose prefill completes, each before the step's output; the block table answered from layer 0's
    message equals the child's own answer; the K/V this process reads through ``kv_caches`` at those blocks equal an
    in-process engine's after the same prefill (the child's memory, not a copy); ``release`` frees the blocks."""
    from engine.llm_engine import LLMEngine
    from worker_common.engine_process import RemoteEngine

    torch.set_num_threads(1)
    cfg = engine_config()
    remote = RemoteEngine(cfg, "kv-proxy", kv=True).start()
    try:
        assert remote.cfg.kv_cache_shared and len(remote.kv_caches) == len(LLMEngine(cfg).kv_caches)
        seen: list = []
        remote.layer_done_callback = lambda layer, ids, *_: seen.append((layer, tuple(ids)))
        prompt = list(range(3, 3 + 3 * remote.block_size + 5))
        remote.add_request("a", prompt, SamplingParams(max_tokens=1, temperature=0.0), prefill_only=True)
        outs: list = []
        while not outs:
            outs = remote.step(1.0)
            if not outs:
                assert remote.has_unfinished_requests()
        assert [o.finish_reason for o in outs] == ["prefill_done"]
        layers = len(remote.kv_caches)
        assert seen == [(i, ("a",)) for i in range(layers)]
        table = remote.get_block_table("a")
        assert table == remote._call("get_block_table", "a") and len(table) == -(-len(prompt) // remote.block_size)

        local = LLMEngine(cfg)
        local.add_request("a", prompt, SamplingParams(max_tokens=1, temperature=0.0), prefill_only=True)
        assert [o.finish_reason for o in local.step()] == ["prefill_done"]
        mine = local.get_block_table("a")
        n = len(prompt)
        for (rk, rv), (lk, lv) in zip(remote.kv_caches, local.kv_caches):
            for got, want in ((rk, lk), (rv, lv)):
                g = got[table].flatten(0, 1)[:n]
                assert g.abs().sum() > 0 and torch.equal(g, want[mine].flatten(0, 1)[:n])
        assert remote.num_free_blocks < remote.num_total_blocks  # held after prefill_done, until released
        remote.release("a")
        while remote.has_unfinished_requests():
            remote.step()
        assert remote.num_free_blocks == remote.num_total_blocks and not remote.has_request("a")
    finally:
        remote.shutdown()


def test_the_kv_proxys_calls_answer_as_the_engine_does():
    """Reservations through calls: blocks and a ValueError naming the field come back as the engine's; an id the
    engine holds is known; an abort frees it; a proxy started without ``kv`` refuses KV calls, naming why."""
    from worker_common.engine_process import RemoteEngine

    torch.set_num_threads(1)
    remote = RemoteEngine(engine_config(), "kv-calls", kv=True).start()
    plain = RemoteEngine(engine_config(), "plain").start()
    try:
        total = remote.num_total_blocks
        with pytest.raises(ValueError, match="num_tokens must be a positive integer"):
            remote.reserve_prompt("r", 0)
        blocks, cached = remote.reserve_prompt("r", 2 * remote.block_size + 1)
        assert len(blocks) == 3 and cached == 0 and remote.has_request("r") and not remote.has_request("s")
        assert remote.num_free_blocks == total - 3  # the reply's snapshot: taken now, not a step later
        with pytest.raises(ValueError, match="already in use"):
            remote.reserve_prompt("r", 4)
        assert remote.reset_prefix_cache() == (False, 3)  # the reservation holds its blocks
        remote.abort_request("r")
        while remote.has_unfinished_requests():
            remote.step()
        assert remote.num_free_blocks == total and not remote.has_request("r")
        assert remote.reset_prefix_cache() == (True, 0) and plain.reset_prefix_cache() == (True, 0)  # any role
        with pytest.raises(RuntimeError, match=r"kv=True"):
            plain.reserve_prompt("r", 4)
    finally:
        remote.shutdown()
        plain.shutdown()


def test_an_exception_in_the_engine_process_reaches_the_worker_with_its_traceback():
    """Anything but a refused add ends the engine process; the proxy's next step raises with the child's
    traceback (so the worker's log names the cause), and the child is gone."""
    from worker_common.engine_process import RemoteEngine

    remote = RemoteEngine(engine_config(), "failing").start()
    try:
        remote._send(("no-such-command",))  # a protocol error: the child raises
        with pytest.raises(RuntimeError) as e:
            for _ in range(200):
                remote.step(0.1)
        assert "the engine process failed" in str(e.value) and "no-such-command" in str(e.value)
        wait_until(lambda: not remote._proc.is_alive(), timeout=10, interval=0.05, message="the child exited")
    finally:
        remote.shutdown()


def test_config_refuses_what_the_engine_process_cannot_do_yet():
    from engine.config import EngineConfig
    from prefill_worker import PrefillWorkerConfig

    gpu, store = EngineConfig(model="tiny", device="cuda"), "tcp://127.0.0.1:1"  # (a store never dialled)
    with pytest.raises(ValueError, match="engine_process for the decode role needs a CPU engine"):
        DecodeWorkerConfig("d", engine=gpu, engine_process=True, kv_store=store)
    with pytest.raises(ValueError, match="engine_process for the prefill role needs a CPU engine"):
        PrefillWorkerConfig("p", engine=gpu, engine_process=True, kv_store=store)
    assert DecodeWorkerConfig("d", engine=engine_config(), engine_process=True, kv_store=store).engine_process
    with pytest.raises(ValueError, match="engine_process must be a bool"):
        ColocatedWorkerConfig("c", engine=engine_config(), engine_process="yes")


def test_engine_process_death_while_idle_takes_the_worker_out_and_names_the_cause():
    """Killed while the worker serves nothing: the idle loop notices (it used to keep reporting ready and fail
    every later request with a broken pipe), the worker reports not ready and ``engine_failed`` says why (the
    cluster's actor then fails its probe, so the supervisor replaces the worker)."""
    torch.set_num_threads(1)
    r = start_colocated(n=1, tag="epi-", worker={"engine_process": True}, router={"pool_wait_s": 0.0})
    try:
        w = r.decodes[0]
        assert joined(collect(r.stub, prompt="x", max_tokens=2, temperature=0.0))[2] == "length"
        assert w.info().ready and w.engine_failed() is None
        os.kill(_engine_pid(w), signal.SIGKILL)
        wait_until(lambda: not w.info().ready, timeout=30, interval=0.02,
                   message="the worker still reports ready with its engine process dead")
        assert "engine process exited" in (w.engine_failed() or ""), w.engine_failed()
        with pytest.raises(grpc.RpcError) as e:
            collect(r.stub, prompt="x", max_tokens=2, temperature=0.0)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        r.close()
