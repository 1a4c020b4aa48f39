"""One event loop in the router (``RouterConfig.one_loop``, issue 46 item 3): the HTTP front end serves on the gRPC
front end's loop, and the workers' output streams are read there (``grpc.aio``), so a flow's streaming stretch runs
on that loop and its events reach either front end without a thread hop.

Real workers, a real router on loopback, the ``openai`` client and grpcio. Checked: greedy output through gRPC and
through the OpenAI HTTP API at once equals the offline engine (colocated and disaggregated); the chunks are
processed on the loop's thread and the router has no output stream reader thread and no HTTP thread; a cancelled
gRPC stream and a closed HTTP stream free every block; a stream that breaks mid-request moves the request to the
other worker with the output still equal to offline; a stop closes the loop's streams and channels.
"""
from __future__ import annotations

import threading

import grpc
import openai
import pytest
import torch

from engine.sampling_params import SamplingParams
from proto import pdserve_pb2
from tests.roles.harness import collect, joined, offline, start_colocated, start_roles
from tests.waiting import wait_until

PROMPTS = ["def add(a, b):", "x", "# " + "the quick brown fox jumps over the lazy dog " * 8, "return None"]
ONE_LOOP = {"one_loop": True, "http_port": 0}


@pytest.fixture(scope="module")
def colo():
    torch.set_num_threads(1)
    r = start_colocated(n=1, tag="oneloop-", router=ONE_LOOP)
    yield r
    r.close()


def _client(roles) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{roles.router.http_address}/v1", api_key="none", max_retries=0,
                         timeout=120)


def _both_apis(roles, prompts: list, tokens: int) -> tuple[list, list]:
    """Every prompt through gRPC and through the HTTP API, all at once: (gRPC responses, HTTP texts) per prompt."""
    grpc_got: list = [None] * len(prompts)
    http_got: list = [None] * len(prompts)
    client = _client(roles)

    def by_grpc(i: int) -> None:
        grpc_got[i] = collect(roles.stub, prompt=prompts[i], max_tokens=tokens, temperature=0.0, ignore_eos=True,
                              timeout=120)

    def by_http(i: int) -> None:
        stream = client.completions.create(model="tiny", prompt=prompts[i], max_tokens=tokens, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})
        http_got[i] = "".join(c.choices[0].text for c in stream if c.choices)

    threads = [threading.Thread(target=f, args=(i,)) for i in range(len(prompts)) for f in (by_grpc, by_http)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    client.close()
    return grpc_got, http_got


def test_both_front_ends_stream_from_the_one_loop_equal_offline(colo):
    from router import request_flow

    seen: list[str] = []
    orig = request_flow.RequestFlow._emit

    def recording(self, *a, **k):
        seen.append(threading.current_thread().name)
        return orig(self, *a, **k)

    request_flow.RequestFlow._emit = recording  # type: ignore[method-assign]
    try:
        grpc_got, http_got = _both_apis(colo, PROMPTS, 24)
        names = [t.name for t in threading.enumerate()]  # while the router is up, after its streams were used
    finally:
        request_flow.RequestFlow._emit = orig  # type: ignore[method-assign]
    ref = offline(PROMPTS, [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)] * len(PROMPTS))
    for (ids, text, reason, _), resps, http_text in zip(ref, grpc_got, http_got):
        assert joined(resps) == (ids, text, reason)
        assert http_text == text
    # the chunks went through their flows on the loop's thread (the first token of each request, and chunks that
    # came while its flow was on the pool, go through there), never on a reader thread of their own; there is none,
    # and no HTTP thread either
    assert len(seen) >= 2 * len(PROMPTS) * 24 // 8, seen
    assert sum(n == "router-aio" for n in seen) >= 0.5 * len(seen), seen
    assert f"out-stream-{colo.decodes[0].address}" not in names, names  # (other tests' routers may have theirs)
    assert colo.router.http._thread is None and colo.router.http._task is not None  # HTTP: a task of the loop
    assert len(colo.decodes[0].output_streams) == 1  # one stream to this router, read on the loop
    assert colo.wait_idle(10.0)


def test_a_cancelled_grpc_stream_and_a_closed_http_stream_free_their_blocks(colo):
    s = colo.stub.Generate(pdserve_pb2.GenerateRequest(prompt="a", max_tokens=1500, ignore_eos=True,
                                                       temperature=0.0), timeout=60)
    next(s)
    next(s)
    s.cancel()
    assert wait_until(colo.idle, 30), colo.busy()
    assert wait_until(lambda: colo.router.num_in_flight == 0, 30)
    client = _client(colo)
    stream = client.completions.create(model="tiny", prompt="b", max_tokens=1500, temperature=0, stream=True,
                                       extra_body={"ignore_eos": True})
    it = iter(stream)
    next(it)
    next(it)
    stream.close()  # the client goes away mid-stream
    client.close()
    assert wait_until(colo.idle, 30), colo.busy()
    assert wait_until(lambda: colo.router.num_in_flight == 0, 30)
    streams = colo.router.core.streams
    assert len(streams._streams) == 1  # the worker's stream stays open for the next requests ...
    assert wait_until(lambda: all(len(st) == 0 for st in streams._streams.values()), 30)  # ... with none on it
    # and the loop serves on
    assert sum(len(r.token_ids) for r in collect(colo.stub, token_ids=[5, 6], max_tokens=4)) == 4


