"""Automatic prefix caching: reused blocks give the same tokens as computing them, and nothing leaks.

References: transformers' own greedy continuation of the full prompt (independent of our cache),
and the same engine with ``enable_prefix_caching=False``. Hit counts are checked against what the
block arithmetic says must be cached (full blocks of the shared prefix, leaving the last prompt
token to compute).
"""
from __future__ import annotations

import pytest
import torch

from engine.block_manager import BlockManager, block_keys
from engine.sampling_params import SamplingParams

from .conftest import greedy, hf_greedy, make_checkpoint, make_engine, prompts_of, run_engine

BS = 4


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    torch.set_num_threads(1)
    return make_checkpoint(tmp_path_factory.mktemp("llama_pc"), "llama", seed=5)


# -- block manager -------------------------------------------------------------------------------

def test_block_manager_caches_full_blocks_and_evicts_least_recently_freed():
    bm = BlockManager(4, 2, enable_caching=True)
    toks = [5, 6, 7, 8, 9]
    keys = block_keys(toks, 2, 2)
    assert keys[1][1] == (7, 8) and keys[1][0] == keys[0][2]  # chained on the parent's hash
    t = bm.allocate(3)
    held = list(t)  # free() empties the table it is given
    for i, k in enumerate(keys):
        bm.register(t[i], k)
    assert bm.lookup(keys) == held[:2]
    # a different first block changes every later key, even with the same tokens after it
    assert bm.lookup(block_keys([1, 6, 7, 8], 2, 2)) == []
    bm.free(t)
    assert bm.num_free_blocks == 4 and bm.lookup(keys) == held[:2]  # freed, still findable
    got = bm.acquire(bm.lookup(keys))
    assert got == held[:2] and bm.num_free_blocks == 2 and all(bm.ref_count(b) == 1 for b in got)
    bm.free(got)
    # LRU order is [3 (never used), 2 (never cached), 1, 0] (a table is freed tail first), so
    # three allocations evict the second cached block but keep the first
    fresh = bm.allocate(3)
    assert held[0] not in fresh and bm.lookup(keys) == [held[0]]
    bm.free(fresh)
    assert bm.num_free_blocks == 4


def test_block_manager_without_caching_never_hits():
    bm = BlockManager(4, 2)
    t = bm.allocate(1)
    k = block_keys([1, 2], 2, 1)
    bm.register(t[0], k[0])
    assert bm.lookup(k) == []


# -- engine --------------------------------------------------------------------------------------

