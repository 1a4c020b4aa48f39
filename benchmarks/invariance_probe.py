"""Where does a batch-invariant engine stop being batch-invariant? (a GPU diagnosis, issue 43 item 4)

Usage (GPU; ~30 s):  python benchmarks/invariance_probe.py [--dtypes bfloat16,float32]
CPU smoke run (the engine part only, no batch invariance promised there): python benchmarks/invariance_probe.py --device cpu

Why: tests/engine/test_batch_invariant_cuda.py failed on an H200 (1 Dec): with ``batch_invariant=True`` a request's
greedy tokens alone (eager, one request at a time) differed from the same request batched with others, chunked
and replayed from the decode graphs, in bfloat16 and in float32. That test says only that they differ. This
script says where, in two parts:

* kernels (CUDA only): each of pdserve's Triton kernels a batch-invariant step runs, fed the same rows alone and
  among others: ``matmul`` (row i of an M-row product against the same row in a 1-row product, M = 2..64),
  ``rms_norm``, ``silu_mul``, ``rope_``, decode attention (a row alone vs in a batch of 8), prefill attention
  with ``invariant=True`` (a 32-token prompt in one chunk vs two chunks of 16), and torch's ``log_softmax`` and
  ``argmax`` over rows. Each prints ``same`` or the largest difference.
* engine: the test's prompts (tiny model) through engines that differ in one thing at a time against the eager
  one-at-a-time engine: batched (all prompts at once, no chunking), chunked (one at a time, 16-token chunks),
  both, and decode graphs (batched, chunked): per configuration, how many outputs equal the reference and, for
  the first that does not, the position of the first differing token or log-probability.

Lifecycle: a one-shot script; every engine is dropped after its run. Nothing is asserted: the output is read to
decide which kernel or step to fix.
"""
from __future__ import annotations

import argparse
import gc
from typing import Any, Callable

