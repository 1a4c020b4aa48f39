"""Prefix-aware routing through the real router and two prefill workers: a prompt goes where its prefix
was prefilled before, so that worker's engine reuses the cached blocks.

The first request is forced onto p1 by hiding p0 from the router's worker source; with both back and
idle, load alone would pick p0 (ties go by worker id), so only prefix routing sends the second one to
p1. The engines' own admission counters say where each prompt ran.
"""
from __future__ import annotations

import pytest
import torch

from engine.sampling_params import SamplingParams
from tests.roles.harness import collect, joined, offline, start_roles


def _ids(n: int, seed: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, 8000, (n,), generator=g).tolist()


@pytest.mark.parametrize("aware", [True, False])
def test_repeated_prefix_goes_to_the_worker_that_cached_it(aware):
    torch.set_num_threads(1)
    system = _ids(50, 31)
    first, second = system + _ids(7, 32), system + _ids(12, 33)
    want = offline([first, second], [SamplingParams(max_tokens=6, temperature=0.0)] * 2)
    roles = start_roles(n_prefill=2, tag=f"pr{int(aware)}-", router={"prefix_aware_routing": aware})
    try:
        p0, p1 = roles.prefills
        roles.source.remove_where(p0.cfg.worker_id)
        assert joined(collect(roles.stub, token_ids=first, max_tokens=6, temperature=0.0))[0] == want[0][0]
        roles.source.add(p0.info)
        assert roles.wait_idle(1.0)
        out = collect(roles.stub, token_ids=second, max_tokens=6, temperature=0.0)
        assert joined(out)[0] == want[1][0]
        if aware:
            assert p0.engine.prefix_cache_queries == 0
            assert p1.engine.prefix_cache_hits == 48  # the system prompt's 3 full blocks of 16
            assert out[-1].usage.cached_tokens == 48
        else:
            assert p0.engine.prefix_cache_queries == len(second) and out[-1].usage.cached_tokens == 0
        assert roles.wait_idle(1.0)
    finally:
        roles.close()