def test_cached_prefix_matches_transformers_and_counts_hits(checkpoint):
    path, hf = checkpoint
    eng = make_engine(path, block_size=BS)
    base = prompts_of([22], seed=3)[0]
    tails = prompts_of([1, 5, 9], seed=4)
    # the first request computes the 22-token prefix: 5 full blocks get cached
    first = run_engine(eng, {"p": base}, greedy(8))["p"]
    assert first == hf_greedy(hf, base, 8)
    assert eng.prefix_cache_hits == 0 and eng.prefix_cache_queries == len(base)
    for i, tail in enumerate(tails):
        prompt = base + tail
        before = eng.prefix_cache_hits
        out = run_engine(eng, {f"t{i}": prompt}, greedy(12))[f"t{i}"]
        assert out == hf_greedy(hf, prompt, 12), f"tail {i}"
        # the prefix's 5 full blocks (20 tokens) are reused; the last prompt token is always computed
        expect = min(len(base) // BS, (len(prompt) - 1) // BS) * BS
        assert eng.prefix_cache_hits - before >= expect
    assert eng.num_free_blocks == eng.num_total_blocks


@pytest.mark.parametrize("length,hits", [(16, 12), (17, 16)])
def test_whole_prompt_cached_still_computes_its_last_token(checkpoint, length, hits):
    """16 tokens = 4 full blocks: 3 are reused, the 4th holds the last token, which is recomputed.
    17 tokens: 4 blocks are reused and the one token left runs through the decode path."""
    path, hf = checkpoint
    eng = make_engine(path, block_size=BS)
    prompt = prompts_of([length], seed=8)[0]
    a = run_engine(eng, {"a": prompt}, greedy(6))["a"]
    b = run_engine(eng, {"b": prompt}, greedy(6))["b"]
    assert a == b == hf_greedy(hf, prompt, 6)
    assert eng.prefix_cache_hits == hits


def test_shared_prefixes_in_one_batch_match_uncached_engine(checkpoint):
    path, _ = checkpoint
    system = prompts_of([13], seed=9)[0]
    prompts = {f"r{i}": system + p for i, p in enumerate(prompts_of([3, 11, 1, 20, 7, 2], seed=10))}
    off = run_engine(make_engine(path, block_size=BS, enable_prefix_caching=False), prompts, greedy(16))
    eng = make_engine(path, block_size=BS)
    warm = run_engine(eng, {"w": system + [7]}, greedy(2))  # caches the system prompt's 3 full blocks
    assert len(warm["w"]) == 2
    on = run_engine(eng, prompts, greedy(16))
    assert on == off
    assert eng.prefix_cache_hits >= 6 * 12
    assert eng.num_free_blocks == eng.num_total_blocks


def test_prefix_caching_under_preemption_and_eviction(checkpoint):
    path, _ = checkpoint
    system = prompts_of([9], seed=11)[0]
    prompts = {f"r{i}": system + p for i, p in enumerate(prompts_of([14, 3, 25, 8, 19, 5, 30, 11], seed=12))}
    ref = run_engine(make_engine(path, block_size=BS, enable_prefix_caching=False), prompts, greedy(20))
    # 24 blocks of 4 tokens for 8 sequences of up to ~60 tokens: preemption and eviction both happen
    eng = make_engine(path, block_size=BS, num_kv_blocks=24, max_num_batched_tokens=32)
    got = run_engine(eng, prompts, greedy(20))
    assert got == ref
    assert eng.num_preemptions > 0
    assert eng.prefix_cache_hits > 0
    assert eng.num_free_blocks == 24
    # after all that churn, what is still cached is still right
    again = run_engine(eng, {"x": prompts["r2"]}, greedy(20))
    assert again["x"] == ref["r2"]


def test_seeded_sampling_is_the_same_with_a_cached_prefix(checkpoint):
    path, _ = checkpoint
    prompt = prompts_of([30], seed=13)[0]
    sp = SamplingParams(max_tokens=16, temperature=0.9, top_p=0.9, seed=1234, ignore_eos=True)
    off = run_engine(make_engine(path, block_size=BS, enable_prefix_caching=False), {"a": prompt}, sp)["a"]
    eng = make_engine(path, block_size=BS)
    cold = run_engine(eng, {"a": prompt}, sp)["a"]
    warm = run_engine(eng, {"b": prompt}, sp)["b"]
    assert off == cold == warm
    assert eng.prefix_cache_hits == 28


def _hand_off(p_eng, path, prompt, params):
    """Prefill ``prompt`` as request "r" on ``p_eng`` (prefill-only), copy its K/V into a fresh engine's
    reserved blocks (what kvtransfer does), release it on ``p_eng`` and add it there as prefilled; returns
    (the decode engine, the first token)."""
    p_eng.add_request("r", prompt, params, prefill_only=True)
    first = None
    while p_eng.has_unfinished_requests():
        for o in p_eng.step():
            first = o.new_token_ids[0]
    table = p_eng.get_block_table("r")
    d_eng = make_engine(path, block_size=BS)
    d_table = d_eng.reserve("r", len(prompt))
    for (pk, pv), (dk, dv) in zip(p_eng.kv_caches, d_eng.kv_caches):
        dk[d_table] = pk[table[:len(d_table)]]
        dv[d_table] = pv[table[:len(d_table)]]
    p_eng.release("r")
    d_eng.add_prefilled_request("r", prompt, first, params)
    return d_eng, first


def test_prefill_only_request_reuses_cache_and_hands_off_full_kv(checkpoint):
    """The prefill role: a cached prefix is not recomputed, yet the held block table covers the
    whole prompt, so the hand-off ships every token's K/V (checked by decoding from a copy)."""
    path, hf = checkpoint
    p_eng = make_engine(path, block_size=BS)
    prompt = prompts_of([27], seed=14)[0]
    run_engine(p_eng, {"warm": prompt[:20] + [9]}, greedy(1))
    hits = p_eng.prefix_cache_hits
    d_eng, first = _hand_off(p_eng, path, prompt, greedy(10))
    assert p_eng.prefix_cache_hits - hits == 20
    assert p_eng.num_free_blocks == p_eng.num_total_blocks
    out = [first]
    while d_eng.has_unfinished_requests():
        for o in d_eng.step():
            out.extend(o.new_token_ids)
    assert out == hf_greedy(hf, prompt, 10)
    assert d_eng.num_free_blocks == d_eng.num_total_blocks


def test_arrived_kv_is_in_the_prefix_cache_for_sibling_requests(checkpoint):
    """n > 1 on a decode worker: after ``add_prefilled_request`` the arrived prompt's full blocks are named in
    the prefix cache at once, so a sibling added right after reuses them (only the tail is computed) and both
    continue exactly as transformers does from the full prompt."""
    path, hf = checkpoint
    prompt = prompts_of([23], seed=21)[0]  # 5 full blocks of 4 + 3 tokens
    d_eng, first = _hand_off(make_engine(path, block_size=BS), path, prompt, greedy(6))
    d_eng.add_request("r#1", prompt, greedy(6))  # before any step
    outs: dict = {"r": [first], "r#1": []}
    cached = {}
    while d_eng.has_unfinished_requests():
        for o in d_eng.step():
            outs[o.request_id].extend(o.new_token_ids)
            cached.setdefault(o.request_id, o.num_cached_tokens)
    want = hf_greedy(hf, prompt, 6)
    assert outs["r"] == want and outs["r#1"] == want
    assert cached["r#1"] == 20  # the 5 full blocks came from the arrived KV; only 3 tokens were computed
    assert d_eng.num_free_blocks == d_eng.num_total_blocks
