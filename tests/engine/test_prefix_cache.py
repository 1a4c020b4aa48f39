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


def _decode_all(d_eng) -> dict[str, list[int]]:
    out: dict[str, list[int]] = {}
    while d_eng.has_unfinished_requests():
        for o in d_eng.step():
            out.setdefault(o.request_id, []).extend(o.new_token_ids)
    return out


def test_a_decode_reservation_reuses_the_history_it_decoded_and_needs_only_the_rest(checkpoint):
    """Issue 47's delta transfer, engine side: a decode engine that streamed turn 1 holds turn 1's prompt and answer
    in its prefix cache after the request ended; ``reserve_prompt`` of turn 2 (turn 1 + answer + a new question)
    takes those full blocks by reference and only positions from the cached count on are copied in (what a delta
    transfer ships); the continuation equals transformers' on the whole turn-2 prompt."""
    path, hf = checkpoint
    p_eng = make_engine(path, block_size=BS)
    turn1 = prompts_of([9], seed=31)[0]
    d_eng, first = _hand_off(p_eng, path, turn1, greedy(6))
    answer = [first] + _decode_all(d_eng)["r"]
    assert answer == hf_greedy(hf, turn1, 6)
    turn2 = turn1 + answer + prompts_of([5], seed=32)[0]  # 9 + 6 + 5 = 20 tokens
    p_eng.add_request("t2", turn2, greedy(1), prefill_only=True)
    first2 = [o.new_token_ids[0] for o in _step_all(p_eng)][0]
    table, cached = d_eng.reserve_prompt("t2", len(turn2), turn2)
    # turn 1's 9 prompt tokens and 5 of its answer's 6 have KV on the decode side (the last sampled token never
    # ran through the model there): 14 tokens, 3 full blocks of 4
    assert cached == 12
    assert all(d_eng.block_manager.ref_count(b) == 1 for b in table)  # the cached ones pinned by the reservation
    src = p_eng.get_block_table("t2")
    for (pk, pv), (dk, dv) in zip(p_eng.kv_caches, d_eng.kv_caches):
        for pos in range(cached, len(turn2)):
            dk[table[pos // BS], pos % BS] = pk[src[pos // BS], pos % BS]
            dv[table[pos // BS], pos % BS] = pv[src[pos // BS], pos % BS]
    p_eng.release("t2")
    d_eng.add_prefilled_request("t2", turn2, first2, greedy(8))
    assert [first2] + _decode_all(d_eng)["t2"] == hf_greedy(hf, turn2, 8)
    assert d_eng.num_free_blocks == d_eng.num_total_blocks


def _step_all(eng):
    while eng.has_unfinished_requests():
        yield from eng.step()


def test_a_decode_reservation_that_does_not_fit_gives_its_cached_blocks_back_and_a_wrong_prompt_is_refused(checkpoint):
    path, _hf = checkpoint
    d_eng = make_engine(path, block_size=BS, num_kv_blocks=7)
    prompt = prompts_of([17], seed=33)[0]
    d_eng.reserve_prompt("a", len(prompt), prompt)
    d_eng.add_prefilled_request("a", prompt, 5, greedy(1))
    _decode_all(d_eng)  # ends at once (max_tokens 1): its 4 full blocks stay cached, all 7 free
    assert d_eng.num_free_blocks == 7
    assert len(d_eng.reserve("filler", 8)) == 2  # fresh blocks first (least recently freed): 5 left, 4 cached
    longer = prompt + prompts_of([8], seed=34)[0]  # 25 tokens: 7 blocks, 4 cached + 3 fresh > the 1 left
    assert d_eng.reserve_prompt("b", len(longer), longer) is None
    assert d_eng.num_free_blocks == 5 and sum(d_eng.block_manager.ref_count(b) for b in range(7)) == 2
    table, cached = d_eng.reserve_prompt("c", len(prompt), prompt)
    assert cached == 16 and len(table) == 5
    with pytest.raises(ValueError, match="differ from the prompt reserved"):
        d_eng.add_prefilled_request("c", [prompt[0] + 1] + prompt[1:], 5, greedy(1))
    with pytest.raises(ValueError, match="prompt_token_ids has 3 tokens"):
        d_eng.reserve_prompt("d", 4, prompt[:3])
    d_eng.abort_request("c")
    assert d_eng.num_free_blocks == 5
    assert d_eng.reserve_prompt("e", len(prompt), None) == (d_eng.get_block_table("e"), 0)


def test_a_fetched_prefix_is_cached_by_commit_reserved_and_only_the_tail_is_computed(checkpoint):
    """Issue 47's prefix fetch, engine side: a prefill engine that lacks a conversation's history reserves its whole
    blocks (``prefix=True``: every cached one taken by reference, here some), the rest arrive (copied here from an
    engine that computed them, as the decode worker's send does), ``commit_reserved`` names them in the prefix cache,
    and the prompt added next computes only its tail: prefix hits = the fetched blocks, continuation = transformers'."""
    path, hf = checkpoint
    src_eng = make_engine(path, block_size=BS)
    prompt = prompts_of([19], seed=35)[0]
    src_eng.add_request("s", prompt, greedy(1), prefill_only=True)
    list(_step_all(src_eng))
    src = src_eng.get_block_table("s")
    eng = make_engine(path, block_size=BS)
    eng.add_request("warm", prompt[:9], greedy(1))  # leaves 2 full blocks of the history cached here
    list(_step_all(eng))
    with pytest.raises(ValueError, match="whole blocks"):
        eng.reserve_prompt("f", 15, prompt[:15], prefix=True)
    table, have = eng.reserve_prompt("f", 16, prompt[:16], prefix=True)
    assert have == 8 and len(table) == 4
    for (sk, sv), (dk, dv) in zip(src_eng.kv_caches, eng.kv_caches):
        for pos in range(have, 16):
            dk[table[pos // BS], pos % BS] = sk[src[pos // BS], pos % BS]
            dv[table[pos // BS], pos % BS] = sv[src[pos // BS], pos % BS]
    src_eng.release("s")
    with pytest.raises(ValueError, match="differ from the prefix reserved"):
        eng.commit_reserved("f", [prompt[0] + 1] + prompt[1:16])
    with pytest.raises(ValueError, match="has no reservation"):
        eng.commit_reserved("nobody", prompt[:16])
    assert eng.commit_reserved("f", prompt[:16]) == 16
    with pytest.raises(ValueError, match="max_model_len"):  # the checks add_request makes, adding nothing
        eng.check_request("p", prompt * 100, greedy(4), prefill_only=True)
    assert not eng.has_request("p")
    eng.add_request("p", prompt, greedy(6))
    outs = list(_step_all(eng))
    assert outs[0].num_cached_tokens == 16  # the 2 blocks it had and the 2 that arrived: 3 tokens computed
    assert [t for o in outs for t in o.new_token_ids] == hf_greedy(hf, prompt, 6)
    eng.abort_request("f")
    assert eng.num_free_blocks == eng.num_total_blocks


def test_cached_prefix_tokens_looks_without_taking_or_evicting(checkpoint):
    path, _hf = checkpoint
    eng = make_engine(path, block_size=BS, num_kv_blocks=6)
    prompt = prompts_of([13], seed=36)[0]
    eng.add_request("a", prompt, greedy(1))
    list(_step_all(eng))  # 3 full blocks cached, all 6 free
    assert eng.cached_prefix_tokens(prompt[:12]) == 12 and eng.cached_prefix_tokens(prompt[:8]) == 8
    assert eng.cached_prefix_tokens([prompt[0] + 1] + prompt[1:12]) == 0
    assert eng.num_free_blocks == 6 and not any(eng.block_manager.ref_count(b) for b in range(6))
    assert eng.cached_prefix_tokens(prompt[:12]) == 12  # still cached: looking took nothing


def test_a_cache_salt_shares_cached_blocks_only_with_its_own_salt(checkpoint):
    """vLLM's cache_salt: a prompt cached under one salt is a hit for that salt only (not for another salt, nor
    unsalted, nor the other way round), in ``add_request``, ``cached_prefix_tokens`` and ``reserve_prompt`` alike;
    the tokens are the same whatever the salt."""
    path, _hf = checkpoint
    eng = make_engine(path, block_size=BS)
    prompt = prompts_of([30], seed=41)[0]
    outs = {}

    def run(rid: str, salt):
        hits = eng.prefix_cache_hits
        outs[rid] = run_engine(eng, {rid: prompt}, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True,
                                                                   cache_salt=salt))[rid]
        return eng.prefix_cache_hits - hits

    assert run("a1", "tenant-a") == 0 and run("b1", "tenant-b") == 0 and run("n1", None) == 0
    assert run("a2", "tenant-a") == 28 and run("b2", "tenant-b") == 28 and run("n2", None) == 28
    assert len({tuple(v) for v in outs.values()}) == 1
    assert eng.cached_prefix_tokens(prompt[:24], cache_salt="tenant-a") == 24
    assert eng.cached_prefix_tokens(prompt[:24], cache_salt="tenant-c") == 0
    got = eng.reserve_prompt("r", 24, prompt[:24], prefix=True, cache_salt="tenant-c")
    assert got is not None and got[1] == 0  # nothing of tenant-c's is cached: every block is fresh
    eng.abort_request("r")
    got = eng.reserve_prompt("r", 24, prompt[:24], prefix=True, cache_salt="tenant-b")
    assert got is not None and got[1] == 24
    eng.abort_request("r")
    assert eng.num_free_blocks == eng.num_total_blocks
    with pytest.raises(ValueError, match="cache_salt"):
        SamplingParams(cache_salt="")


def test_reset_prefix_cache_forgets_cached_blocks_only_when_none_is_held(checkpoint):
    """vLLM's reset_prefix_cache: refused (with the blocks held) while a request runs, nothing forgotten; once idle,
    every cached block is forgotten (the next identical prompt computes all of it) and a CLEARED event says so."""
    path, _hf = checkpoint
    eng = make_engine(path, block_size=BS)
    eng.block_manager.enable_events()
    prompt = prompts_of([30], seed=43)[0]
    run_engine(eng, {"a": prompt}, greedy(4))
    eng.add_request("b", prompt, greedy(8))
    eng.step()
    ok, held = eng.reset_prefix_cache()
    assert not ok and held >= 2
    while eng.has_unfinished_requests():
        eng.step()
    assert eng.cached_prefix_tokens(prompt[:28]) == 28  # the refused reset forgot nothing
    eng.block_manager.take_events()
    assert eng.reset_prefix_cache() == (True, 0)
    assert eng.block_manager.take_events() == [("cleared",)]
    assert eng.cached_prefix_tokens(prompt[:28]) == 0
    hits = eng.prefix_cache_hits
    out = run_engine(eng, {"c": prompt}, greedy(4))["c"]
    assert eng.prefix_cache_hits == hits and out == run_engine(make_engine(path, block_size=BS), {"d": prompt},
                                                               greedy(4))["d"]
    assert eng.num_free_blocks == eng.num_total_blocks