import torch

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n", "x = [", "def binary_search(items, target):\n", "while True:", "# a"]


def _diff(a: torch.Tensor, b: torch.Tensor) -> str:
    if a.shape != b.shape:
        return f"shapes {tuple(a.shape)} vs {tuple(b.shape)}"
    if torch.equal(a, b):
        return "same"
    d = (a.float() - b.float()).abs()
    return f"DIFFERENT: max |diff| {d.max().item():.3g}, {int((d > 0).sum())} of {d.numel()} elements"


def kernels(dtype: torch.dtype) -> None:
    """The kernel-level checks (see the module docstring) on the current CUDA device."""
    from engine import triton_kernels as tk

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    name = str(dtype).removeprefix("torch.")

    def show(what: str, fn: Callable[[], str]) -> None:
        try:
            print(f"  [{name}] {what}: {fn()}", flush=True)
        except Exception as e:  # a probe that cannot run says so and the next one runs
            print(f"  [{name}] {what}: ERROR {type(e).__name__}: {e}", flush=True)

    K, N = 512, 384
    x = torch.randn(64, K, device=dev, generator=g).to(dtype)
    w = (torch.randn(N, K, device=dev, generator=g) * 0.05).to(dtype).t()  # a Linear's weight_t: [K, N] view
    ref = tk.matmul(x[:1], w)

    def matmul() -> str:
        bad = [m for m in range(2, 65) if not torch.equal(tk.matmul(x[:m], w)[:1], ref)]
        row = [i for i in range(1, 64) if not torch.equal(tk.matmul(x[i:i + 1], w), tk.matmul(x, w)[i:i + 1])]
        return "same" if not bad and not row else f"DIFFERENT at M = {bad[:8]}, rows {row[:8]}"

    show("matmul row 0 alone vs in M = 2..64 rows", matmul)
    h = torch.randn(16, 2048, device=dev, generator=g).to(dtype)
    nw = torch.randn(2048, device=dev, generator=g).to(dtype)
    show("rms_norm row 3 alone vs in 16", lambda: _diff(tk.rms_norm(h[3:4].clone(), nw, 1e-5),
                                                       tk.rms_norm(h, nw, 1e-5)[3:4]))
    gu = torch.randn(16, 2 * 1024, device=dev, generator=g).to(dtype)
    show("silu_mul row 3 alone vs in 16", lambda: _diff(tk.silu_mul(gu[3:4].clone()), tk.silu_mul(gu)[3:4]))
    qkv = torch.randn(16, 12, 64, device=dev, generator=g).to(dtype)
    cos, sin = (torch.randn(16, 1, 32, device=dev, generator=g).to(dtype) for _ in range(2))
    show("rope_ row 3 alone vs in 16", lambda: _diff(tk.rope_(qkv[3:4].clone(), cos[3:4], sin[3:4], 10),
                                                    tk.rope_(qkv.clone(), cos, sin, 10)[3:4]))
    # paged caches: 64 blocks of 16 tokens, 2 KV heads of 64, 8 query heads
    H, Hkv, D, BS = 8, 2, 64, 16
    kc = torch.randn(64, BS, Hkv, D, device=dev, generator=g).to(dtype)
    vc = torch.randn(64, BS, Hkv, D, device=dev, generator=g).to(dtype)
    tables = torch.randperm(64, device=dev, generator=g)[:64].view(8, 8)
    lens = torch.tensor([5, 17, 33, 64, 100, 127, 1, 90], device=dev)
    q = torch.randn(8, H, D, device=dev, generator=g).to(dtype)
    scale = D ** -0.5
    full = tk.paged_decode_attention(q, kc, vc, tables, lens, None, scale)
    show("decode attention row 4 alone vs in 8", lambda: _diff(
        tk.paged_decode_attention(q[4:5].clone(), kc, vc, tables[4:5].clone(), lens[4:5].clone(), None, scale),
        full[4:5]))
    qp = torch.randn(32, H, D, device=dev, generator=g).to(dtype)
    bt = tables[3]

    def prefill() -> str:
        whole = tk.paged_prefill_attention(qp, kc, vc, bt, 0, None, scale, invariant=True)
        a = tk.paged_prefill_attention(qp[:16].clone(), kc, vc, bt, 0, None, scale, invariant=True)
        b = tk.paged_prefill_attention(qp[16:].clone(), kc, vc, bt, 16, None, scale, invariant=True)
        return f"first chunk {_diff(a, whole[:16])}; second chunk {_diff(b, whole[16:])}"

    show("prefill attention, 32 tokens whole vs two chunks of 16 (invariant)", prefill)

    def prefill_vs_decode() -> str:  # the last prompt row: prefill kernel vs decode kernel (the last layer's keep)
        whole = tk.paged_prefill_attention(qp, kc, vc, bt, 0, None, scale, invariant=True)
        dec = tk.paged_decode_attention(qp[31:32].clone(), kc, vc, bt[None].clone(),
                                        torch.tensor([32], device=dev), None, scale)
        return _diff(dec, whole[31:32])

    show("row 31 of that prompt: decode kernel vs prefill kernel", prefill_vs_decode)
    logits = torch.randn(16, 8192, device=dev, generator=g)
    show("log_softmax row 3 alone vs in 16", lambda: _diff(torch.log_softmax(logits[3:4].clone(), -1),
                                                          torch.log_softmax(logits, -1)[3:4]))


def _outputs(llm: Any, one_by_one: bool) -> list[tuple[list[int], list[Any]]]:
    from engine import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
    outs = ([o for p in PROMPTS for o in llm.generate([p], params)] if one_by_one
            else llm.generate(PROMPTS, params))
    return [(o.token_ids, [(lp.logprob, lp.top) for lp in o.logprobs]) for o in outs]


def _compare(ref: list, got: list) -> str:
    equal = sum(a == b for a, b in zip(ref, got))
    msg = f"{equal} of {len(ref)} outputs equal the reference"
    for i, (a, b) in enumerate(zip(ref, got)):
        if a == b:
            continue
        tok = next((j for j, (x, y) in enumerate(zip(a[0], b[0])) if x != y), None)
        lp = next((j for j, (x, y) in enumerate(zip(a[1], b[1])) if x != y), None)
        dlp = abs(a[1][lp][0] - b[1][lp][0]) if lp is not None else 0.0
        msg += (f"; first different: prompt {i}, token {tok} (log-probabilities from position {lp}, "
                f"|diff| {dlp:.3g} there)")
        break
    return msg


def engine(device: str, dtype: str) -> None:
    """The engine-level comparison (see the module docstring)."""
    from engine import LLM

    base = dict(device=device, dtype=dtype, max_num_seqs=8, enable_prefix_caching=False,
                batch_invariant=device != "cpu")
    configs = {  # name: (engine kwargs, one request at a time)
        "batched (eager, no chunking)": (dict(enforce_eager=True), False),
        "chunked (eager, one at a time, 16-token chunks)": (dict(enforce_eager=True, max_num_batched_tokens=16), True),
        "batched + chunked (eager)": (dict(enforce_eager=True, max_num_batched_tokens=16), False),
        "decode graphs, one at a time": (dict(), True),
        "decode graphs, batched": (dict(), False),
        "decode graphs, batched + chunked (the test's)": (dict(max_num_batched_tokens=16), False),
    }
    ref = _outputs(LLM("tiny", enforce_eager=True, **base), one_by_one=True)
    gc.collect()
    for name, (kw, one) in configs.items():
        try:
            llm = LLM("tiny", **base, **kw)
            got = _outputs(llm, one_by_one=one)
            print(f"  [{dtype}] {name}: {_compare(ref, got)}", flush=True)
        except Exception as e:
            print(f"  [{dtype}] {name}: ERROR {type(e).__name__}: {e}", flush=True)
        llm = None
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--dtypes", default="bfloat16,float32")
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        ap.error("--device cuda: torch sees no CUDA device here (use --device cpu for the engine part)")
    dtypes = [d.strip() for d in args.dtypes.split(",") if d.strip()]
    for d in dtypes:
        if args.device == "cuda":
            print(f"kernels, {d}:", flush=True)
            kernels(getattr(torch, d))
        print(f"engine, {d} (reference: eager, one request at a time):", flush=True)
        engine(args.device, d)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
