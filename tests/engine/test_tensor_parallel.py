"""Tensor parallelism in the engine (engine/tensor_parallel.py): N real rank processes on one gloo group.

References are independent of the split: the same engine at one rank, and transformers itself on random
checkpoints the engine never saw (GQA with KV heads split, and with one KV head replicated on both ranks; a
Qwen2 with q/k/v biases; a vocabulary that does not divide by the ranks). Tokens must be equal; log-probs agree
within 2e-4 (the split sums each row-parallel product in two halves, so the last float bits differ). Every test
closes its engines and checks their rank processes are gone.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import signal

import pytest
import torch

from engine import LLM, SamplingParams
from engine.config import EngineConfig, ModelConfig
from engine.llm_engine import LLMEngine
from engine.tensor_parallel import TensorParallelError, TPLayout, check_tensor_parallel
from tests.engine.conftest import greedy, hf_greedy, make_checkpoint, make_engine, prompts_of, run_engine
from tests.waiting import wait_until

LOGPROB_TOL = 2e-4
PROMPTS = ["def fib(n):", "The quick brown fox", "import numpy as np\n", "Once upon a time, in a land far away,"]
LONG = "x = [" + ", ".join(str(i) for i in range(150)) + "]"  # ~400 tokens: two prefill chunks of at most 300


def _ranks_of(engine: LLMEngine) -> list:
    return list(engine.tp_group._procs) if engine.tp_group is not None else []


def _close(engine: LLMEngine) -> None:
    procs = _ranks_of(engine)
    engine.close()
    for p in procs:
        wait_until(lambda: not p.is_alive(), timeout=30, message=f"rank process {p.pid} outlived its engine")


@pytest.fixture(scope="module")
def tiny_pair():
    """tiny at one rank and at two (3 query heads and 1 KV head each), chunked prefill on both."""
    kw = dict(num_threads=1, max_num_batched_tokens=300)
    one, two = LLM(model="tiny", **kw), LLM(model="tiny", tensor_parallel_size=2, **kw)
    try:
        yield one, two
    finally:
        _close(two.llm_engine)


def _tokens_and_logprobs(llm: LLM, prompts, params) -> list:
    return [(o.token_ids, o.finish_reason, [(lp.token_id, lp.logprob) for lp in (o.logprobs or [])])
            for o in llm.generate(prompts, params)]


def _assert_close_outputs(a, b) -> None:
    assert [x[:2] for x in a] == [y[:2] for y in b]
    for x, y in zip(a, b):
        assert [t for t, _ in x[2]] == [t for t, _ in y[2]]
        assert max((abs(p - q) for (_, p), (_, q) in zip(x[2], y[2])), default=0.0) < LOGPROB_TOL


def test_two_ranks_generate_what_one_does_on_tiny(tiny_pair):
    """Greedy tokens equal, chosen-token log-probs close, for a batch whose prompts need several prefill chunks."""
    one, two = tiny_pair
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True, logprobs=0)
    ref = _tokens_and_logprobs(one, PROMPTS + [LONG], params)
    got = _tokens_and_logprobs(two, PROMPTS + [LONG], params)
    _assert_close_outputs(ref, got)
    assert two.llm_engine.tp_group.comm.reduce_seconds > 0  # the ranks really exchanged partial sums


def test_two_ranks_embed_what_one_does(tiny_pair):
    """An embedding is rank 0's final hidden state, complete after the last all-reduce: the same vector."""
    one, two = tiny_pair
    for a, b in zip(one.embed(PROMPTS + [LONG]), two.embed(PROMPTS + [LONG])):
        assert max(abs(x - y) for x, y in zip(a.outputs.embedding, b.outputs.embedding)) < 1e-5


