"""benchmarks/cuda_engine.py's logic on CPU, in its --quick shape: the checkpoint it writes loads in both
pdserve's engine and transformers, its float32 parity check finds every greedy token equal to
transformers' own generate, and its CLI runs every phase to a complete JSON report without errors.
(The script's point is the CUDA run; CI has no GPU, so this keeps the code path it depends on tested.)"""
from __future__ import annotations

import json

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
    rc = cuda_engine.main(["--device", "cpu", "--quick", "--out", str(tmp_path), "--ckpt", str(tmp_path / "ckpt")])
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
