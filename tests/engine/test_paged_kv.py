"""Paged KV cache: block accounting, preemption, chunked prefill and the prefill -> decode hand-off.

The reference for every "identical output" check is the same engine run with
no pressure (big cache, big token budget), which the parity tests tie to
transformers.
"""
from __future__ import annotations

import pytest
import torch

from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

from .conftest import greedy, prompts_of, run_engine

LENGTHS = [3, 17, 30, 8, 45, 12, 26, 5]


def tiny(**over) -> LLMEngine:
    kw = dict(model="tiny", num_kv_blocks=512, block_size=8)
    kw.update(over)
    return LLMEngine(EngineConfig(**kw))


@pytest.fixture(scope="module")
def prompts():
    return prompts_of(LENGTHS, seed=21, vocab=8192)


@pytest.fixture(scope="module")
def reference(prompts):
    torch.set_num_threads(1)
    eng = tiny()
    return run_engine(eng, {f"r{i}": p for i, p in enumerate(prompts)}, greedy(24))


# -- block manager -------------------------------------------------------------------------------

def test_block_manager_refcounts_and_errors():
    bm = BlockManager(6, 4)
    t = []
    assert bm.ensure(t, 9) and len(t) == 3 and bm.num_free_blocks == 3
    assert bm.ensure(t, 12) and len(t) == 3  # still fits in 3 blocks
    assert not bm.ensure(t, 30) and len(t) == 3  # short: no partial growth
    shared = bm.fork(t)
    assert all(bm.ref_count(b) == 2 for b in t)
    bm.free(t)
    assert bm.num_free_blocks == 3  # still held by the fork
    bm.free(shared)
    assert bm.num_free_blocks == 6
    with pytest.raises(ValueError, match="double free"):
        bm.free([0])
    with pytest.raises(ValueError, match="only 6 free"):
        bm.allocate(7)
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(0, 4)


# -- accounting under a mixed workload -----------------------------------------------------------

def test_mixed_workload_frees_every_block(prompts, reference):
    eng = tiny(max_num_batched_tokens=40, max_num_seqs=5)
    total = eng.num_total_blocks
    params = {f"r{i}": SamplingParams(max_tokens=24 if i % 2 else 7, temperature=0.0, ignore_eos=True)
              for i in range(len(prompts))}
    # one request stops on a token we know it will produce (its 5th greedy token)
    params["r3"] = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True,
                                  stop_token_ids=[reference["r3"][4]])
    for i, p in enumerate(prompts):
        eng.add_request(f"r{i}", p, params[f"r{i}"])
    reasons, got = {}, {k: [] for k in params}
    steps = 0
    while eng.has_unfinished_requests():
        outs = eng.step()
        steps += 1
        assert eng.num_running <= 5
        for o in outs:
            got[o.request_id] += o.new_token_ids
            if o.finish_reason:
                reasons[o.request_id] = o.finish_reason
        if steps == 3:
            eng.abort_request("r4")  # mid-prefill (45 tokens > 40-token budget)
            eng.abort_request("r1")  # running
            eng.abort_request("r7")  # may still be waiting
            eng.abort_request("nope")  # unknown ids are ignored
        if steps == 6:
            used = total - eng.num_free_blocks
            assert used > 0
    assert eng.num_free_blocks == total
    assert all(eng.block_manager.ref_count(b) == 0 for b in range(total))
    assert reasons["r3"] == "stop" and got["r3"] == reference["r3"][:5]
    assert reasons["r0"] == "length" and got["r0"] == reference["r0"][:7]
    assert reasons["r5"] == "length" and got["r5"] == reference["r5"]
    assert "r4" not in reasons and "r1" not in reasons


# -- preemption ----------------------------------------------------------------------------------

def test_tiny_kv_budget_preempts_with_identical_outputs(prompts, reference):
    # 16 blocks x 8 tokens = 128 token slots for 8 sequences of up to 45 + 24 tokens
    eng = tiny(num_kv_blocks=16)
    got = run_engine(eng, {f"r{i}": p for i, p in enumerate(prompts)}, greedy(24))
    assert eng.num_preemptions > 0
    assert got == reference
    assert eng.num_free_blocks == eng.num_total_blocks


