"""Decode steps through the CUDA-graph runner's static buffers and buckets (engine/cuda_graphs.py).

On CPU the graphs are not captured (``static_decode_buffers``): every pure decode step is copied into the static
buffers, padded to its bucket and run on them, exactly the ops a captured graph replays. These tests demand that
path give the eager engine's tokens and log-probabilities bit for bit (pdserve's CPU kernels give a row the same
bits in any batch, so padding a batch changes nothing), that padding rows touch no request's KV, that stale
block-table columns are never read, and that bad bucket lists fail at configuration. The CUDA capture itself is
checked by the last test where a GPU is present (benchmarks/device_session.sh runs it).
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, EngineConfig, SamplingParams
from engine import attention
from engine.config import check_graph_sizes, default_graph_sizes
from engine.cuda_graphs import DecodeGraphs

from .conftest import make_checkpoint, outputs_of

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n", "x = [", "def binary_search(items, target):\n", "while True:", "# a",
           "print(", "y", "with open(path) as f:\n", "try:\n    pass\n", "lambda"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3}


def _params() -> list[SamplingParams]:
    """Greedy with logprobs for most prompts, seeded sampling with penalties for some."""
    out = []
    for i in range(len(PROMPTS)):
        if i % 3 == 2:
            out.append(SamplingParams(max_tokens=20, temperature=0.8, top_p=0.9, seed=100 + i, logprobs=2,
                                      repetition_penalty=1.1))
        else:
            out.append(SamplingParams(max_tokens=20 + i, temperature=0.0, logprobs=2))
    return out


def _pair(model: str = "tiny", **kw) -> tuple[LLM, LLM]:
    eager = LLM(model, max_num_seqs=8, **kw)
    static = LLM(model, max_num_seqs=8, static_decode_buffers=True, **kw)
    assert eager.llm_engine.runner.graphs is None
    return eager, static


def _exact(a: list, b: list, tol: float = 0.0) -> None:
    """The same tokens; the same logprobs and top alternatives, to ``tol``."""
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        if not tol:
            assert [(t.token_id, t.logprob, t.top) for t in x.logprobs] == [(t.token_id, t.logprob, t.top)
                                                                            for t in y.logprobs]
        for p, q in zip(x.logprobs, y.logprobs, strict=True):
            assert abs(p.logprob - q.logprob) <= tol and [i for i, _ in p.top] == [i for i, _ in q.top]


@pytest.mark.parametrize("kw", [{}, {"kv_cache_dtype": "int8"}, {"cpu_gemm": "pdserve"},
                                {"speculative_config": NGRAM}], ids=["fused", "int8-kv", "row-kernel", "ngram"])
def test_static_decode_buffers_give_the_eager_tokens_bit_for_bit(kw):
    eager, static = _pair(**kw)
    params = _params()
    a, b = eager.generate(PROMPTS, params), static.generate(PROMPTS, params)
    # the fp32 row kernel (cpu_gemm="pdserve") sums a row in another order once a batch has more rows (a padded
    # batch does): its logprobs agree to float rounding, as a GPU's GEMMs would
    _exact(a, b, 1e-5 if kw.get("cpu_gemm") == "pdserve" else 0.0)
    graphs = static.llm_engine.runner.graphs
    assert graphs.sizes == [1, 2, 4, 8] and not graphs.graphs  # nothing captured on CPU
    assert graphs.replays >= 20, graphs.replays  # the decode steps really went through the buffers


def test_static_decode_buffers_on_plain_torch_ops(monkeypatch):
    """What a GPU without the Triton kernel runs: torch linears and the gather+SDPA decode attention, which reads
    the whole padded table width (stale columns included) under the length mask."""
    calls = []
    real = attention.gather_decode_attention

    def counted(q, *a):
        calls.append(q.shape[0])
        return real(q, *a)

    monkeypatch.setattr(attention, "cpu_kernels", lambda: None)
    monkeypatch.setattr(attention, "gather_decode_attention", counted)
    eager, static = _pair(cpu_gemm="torch")
    params = [SamplingParams(max_tokens=16 + i, temperature=0.0, logprobs=1) for i in range(len(PROMPTS))]
    a, b = eager.generate(PROMPTS, params), static.generate(PROMPTS, params)
    for x, y in zip(a, b, strict=True):
        assert x.token_ids == y.token_ids
        # torch's GEMM may round a row differently in a padded batch (as cuBLAS does): logprobs agree closely
        assert all(abs(p.logprob - q.logprob) < 1e-4 for p, q in zip(x.logprobs, y.logprobs, strict=True))
    assert 8 in calls and static.llm_engine.runner.graphs.replays > 0


def test_sliding_window_model_through_static_buffers(tmp_path):
    path, _ = make_checkpoint(tmp_path, "mistral", sliding_window=6)
    eager, static = _pair(str(path), num_kv_blocks=128, block_size=4)
    prompts = [[5 + i, 9, 200 + i, 17, 33][: 1 + i % 5] * (1 + i % 4) for i in range(11)]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=1, ignore_eos=True)
    assert outputs_of(eager, prompts, params) == outputs_of(static, prompts, params)
    assert static.llm_engine.runner.graphs.replays > 0


def test_gemma3_local_and_global_rope_through_static_buffers(tmp_path):
    """Gemma 3's local layers rotate with a table of their own: the piecewise graphs' buffers hold both."""
    path, _ = make_checkpoint(tmp_path, "gemma3", head_dim=32, num_hidden_layers=3, sliding_window=6,
                              layer_types=["sliding_attention", "full_attention", "sliding_attention"])
    eager, static = _pair(str(path), num_kv_blocks=128, block_size=4)
    assert static.llm_engine.model.rope_local_cos is not None
    prompts = [[5 + i, 9, 200 + i, 17, 33][: 1 + i % 5] * (1 + i % 4) for i in range(11)]
    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=1, ignore_eos=True)
    assert outputs_of(eager, prompts, params) == outputs_of(static, prompts, params)
    assert static.llm_engine.runner.graphs.replays > 0 and static.llm_engine.piecewise_steps > 0


def _graphs(llm: LLM) -> tuple[DecodeGraphs, list[tuple[torch.Tensor, torch.Tensor]]]:
    eng = llm.llm_engine
    return eng.runner.graphs, eng.kv_caches


def test_padding_rows_write_only_the_scratch_block():
    llm = LLM("tiny", max_num_seqs=8, num_kv_blocks=16, block_size=4, static_decode_buffers=True)
    graphs, caches = _graphs(llm)
    assert graphs.scratch_block == 16 and caches[0][0].shape[0] == 17  # one block past the pool
    torch.manual_seed(0)
    for k, v in caches:
        k.normal_()
        v.normal_()
    before = [(k.clone(), v.clone()) for k, v in caches]
    # three rows (a bucket of 4): positions 5, 2 and 9 of sequences on blocks [3, 4], [7], [1, 2, 6]
    # five rows first (a bucket of 8), so the next step's padding row was a real row the step before
    graphs.run([1] * 5, [0] * 5, [8 * 4 + i for i in range(5)], [[8, 9]] * 5, [7] * 5)
    before = [(k.clone(), v.clone()) for k, v in caches]
    tables = [[3, 4], [7], [1, 2, 6]]
    pos = [5, 2, 9]
    slots = [t[p // 4] * 4 + p % 4 for t, p in zip(tables, pos)]
    logits = graphs.run([11, 12, 13], pos, slots, tables, [p + 1 for p in pos])
    assert logits.shape[0] == 3
    # the padding row is reset to a one-row context in the scratch block: it reads nothing of any request
    assert graphs.ctx_lens[:4].tolist() == [6, 3, 10, 1] and graphs.slot_mapping[3].item() == 16 * 4
    assert graphs.block_tables[3, :2].tolist() == [16, 16]
    for (k0, v0), (k, v) in zip(before, caches):
        changed = sorted({int(i) for i in torch.nonzero((k0 != k).flatten(1).any(1) | (v0 != v).flatten(1).any(1))})
        # (the scratch row may get the very K/V the step before wrote there: same token, same position)
        assert set(changed) - {16} == {4, 6, 7}, changed
        flat0, flat = k0.flatten(0, 1), k.flatten(0, 1)
        rows = {int(i) for i in torch.nonzero((flat0 != flat).flatten(1).any(1))}
        assert rows - {16 * 4} == set(slots), rows  # the three real slots, and at most the scratch block's first row


def test_stale_table_columns_are_never_read():
    """A wide step, then a narrow one: the narrow step's rows must not see the wide step's blocks."""
    llm = LLM("tiny", max_num_seqs=8, num_kv_blocks=32, block_size=4, static_decode_buffers=True)
    graphs, caches = _graphs(llm)
    torch.manual_seed(1)
    for k, v in caches:
        k.normal_()
        v.normal_()
    graphs.run([5, 6], [15, 14], [9 * 4 + 3, 13 * 4 + 2], [[1, 2, 3, 9], [10, 11, 12, 13]], [16, 15])
    narrow = graphs.run([7, 8], [3, 2], [20 * 4 + 3, 21 * 4 + 2], [[20], [21]], [4, 3]).clone()
    fresh = LLM("tiny", max_num_seqs=8, num_kv_blocks=32, block_size=4, static_decode_buffers=True)
    g2, c2 = _graphs(fresh)
    for (k, v), (k2, v2) in zip(caches, c2):
        k2.copy_(k)
        v2.copy_(v)
    assert torch.equal(g2.run([7, 8], [3, 2], [20 * 4 + 3, 21 * 4 + 2], [[20], [21]], [4, 3]), narrow)
    assert g2.block_tables[0, 1:4].tolist() == [32, 32, 32] and graphs.block_tables[0, 1:4].tolist() == [2, 3, 9]


def test_uncaptured_buffers_leave_the_kv_budget_whole_and_the_estimate_grows_with_the_bucket():
    eager, static = LLM("tiny", max_num_seqs=8), LLM("tiny", max_num_seqs=8, static_decode_buffers=True)
    assert static.llm_engine.graph_memory_estimate == 0
    assert static.llm_engine.num_total_blocks == eager.llm_engine.num_total_blocks
    from engine.config import ModelConfig
    from engine.cuda_graphs import graph_memory_estimate

    mc = ModelConfig(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=64)
    one, many = (graph_memory_estimate(mc, b, torch.bfloat16, 256) for b in (1, 256))
    # at least the bucket's float32 logits, and about linear in the bucket
    assert many >= 256 * 128256 * 4 and 200 * one < many < 300 * one


def test_buckets_and_their_limits():
    assert default_graph_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 40, 48, 56, 64]
    assert default_graph_sizes(5) == [1, 2, 4, 5] and default_graph_sizes(1) == [1]
    assert check_graph_sizes([8, 1, 4, 4], 8) == [1, 4, 8]
    llm = LLM("tiny", max_num_seqs=4, static_decode_buffers=True, cuda_graph_sizes=[2, 4])
    graphs = llm.llm_engine.runner.graphs
    assert (graphs.bucket_for(1), graphs.bucket_for(3), graphs.bucket_for(5)) == (2, 4, None)
    with pytest.raises(ValueError, match="1..4 rows, got 5"):
        graphs.run([1] * 5, [0] * 5, [0] * 5, [[0]] * 5, [1] * 5)
    # a step past the largest bucket (verification rows) runs eagerly and still matches
    eager = LLM("tiny", max_num_seqs=4, speculative_config=NGRAM)
    static = LLM("tiny", max_num_seqs=4, static_decode_buffers=True, cuda_graph_sizes=[2, 4],
                 speculative_config=NGRAM)
    p = SamplingParams(max_tokens=24, temperature=0.0, logprobs=1)
    _exact(eager.generate(PROMPTS[:4], p), static.generate(PROMPTS[:4], p))


@pytest.mark.parametrize("sizes, message", [
    ([1, 2, 4], "cuda_graph_sizes does not cover max_num_seqs=8: its largest bucket is 4"),
    ([0, 8], "cuda_graph_sizes must be positive integers"),
    ("8", "cuda_graph_sizes must be a list of batch sizes"),
    ([True, 8], "cuda_graph_sizes must be positive integers")])
def test_a_bad_bucket_list_fails_at_configuration(sizes, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(max_num_seqs=8, cuda_graph_sizes=sizes)


def test_enforce_eager_wins_and_flags_reach_the_engine():
    assert LLM("tiny", static_decode_buffers=True, enforce_eager=True).llm_engine.runner.graphs is None
    with pytest.raises(ValueError, match="enforce_eager must be a bool"):
        EngineConfig(enforce_eager="yes")
    from cluster.cli import build_parser
    from cluster.up_checks import check_up_args
    from cluster.up_flags import engine_overrides

    args = build_parser().parse_args(["up", "--enforce-eager", "--cuda-graph-sizes", "1", "8", "64"])
    check_up_args(args)
    assert engine_overrides(args) == {"enforce_eager": True, "cuda_graph_sizes": [1, 8, 64]}
    with pytest.raises(ValueError, match="--cuda-graph-sizes does not cover max_num_seqs=64"):
        check_up_args(build_parser().parse_args(["up", "--cuda-graph-sizes", "1", "8"]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU (device_session.sh)")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_graphs_replay_the_static_path_on_cuda(dtype):
    """On a GPU: replaying the captured graphs gives the uncaptured static path's tokens and logprobs exactly (the
    same kernels on the same padded batch), and the greedy tokens of the eager engine."""
    kw = dict(device="cuda", dtype=dtype, max_num_seqs=8)
    graphs_llm = LLM("tiny", **kw)
    static = LLM("tiny", static_decode_buffers=True, **kw)
    eager = LLM("tiny", enforce_eager=True, **kw)
    assert graphs_llm.llm_engine.runner.graphs.graphs  # captured
    # what the capture took fits what was taken out of the KV budget for it
    eng = graphs_llm.llm_engine
    assert 0 < eng.runner.graphs.memory_bytes <= eng.graph_memory_estimate
    assert eng.num_total_blocks < eager.llm_engine.num_total_blocks
    p = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
    g = graphs_llm.generate(PROMPTS, p)
    _exact(g, static.generate(PROMPTS, p))
    assert [o.token_ids for o in g] == [o.token_ids for o in eager.generate(PROMPTS, p)]


def test_a_cuda_engine_without_the_triton_decode_kernel_stays_eager(monkeypatch):
    """Captured decode attention must read through the block tables: where pdserve's Triton kernel cannot run, the
    fallback would gather max_model_len keys per row each step, so the engine does not capture (and says why)."""
    from engine.cuda_graphs import eager_reason

    cuda, bf16 = torch.device("cuda"), torch.bfloat16
    assert "int8 KV cache" in eager_reason(cuda, bf16, torch.int8, 64)
    assert "head_dim 48" in eager_reason(cuda, bf16, bf16, 48)
    pytest.importorskip("triton")
    assert eager_reason(cuda, bf16, bf16, 64) is None
    assert eager_reason(cuda, bf16, torch.float8_e4m3fn, 64) is None  # the decode kernel widens an fp8 cache
    monkeypatch.setenv("PDSERVE_TRITON_KERNELS", "0")
    assert "PDSERVE_TRITON_KERNELS=0" in eager_reason(cuda, bf16, bf16, 64)


def test_the_block_table_mirror_follows_every_change_and_converts_only_what_changed(monkeypatch):
    """The host mirror of the block tables is rewritten row by row where a row's table changed (a full rewrite
    each step cost ~2 ms at 256 rows of 2K-token contexts). Every kind of change must reach the device: a new
    block, a table trimmed and refilled to the same length with the same last block (speculative blocks freed,
    others taken), a table cleared and refilled longer (a preemption), sequences changing rows, a row turned
    padding."""
    llm = LLM("tiny", max_num_seqs=8, num_kv_blocks=64, block_size=4, static_decode_buffers=True)
    graphs, _ = _graphs(llm)
    scratch = graphs.scratch_block

    def step(tables):
        n = len(tables)
        graphs.run([1] * n, [0] * n, [t[0] * 4 for t in tables], tables, [1] * n)
        for i, t in enumerate(tables):
            assert graphs.block_tables[i, :len(t)].tolist() == t, (i, t)
        size = graphs.bucket_for(n)
        assert (graphs.block_tables[n:size] == scratch).all()  # padding rows: the scratch block only

    a, b, c, d = [1, 2, 3], [4, 5], [6], [20, 21, 22, 23]
    step([a, b, c, d])
    a.append(7)
    step([a, b, c, d])
    a[:] = [1, 9, 3, 7]  # the same list, length and last block; its middle changed
    step([a, b, c, d])
    b.clear()
    b.extend([10, 11, 12])  # refilled longer: its first entries changed too
    step([a, b, c, d])
    step([d, c, b, a])  # every sequence in another row
    step([c, a, b])  # row 3, real a step ago, is padding now
    step([c, a, b, d])

    calls: list[int] = []
    real = torch.tensor

    def counted(*args, **kw):
        calls.append(1)
        return real(*args, **kw)

    monkeypatch.setattr(torch, "tensor", counted)
    graphs._update_tables([c, a, b, d], 4)
    assert not calls  # nothing changed: nothing converted
    d.append(30)
    graphs._update_tables([c, a, b, d], 4)
    assert len(calls) == 1 and graphs._host_tables[3, :5].tolist() == [20, 21, 22, 23, 30]