def test_two_ranks_prompt_logprobs_prefix_cache_and_seeded_sampling(tiny_pair):
    """The logits-row plan (prompt-logprob chunks, then sampling rows) and rank 0's prefix cache and sampler."""
    one, two = tiny_pair
    long = LONG
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True, prompt_logprobs=2)
    a, b = one.generate([long], params)[0], two.generate([long], params)[0]
    assert a.token_ids == b.token_ids
    pa, pb = [lp for lp in a.prompt_logprobs if lp], [lp for lp in b.prompt_logprobs if lp]
    assert len(pa) == len(pb) > 256  # more than one PROMPT_LOGITS_ROWS chunk
    assert [x.token_id for x in pa] == [y.token_id for y in pb]
    assert max(abs(x.logprob - y.logprob) for x, y in zip(pa, pb)) < LOGPROB_TOL
    hits = two.llm_engine.prefix_cache_hits
    again = two.generate([long], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))[0]
    assert two.llm_engine.prefix_cache_hits > hits and again.token_ids == a.token_ids
    seeded = SamplingParams(temperature=0.9, top_p=0.9, max_tokens=16, seed=7, ignore_eos=True)
    assert one.generate(PROMPTS[:2], seeded)[0].token_ids == two.generate(PROMPTS[:2], seeded)[0].token_ids


def test_two_ranks_with_ngram_speculation_and_a_json_schema(tiny_pair):
    one, two = tiny_pair
    llm = LLM(model="tiny", tensor_parallel_size=2, num_threads=1, speculative_config={
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3})
    try:
        params = greedy(32)
        assert ([o.token_ids for o in llm.generate(PROMPTS, params)]
                == [o.token_ids for o in one.generate(PROMPTS, params)])
        assert llm.llm_engine.spec_stats.num_draft_tokens > 0
    finally:
        _close(llm.llm_engine)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    sp = SamplingParams(temperature=0.0, max_tokens=24, structured_outputs={"json": schema})
    assert two.generate(["Answer in JSON:"], sp)[0].text == one.generate(["Answer in JSON:"], sp)[0].text


@pytest.mark.parametrize("arch,over", [
    ("llama", dict(num_attention_heads=4, num_key_value_heads=2)),                 # KV heads split
    ("llama", dict(num_attention_heads=4, num_key_value_heads=1, vocab_size=511)),  # replicated, uneven vocab
    ("qwen2", dict(num_attention_heads=4, num_key_value_heads=2)),                 # q/k/v biases
    ("qwen3", dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32)),     # q/k norms, replicated
    ("phi3", dict(num_attention_heads=4, num_key_value_heads=2)),                  # fused q/k/v, gate/up split
    ("gemma3", dict(head_dim=32, num_hidden_layers=3, sliding_window=8,           # four norms, local RoPE, GeGLU
                    layer_types=["sliding_attention", "full_attention", "sliding_attention"])),
])
def test_two_ranks_match_transformers_on_an_unseen_checkpoint(tmp_path, arch, over):
    path, hf = make_checkpoint(tmp_path, arch, seed=3, **over)
    prompts = prompts_of([5, 13, 22], seed=4, vocab=over.get("vocab_size", 512))
    eng = make_engine(path, tensor_parallel_size=2, num_threads=1)
    try:
        got = run_engine(eng, {str(i): p for i, p in enumerate(prompts)}, greedy(12))
    finally:
        _close(eng)
    for i, p in enumerate(prompts):
        assert got[str(i)] == hf_greedy(hf, p, 12), (arch, over, i)


@pytest.mark.parametrize("over", [dict(kv_cache_dtype="int8"), dict(quantization="w8a8")],
                         ids=["int8-kv", "w8a8"])
def test_two_ranks_quantized_follow_one_rank(tiny_pair, over):
    """int8 KV per shard is the same per-head quantization as one rank's; w8a8 scales each shard's rows over
    the shard's own inputs (o_proj, down_proj), so tokens may part late: the first 12 must agree."""
    one = LLM(model="tiny", num_threads=1, **over)
    two = LLM(model="tiny", tensor_parallel_size=2, num_threads=1, **over)
    try:
        n = 24 if "kv_cache_dtype" in over else 12
        a = [o.token_ids[:n] for o in one.generate(PROMPTS, greedy(n))]
        b = [o.token_ids[:n] for o in two.generate(PROMPTS, greedy(n))]
        assert a == b
        assert two.llm_engine.kv_caches[0][0].dtype == (torch.int8 if "kv_cache_dtype" in over else torch.float32)
    finally:
        _close(two.llm_engine)


