"""Conditional disaggregation: the router has the decode worker prefill short prompts itself (or any
prompt while the prefill pool is backed up), through the real router, workers and gloo KV.

Which path a request took is read from the engines themselves: every prompt an engine admits is
counted in its ``prefix_cache_queries`` (prompt tokens looked up), so a prompt prefilled locally
shows up in the decode engine's count and not in the prefill engine's. Outputs must equal the
offline engine's whichever path ran.
"""
from __future__ import annotations

import concurrent.futures as cf
import time

import grpc
import pytest
import torch

from engine.sampling_params import SamplingParams
from proto import pdserve_pb2
from router.config import RouterConfig
from router.selection import prefill_locally
from tests.roles.harness import collect, joined, offline, start_roles


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 8000, (n,), generator=g).tolist()


def test_prefill_locally_rule():
    assert prefill_locally(20, None, 20, None)
    assert not prefill_locally(20, None, 21, 10_000)  # no queue rule
    assert prefill_locally(20, 100, 500, 100)  # long, but the prefill pool is backed up
    assert not prefill_locally(20, 100, 500, 99)
    assert not prefill_locally(20, 100, 500, None)  # no prefill worker to measure: disaggregate
    assert not prefill_locally(0, None, 1, None)


@pytest.mark.parametrize("field,value", [("local_prefill_max_tokens", -1), ("local_prefill_max_tokens", 1.5),
                                         ("prefill_queue_max_tokens", -3)])
def test_config_rejects_bad_values(field, value):
    with pytest.raises(ValueError, match=field):
        RouterConfig(**{field: value})


def test_short_prompts_prefill_on_decode_and_match_offline():
    torch.set_num_threads(1)
    short = [_ids(n, 100 + n) for n in (3, 9, 20)]
    long = [_ids(n, 200 + n) for n in (21, 45)]
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    seeded = SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=77)
    want = offline(short + long, [greedy] * 5)
    want_seeded = offline([short[1]], [seeded])[0][0]
    roles = start_roles(tag="lp-", router={"local_prefill_max_tokens": 20})
    try:
        p_eng, d_eng = roles.prefills[0].engine, roles.decodes[0].engine
        with cf.ThreadPoolExecutor(5) as ex:
            futs = [ex.submit(collect, roles.stub, token_ids=p, max_tokens=10, temperature=0.0) for p in short + long]
            got = [f.result() for f in futs]
        for g, w in zip(got, want):
            assert joined(g)[0] == w[0]
        for g in got[:3]:
            assert g[-1].timings.kv_transfer_s == 0.0 and g[-1].timings.ttft_s > 0
        seeded_out = collect(roles.stub, token_ids=short[1], max_tokens=10, temperature=0.8, top_p=0.9, seed=77)
        assert joined(seeded_out)[0] == want_seeded
        assert roles.wait_idle(1.0)
        # the two long prompts went through the prefill pool, the four short ones (seeded one included) did not
        assert p_eng.prefix_cache_queries == 21 + 45
        assert d_eng.prefix_cache_queries == 3 + 9 + 20 + 9
        text = roles.router.metrics.render().decode()
        assert 'pdserve:local_prefill_requests_total{model_name="tiny",role="router",worker="router"} 4.0' in text
    finally:
        roles.close()


def test_backed_up_prefill_pool_sends_every_prompt_to_decode_and_cancel_frees():
    torch.set_num_threads(1)
    roles = start_roles(tag="lpq-", router={"prefill_queue_max_tokens": 0})  # always "backed up"
    try:
        p_eng, d_eng = roles.prefills[0].engine, roles.decodes[0].engine
        prompt = _ids(60, 5)
        want = offline([prompt], [SamplingParams(max_tokens=8, temperature=0.0)])[0][0]
        assert joined(collect(roles.stub, token_ids=prompt, max_tokens=8, temperature=0.0))[0] == want
        assert p_eng.prefix_cache_queries == 0 and d_eng.prefix_cache_queries == 60
        # cancel a local request midway: the decode worker's blocks come back within 1 s
        stream = roles.stub.Generate(pdserve_pb2.GenerateRequest(token_ids=_ids(30, 6), max_tokens=1500,
                                                                 ignore_eos=True, temperature=0.0), timeout=60)
        got = [next(stream) for _ in range(4)]
        assert sum(len(r.token_ids) for r in got) >= 4
        d = roles.decodes[0]
        assert d.info().num_free_blocks < d.info().num_total_blocks
        t = time.monotonic()
        stream.cancel()
        assert roles.wait_idle(1.0), [w.info() for w in roles.prefills + roles.decodes]
        assert time.monotonic() - t < 1.0
        with pytest.raises(grpc.RpcError) as ei:
            collect(roles.stub, token_ids=[8192 + 5], max_tokens=2)
        assert ei.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert joined(collect(roles.stub, token_ids=prompt, max_tokens=8, temperature=0.0))[0] == want
    finally:
        roles.close()