def test_preemption_keeps_seeded_sampling_identical(prompts):
    params = SamplingParams(max_tokens=20, temperature=0.9, top_k=50, seed=1234, ignore_eos=True)
    ref = run_engine(tiny(), {f"r{i}": p for i, p in enumerate(prompts)}, params)
    eng = tiny(num_kv_blocks=14)
    got = run_engine(eng, {f"r{i}": p for i, p in enumerate(prompts)}, params)
    assert eng.num_preemptions > 0
    assert got == ref
    assert len({tuple(v) for v in ref.values()}) == len(ref)  # really sampled, not one fixed string


def test_prompt_larger_than_cache_is_rejected():
    eng = tiny(num_kv_blocks=4)  # 32 token slots
    assert eng.max_model_len == 32
    with pytest.raises(ValueError, match="max_model_len"):
        eng.add_request("big", list(range(3, 40)), greedy(4))
    # a fitting prompt stops at max_model_len with "length"
    out = run_engine(eng, {"ok": list(range(3, 28))}, greedy(100))
    assert len(out["ok"]) == 32 - 25
    assert eng.num_free_blocks == 4


# -- chunked prefill -----------------------------------------------------------------------------

@pytest.mark.parametrize("budget", [7, 16])
def test_chunked_prefill_identical(prompts, reference, budget):
    eng = tiny(max_num_batched_tokens=budget)
    got = run_engine(eng, {f"r{i}": p for i, p in enumerate(prompts)}, greedy(24))
    assert got == reference


def test_chunked_prefill_logits_match_one_shot():
    """A 45-token prompt in chunks of 7 gives the same last-token logits as in one chunk."""
    p = prompts_of([45], seed=5, vocab=8192)[0]
    params = SamplingParams(max_tokens=1, temperature=0.0, logprobs=5)
    a = run_engine_lp(tiny(), p, params)
    b = run_engine_lp(tiny(max_num_batched_tokens=7), p, params)
    assert a.token_id == b.token_id
    assert a.logprob == pytest.approx(b.logprob, abs=1e-5)
    assert [t for t, _ in a.top] == [t for t, _ in b.top]


@pytest.mark.parametrize("budget", [22, 11, 2])
def test_a_prompt_cut_one_token_short_gets_the_same_bits(budget):
    """A 23-token prompt in chunks that leave its last token alone (22 + 1, 11 + 11 + 1, 2 x 11 + 1): that token is
    still a prefill row, not a decode one, so its logprobs are the one-chunk run's to the bit (the H200 run of 1 Dec
    saw batch-invariant engines differ exactly there; on CPU the decode path differed by ~1e-6)."""
    p = prompts_of([23], seed=6, vocab=8192)[0]
    params = SamplingParams(max_tokens=3, temperature=0.0, logprobs=3)

    def lps(eng):
        eng.add_request("x", p, params)
        out = []
        while eng.has_unfinished_requests():
            for o in eng.step():
                out += [(lp.token_id, lp.logprob, lp.top) for lp in o.logprobs or []]
        return out

    want = lps(tiny())
    assert len(want) == 3
    assert lps(tiny(max_num_batched_tokens=budget)) == want


def test_a_step_with_a_prefill_chunk_always_attends_its_sampled_rows_as_single_queries(monkeypatch):
    """The last layer of a step that holds a prefill chunk runs only its sampled rows, each as a single query over its
    cache (``meta.keep``), also when every row of the step samples (a prompt's last token alone in its chunk): so a
    prompt's sampled row meets the same attention kernel whether its chunk was one token or many (on a GPU the
    decode and prefill kernels round differently; benchmarks/invariance_probe.py)."""
    from engine.model_runner import ModelRunner

    metas = []
    real = ModelRunner._prepare
    monkeypatch.setattr(ModelRunner, "_prepare", lambda self, sched: metas.append(out := real(self, sched)) or out)
    eng = tiny(max_num_batched_tokens=22)
    eng.add_request("x", prompts_of([23], seed=6, vocab=8192)[0], greedy(2))
    while eng.has_unfinished_requests():
        eng.step()
    with_prefill = [(m[2], m[3]) for m in metas if m[2].prefills]
    # the prompt cut one short: its last token alone, the one row of its step, which samples
    assert [m.prefills[0].end - m.prefills[0].start for m, _ in with_prefill] == [22, 1]
    assert all(m.keep is not None and m.keep.num_decode == len(rows) for m, rows in with_prefill)


