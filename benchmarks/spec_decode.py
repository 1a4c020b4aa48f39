"""Speculative decoding on the trained ``tiny`` / ``tiny-draft`` pair vs plain decoding, in one run.

Lifecycle: a one-shot script. It cuts code prompts from Python source files (by
default the standard library files the models were *not* trained on: every 20th
file of ``engine.assets.train_tokenizer.corpus_files``, the held-out split of
``engine/assets/train_models.py``; ``--files`` takes other paths), then measures,
with the same prompts for every contender:

* a sweep over k = 1..6 at batch 1, greedy and temperature 0.8 (seeded): for the
  draft model and for n-grams, the acceptance rate (accepted / proposed draft
  tokens), the mean accepted length (tokens emitted per verified step:
  accepted drafts + the target's own token) and decode tokens/s;
* the main table: decode tokens/s at batch 1 and 8, greedy and temperature 0.8,
  for plain decoding, n-grams and the draft model at ``--k`` (default 4), each
  with its ratio to plain decoding measured in the same round.

Decode tokens/s = batch x (N - 1) / (t_N - t_1): t_N is the wall time of the whole
batch with N new tokens, t_1 with one (the prompt's prefill and first token), so
prompt processing is not counted; each rate is the best of ``--repeats`` runs
(contenders run one after another, so run it on a quiet machine). Output is identical across
contenders (the engine's speculation is lossless; tests/engine check it), and
this script checks the greedy outputs agree too.

Usage: python benchmarks/spec_decode.py [--repeats 3] [--new-tokens 96] [--json out.json]
"""
from __future__ import annotations

import argparse
import sysconfig
import time
from pathlib import Path

import torch


from engine import LLM, SamplingParams
from engine.assets.train_models import HELD_OUT_EVERY
from engine.assets.train_tokenizer import corpus_files

from benchmarks.harness import write_json


def code_prompts(files: list[Path], tokenizer, n: int, length: int) -> list[list[int]]:
    """n prompts of ``length`` tokens: the opening of each file long enough, cut at a line end when possible."""
    out = []
    for p in files:
        ids = tokenizer.encode(p.read_text(encoding="utf-8", errors="replace"))
        if len(ids) < length + 64:
            continue
        out.append(ids[:length])
        if len(out) == n:
            break
    if len(out) < n:
        raise SystemExit(f"only {len(out)} files have more than {length + 64} tokens; pass more --files")
    return out


def run(llm: LLM, prompts: list[list[int]], n: int, temperature: float) -> tuple[float, list]:
    params = [SamplingParams(max_tokens=n, temperature=temperature, seed=i if temperature else None,
                             ignore_eos=True) for i in range(len(prompts))]
    t = time.perf_counter()
    outs = llm.generate(prompts, params)
    return time.perf_counter() - t, [o.token_ids for o in outs]


