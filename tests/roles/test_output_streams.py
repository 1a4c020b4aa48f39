"""Output streams (issue 31): a worker's tokens for a router travel on one stream, a message per engine step.

Real workers and a real router on loopback. Checked: greedy and seeded output through the streams equals the
offline engine (colocated, disaggregated, n > 1 choices, logprobs), and one message carries several requests'
chunks; a cancelled request and a stopped router free every block; a stream that breaks mid-request moves the
request to another worker with the output still equal to offline; a worker without ``OpenOutputStream`` (an
older version) is served per call; bad stream ids are refused naming the field.
"""
from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from decode_worker import ColocatedWorker
from engine.sampling_params import SamplingParams
from proto import pdserve_pb2, worker_pb2, worker_pb2_grpc
from router.wire import params_to_wire
from tests.roles.harness import collect, joined, offline, start_colocated, start_roles
from tests.waiting import wait_until

PROMPTS = ["def add(a, b):", "x", "# " + "the quick brown fox jumps over the lazy dog " * 8, "return None",
           "import os\n", "class A:"]


def _concurrent(stub, prompts, **kw):
    got = [None] * len(prompts)

    def run(i):
        got[i] = collect(stub, prompt=prompts[i], **kw)

    ts = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    return got


@pytest.fixture(scope="module")
def colo():
    torch.set_num_threads(1)
    r = start_colocated(n=1, tag="ostream-")
    yield r
    r.close()


def test_colocated_greedy_equal_offline_one_message_per_step(colo):
    w = colo.decodes[0]
    m0, o0 = w.output_streams.messages_total, w.output_streams.outputs_total
    ref = offline(PROMPTS, [SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)] * len(PROMPTS))
    got = _concurrent(colo.stub, PROMPTS, max_tokens=16, temperature=0.0, ignore_eos=True)
    for (ids, text, reason, _), resps in zip(ref, got):
        assert joined(resps) == (ids, text, reason)
    assert len(w.output_streams) == 1  # one router, one stream
    msgs, outs = w.output_streams.messages_total - m0, w.output_streams.outputs_total - o0
    assert outs >= len(PROMPTS) * 16  # every token went through the stream (none on the requests' own calls)
    assert msgs < outs * 0.6, (msgs, outs)  # requests decoding together share a message
    assert colo.wait_idle(2.0)


def test_colocated_choices_seeded_and_logprobs_equal_offline(colo):
    sp = SamplingParams(max_tokens=10, temperature=0.9, seed=5, logprobs=2)
    (ids, text, _, lps), = offline([PROMPTS[0]], [sp])
    resps = collect(colo.stub, prompt=PROMPTS[0], max_tokens=10, temperature=0.9, seed=5, logprobs=2)
    assert joined(resps)[:2] == (ids, text)
    got = [(lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for r in resps for lp in r.logprobs]
    assert [g[0] for g in got] == [lp.token_id for lp in lps] == ids
    assert [g[1] for g in got] == pytest.approx([lp.logprob for lp in lps], abs=1e-5)
    assert [[t for t, _ in g[2]] for g in got] == [[t for t, _ in lp.top] for lp in lps]
    resps = collect(colo.stub, prompt=PROMPTS[3], max_tokens=8, temperature=0.0, n=3, ignore_eos=True)
    (ids, _, _, _), = offline([PROMPTS[3]], [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)])
    by_choice = {}
    for r in resps:
        by_choice.setdefault(r.index, []).extend(r.token_ids)
    assert by_choice == {0: ids, 1: ids, 2: ids}
    assert colo.wait_idle(2.0)


def test_cancel_frees_blocks_and_router_forgets_it(colo):
    s = colo.stub.Generate(pdserve_pb2.GenerateRequest(prompt="a", max_tokens=1500, ignore_eos=True,
                                                       temperature=0.0), timeout=60)
    next(s)
    next(s)
    s.cancel()
    assert wait_until(lambda: colo.idle(), 30), colo.busy()
    streams = colo.router.core.streams
    assert wait_until(lambda: all(len(st) == 0 for st in streams._streams.values()), 30)


def test_bad_stream_ids_are_refused_naming_the_field(colo):
    w = colo.decodes[0]
    with grpc.insecure_channel(w.address) as ch:
        stub = worker_pb2_grpc.ColocatedWorkerStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.OpenOutputStream(worker_pb2.OutputStreamRequest(stream_id=""), timeout=10))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "stream_id" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(worker_pb2.ColocatedRequest(request_id="bad-stream", prompt_token_ids=[1, 2, 3],
                                                           params=params_to_wire(SamplingParams(max_tokens=4)),
                                                           output_stream="no-such-stream"), timeout=10))
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE and "output stream" in e.value.details()
        open_id = next(iter(w.output_streams._streams))
        with pytest.raises(grpc.RpcError) as e:
            list(stub.OpenOutputStream(worker_pb2.OutputStreamRequest(stream_id=open_id), timeout=10))
        assert e.value.code() == grpc.StatusCode.ALREADY_EXISTS and "stream_id" in e.value.details()
    assert colo.wait_idle(2.0)


def test_disaggregated_greedy_equal_offline_through_the_decode_stream():
    torch.set_num_threads(1)
    r = start_roles(tag="ostream-pd-")
    try:
        ref = offline(PROMPTS[:4], [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)] * 4)
        got = _concurrent(r.stub, PROMPTS[:4], max_tokens=12, temperature=0.0, ignore_eos=True)
        for (ids, text, reason, _), resps in zip(ref, got):
            assert joined(resps) == (ids, text, reason)
        d = r.decodes[0]
        assert len(d.output_streams) == 1 and d.output_streams.outputs_total >= 4 * 11
        assert r.wait_idle(2.0), r.busy()
    finally:
        r.close()


