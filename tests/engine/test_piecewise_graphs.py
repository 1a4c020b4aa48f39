"""Steps with a prefill chunk through the piecewise graphs' static buffers (engine/piecewise_graphs.py).

On CPU the pieces are not captured (``static_decode_buffers``): every step the decode graphs do not take and that
fits a token bucket runs each layer's pieces on the static buffers, padded to its bucket, with attention eagerly on
the real rows, exactly the ops captured pieces replay. These tests demand that path give the eager engine's tokens
and log-probabilities bit for bit (pdserve's CPU kernels give a row the same bits in any batch), that padding rows
(whatever they hold) change no real row and write no KV, that larger steps run eagerly, and that bad bucket lists
fail at configuration. The capture itself is checked on a GPU (test_piecewise_cuda.py, in device_session.sh); that
a piece holds no op a CUDA graph refuses is checked on CPU in test_triton_kernels.py.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine.attention import AttentionMetadata, PrefillSpan
from engine.config import default_token_sizes

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n", "x = [", "def binary_search(items, target):\n", "while True:", "# a",
           "print(", "y", "with open(path) as f:\n", "try:\n    pass\n", "lambda"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}
# a 24-token step budget and 8-token blocks: prompts are chunked, so most steps mix a chunk with decodes, later
# chunks read the cache in place, and prefix hits start prompts past their first block
SMALL_STEPS = dict(max_num_seqs=6, max_num_batched_tokens=24, block_size=8, enable_prefix_caching=True)


def _params() -> list[SamplingParams]:
    """Greedy with logprobs, some with prompt logprobs (rows past the sampling ones), some seeded sampling."""
    out = []
    for i in range(len(PROMPTS)):
        if i % 4 == 3:
            out.append(SamplingParams(max_tokens=14, temperature=0.8, top_p=0.9, seed=7 + i, logprobs=2))
        else:
            out.append(SamplingParams(max_tokens=10 + i, temperature=0.0, logprobs=2,
                                      prompt_logprobs=1 if i % 4 == 1 else None))
    return out


def _same(a: list, b: list) -> None:
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        assert [(t.token_id, t.logprob, t.top) for t in x.logprobs] == [(t.token_id, t.logprob, t.top)
                                                                        for t in y.logprobs]
        if x.prompt_logprobs is not None or y.prompt_logprobs is not None:
            assert [(t.token_id, t.logprob) for t in x.prompt_logprobs[1:]] == \
                [(t.token_id, t.logprob) for t in y.prompt_logprobs[1:]]


@pytest.mark.parametrize("kw", [{}, {"kv_cache_dtype": "int8"}, {"speculative_config": NGRAM}],
                         ids=["fused", "int8-kv", "ngram"])
def test_static_pieces_give_the_eager_tokens_bit_for_bit(kw):
    prompts = PROMPTS + [p + " # again" for p in PROMPTS[:5]]  # prefix hits
    params = _params() + _params()[:5]
    eager = LLM("tiny", **SMALL_STEPS, **kw)
    static = LLM("tiny", static_decode_buffers=True, **SMALL_STEPS, **kw)
    assert eager.llm_engine.runner.piecewise is None
    _same(eager.generate(prompts, params), static.generate(prompts, params))
    runner = static.llm_engine.runner
    assert runner.piecewise.sizes == [8, 16, 24] and not runner.piecewise.graphs  # nothing captured on CPU
    assert runner.piecewise.replays >= 10 and runner.graphs.replays >= 10, (runner.piecewise.replays,
                                                                            runner.graphs.replays)
    # the engine's record (what a worker's engine_steps_total{path} counts) has them, and only them
    stats = static.llm_engine.make_stats()
    assert (stats.graph_steps, stats.piecewise_steps) == (runner.graphs.replays, runner.piecewise.replays)
    assert stats.graph_steps + stats.piecewise_steps <= stats.num_steps
    assert (eager.llm_engine.make_stats().graph_steps, eager.llm_engine.make_stats().piecewise_steps) == (0, 0)


def test_steps_past_the_largest_bucket_run_eagerly_and_agree():
    eager = LLM("tiny", **SMALL_STEPS)
    static = LLM("tiny", static_decode_buffers=True, cuda_graph_token_sizes=[8], **SMALL_STEPS)
    model = static.llm_engine.runner.model
    eager_steps = []
    real = model.forward

    def counted(input_ids, positions, meta, *a, **k):
        if meta.prefills:  # (the decode graphs' static path calls the model too: pure decode steps)
            eager_steps.append(input_ids.shape[0])
        return real(input_ids, positions, meta, *a, **k)

    model.forward = counted
    params = _params()
    _same(eager.generate(PROMPTS, params), static.generate(PROMPTS, params))
    pw = static.llm_engine.runner.piecewise
    assert eager_steps and min(eager_steps) > 8 and pw.replays > 0, (eager_steps, pw.replays)


@pytest.mark.parametrize("keep_rows", [None, [0, 2], []], ids=["every-row", "sampling-rows", "no-row"])
def test_padding_rows_change_no_real_row_and_write_no_kv(keep_rows):
    """A step of a decode and a two-token prompt chunk (3 tokens, the 8-token bucket) with NaN in every padding row
    of the buffers and stale ids, positions and slots there: the eager model's hidden states to the bit, and only
    the step's three K/V slots written (and the scratch block's, which no sequence owns)."""
    llm = LLM("tiny", num_kv_blocks=16, block_size=4, static_decode_buffers=True, cuda_graph_token_sizes=[8])
    runner = llm.llm_engine.runner
    pw, model, caches = runner.piecewise, runner.model, llm.llm_engine.kv_caches
    torch.manual_seed(0)
    for k, v in caches:
        k.normal_()
        v.normal_()
    twin = [(k.clone(), v.clone()) for k, v in caches]
    orig = [k.clone() for k, _ in caches]

    def meta() -> AttentionMetadata:
        m = AttentionMetadata(slot_mapping=torch.tensor([3 * 4 + 2, 7 * 4, 7 * 4 + 1]), num_decode=1, block_size=4,
                              decode_block_tables=torch.tensor([[3]]), decode_ctx_lens=torch.tensor([3]),
                              prefills=[PrefillSpan(1, 3, 0, torch.tensor([7]))])
        if keep_rows is not None:
            m.keep = AttentionMetadata(slot_mapping=m.slot_mapping, num_decode=len(keep_rows), block_size=4,
                                       rows=torch.tensor(keep_rows, dtype=torch.long))
            if keep_rows:
                m.keep.decode_block_tables = torch.tensor([[3], [7]])
                m.keep.decode_ctx_lens = torch.tensor([3, 2])
        return m

    ids, pos = torch.tensor([11, 12, 13]), torch.tensor([2, 0, 1])
    for buf in (pw.hidden, pw.qkv, pw.attn, pw.cos, pw.sin):
        buf.fill_(float("nan"))
    pw.input_ids.fill_(99)
    pw.positions.fill_(50)
    pw.slot_mapping.fill_(5 * 4)  # real slots a step of 8 rows left behind
    pw._live = 8
    with torch.inference_mode():
        got = pw.run(ids, pos, meta())
        want = model(ids, pos, meta(), twin)
    assert got.shape[0] == (3 if keep_rows is None else len(keep_rows))
    assert torch.equal(got, want) and not got.isnan().any()
    assert caches[0][0].shape[0] == 17  # the pool's 16 blocks and the scratch block the padding rows write
    for (k, v), (k2, v2) in zip(caches, twin, strict=True):
        # the eager step wrote the same slots, the same values
        assert torch.equal(k[:16], k2[:16]) and torch.equal(v[:16], v2[:16])
    for k, k0 in zip((k for k, _ in caches), orig):
        changed = {int(i) for i in torch.nonzero((k0 != k).flatten(0, 1).flatten(1).any(1))}
        assert changed - {16 * 4} == {3 * 4 + 2, 7 * 4, 7 * 4 + 1}, changed  # and the scratch block's first slot
    with pytest.raises(ValueError, match="1..8 tokens, got 9"):
        pw.run(torch.zeros(9, dtype=torch.long), torch.zeros(9, dtype=torch.long), meta())


def test_buckets_defaults_and_bad_lists():
    assert default_token_sizes(2048) == [8, 16, 32, 64, 96, 128, 192, 256, 384, 512]
    assert default_token_sizes(100) == [8, 16, 32, 64, 96, 100] and default_token_sizes(4) == [4]
    assert EngineConfig(cuda_graph_token_sizes=[64, 8, 8]).cuda_graph_token_sizes == [8, 64]
    for sizes, message in [([0, 8], "cuda_graph_token_sizes must be positive integers"),
                           ("8", "cuda_graph_token_sizes must be a list of token counts"),
                           ([8, 4096], "cuda_graph_token_sizes has 4096, past max_num_batched_tokens=2048")]:
        with pytest.raises(ValueError, match=message):
            EngineConfig(cuda_graph_token_sizes=sizes)
    # [] turns them off; enforce_eager turns every graph off
    assert LLM("tiny", static_decode_buffers=True, cuda_graph_token_sizes=[]).llm_engine.runner.piecewise is None
    assert LLM("tiny", static_decode_buffers=True, enforce_eager=True).llm_engine.runner.piecewise is None
    pw = LLM("tiny", static_decode_buffers=True, max_num_batched_tokens=64).llm_engine.runner.piecewise
    assert pw.sizes == [8, 16, 32, 64] and (pw.bucket_for(1), pw.bucket_for(33), pw.bucket_for(65)) == (8, 64, None)


def test_a_workers_layer_hook_keeps_its_steps_on_the_graphs():
    """Decode and colocated workers set ``layer_done_callback`` (it times a prompt's queue wait): a step that
    completes a prompt calls it, and must still run through the pieces (or a decode bucket), calling it for each
    layer in order with the prompts done, as the eager model does."""
    def hooked(llm: LLM) -> list:
        calls: list = []
        llm.llm_engine.layer_done_callback = lambda layer, ids: calls.append((layer, tuple(ids)))
        return calls

    eager = LLM("tiny", **SMALL_STEPS)
    static = LLM("tiny", static_decode_buffers=True, **SMALL_STEPS)
    want, got = hooked(eager), hooked(static)
    params = [SamplingParams(max_tokens=6, temperature=0.0, logprobs=1) for _ in PROMPTS]
    _same(eager.generate(PROMPTS, params), static.generate(PROMPTS, params))
    layers = len(static.llm_engine.runner.model.layers)
    assert got == want and len({rid for _, ids in got for rid in ids}) == len(PROMPTS)  # every prompt's completion
    assert [layer for layer, _ in got] == list(range(layers)) * (len(got) // layers)  # every layer, in order
    # every step with a prompt's last chunk fit a bucket: none ran eagerly
    eng = static.llm_engine
    assert eng.graph_steps + eng.piecewise_steps == eng.num_steps


def test_the_flag_reaches_the_engine_overrides_and_a_bad_count_is_a_flag_error():
    # (that prefill workers drop it, as they run eagerly: tests/cluster/test_device.py)
    from cluster.cli import build_parser
    from cluster.up_checks import check_up_args
    from cluster.up_flags import engine_overrides

    args = build_parser().parse_args(["up", "--cuda-graph-token-sizes", "16", "64"])
    check_up_args(args)
    assert engine_overrides(args) == {"cuda_graph_token_sizes": [16, 64]}
    off = build_parser().parse_args(["up", "--cuda-graph-token-sizes"])
    assert engine_overrides(off) == {"cuda_graph_token_sizes": []}
    with pytest.raises(ValueError, match="--cuda-graph-token-sizes has 4096, past max_num_batched_tokens"):
        check_up_args(build_parser().parse_args(["up", "--cuda-graph-token-sizes", "4096"]))



def test_the_memory_estimate_covers_a_pieces_peak_and_grows_with_the_bucket():
    from engine.config import ModelConfig
    from engine.piecewise_graphs import piecewise_memory_estimate

    mc = ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64)
    small, big = (piecewise_memory_estimate(mc, n, torch.bfloat16) for n in (8, 512))
    # at least the MLP's gate/up and product rows and the residual and qkv rows a piece holds at once, in bf16
    assert big >= 512 * (3 * 8192 + 3 * 2048 + 3072) * 2
    assert 60 * small < big < 70 * small  # linear in the bucket (no logits: the last layer runs eagerly)
