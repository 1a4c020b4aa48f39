"""What serving LoRA adapters costs on this machine: decode and prefill steps under adapters against the base model.

Lifecycle: a one-shot script. It writes ``--adapters`` random PEFT-format LoRA adapters (rank ``--rank``, every
projection of every layer, B of magnitude 0.02) for ``--model`` (default ``bench``: 12 layers, hidden 768, 12 query /
4 KV heads) into a temporary directory, builds ONE engine serving them (``EngineConfig.lora_modules``), and measures
in that engine, for each batch size B in ``--batches`` (the three in turn, ``--rounds`` times, medians):

* ``base``: the median ``step()`` time with B sequences decoding on the base model (the fused C++ decode layers);
* ``one``: the same B sequences all under one adapter (each projection adds x A^T B^T; the Python layer path);
* ``mixed``: B sequences spread round-robin over every adapter and the base model (one group per adapter);

and the one step that prefills a ``--prefill-tokens`` prompt on the base model and under one adapter. Ratios are
against ``base`` in the same run. Prompts of 32 tokens are prefilled first and not counted. Last, a load at run time
(``LLMEngine.add_lora`` of one more adapter, then ``remove_lora``, ``--rounds`` times): what it holds the engine loop
for between two steps, as milliseconds and as base decode steps of the first batch size.

Usage: python benchmarks/lora_overhead.py [--model bench] [--rank 16] [--adapters 4] [--batches 1 8 32]
       [--repeats 10] [--rounds 3] [--json out.json]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine import SamplingParams
from engine.config import EngineConfig
from engine.llm_engine import LLMEngine
from engine.loader import load_model_config
from engine.lora import PROJECTIONS, _proj_shape
from loadtest.machine import machine_info


def write_adapter(path: Path, mc, rank: int, seed: int) -> None:
    """A random PEFT LoRA adapter of ``mc`` (every projection), as ``save_pretrained`` lays it out."""
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(mc.num_hidden_layers):
        for proj in PROJECTIONS:
            out, inp = _proj_shape(mc, proj)
            block = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, inp, generator=g) / inp ** 0.5
            tensors[f"{key}.lora_B.weight"] = torch.randn(out, rank, generator=g) * 0.02
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    (path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                                                          "target_modules": list(PROJECTIONS)}))


def decode_step_s(eng: LLMEngine, names: list, repeats: int, tag: str) -> list[float]:
    """Decode step seconds (``repeats`` of them) with one sequence per entry of ``names`` (its adapter; None: the
    base model)."""
    params = [SamplingParams(temperature=0.0, max_tokens=repeats + 4, ignore_eos=True, lora_name=n) for n in names]
    for i, p in enumerate(params):
        eng.add_request(f"{tag}-{i}", [(7 * i + j) % 1000 + 3 for j in range(32)], p)
    while any(s.num_computed < len(s.prompt_token_ids) for s in eng._seqs.values()):
        eng.step()  # prefills (not counted)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        eng.step()
        times.append(time.perf_counter() - t0)
    for i in range(len(names)):
        eng.abort_request(f"{tag}-{i}")
    return times


def prefill_step_s(eng: LLMEngine, tokens: int, name, tag: str) -> float:
    eng.add_request(tag, [(11 * j) % 1000 + 3 for j in range(tokens)],
                    SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True, lora_name=name))
    t0 = time.perf_counter()
    eng.step()
    dt = time.perf_counter() - t0
    eng.abort_request(tag)
    return dt


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="bench")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--adapters", type=int, default=4)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--repeats", type=int, default=10, help="decode steps timed per turn")
    ap.add_argument("--rounds", type=int, default=3, help="turns of base / one adapter / mixed")
    ap.add_argument("--prefill-tokens", type=int, default=512)
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--json", default=None, metavar="PATH")
    args = ap.parse_args()
    mc = load_model_config(EngineConfig(model=args.model))
    with tempfile.TemporaryDirectory() as tmp:
        modules = {}
        for i in range(args.adapters):
            write_adapter(Path(tmp) / f"a{i}", mc, args.rank, seed=i)
            modules[f"a{i}"] = str(Path(tmp) / f"a{i}")
        eng = LLMEngine(EngineConfig(model=args.model, lora_modules=modules, num_threads=args.threads,
                                     max_num_batched_tokens=max(2048, args.prefill_tokens), num_kv_blocks=2048,
                                     enable_prefix_caching=False))
        names = list(modules)
        result: dict = {"machine": machine_info(), "args": vars(args), "decode": {}, "prefill": {}}
        print(f"{args.model}: {args.adapters} adapters of rank {args.rank} on every projection; median step ms "
              "(x base)")
        for b in args.batches:
            # the three take turns, ``--rounds`` times, so a host's drift falls on all of them alike
            kinds = {"base": [None] * b, "one": [names[0]] * b,
                     "mixed": [([None] + names)[i % (len(names) + 1)] for i in range(b)]}
            times: dict = {k: [] for k in kinds}
            for r in range(args.rounds):
                for k, row_names in kinds.items():
                    times[k] += decode_step_s(eng, row_names, args.repeats, f"{k}{b}-{r}")
            base, one, mixed = (statistics.median(times[k]) for k in kinds)
            result["decode"][b] = {"base_ms": base * 1e3, "one_ms": one * 1e3, "mixed_ms": mixed * 1e3}
            print(f"  decode B={b:<3} base {base * 1e3:7.2f}  one adapter {one * 1e3:7.2f} ({one / base:.2f}x)  "
                  f"mixed {mixed * 1e3:7.2f} ({mixed / base:.2f}x)")
        pre: dict = {"base": [], "one": []}
        for r in range(args.rounds):
            pre["base"].append(prefill_step_s(eng, args.prefill_tokens, None, f"pb{r}"))
            pre["one"].append(prefill_step_s(eng, args.prefill_tokens, names[0], f"po{r}"))
        base, one = statistics.median(pre["base"]), statistics.median(pre["one"])
        result["prefill"] = {"tokens": args.prefill_tokens, "base_ms": base * 1e3, "one_ms": one * 1e3}
        print(f"  prefill {args.prefill_tokens} tokens: base {base * 1e3:.1f}  one adapter {one * 1e3:.1f} "
              f"({one / base:.2f}x)")
        rt = Path(tmp) / "runtime"
        write_adapter(rt, mc, args.rank, seed=1000)
        loads, unloads = [], []
        for r in range(args.rounds):
            t0 = time.perf_counter()
            eng.add_lora("runtime", str(rt))
            t1 = time.perf_counter()
            eng.remove_lora("runtime")
            loads.append(t1 - t0)
            unloads.append(time.perf_counter() - t1)
        step = result["decode"][args.batches[0]]["base_ms"] / 1e3
        load, unload = statistics.median(loads), statistics.median(unloads)
        result["runtime_load"] = {"add_ms": load * 1e3, "remove_ms": unload * 1e3, "per_base_step": load / step}
        print(f"  load at run time: add_lora {load * 1e3:.1f} ms ({load / step:.1f} base decode steps of "
              f"B={args.batches[0]}), remove_lora {unload * 1e3:.2f} ms")
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
