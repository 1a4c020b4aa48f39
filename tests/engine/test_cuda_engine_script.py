"""benchmarks/cuda_engine.py's logic on CPU, in its --quick shape: the checkpoint it writes loads in both
pdserve's engine and transformers, its float32 parity check finds every greedy token equal to
transformers' own generate, and its CLI runs every phase to a complete JSON report without errors.
(The script's point is the CUDA run; CI has no GPU, so this keeps the code path it depends on tested.)"""
from __future__ import annotations

import json

import os

import pytest

pytest.importorskip("transformers")

from benchmarks import cuda_engine  # noqa: E402
from benchmarks.cuda import checkpoint, parity  # noqa: E402
from benchmarks.cuda.context import Ctx  # noqa: E402


def test_float32_parity_greedy_tokens_match_transformers(tmp_path):
    work = checkpoint.QUICK
    ckpt = checkpoint.make_checkpoint(tmp_path / "ckpt", checkpoint.SHAPES["tiny"], max_pos=work.max_pos, device="cpu")
    ctx = Ctx("cpu", ckpt, checkpoint.SHAPES["tiny"], work, tmp_path / "out", {})
    prompts = checkpoint.prompts_of(work.parity_lens, seed=11)
    try:
        res = parity.parity_dtype(ctx, "float32", prompts, work.parity_new)
    finally:
        ctx.drop(hf=("float32",), eng=("float32",))
    hl, el, ht, et = res["_raw"]
    assert len(ht) == len(prompts) and all(len(t) == work.parity_new for t in ht)
    assert et == ht  # greedy tokens, token for token, on every prompt
    assert res["all_greedy_match"] and res["all_top1_agree"]
    assert res["max_logits_diff"] < 1e-4
    assert min(r["logits_ref_std"] for r in res["prompts"]) > 0.1  # the tolerance means something
    assert all(r["distinct_ref_tokens"] > 1 for r in res["prompts"])


def test_cli_quick_run_writes_a_complete_report(tmp_path):
    rc = cuda_engine.main(["--device", "cpu", "--quick", "--out", str(tmp_path), "--ckpt", str(tmp_path / "ckpt"),
                           "--phases", "parity,decode,prefill,graphs,kernels"])
    report = json.loads((tmp_path / "cuda_engine.json").read_text())
    assert rc == 0 and report["errors"] == {}
    assert report["parity"]["float32_strict_pass"]
    assert set(report["parity"]["bfloat16_vs_float32_reference"]) == {"engine_bf16", "transformers_bf16"}
    assert set(report["decode"]["engine"]) == {str(b) for b in checkpoint.QUICK.decode_batches}
    assert all(r["tokens_per_s"] > 0 for r in report["decode"]["engine"].values())
    assert set(report["prefill"]["cases"]) == {f"{b}x{n}" for b, n in checkpoint.QUICK.prefill}
    assert all(c["engine_steps"] == 1 for c in report["prefill"]["cases"].values())
    assert report["model"]["params"] > 0 and report["device"]["torch"]
    graphs = report["graphs"]  # off a GPU: the static buffers, uncaptured, against enforce_eager
    assert graphs["buckets"] and not graphs["captured"]
    assert graphs["tokens"]["identical"] == graphs["tokens"]["sequences"] == 8
    assert set(graphs["decode"]) == {str(b) for b in checkpoint.QUICK.decode_batches}
    # the mixed steps (a decode batch and a whole new prompt each) went through the piecewise graphs' buffers
    mixed = graphs["mixed"]["4+20"]
    assert mixed["graphs"]["piecewise_steps"] == checkpoint.QUICK.mixed_steps and mixed["eager"]["piecewise_steps"] == 0
    # the kernels phase (on CPU, operators' self time stand in for kernels): a case for every single-sequence prefill
    # and every decode batch, its time split into classes that add up to its busy time, a top list, an idle share
    k = report["kernels"]
    assert set(k["prefill"]) == {str(n) for b, n in checkpoint.QUICK.prefill if b == 1}
    assert set(k["decode"]) == {str(b) for b in checkpoint.QUICK.decode_batches}
    for case in [*k["prefill"].values(), *k["decode"].values()]:
        assert case["busy_ms"] > 0 and case["wall_ms"] > 0 and 0 <= case["idle_share"] <= 1
        assert sum(case["classes_ms"].values()) == pytest.approx(case["busy_ms"], rel=1e-3)
        assert 0 < len(case["top"]) <= 12 and case["top"][0][2] >= case["top"][-1][2]
    assert "gemm" in k["decode"]["1"]["classes_ms"]  # a linear layer's matmuls, even in this tiny shape