def test_the_split_holds_a_share_of_the_weights_and_twice_the_blocks(tiny_pair):
    one, two = tiny_pair
    e1, e2 = one.llm_engine, two.llm_engine
    assert e2.kv_caches[0][0].shape[2] == 1 and e1.kv_caches[0][0].shape[2] == 2  # KV heads per rank
    assert e2.num_total_blocks == 2 * e1.num_total_blocks  # the same per-rank budget holds twice the tokens
    n1 = sum(p.numel() for p in e1.runner.model.parameters() if p is not None)
    n2 = sum(p.numel() for p in e2.runner.model.parameters() if p is not None)
    assert n2 < 0.6 * n1


def test_layout_shards_cover_the_whole_model_once():
    """Every query head, MLP column and vocabulary row is on exactly one rank; KV heads on each rank its query
    heads use."""
    mc = ModelConfig(vocab_size=1001, hidden_size=64, intermediate_size=96, num_hidden_layers=1,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=8)
    for n in (2, 4, 8):
        lays = [TPLayout(mc, n, r) for r in range(n)]
        assert sum(la.heads for la in lays) == 8 and sum(la.intermediate for la in lays) == 96
        assert sorted(v for la in lays for v in range(la.vocab_lo, la.vocab_hi)) == list(range(1001))
        for la in lays:
            first_q = la.rank * la.heads
            # the query heads of a rank belong to the KV heads it holds (GQA group = 4 query heads)
            assert la.kv_head_lo <= first_q // 4 < la.kv_head_lo + la.kv_heads
        q = torch.arange(8 * 8 * 64, dtype=torch.float32).view(64, 64)
        parts = [la.shard("model.layers.0.self_attn.q_proj.weight", q) for la in lays]
        assert torch.equal(torch.cat(parts), q)
    with pytest.raises(ValueError, match="q_proj.*expected 64 along dimension 0"):
        TPLayout(mc, 2, 0).shard("model.layers.0.self_attn.q_proj.weight", torch.zeros(60, 64))


@pytest.mark.parametrize("size,over,match", [
    (0, {}, "tensor_parallel_size must be an integer >= 1"),
    (4, {}, r"tensor_parallel_size=4 must divide the model's num_attention_heads \(6\)"),
    (3, {}, r"tensor_parallel_size=3 and the model's num_key_value_heads \(2\) must divide one another"),
    (2, dict(intermediate_size=1023, num_attention_heads=2, num_key_value_heads=2),
     r"must divide the model's intermediate_size \(1023\)"),
    (2, dict(device="cuda"), "NCCL ranks on GPUs are not built yet"),
    (2, dict(cpus=1), "more ranks than this node's 1 CPU cores"),
    (2, dict(quantization="int4", group_size=128, head_dim=64),
     r"each rank's o_proj has 192 inputs, not a multiple of quantization_group_size \(128\)"),
])
def test_a_split_that_cannot_work_is_refused_naming_the_flag(size, over, match):
    kw = {k: over.pop(k) for k in ("device", "cpus", "quantization", "group_size") if k in over}
    mc = ModelConfig(vocab_size=8192, hidden_size=384, intermediate_size=over.pop("intermediate_size", 1024),
                     num_hidden_layers=1, head_dim=64, num_attention_heads=over.pop("num_attention_heads", 6),
                     num_key_value_heads=over.pop("num_key_value_heads", 2))
    with pytest.raises(ValueError, match=match):
        check_tensor_parallel(mc, size, **kw)


