"""Router + 1 prefill + 1 decode worker on loopback equal the offline engine.

Real gRPC servers, real engines on the ``tiny`` model, real kvtransfer (gloo over a
TCPStore) between the workers. The reference is ``engine.LLM("tiny").generate``.
"""
from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from engine.sampling_params import SamplingParams
from proto import pdserve_pb2
from tests.roles.harness import KV, collect, joined, offline, start_roles


PROMPTS = [
    "def add(a, b):",
    "import os\nimport sys\n\nclass Loader(object):\n    \"\"\"Load things from a path.\"\"\"\n    def __init__(self, path):",
    "x",
    "# " + "the quick brown fox jumps over the lazy dog " * 12,   # ~100+ tokens: several blocks
    "for i in range(10):\n    print(i)",
    "return None",
]


@pytest.fixture(scope="module")
def roles():
    torch.set_num_threads(1)
    r = start_roles(kv=KV, tag="dis-")
    yield r
    r.close()


def _run_concurrently(fn, args_list):
    results = [None] * len(args_list)
    errors = []

    def run(i, a):
        try:
            results[i] = fn(*a)
        except Exception as e:  # surfaced below
            errors.append(e)

    ts = [threading.Thread(target=run, args=(i, a)) for i, a in enumerate(args_list)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(120)
    assert not errors, errors
    return results


def test_greedy_concurrent_mixed_lengths_equal_offline(roles):
    max_tokens = [24, 8, 16, 12, 20, 1]
    ref = offline(PROMPTS, [SamplingParams(max_tokens=m, temperature=0.0) for m in max_tokens])
    got = _run_concurrently(lambda p, m: collect(roles.stub, prompt=p, max_tokens=m, temperature=0.0),
                            list(zip(PROMPTS, max_tokens)))
    for (ids, text, reason, _lp), resps in zip(ref, got):
        g_ids, g_text, g_reason = joined(resps)
        assert g_ids == ids
        assert g_text == text
        assert g_reason == reason
        last = resps[-1]
        assert last.usage.completion_tokens == len(ids)
        assert last.usage.prompt_tokens > 0
        assert last.timings.ttft_s > 0 and last.timings.total_s >= last.timings.ttft_s
    assert roles.wait_idle(2.0)


def test_token_id_prompt_and_first_token_streams_first(roles):
    tok = roles.router.tokenizer
    ids = tok.encode(PROMPTS[1])
    ref = offline([PROMPTS[1]], [SamplingParams(max_tokens=6, temperature=0.0)])
    stream = roles.stub.Generate(pdserve_pb2.GenerateRequest(token_ids=ids, max_tokens=6, temperature=0.0), timeout=60)
    first = next(stream)
    assert len(first.token_ids) == 1 and first.token_ids[0] == ref[0][0][0]
    rest = list(stream)
    assert [first.token_ids[0]] + [t for r in rest for t in r.token_ids] == ref[0][0]


def test_seeded_sampling_equals_offline(roles):
    params = [SamplingParams(max_tokens=12, temperature=0.8, top_p=0.9, seed=s) for s in (1, 2, 3)]
    ref = offline(PROMPTS[:3], params)
    got = _run_concurrently(lambda p, s: collect(roles.stub, prompt=p, max_tokens=12, temperature=0.8, top_p=0.9,
                                                 seed=s), list(zip(PROMPTS[:3], (1, 2, 3))))
    for (ids, text, _r, _lp), resps in zip(ref, got):
        assert joined(resps)[:2] == (ids, text)
    # different seeds gave different samples (else this test could not fail)
    assert len({tuple(r[0]) for r in ref}) > 1


def test_stop_string_same_text_as_offline_and_frees_decode(roles):
    full = offline([PROMPTS[0]], [SamplingParams(max_tokens=24, temperature=0.0)])[0][1]
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert stop.strip(), full
    ref = offline([PROMPTS[0]], [SamplingParams(max_tokens=24, temperature=0.0, stop=[stop])])[0]
    resps = collect(roles.stub, prompt=PROMPTS[0], max_tokens=24, temperature=0.0, stop=[stop])
    ids, text, reason = joined(resps)
    assert reason == "stop" == ref[2]
    assert text == ref[1] and stop not in text
    assert len(text) < len(full)
    # the last message says what stopped it (vLLM's stop_reason): the stop string; a stop token's id; EOS: neither
    assert (resps[-1].WhichOneof("stop_reason"), resps[-1].stop_string) == ("stop_string", stop)
    ids_full = offline([PROMPTS[0]], [SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)])[0][0]
    k = next(i for i in range(2, 24) if ids_full[i] not in ids_full[:i])
    by_token = collect(roles.stub, prompt=PROMPTS[0], max_tokens=24, temperature=0.0, ignore_eos=True,
                       stop_token_ids=[ids_full[k]])
    assert (by_token[-1].finish_reason, by_token[-1].WhichOneof("stop_reason"), by_token[-1].stop_token_id) == \
        ("stop", "stop_token_id", ids_full[k])
    plain = collect(roles.stub, prompt=PROMPTS[0], max_tokens=4, temperature=0.0, ignore_eos=True)
    assert plain[-1].finish_reason == "length" and plain[-1].WhichOneof("stop_reason") is None
    assert roles.wait_idle(1.0)