def test_disagg_vs_colocated_on_one_gpu_asks_for_cuda_ipc(tmp_path):
    """benchmarks/disagg_vs_colocated.py --device cuda (issue 43's verdict run): every engine on the GPU in bf16, the
    prefill cache one shareable allocation and both roles on nccl endpoints (their pair then takes CUDA IPC); on CPU
    nothing of that."""
    from benchmarks import disagg_vs_colocated as dvc

    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,100,20\n")
    ns = dvc.parse_args(["--device", "cuda", "--trace", str(trace), "--kv-cache-gib", "8",
                         "--max-num-batched-tokens", "512", "--colocated-workers", "1"])
    engine_kw, role_kw = dvc.engine_and_worker_kw(ns)
    assert engine_kw["device"] == "cuda" and engine_kw["dtype"] == "bfloat16" and engine_kw["kv_cache_shared"]
    assert engine_kw["kv_cache_memory_bytes"] == 8 << 30 and engine_kw["max_num_batched_tokens"] == 512
    assert role_kw == {"prefill": {"kv_backend": "nccl"}, "decode": {"kv_backend": "nccl"}}
    from engine.config import EngineConfig

    EngineConfig(**engine_kw)  # a config the workers accept
    cpu_kw, cpu_roles = dvc.engine_and_worker_kw(dvc.parse_args(["--trace", str(trace), "--colocated-workers", "1"]))
    assert "device" not in cpu_kw and "dtype" not in cpu_kw and cpu_roles == {}
    assert "async_scheduling" not in engine_kw
    ahead, _ = dvc.engine_and_worker_kw(dvc.parse_args(["--device", "cuda", "--trace", str(trace), "--async-scheduling"]))
    assert ahead["async_scheduling"] is True
    EngineConfig(**ahead)
    with pytest.raises(SystemExit, match="--async-scheduling needs --device cuda"):
        dvc.parse_args(["--trace", str(trace), "--async-scheduling"])
    # --engine-process: the colocated workers' engine core in a process of its own; the KV roles keep theirs
    _, ep_roles = dvc.engine_and_worker_kw(dvc.parse_args(["--device", "cuda", "--trace", str(trace), "--engine-process"]))
    assert ep_roles == {"prefill": {"kv_backend": "nccl"}, "decode": {"kv_backend": "nccl"},
                        "colocated": {"engine_process": True}}
    # --cores-per-worker: every worker of the largest deployment gets that many cores, or the run is refused
    with pytest.raises(SystemExit, match="--cores-per-worker must be >= 1"):
        dvc.parse_args(["--trace", str(trace), "--cores-per-worker", "0"])
    with pytest.raises(SystemExit, match=r"core\(s\) for each worker"):
        dvc.parse_args(["--trace", str(trace), "--cores-per-worker", str(len(os.sched_getaffinity(0)))])


