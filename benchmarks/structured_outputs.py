"""Structured outputs on the offline engine: what a constraint costs per step, at the first token and to compile.

Lifecycle: a one-shot script. For each model (``tiny``, ``bench``) it runs the same prompts with and
without a JSON Schema constraint (an array of objects with bounded numbers, an enum and a bounded string:
long answers, so every step is masked), greedy, at batch 1 and 8, and reports:

* decode tokens/s = batch / the median decode step (each ``engine.step()`` after the one that produced the
  first tokens, over ``--repeats`` runs; medians, because the machine is shared);
* TTFT per request = from just before its ``add_request`` (which builds its grammar matcher) to the end of the
  step that returned its first token (prefill + first sampled token, the first mask included); median and
  max over every request of every round, with and without the constraint, at batch 1 and 8 (a batch's
  requests are added back to back, so the last one added waits least);
* the mask cost per step from the engine's own counters (``GrammarCompiler``): time computing the batch's
  bitmasks, as a share of the free decode step; masks inline (the engine's default on CPU) and on the mask
  thread (``overlap_masks = True``, CUDA's default: on CPU the thread waits for the GIL the kernels hold
  through the forward, which this shows), with the time the step waited for the thread after the logits;
* compile costs: the llguidance tokenizer built from our tokenizer, each schema's grammar (cold:
  JSON Schema -> grammar -> validated against the vocabulary), a matcher + its first mask;
* the decode worker's rebuild cost: a matcher made from the constraint and fast-forwarded through a
  long answer's token ids (what a decode worker or a migration target does per request).

Constrained rows stop when their grammar completes or at ``--new-tokens``; their token counts are what
the rates divide by. Contenders run one after another: run it on a quiet machine (``nice`` otherwise, and
say so). The three contenders run interleaved, round after round.

Usage: python benchmarks/structured_outputs.py [--models tiny bench] [--new-tokens 64] [--repeats 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import os
import time

import torch


from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.structured_outputs import GrammarCompiler

from benchmarks.harness import write_json

ITEM = {"type": "object", "additionalProperties": False, "required": ["id", "name", "kind", "score"],
        "properties": {"id": {"type": "integer", "minimum": 0, "maximum": 100000},
                       "name": {"type": "string", "maxLength": 40},
                       "kind": {"enum": ["file", "directory", "link"]},
                       "score": {"type": "number", "minimum": 0, "maximum": 1}}}
LIST = {"type": "array", "items": ITEM, "minItems": 16, "maxItems": 64}
"""At least 16 items (well over 100 tokens): constrained rows run to --new-tokens like the free ones."""
PERSON = {"type": "object", "required": ["name", "age", "address"], "additionalProperties": False,
          "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 150},
                         "address": {"type": "object", "required": ["city"],
                                     "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                         "pattern": "^[0-9]{5}$"}}},
                         "emails": {"type": "array", "items": {"type": "string", "format": "email"}}}}
SCHEMAS = {"list_of_items": LIST, "person_nested": PERSON, "item": ITEM}
PROMPTS = ["List the files of the project as JSON:", "import os\nimport sys\n\ndef walk(root):\n",
           "Here is the inventory:", "{", "class Config:\n    path: str\n", "# the records\n",
           "Describe the directory tree.", "data = "]


def one_run(llm: LLM, prompts: list[str], params: SamplingParams) -> dict:
    """Add the batch, step it to the end; each step's wall time and mask counters (deltas)."""
    eng = llm.llm_engine
    tok = llm.get_tokenizer()
    g = eng._grammar
    ids = [tok.encode(p) for p in prompts]
    added: dict[str, float] = {}
    for i, p in enumerate(ids):
        rid = f"b{time.monotonic_ns()}-{i}"
        added[rid] = time.perf_counter()
        eng.add_request(rid, p, params)
    steps, first_at, n_tokens, ttfts = [], None, 0, []
    while eng.has_unfinished_requests():
        before = (g.mask_compute_s, g.mask_wait_s) if g is not None else (0.0, 0.0)
        t0 = time.perf_counter()
        outs = eng.step()
        t1 = time.perf_counter()
        n_tokens += sum(len(o.new_token_ids) for o in outs)
        ttfts += [t1 - added.pop(o.request_id) for o in outs if o.new_token_ids and o.request_id in added]
        if first_at is None and outs:
            first_at = t1
        else:
            after = (g.mask_compute_s, g.mask_wait_s) if g is not None else (0.0, 0.0)
            steps.append((t1 - t0, after[0] - before[0], after[1] - before[1]))
    return {"ttfts": ttfts, "steps": steps, "tokens": n_tokens}


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else float("nan")