def decode_rate(llm: LLM, prompts, n: int, temperature: float, repeats: int) -> tuple[float, dict, list]:
    """Best decode tokens/s over ``repeats``, the spec stats of one N-token run, and its outputs."""
    best = 0.0
    stats = None
    outs = []
    for _ in range(repeats):
        eng = llm.llm_engine
        eng.spec_stats.__init__()
        t_n, outs = run(llm, prompts, n, temperature)
        st = eng.spec_stats
        stats = {"acceptance_rate": round(st.acceptance_rate, 3), "mean_accepted_length": round(
            st.mean_accepted_length, 3), "drafts": st.num_drafts}
        t_1, _ = run(llm, prompts, 1, temperature)
        best = max(best, len(prompts) * (n - 1) / max(t_n - t_1, 1e-9))
    return best, stats, outs


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", nargs="*", type=Path, default=None,
                    help="Python files to cut prompts from (default: the models' held-out stdlib files)")
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--k", type=int, default=4, help="draft tokens per step in the main table")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--sweep", action=argparse.BooleanOptionalAction, default=True, help="the k = 1..6 sweep")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.files is None:
        lib = Path(sysconfig.get_paths()["stdlib"])
        files = [p for i, p in enumerate(corpus_files(lib)) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    else:
        files = args.files
    kw = dict(num_threads=args.threads, num_kv_blocks=1024, enable_prefix_caching=False)
    plain = LLM("tiny", **kw)
    prompts8 = code_prompts(files, plain.tokenizer, 8, args.prompt_len)
    prompts1 = prompts8[:4]  # batch 1: four prompts one at a time
    n = args.new_tokens

    def spec(method: str, k: int) -> LLM:
        cfg = {"method": method, "num_speculative_tokens": k}
        if method == "draft_model":
            cfg["model"] = "tiny-draft"
        return LLM("tiny", speculative_config=cfg, **kw)

    results: dict = {"machine": {"threads": args.threads, "torch": torch.__version__}, "sweep": [], "table": []}

    def batch1(llm: LLM, temp: float):
        rates, stats, outs = [], [], []
        for p in prompts1:
            r, s, o = decode_rate(llm, [p], n, temp, args.repeats)
            rates.append(r)
            stats.append(s)
            outs += o
        mean_rate = len(rates) / sum(1 / r for r in rates)  # total tokens / total time
        acc = [s["acceptance_rate"] for s in stats]
        mal = [s["mean_accepted_length"] for s in stats]
        return mean_rate, {"acceptance_rate": round(sum(acc) / len(acc), 3),
                           "mean_accepted_length": round(sum(mal) / len(mal), 3)}, outs

    ref_greedy = None
    if args.sweep:
        print(f"sweep: batch 1, {len(prompts1)} prompts of {args.prompt_len} tokens, {n} new tokens")
        print(f"{'method':<12} {'temp':>4} {'k':>2} {'accept':>7} {'mean len':>8} {'tok/s':>7} {'vs plain':>8}")
        base = {t: batch1(plain, t) for t in (0.0, 0.8)}
        ref_greedy = base[0.0][2]
        for t in (0.0, 0.8):
            print(f"{'plain':<12} {t:>4} {'-':>2} {'-':>7} {'-':>8} {base[t][0]:>7.1f} {1.0:>8.2f}")
        for method in ("draft_model", "ngram"):
            for k in range(1, 7):
                llm = spec(method, k)
                for t in (0.0, 0.8):
                    rate, st, outs = batch1(llm, t)
                    if t == 0.0 and outs != ref_greedy:
                        raise SystemExit(f"{method} k={k}: greedy output differs from plain decoding")
                    row = {"method": method, "temperature": t, "k": k, **st, "tok_s": round(rate, 1),
                           "vs_plain": round(rate / base[t][0], 2)}
                    results["sweep"].append(row)
                    print(f"{method:<12} {t:>4} {k:>2} {st['acceptance_rate']:>7.3f} "
                          f"{st['mean_accepted_length']:>8.2f} {rate:>7.1f} {rate / base[t][0]:>8.2f}", flush=True)
                del llm
    print(f"\nmain table: k = {args.k}, {n} new tokens, prompts of {args.prompt_len} tokens")
    print(f"{'batch':>5} {'temp':>4} {'plain tok/s':>11} {'ngram':>13} {'draft model':>13}")
    contenders = {"plain": plain, "ngram": spec("ngram", args.k), "draft_model": spec("draft_model", args.k)}
    for batch in (1, 8):
        for t in (0.0, 0.8):
            rates = {}
            for name, llm in contenders.items():
                if batch == 1:
                    rates[name], _, _ = batch1(llm, t)
                else:
                    rates[name], _, _ = decode_rate(llm, prompts8, n, t, args.repeats)
            results["table"].append({"batch": batch, "temperature": t, **{k: round(v, 1) for k, v in rates.items()}})
            p = rates["plain"]
            print(f"{batch:>5} {t:>4} {p:>11.1f} {rates['ngram']:>7.1f} {rates['ngram'] / p:>4.2f}x "
                  f"{rates['draft_model']:>7.1f} {rates['draft_model'] / p:>4.2f}x", flush=True)
    if args.json:
        write_json(args.json, results, indent=2)


if __name__ == "__main__":
    main()