def test_decode_host_overhead_runs_every_step_through_the_static_buffers():
    """benchmarks/decode_host_overhead.py on CPU: each timed step went through the decode buckets (it refuses to
    report otherwise) and its host time is the step's wall less the forward."""
    from benchmarks import decode_host_overhead
    from engine.cuda_graphs import DecodeGraphs

    forward = DecodeGraphs._forward
    r = decode_host_overhead.measure("tiny", "cpu", batch=3, steps=4, dtype=None)
    assert r["batch"] == 3 and 0 < r["forward_ms"] < r["wall_ms"]  # the forward was timed, and is part of a step
    assert 0 < r["host_share"] < 1
    assert DecodeGraphs._forward is forward  # its timing wrapper is taken off again
    # with async scheduling every timed step was launched ahead of the one before, on one engine for two batches
    llm = decode_host_overhead.build("tiny", "cpu", [2, 3], 4, None, async_scheduling=True)
    rows = [decode_host_overhead.measure("tiny", "cpu", b, 4, None, llm=llm) for b in (3, 2)]
    assert [(r["batch"], r["async_scheduling"], r["ahead_steps"]) for r in rows] == [(3, True, 4), (2, True, 4)]
    assert llm.llm_engine.num_free_blocks == llm.llm_engine.num_total_blocks


def test_serving_overhead_passes_async_scheduling_to_every_engine_on_cuda_only():
    from benchmarks import serving_overhead as so
    from engine.config import EngineConfig

    ns = so.parse_args(["--device", "cuda", "--dtype", "bfloat16", "--modes", "colocated", "--async-scheduling"])
    kw = so.engine_kw(vars(ns))
    assert kw["async_scheduling"] is True
    EngineConfig(model="tiny", **kw)  # a config the offline engine and the workers accept
    assert "async_scheduling" not in so.engine_kw(vars(so.parse_args(["--device", "cuda", "--modes", "colocated"])))
    with pytest.raises(SystemExit, match="--async-scheduling needs --device cuda"):
        so.parse_args(["--async-scheduling"])


def test_verdict_slos_rescores_a_result_at_other_slos(tmp_path, capsys):
    """benchmarks/verdict_slos.py: a request meets (TTFT, TPOT) when both hold, TPOT over the tokens after the
    first; a failed request misses; goodput is the highest rate with it and every lower one at the goal."""
    from benchmarks import verdict_slos as vs

    # rate 4: TTFT 0.1 s, 11 tokens in 0.6 s (TPOT 50 ms), and TTFT 0.3 s, 2 tokens in 0.31 s (TPOT 10 ms);
    # rate 8: the first again, and a failed request
    a = {"ttft": 0.1, "lat": 0.6, "out": 11}
    b = {"ttft": 0.3, "lat": 0.31, "out": 2}
    pt = lambda rate, rows, errs: {"rate": rate, "ttfts": [r["ttft"] for r in rows], "errors": errs,  # noqa: E731
                                   "latencies": [r["lat"] for r in rows], "output_lens": [r["out"] for r in rows]}
    p4, p8 = pt(4.0, [a, b], ["", ""]), pt(8.0, [a, a], ["", "timeout"])
    assert vs.attainment(p4, 500, 60) == 1.0
    assert vs.attainment(p4, 200, 60) == 0.5       # b's TTFT is over
    assert vs.attainment(p4, 500, 40) == 0.5       # a's TPOT is over
    assert vs.attainment(p8, 500, 60) == 0.5       # the failed one misses
    assert vs.goodput([p8, p4], 500, 60, 0.5) == 8.0 and vs.goodput([p8, p4], 500, 60, 0.9) == 4.0
    assert vs.goodput([p4, p8], 200, 60, 0.9) == 0.0
    res = tmp_path / "r.json"
    res.write_text(json.dumps({"slos_ms": {"ttft": 500, "tpot": 60}, "points": {"colocated": [p4, p8]}}))
    assert vs.main([str(res), "--slos", "200:60"]) == 0
    out = capsys.readouterr().out
    assert "TTFT <= 500 ms, TPOT <= 60.0 ms: colocated goodput 4 req/s (4:100% 8:50%)" in out
    assert "TTFT <= 200 ms, TPOT <= 60.0 ms: colocated goodput 0 req/s (4:50% 8:50%)" in out
    with pytest.raises(SystemExit, match="--slos"):
        vs.parse_slos("200")
    with pytest.raises(SystemExit, match="--goal"):
        vs.main([str(res), "--goal", "90"])
    (tmp_path / "other.json").write_text("{}")
    with pytest.raises(SystemExit, match="not a disagg_vs_colocated.py result"):
        vs.main([str(tmp_path / "other.json")])