def measure(llm: LLM, batch: int, new_tokens: int, repeats: int, so) -> dict:
    """Free, constrained (masks inline: the engine's CPU default) and constrained with the mask thread, interleaved
    per repeat so they share the machine's noise; medians of per-step times (robust to other tenants)."""
    prompts = PROMPTS[:batch]
    eng = llm.llm_engine
    modes = {"free": None, "json": False, "json_mask_thread": True}
    runs: dict = {m: [] for m in modes}
    for rep in range(repeats + 1):  # the first round warms up (and compiles the grammar)
        for mode, overlap in modes.items():
            c = None if overlap is None else so
            if c is not None:
                eng.grammar.overlap_masks = overlap
            params = SamplingParams(max_tokens=new_tokens, temperature=0.0, structured_outputs=c,
                                    ignore_eos=c is None)
            r = one_run(llm, prompts, params)
            if rep:
                runs[mode].append(r)
    out = {}
    for mode, rs in runs.items():
        steps = [s for r in rs for s in r["steps"]]
        step = _median([s[0] for s in steps])
        out[mode] = {"decode_tok_s": batch / step, "step_ms": 1e3 * step,
                     "ttft_ms": 1e3 * _median([t for r in rs for t in r["ttfts"]]),
                     "ttft_max_ms": 1e3 * max(t for r in rs for t in r["ttfts"]),
                     "tokens_per_run": [r["tokens"] for r in rs]}
        if mode != "free":
            out[mode]["mask"] = {"compute_ms": 1e3 * _median([s[1] for s in steps]),
                                 "wait_ms": 1e3 * _median([s[2] for s in steps]),
                                 "wait_mean_ms": 1e3 * sum(s[2] for s in steps) / len(steps)}
    return out


def compile_costs(tokenizer, vocab: int) -> dict:
    out: dict = {}
    comp = GrammarCompiler(tokenizer, vocab)
    out["tokenizer_build_ms"] = 1e3 * comp.tokenizer_build_s
    for name, schema in SCHEMAS.items():
        c = GrammarCompiler.__new__(GrammarCompiler)
        c.__dict__.update(comp.__dict__)
        c._cache, c.compile_s = type(comp._cache)(), 0.0
        so = StructuredOutputsParams(json=schema)
        t0 = time.perf_counter()
        c.compile(so)
        t1 = time.perf_counter()
        c.check(so)  # matcher + first mask (compile cached now)
        t2 = time.perf_counter()
        out[name] = {"compile_ms": 1e3 * (t1 - t0), "matcher_and_first_mask_ms": 1e3 * (t2 - t1)}
    return out


def apply_cost(vocab: int, batch: int = 8, reps: int = 200) -> dict:
    """The sampler's share: unpacking a batch of bitmasks and setting forbidden logits to -inf (median)."""
    from engine.structured_outputs import apply_bitmask

    x = torch.randn(batch, vocab)
    bm = torch.randint(-2**31, 2**31 - 1, (batch, (vocab + 31) // 32), dtype=torch.int32)
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        apply_bitmask(x, bm, list(range(batch)))
        ts.append(time.perf_counter() - t0)
    return {f"apply_ms_b{batch}": 1e3 * _median(ts)}


def rebuild_cost(tokenizer, vocab: int, n_items: int = 60) -> dict:
    """A decode worker's rebuild: matcher from the constraint, fast-forwarded through a long answer."""
    comp = GrammarCompiler(tokenizer, vocab)
    so = StructuredOutputsParams(json=LIST)
    answer = json.dumps([{"id": i, "name": f"src/module_{i}/file_{i}.py", "kind": "file", "score": 0.5}
                         for i in range(n_items)], separators=(",", ":"))
    ids = tokenizer.encode(answer, add_special_tokens=False)
    comp.new_matcher(so)  # compile once (the worker's cache is warm after the first such request)
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        comp.new_matcher(so, ids)
        best = min(best, time.perf_counter() - t0)
    return {"answer_tokens": len(ids), "rebuild_ms": 1e3 * best, "us_per_token": 1e6 * best / len(ids)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", nargs="+", default=["tiny", "bench"])
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    report: dict = {"machine": {"cpus": os.cpu_count(), "threads": args.threads,
                               "loadavg_start": os.getloadavg()}, "models": {}}
    so = StructuredOutputsParams(json=LIST)
    for model in args.models:
        llm = LLM(model, num_threads=args.threads, num_kv_blocks=1024)
        tok, vocab = llm.get_tokenizer(), llm.llm_engine.model_config.vocab_size
        r: dict = {"compile": compile_costs(tok, vocab), "rebuild": rebuild_cost(tok, vocab), "apply": apply_cost(vocab)}
        for batch in (1, 8):
            m8 = measure(llm, batch, args.new_tokens, args.repeats, so)
            r[f"batch{batch}"] = m8
            free = m8["free"]
            for name in ("free", "json", "json_mask_thread"):
                m = m8[name]
                extra = ""
                if "mask" in m:
                    mk = m["mask"]
                    extra = (f"  (x{m['step_ms'] / free['step_ms']:.3f} of free) mask compute {mk['compute_ms']:.3f} ms"
                             f" ({100 * mk['compute_ms'] / free['step_ms']:.1f}% of a free step), waited "
                             f"{mk['wait_ms']:.3f} ms median, {mk['wait_mean_ms']:.3f} ms mean")
                print(f"{model:6s} batch {batch} {name:18s} decode {m['decode_tok_s']:8.1f} tok/s  "
                      f"TTFT {m['ttft_ms']:7.1f} ms (max {m['ttft_max_ms']:7.1f})  step {m['step_ms']:6.2f} ms{extra}",
                      flush=True)
        print(f"{model}: compile {json.dumps(r['compile'])}", flush=True)
        print(f"{model}: rebuild {json.dumps(r['rebuild'])}", flush=True)
        print(f"{model}: mask application {json.dumps(r['apply'])}", flush=True)
        report["models"][model] = r
        del llm
    report["machine"]["loadavg_end"] = os.getloadavg()
    print(f"load average start {report['machine']['loadavg_start']}, end {report['machine']['loadavg_end']}")
    if args.json:
        write_json(args.json, report, indent=2)


if __name__ == "__main__":
    main()