def test_engine_refuses_a_bad_split_before_starting_any_rank():
    before = len(mp.active_children())
    with pytest.raises(ValueError, match=r"tensor_parallel_size=4 must divide the model's num_attention_heads"):
        LLMEngine(EngineConfig(model="tiny", tensor_parallel_size=4))
    assert len(mp.active_children()) == before
    with pytest.raises(ValueError, match="tensor_parallel_size must be an integer >= 1"):
        EngineConfig(model="tiny", tensor_parallel_size=True)


def test_a_rank_that_cannot_load_fails_the_start_with_its_error(tmp_path):
    path, _ = make_checkpoint(tmp_path, "llama", seed=1)
    # a tensor the model does not have: every rank refuses the checkpoint, rank 0 raises and ends the others
    from safetensors.torch import load_file, save_file

    st = load_file(str(path / "model.safetensors"))
    st["model.layers.0.mlp.extra.weight"] = torch.zeros(2, 2)
    save_file(st, str(path / "model.safetensors"), metadata={"format": "pt"})
    before = {p.pid for p in mp.active_children()}
    with pytest.raises((ValueError, TensorParallelError), match="unexpected tensor 'model.layers.0.mlp.extra.weight'"):
        make_engine(path, tensor_parallel_size=2, num_threads=1)
    wait_until(lambda: {p.pid for p in mp.active_children()} <= before, timeout=30,
               message="a rank process outlived the failed start")


def test_a_killed_rank_fails_the_step_and_the_engine_ends_the_rest():
    eng = LLMEngine(EngineConfig(model="tiny", tensor_parallel_size=2, num_threads=1))
    procs = _ranks_of(eng)
    try:
        assert run_engine(eng, {"a": [5, 6, 7]}, greedy(3))["a"]
        assert eng.ranks_up() == [True, True]
        os.kill(procs[0].pid, signal.SIGKILL)
        wait_until(lambda: not procs[0].is_alive(), timeout=30, message="rank 1 did not die")
        assert eng.ranks_up() == [True, False]  # what pdserve:tensor_parallel_rank_up{rank="1"} reports
        eng.add_request("b", [5, 6, 7], greedy(3))
        with pytest.raises(TensorParallelError, match=r"rank\(s\) \[1\] died"):
            eng.step()
    finally:
        _close(eng)


def test_ranks_end_when_their_engine_process_dies(tmp_path):
    """No rank outlives rank 0: SIGKILL the process holding the engine; its ranks see the pipe close and exit."""
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    holder = ctx.Process(target=_hold_engine, args=(q,))
    holder.start()
    try:
        pids = q.get(timeout=120)
        os.kill(holder.pid, signal.SIGKILL)
        holder.join(30)

        def gone() -> bool:
            for pid in pids:
                try:
                    os.kill(pid, 0)
                except ProcessLookupError:
                    continue
                if open(f"/proc/{pid}/stat").read().split()[2] != "Z":
                    return False
            return True

        wait_until(gone, timeout=60, message=f"rank processes {pids} outlived their engine's process")
    finally:
        if holder.is_alive():
            holder.kill()


def _hold_engine(q) -> None:
    eng = LLMEngine(EngineConfig(model="tiny", tensor_parallel_size=2, num_threads=1))
    q.put([p.pid for p in eng.tp_group._procs])
    signal.pause()


