"""Prefix caching through the serving path: a repeated prompt prefix is not prefilled again on the
prefill worker (reported as usage.cached_tokens and in pdserve:prefix_cache_hits_total), and the
stream is still the engine's offline output token for token, since the KV shipped to the decode
worker covers the whole prompt, cached blocks included.
"""
from __future__ import annotations

import torch

from engine.sampling_params import SamplingParams
from tests.roles.harness import collect, joined, offline, start_colocated, start_roles
from tests.roles.test_metrics import _scrape, _total

BS = 16  # the engine's default block size, which the harness keeps


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 8000, (n,), generator=g).tolist()


def test_disaggregated_reuses_prefill_cache_and_matches_offline():
    torch.set_num_threads(1)
    system = _ids(40, 1)  # 2 full blocks of 16 shared by every request below
    prompts = [system + _ids(n, 10 + n) for n in (5, 20, 1)]
    want = offline(prompts, [SamplingParams(max_tokens=12, temperature=0.0)] * len(prompts))
    roles = start_roles(tag="pc-", metrics=True)
    try:
        first = collect(roles.stub, token_ids=prompts[0], max_tokens=12, temperature=0.0)
        assert joined(first)[0] == want[0][0]
        assert first[-1].usage.cached_tokens == 0
        for p, w in zip(prompts[1:], want[1:]):
            resps = collect(roles.stub, token_ids=p, max_tokens=12, temperature=0.0)
            assert joined(resps)[0] == w[0]
            # at least the shared system prompt's 2 blocks; never the prompt's last token
            cached = resps[-1].usage.cached_tokens
            assert 2 * BS <= cached <= len(p) - 1 and cached % BS == 0
        assert roles.wait_idle(1.0)  # every block back on both workers, the cached ones included
        pe = roles.prefills[0].engine
        assert pe.prefix_cache_hits >= 2 * 2 * BS
        scraped = _scrape(roles.prefills[0].metrics_address)
        assert _total(scraped, "pdserve:prefix_cache_hits_total") == pe.prefix_cache_hits
        assert _total(scraped, "pdserve:prefix_cache_queries_total") == sum(len(p) for p in prompts)
    finally:
        roles.close()


def test_colocated_reports_cached_tokens():
    torch.set_num_threads(1)
    prompt = _ids(50, 3)
    want = offline([prompt], [SamplingParams(max_tokens=6, temperature=0.0)])[0][0]
    roles = start_colocated(tag="pcc-")
    try:
        a = collect(roles.stub, token_ids=prompt, max_tokens=6, temperature=0.0)
        b = collect(roles.stub, token_ids=prompt, max_tokens=6, temperature=0.0)
        assert joined(a)[0] == joined(b)[0] == want
        assert a[-1].usage.cached_tokens == 0
        assert b[-1].usage.cached_tokens == 48  # (50 - 1) // 16 = 3 blocks
    finally:
        roles.close()