def test_logprobs_equal_offline(roles):
    ref = offline([PROMPTS[4]], [SamplingParams(max_tokens=5, temperature=0.0, logprobs=2)])[0]
    resps = collect(roles.stub, prompt=PROMPTS[4], max_tokens=5, temperature=0.0, logprobs=2)
    lps = [lp for r in resps for lp in r.logprobs]
    assert [lp.token_id for lp in lps] == ref[0]
    for got, want in zip(lps, ref[3]):
        assert got.logprob == pytest.approx(want.logprob, abs=1e-4)
        assert [t.token_id for t in got.top] == [t for t, _ in want.top]


def test_bad_inputs_get_invalid_argument_naming_the_field_then_serve(roles):
    cases = [
        (dict(), "prompt"),
        (dict(prompt="a", token_ids=[1]), "token_ids"),
        (dict(token_ids=[1, 10**6]), "token_ids[1]"),
        (dict(prompt="a", max_tokens=-1), "max_tokens"),
        (dict(prompt="a", max_tokens=5000), "max_tokens"),
        (dict(prompt="a", temperature=-0.5), "temperature"),
        (dict(prompt="a", top_p=2.0), "top_p"),
        (dict(prompt="a", logprobs=99), "logprobs"),
        (dict(prompt="a", stop=[""]), "stop"),
    ]
    for kw, field in cases:
        with pytest.raises(grpc.RpcError) as ei:
            collect(roles.stub, timeout=10, **kw)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (kw, ei.value)
        assert field in ei.value.details(), (kw, ei.value.details())
    ids, _text, reason = joined(collect(roles.stub, prompt="def f():", max_tokens=3, temperature=0.0))
    assert len(ids) == 3 and reason == "length"


def test_cancel_midway_frees_both_workers_blocks(roles):
    assert roles.wait_idle(2.0)
    stream = roles.stub.Generate(pdserve_pb2.GenerateRequest(prompt=PROMPTS[3], max_tokens=1500, ignore_eos=True,
                                                             temperature=0.0), timeout=60)
    got = [next(stream) for _ in range(4)]
    assert sum(len(r.token_ids) for r in got) >= 4
    d = roles.decodes[0]
    assert d.info().num_free_blocks < d.info().num_total_blocks  # the sequence holds blocks now
    t = time.monotonic()
    stream.cancel()
    assert roles.wait_idle(1.0), [w.info() for w in roles.prefills + roles.decodes]
    assert time.monotonic() - t < 1.0
    # and the cluster still serves
    assert joined(collect(roles.stub, prompt="x", max_tokens=2, temperature=0.0))[2] == "length"


def test_client_deadline_ends_with_deadline_exceeded_and_frees(roles):
    with pytest.raises(grpc.RpcError) as ei:
        collect(roles.stub, timeout=0.5, prompt=PROMPTS[0], max_tokens=1800, ignore_eos=True, temperature=0.0)
    assert ei.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert roles.wait_idle(1.0)


def test_inproc_kv_backend_by_name_gives_the_same_tokens():
    ref = offline([PROMPTS[1]], [SamplingParams(max_tokens=8, temperature=0.0)])[0]
    r = start_roles(kv="inproc", tag="inproc-")
    try:
        assert r.decodes[0].kv is not None and r.decodes[0].cfg.kv_backend == "inproc"
        assert joined(collect(r.stub, prompt=PROMPTS[1], max_tokens=8, temperature=0.0)) == ref[:3]
        assert r.wait_idle(1.0)
    finally:
        r.close()


def test_a_prefill_whose_dest_cached_tokens_is_out_of_range_is_refused_naming_the_field(roles):
    """A delta transfer's cut (``PrefillRequest.dest_cached_tokens``) must leave at least one prompt position to
    send: outside [0, len(prompt)) the prefill worker answers INVALID_ARGUMENT before taking any block."""
    from proto import worker_pb2, worker_pb2_grpc
    from router.wire import params_to_wire

    p = roles.prefills[0]
    with grpc.insecure_channel(p.address) as ch:
        stub = worker_pb2_grpc.PrefillWorkerStub(ch)
        for bad in (4, 9, -1):
            msg = worker_pb2.PrefillRequest(request_id=f"cut{bad}", prompt_token_ids=[5, 6, 7, 8],
                                            params=params_to_wire(SamplingParams(max_tokens=2)), dest_kv_name="d0",
                                            dest_block_ids=[0], dest_block_size=16, dest_cached_tokens=bad)
            with pytest.raises(grpc.RpcError) as ei:
                list(stub.Prefill(msg, timeout=10))
            assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT, (bad, ei.value)
            assert "dest_cached_tokens must be in [0, 4)" in ei.value.details(), ei.value.details()
    assert roles.wait_idle(5.0)