def test_rank_zero_maps_every_ranks_kv_cache(tiny_pair):
    """What a follower computes lands in memory rank 0 maps (the worker's KV transfers read and write it there):
    after the same prompt, rank r's cache holds the heads ``kv_head_ranges[r]`` of one rank's cache."""
    one, two = tiny_pair
    e1, e2 = one.llm_engine, two.llm_engine
    prompt = list(range(40, 77))
    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    for e in (e1, e2):
        e.add_request("kv-map", prompt, params, prefill_only=True)
        while e.has_unfinished_requests():
            e.step()
    assert e2.kv_head_ranges == [(0, 1), (1, 2)]
    b1, b2 = e1.get_block_table("kv-map"), e2.get_block_table("kv-map")
    bs = e1.block_size
    for r, (lo, hi) in enumerate(e2.kv_head_ranges):
        for layer in range(len(e1.kv_caches)):
            for kv in (0, 1):
                ref = torch.stack([e1.kv_caches[layer][kv][b1[p // bs], p % bs, lo:hi] for p in range(len(prompt))])
                got = torch.stack([e2.rank_kv_caches[r][layer][kv][b2[p // bs], p % bs] for p in range(len(prompt))])
                assert got.abs().sum() > 0 and torch.allclose(got, ref, atol=1e-4), (r, layer, kv)
    for e in (e1, e2):
        e.release("kv-map")


def test_two_ranks_generate_what_one_does_on_bench():
    """The built-in `bench` (12 layers, hidden 768, 12 query / 4 KV heads: two KV heads a rank), from its seeded
    random weights on every rank: greedy tokens equal, chosen-token log-probs close."""
    kw = dict(num_threads=1, num_kv_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True, logprobs=0)
    prompts = [[5, 17, 400, 23, 99, 4], [300, 12, 77], list(range(100, 140))]
    ref = _tokens_and_logprobs(LLM(model="bench", **kw), prompts, params)
    two = LLM(model="bench", tensor_parallel_size=2, **kw)
    try:
        _assert_close_outputs(ref, _tokens_and_logprobs(two, prompts, params))
    finally:
        _close(two.llm_engine)


def test_two_ranks_beam_search_keeps_the_same_beams(tiny_pair):
    """Beam search runs on rank 0's sampler over the gathered logits: the same beams, scores within the log-prob
    tolerance."""
    from engine import BeamSearchParams

    one, two = tiny_pair
    params = BeamSearchParams(beam_width=3, max_tokens=10, ignore_eos=True)
    a, b = one.beam_search(PROMPTS[:2], params), two.beam_search(PROMPTS[:2], params)
    for x, y in zip(a, b):
        assert [s.tokens for s in x.sequences] == [s.tokens for s in y.sequences]
        assert max(abs(s.cum_logprob - t.cum_logprob) for s, t in zip(x.sequences, y.sequences)) < 10 * LOGPROB_TOL


def test_two_ranks_with_a_draft_model_generate_the_targets_greedy_tokens(tiny_pair):
    """The draft model (tiny-draft, unsplit, on rank 0) proposes; the split target verifies: greedy output is the
    one-rank target's, and drafts were really accepted."""
    one, _two = tiny_pair
    llm = LLM(model="tiny", tensor_parallel_size=2, num_threads=1,
              speculative_config={"method": "draft_model", "model": "tiny-draft", "num_speculative_tokens": 3})
    try:
        params = greedy(24)
        assert ([o.token_ids for o in llm.generate(PROMPTS, params)]
                == [o.token_ids for o in one.generate(PROMPTS, params)])
        stats = llm.llm_engine.spec_stats
        assert stats.num_draft_tokens > 0 and stats.num_accepted_tokens > 0
    finally:
        _close(llm.llm_engine)


@pytest.mark.parametrize("quant,n", [("int4", 24), ("w4a8", 12)])
def test_two_ranks_group_quantized_follow_one_rank(quant, n):
    """int4 / w4a8 with groups of 64 (tiny's row-parallel shards are 192 and 512 inputs wide, so 128-wide groups
    would straddle ranks: refused, tests above): a shard's groups are the whole model's groups, so int4 weights
    are the same bits; w4a8 also scales activations over each shard's inputs, so its tokens may part late."""
    kw = dict(model="tiny", num_threads=1, quantization=quant, quantization_group_size=64)
    one, two = LLM(**kw), LLM(tensor_parallel_size=2, **kw)
    try:
        a = [o.token_ids for o in one.generate(PROMPTS, greedy(n))]
        b = [o.token_ids for o in two.generate(PROMPTS, greedy(n))]
        assert a == b
    finally:
        _close(two.llm_engine)