def test_a_broken_stream_moves_its_requests_and_output_stays_equal_offline():
    """The stream from the worker running a request closes mid-request: the router migrates the request to the
    other worker (resuming after the tokens streamed) and the client's tokens equal offline."""
    torch.set_num_threads(1)
    r = start_colocated(n=2, tag="ostream-mig-")
    try:
        n_tok = 200
        (ids, text, reason, _), = offline([PROMPTS[2]], [SamplingParams(max_tokens=n_tok, temperature=0.0,
                                                                          ignore_eos=True)])
        s = r.stub.Generate(pdserve_pb2.GenerateRequest(prompt=PROMPTS[2], max_tokens=n_tok, ignore_eos=True,
                                                        temperature=0.0), timeout=120)
        resps = [next(s), next(s)]
        w = next(w for w in r.decodes if w.requests)
        w.output_streams.close_all()  # the worker's end of the stream goes away with the request on it
        resps.extend(s)
        assert joined(resps) == (ids, text, reason)
        assert wait_until(r.idle, 30), r.busy()
    finally:
        r.close()


def test_a_closed_stream_aborts_its_requests_on_the_worker(colo):
    """The router's end of a stream goes away while a request's call is still open: the worker aborts the request
    (frees its blocks, ends its call CANCELLED) instead of generating on for nobody."""
    w = colo.decodes[0]
    with grpc.insecure_channel(w.address) as ch:
        stub = worker_pb2_grpc.ColocatedWorkerStub(ch)
        stream = stub.OpenOutputStream(worker_pb2.OutputStreamRequest(stream_id="test-closed-stream"))
        assert not next(stream).outputs  # the stream is open
        tokens0 = w.output_tokens_total
        call = stub.Generate(worker_pb2.ColocatedRequest(
            request_id="on-a-closed-stream", prompt_token_ids=[5, 6, 7],
            params=params_to_wire(SamplingParams(max_tokens=1500, ignore_eos=True, temperature=0.0)),
            output_stream="test-closed-stream"), timeout=120)
        first = next(stream)
        assert first.outputs[0].request_id == "on-a-closed-stream" and first.outputs[0].chunk.token_ids
        stream.cancel()
        assert wait_until(lambda: colo.idle() and len(w.output_streams) == 1, 60), colo.busy()
        with pytest.raises(grpc.RpcError) as e:
            list(call)
        assert e.value.code() == grpc.StatusCode.CANCELLED
        assert w.output_tokens_total - tokens0 < 1500  # aborted, not run to its end


def test_a_broken_stream_cancels_the_requests_call():
    """The router's end: when a worker's stream breaks, each request on it fails UNAVAILABLE (to retry or
    migrate) and its own call is cancelled, so the worker stops generating it."""
    torch.set_num_threads(1)
    # (pool_wait_s: the request, its worker excluded, finds the pool empty; 15 s of waiting for a worker to come
    # back would show nothing more)
    r = start_colocated(n=1, tag="ostream-stop-", router=dict(pool_wait_s=1.0))
    try:
        w = r.decodes[0]
        tokens0 = w.output_tokens_total
        s = r.stub.Generate(pdserve_pb2.GenerateRequest(prompt="a", max_tokens=1500, ignore_eos=True,
                                                        temperature=0.0), timeout=60)
        next(s)
        assert len(w.output_streams) == 1 and w.requests
        drop = w.output_streams.drop
        w.output_streams.drop = lambda st: (drop(st), set())[1]  # the worker's own abort off: only the router's
        w.output_streams.close_all()  # cancel of the request's call can end it now
        with pytest.raises(grpc.RpcError):
            list(s)  # no other worker to migrate to
        assert wait_until(lambda: r.idle(), 60), r.busy()
        assert w.output_tokens_total - tokens0 < 1500
    finally:
        r.close()


class _OldColocatedWorker(ColocatedWorker):
    """A worker from before output streams: OpenOutputStream is UNIMPLEMENTED, as gRPC answers for a method a
    server does not have."""

    def OpenOutputStream(self, request, context):
        context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")


def test_a_worker_without_output_streams_is_served_per_call():
    from decode_worker import ColocatedWorkerConfig
    from router import RouterConfig, RouterServer, StaticWorkerSource
    from tests.roles.harness import engine_config

    torch.set_num_threads(1)
    w = _OldColocatedWorker(ColocatedWorkerConfig("ostream-old-c0", engine=engine_config())).start()
    router = RouterServer(RouterConfig(serve_metrics=False, mode="colocated"), StaticWorkerSource([w.info])).start()
    try:
        from proto import pdserve_pb2_grpc

        with grpc.insecure_channel(router.address) as ch:
            stub = pdserve_pb2_grpc.PDServeStub(ch)
            ref = offline(PROMPTS[:3], [SamplingParams(max_tokens=8, temperature=0.0)] * 3)
            got = _concurrent(stub, PROMPTS[:3], max_tokens=8, temperature=0.0)
            for (ids, text, reason, _), resps in zip(ref, got):
                assert joined(resps) == (ids, text, reason)
        assert w.output_streams.outputs_total == 0
        assert w.address in router.core.streams._unsupported
        t0 = time.monotonic()
        assert router.core.streams.stream_for(w.address) is None and time.monotonic() - t0 < 1.0  # not asked again
    finally:
        router.stop()
        w.stop()