@pytest.mark.parametrize("shape, vocab, published", [("1b", 128256, 1.24e9), ("8b", 128256, 8.03e9)])
def test_the_benchmark_shapes_are_the_llama_models_they_name(shape, vocab, published):
    """benchmarks/cuda/checkpoint.py's shapes with Llama 3's 128,256-token vocabulary (untied for the 8B, tied for the
    3.2-1B) hold the parameter counts Meta publishes (Llama-3.2-1B 1.24B, Llama-3.1-8B 8.03B), within 1%."""
    from engine.config import ModelConfig

    cfg = checkpoint.hf_config(checkpoint.SHAPES[shape], 8192, 0.02)
    cfg.update(vocab_size=vocab, tie_word_embeddings=shape == "1b")
    assert ModelConfig.from_hf_dict(cfg).num_params == pytest.approx(published, rel=0.01)


def test_py_spy_stacks_are_read_as_leaf_shares_and_bad_seconds_are_refused(tmp_path):
    """benchmarks/harness/spy.py's reader (serving_overhead.py and disagg_vs_colocated.py --py-spy): each sample's
    leaf frame, weighted by its count, as a share of all samples; lines that are not stacks are skipped."""
    from benchmarks import disagg_vs_colocated as dvc
    from benchmarks.harness import spy

    raw = tmp_path / "raw.txt"
    raw.write_text("main (a.py:1);step (b.py:2) 6\nmain (a.py:1);wait (c.py:3) 3\nmain (a.py:1);step (b.py:2) 1\n"
                   "garbage\n")
    assert spy.top_functions(raw) == [("step (b.py:2)", 0.7), ("wait (c.py:3)", 0.3)]
    assert spy.top_functions(raw, n=1) == [("step (b.py:2)", 0.7)]
    trace = tmp_path / "t.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,100,20\n")
    with pytest.raises(SystemExit, match="--py-spy"):
        dvc.parse_args(["--trace", str(trace), "--py-spy", "-1"])


def test_invariance_probe_engine_part_finds_every_configuration_equal_on_cpu(capsys):
    """benchmarks/invariance_probe.py --device cpu (its engine part; the kernel part needs CUDA): on pdserve's CPU
    kernels batching, chunking and the static decode buffers change no bit, so every configuration reports all 8
    outputs equal to one request at a time (before 1 Dec's scheduler fix the chunked ones reported 7 of 8)."""
    from benchmarks import invariance_probe

    assert invariance_probe.main(["--device", "cpu", "--dtypes", "float32"]) == 0
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  [float32]")]
    assert len(lines) == 6 and all("8 of 8 outputs equal the reference" in ln for ln in lines), lines


def test_kernel_names_fall_into_the_classes_a_profile_is_read_by():
    from benchmarks.cuda.kernels import classify

    assert classify("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_warpgroupsize1x1x1") == "gemm"
    assert classify("nvjet_tst_128x256_64x4_2x1_v_bz_coopB_TNT") == "gemm"
    assert classify("mkldnn::_linear_pointwise") == "gemm"
    # engine/triton_kernels.py's own
    for name, cls in (("_decode_attention_kernel", "attention"), ("_prefill_attention_kernel", "attention"),
                      ("_rms_norm_kernel", "norm"), ("_rope_kernel", "rope"), ("_silu_mul_kernel", "activation"),
                      ("_matmul_kernel", "gemm")):
        assert classify(name) == cls, name
    assert classify("aten::_scaled_dot_product_flash_attention_for_cpu") == "attention"
    assert classify("Memcpy HtoD (Pageable -> Device)") == "copy"
    assert classify("void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>>") == "other"