def test_a_stream_is_never_opened_on_the_loop_that_reads_it(colo):
    """``stream_for`` may wait for a new stream's first message: on the loop that must read that message it would
    wait for itself, so there it answers None at once (the request streams per call) instead of stalling."""
    import asyncio
    import time

    router = colo.router
    address = colo.decodes[0].address

    async def on_loop():
        t0 = time.monotonic()
        return router.core.streams.stream_for(address), time.monotonic() - t0

    got, took = asyncio.run_coroutine_threadsafe(on_loop(), router._serving.loop).result(30)
    assert got is None and took < 1.0
    assert router.core.streams.stream_for(address) is not None  # off the loop: the open stream


def test_the_cluster_secret_travels_on_the_loops_streams():
    """Workers that require the cluster secret accept the stream the loop opens (its asyncio channel carries the
    secret as call metadata): the tokens come on the one stream, not per call."""
    secret = "one-loop-cluster-secret-0123"
    torch.set_num_threads(1)
    r = start_colocated(n=1, tag="oneloop-sec-", router={"one_loop": True, "cluster_secret": secret},
                        worker={"cluster_secret": secret})
    try:
        w = r.decodes[0]
        (ids, text, reason, _), = offline([PROMPTS[0]], [SamplingParams(max_tokens=8, temperature=0.0,
                                                                          ignore_eos=True)])
        assert joined(collect(r.stub, prompt=PROMPTS[0], max_tokens=8, temperature=0.0, ignore_eos=True)) == \
            (ids, text, reason)
        assert len(w.output_streams) == 1 and w.output_streams.outputs_total >= 8
    finally:
        r.close()


def test_a_broken_stream_moves_its_request_on_one_loop():
    torch.set_num_threads(1)
    r = start_colocated(n=2, tag="oneloop-mig-", router={"one_loop": True})
    try:
        n_tok = 200
        (ids, text, reason, _), = offline([PROMPTS[2]], [SamplingParams(max_tokens=n_tok, temperature=0.0,
                                                                          ignore_eos=True)])
        s = r.stub.Generate(pdserve_pb2.GenerateRequest(prompt=PROMPTS[2], max_tokens=n_tok, ignore_eos=True,
                                                        temperature=0.0), timeout=120)
        resps = [next(s), next(s)]
        w = next(w for w in r.decodes if w.requests)
        other = next(o for o in r.decodes if o is not w)
        before = other.output_tokens_total
        w.output_streams.close_all()  # the worker's end of the stream goes away with the request on it
        resps.extend(s)
        assert joined(resps) == (ids, text, reason)
        assert other.output_tokens_total > before  # the rest came from the other worker: the request moved
        assert wait_until(r.idle, 30), r.busy()
    finally:
        r.close()


def test_disaggregated_on_one_loop_equal_offline_and_stop_closes_the_streams():
    torch.set_num_threads(1)
    r = start_roles(tag="oneloop-pd-", router=ONE_LOOP)
    try:
        grpc_got, http_got = _both_apis(r, PROMPTS[:3], 12)
        ref = offline(PROMPTS[:3], [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 3)
        for (ids, text, reason, _), resps, http_text in zip(ref, grpc_got, http_got):
            assert joined(resps) == (ids, text, reason)
            assert http_text == text
        assert len(r.decodes[0].output_streams) == 1
        assert r.wait_idle(10.0), r.busy()
        core = r.router.core
        assert core.clients._aio_channels  # the stream's channel is an asyncio one
        # a stop with a request in flight: it ends for the client, its workers free it, nothing is retried
        s = r.stub.Generate(pdserve_pb2.GenerateRequest(prompt="a", max_tokens=1500, ignore_eos=True,
                                                        temperature=0.0), timeout=60)
        next(s)
        next(s)
        generated = r.decodes[0].output_tokens_total
        r.router.stop()
        with pytest.raises(grpc.RpcError):
            list(s)
        assert not core.clients._aio_channels and not core.streams._streams
        # the worker sees its stream end (the router's end was cancelled on the loop, not left to die with it)
        assert wait_until(lambda: len(r.decodes[0].output_streams) == 0, 30)
        assert wait_until(r.idle, 30), r.busy()
        assert r.decodes[0].output_tokens_total - generated < 1500  # aborted, not run to its end
        with pytest.raises(grpc.RpcError):
            collect(r.stub, token_ids=[5, 6], max_tokens=2, timeout=10)
    finally:
        r.close()