def run_engine_lp(eng, prompt, params):
    eng.add_request("x", prompt, params)
    lps = []
    while eng.has_unfinished_requests():
        for o in eng.step():
            lps += o.logprobs or []
    return lps[0]


# -- prefill on A, decode on B -------------------------------------------------------------------

def test_prefill_only_handoff_to_reserved_blocks(prompts, reference):
    a = tiny(block_size=8)
    b = tiny(block_size=8, num_kv_blocks=300)
    layers_seen: list[tuple[int, list[str]]] = []
    a.layer_done_callback = lambda i, ids: layers_seen.append((i, list(ids)))
    for i in (1, 4):  # 17 and 45 tokens
        rid = f"r{i}"
        p = prompts[i]
        a.add_request(rid, p, greedy(24), prefill_only=True)
        # b reserves first, so its blocks differ from a's
        b_blocks = b.reserve(rid, len(p))
        assert b_blocks is not None and len(b_blocks) == -(-len(p) // 8)
        first = None
        while first is None:
            for o in a.step():
                assert o.finish_reason == "prefill_done"
                first = o.new_token_ids[0]
        a_blocks = a.get_block_table(rid)
        assert a.num_free_blocks == a.num_total_blocks - len(a_blocks)  # held until release
        for (ka, va), (kb, vb) in zip(a.kv_caches, b.kv_caches):
            kb[b_blocks] = ka[a_blocks]
            vb[b_blocks] = va[a_blocks]
        a.release(rid)
        assert a.num_free_blocks == a.num_total_blocks
        b.add_prefilled_request(rid, p, first, greedy(24))
    n_layers = a.model_config.num_hidden_layers
    # one callback per layer per request, in layer order, only for the step with the last chunk
    assert [i for i, _ in layers_seen] == list(range(n_layers)) * 2
    assert {tuple(ids) for _, ids in layers_seen} == {("r1",), ("r4",)}
    out = {"r1": [], "r4": []}
    while b.has_unfinished_requests():
        for o in b.step():
            out[o.request_id] += o.new_token_ids
    assert [reference["r1"][0]] + out["r1"] == reference["r1"]
    assert [reference["r4"][0]] + out["r4"] == reference["r4"]
    assert b.num_free_blocks == b.num_total_blocks


def test_reserve_limits_and_abort():
    eng = tiny(num_kv_blocks=10, block_size=8)
    assert eng.reserve("a", 60) is not None  # 8 blocks
    assert eng.reserve("b", 30) is None  # needs 4, only 2 left
    with pytest.raises(ValueError, match="already in use"):
        eng.reserve("a", 5)
    with pytest.raises(ValueError, match="num_tokens"):
        eng.reserve("c", 0)
    with pytest.raises(ValueError, match="no reservation"):
        eng.add_prefilled_request("zz", [5, 6], 7, greedy(3))
    with pytest.raises(ValueError, match="more than"):
        eng.add_prefilled_request("a", list(range(3, 70)), 7, greedy(3))
    eng.abort_request("a")
    assert eng.num_free_blocks == 10
    # first token already final: no re-emission, just the finish, and blocks come back
    assert eng.reserve("d", 4) is not None
    eng.add_prefilled_request("d", [5, 6, 7, 8], 9, SamplingParams(max_tokens=1))
    outs = eng.step()
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outs] == [("d", [], "length")]
    assert eng.num_free_blocks == 10 and not eng.has_unfinished_requests()
