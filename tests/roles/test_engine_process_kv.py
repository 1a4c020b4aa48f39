"""The prefill and decode roles with their engine cores in processes of their own (``WorkerConfig.engine_process``):
the router + 1 prefill + 1 decode worker on loopback, each worker's engine a child process whose KV cache is shared
memory the worker maps (``RemoteEngine(kv=True)``). Greedy output equals the offline engine under concurrency and
with the prefix cache's delta transfers; the decode worker pulls the prefill's KV straight from the prefill's
engine process; a cancel frees blocks in both children; a prefill engine process that dies fails its request
(never hangs)."""
from __future__ import annotations

import os
import re
import signal
import threading

import psutil
import pytest
import torch

from engine.sampling_params import SamplingParams
from tests.roles.harness import collect, counter_values, joined, offline, start_roles
from tests.waiting import wait_until

PROMPTS = [
    "def add(a, b):",
    "x",
    "# " + "the quick brown fox jumps over the lazy dog " * 12,  # several blocks
    "for i in range(10):\n    print(i)",
]


@pytest.fixture(scope="module")
def roles():
    torch.set_num_threads(1)
    r = start_roles(tag="epkv-", metrics=True, worker={"engine_process": True})
    yield r
    r.close()


def _links(roles) -> dict[str, float]:
    out: dict[str, float] = {}
    for w in [*roles.prefills, *roles.decodes]:
        for k, v in counter_values(w.metrics, "pdserve:kv_transfers", "link").items():
            out[k] = out.get(k, 0.0) + v
    return out


def test_both_roles_step_in_child_processes_and_greedy_equals_offline(roles):
    for w in [*roles.prefills, *roles.decodes]:
        assert type(w.engine).__name__ == "RemoteEngine" and w.engine.kv
        child = psutil.Process(w.engine.pid)
        assert child.ppid() == os.getpid() and child.is_running()
    max_tokens = [16, 6, 12, 10]
    ref = offline(PROMPTS, [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens])
    got: list = [None] * len(PROMPTS)
    errors: list = []

    def run(i: int) -> None:
        try:
            got[i] = joined(collect(roles.stub, prompt=PROMPTS[i], max_tokens=max_tokens[i], temperature=0.0))
        except Exception as e:  # noqa: BLE001 - reported below
            errors.append(e)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(PROMPTS))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    for (ids, text, reason), (ref_ids, ref_text, ref_reason, _) in zip(got, ref):
        assert ids == ref_ids and text == ref_text and reason == ref_reason
    # the decode worker read the prefill's KV from the prefill's engine process (its segment, mapped by pid/fd)
    links = _links(roles)
    assert links.get("pull", 0) >= len(PROMPTS) and set(links) == {"pull"}, links
    assert roles.wait_idle(10.0)


def test_prefix_cache_delta_transfer_equals_offline(roles):
    """The same long prompt twice: the second's leading blocks are in the decode worker's prefix cache (in its
    child), reserved by reference and not sent again."""
    prompt = "# " + "a stitch in time saves nine, " * 14
    ref = offline([prompt], [SamplingParams(max_tokens=8, temperature=0.0)])[0]
    cached = lambda: sum(counter_values(w.metrics, "pdserve:kv_transfer_cached_tokens").get("", 0.0)  # noqa: E731
                         for w in roles.decodes)
    before = cached()
    for _ in range(2):
        ids, text, _reason = joined(collect(roles.stub, prompt=prompt, max_tokens=8, temperature=0.0))
        assert (ids, text) == (ref[0], ref[1])
    assert cached() - before >= roles.decodes[0].engine.block_size
    assert roles.wait_idle(10.0)


def test_cancel_mid_stream_frees_blocks_in_both_engine_processes(roles):
    from proto import pdserve_pb2

    d = roles.decodes[0].engine
    before = d.make_stats().num_scheduled_tokens
    stream = roles.stub.Generate(pdserve_pb2.GenerateRequest(prompt="def forever():", max_tokens=1500,
                                                             temperature=0.0, ignore_eos=True), timeout=60)
    first = next(stream)
    assert first.token_ids
    stream.cancel()
    # the free blocks the workers report come from their children's snapshots: both engines let the request go
    assert roles.wait_idle(30.0)
    # and the decode worker's child stopped decoding it (an abort lost on the way would run all 1500 tokens first)
    assert d.make_stats().num_scheduled_tokens - before < 1500


def test_a_dead_prefill_engine_process_takes_the_worker_out_and_requests_go_on():
    torch.set_num_threads(1)
    r = start_roles(tag="epkvd-", worker={"engine_process": True}, router={"pool_wait_s": 0.0})
    try:
        p = r.prefills[0]
        assert joined(collect(r.stub, prompt="x", max_tokens=2, temperature=0.0))[2] == "length"
        os.kill(p.engine.pid, signal.SIGKILL)
        wait_until(lambda: not p.info().ready, timeout=30, interval=0.02,
                   message="the prefill worker still reports ready with its engine process dead")
        # ("exited": noticed idle; "died": inside a step, waiting for the release of the last request's blocks)
        assert re.search("engine process (exited|died)", p.engine_failed() or ""), p.engine_failed()
        # the router no longer sees a ready prefill worker: the request runs whole on the decode worker (degraded)
        ids, _text, reason = joined(collect(r.stub, prompt="x", max_tokens=2, temperature=0.0, timeout=30))
        assert reason == "length" and ids == offline(["x"], [SamplingParams(max_tokens=2, temperature=0.0)])[0][0]
    finally:
        r.close()
