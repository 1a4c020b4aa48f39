"""``pdserve profile``: measure what a serving simulation needs on this machine and write ``profile.json``.

Lifecycle: ``main(argv)`` checks its flags (exit 2, ``error: ...`` naming the flag, nothing written),
then measures, in this order, each part but the first optional:

1. **Engine steps**: one ``LLMEngine`` for the given model and numerics runs real requests (random
   token ids, greedy, ``ignore_eos``); every ``engine.step()`` is timed, and its features are read by
   a wrapper around ``scheduler.schedule`` through ``simulator.costs.step_features`` (the one pricing
   the simulator uses too). The grid: pure decode at batch sizes 1..64 at a short, a medium and a long
   context; one prompt of n tokens for n on a geometric grid up to ``--max-num-batched-tokens``, fresh
   and after a cached prefix (prefix caching turns a second prompt sharing a prefix into a chunk with
   context c > 0); k prompts of T / k tokens in one step (lin(T) at large T apart from one long prompt's
   attention); and mixed steps (a prompt chunk plus B decoding sequences). Each point runs once to
   warm up, then ``--reps`` times; its median is kept. ``fit_step_model`` fits the ``StepModel`` to the
   points by non-negative least squares on relative residuals (``nnls``). The steps that filled the
   decode batches are kept as ``fill`` samples, out of the fit: a check on steps the fit never saw.
2. **KV link** (``--skip-link``): this model's paged KV (its layers, heads, row width and cache dtype)
   sent through kvtransfer's own ``KVEndpoint`` over gloo to a second process on loopback, 64 KB to
   64 MB; ``fit_link`` fits ``LinkModel(latency_s, bytes_per_s)``. NCCL needs two GPUs: not measured
   here, and meta.notes says so.
3. **Router** (``--skip-router``): a colocated worker and a ``RouterServer`` on loopback gRPC in this
   process; TTFT of short prompts minus the engine's own prefill step gives ``router_per_request_s``,
   the mean token gap of one greedy stream minus the engine's own one-sequence decode step, and the same of
   8 streams at once against the engine's 8-sequence step, give the serving path's cost of a step that streams
   (``router_per_step_s``) and of each token it streams (``router_per_token_s``): excess = per_step +
   per_token x streams (all clamped at 0; the raw numbers stay in meta.router).

4. **All-reduce** (``--tensor-parallel-size`` N > 1 only): ``measure_all_reduce`` times the engine's own
   collective (``TPComm.all_reduce``) among N fresh rank processes on loopback, for one step's rows of hidden
   size at the grid's token counts. The steps of (1) already include the all-reduces (every rank runs each
   measured step), so the fit prices them; these samples say how much of a step they are. At N > 1 the router
   and co-run parts are not measured (the serving path's cost is the host's, not the TP's: ``pdserve
   simulate``/``plan`` take it from the TP 1 profile given beside it, ``simulator.costs.ProfileSet``), and the
   profile records one rank's KV bytes per token and its weights' bytes (``--rank-memory-bytes`` pricing).

5. **Co-running** (``--skip-corun``; CPU only): simulator/corun.py times a few decode and prefill steps
   alone and again beside ``--corun-siblings`` busy processes running the same engine on this host's other
   cores, and fits ``CorunModel`` (the extra per busy sibling: a constant plus a share of the solo time), which
   prices deployments of several workers per host (``pdserve simulate --workers-per-host``).

Then it writes ``--out`` through a temporary file and a rename (never half a profile) and prints a
summary. Every measured sample, the fit's errors and where it ran (commit, torch, CPU and its flags,
device, date, command line, wall time) go to ``meta``.
"""
from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional, Sequence

from simulator.costs import LinkModel, Profile
from simulator.fit import _features, choose_knots, fit_errors, fit_link, fit_step_model
from simulator.corun import fit_corun, measure_corun
from simulator.profile_engine import ROUTER_PROMPT_TOKENS, StepProbe, measure_engine
from simulator.serving_costs import measure_all_reduce, measure_link, measure_router

MIB = 1 << 20
RELEVANT_CPU_FLAGS = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                      "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8", "asimd", "sve")
LINK_SIZES = (64 << 10, 256 << 10, 1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB)
LINK_SIZES_QUICK = (64 << 10, 1 * MIB, 64 * MIB)  # the largest well past the fixed cost, even pulled on one host


def _git_commit() -> str:
    try:
        r = subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).resolve().parents[1],
                           capture_output=True, text=True, timeout=10)
        return r.stdout.strip() if r.returncode == 0 and r.stdout.strip() else "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _cpu() -> tuple[str, list[str]]:
    name, flags = platform.processor() or platform.machine(), []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            key, _, val = line.partition(":")
            if key.strip() == "model name" and name in ("", platform.processor() or platform.machine()):
                name = val.strip()
            elif key.strip() in ("flags", "Features") and not flags:
                flags = val.split()
    except OSError:
        pass
    return name, [f for f in RELEVANT_CPU_FLAGS if f in flags]


# -- command line ----------------------------------------------------------------------------------

def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="pdserve profile",
                                description="Measure this machine's engine steps, KV link and router costs for one "
                                            "model configuration and write a profile for `pdserve simulate`.")
    p.add_argument("--model", default="tiny", help="built-in model (tiny, bench) or a Hugging Face model directory")
    p.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16 (default float32)")
    p.add_argument("--quantization", default="none", help="none | int8 | int4 | w8a8 | w4a8 | fp8 (default none)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | int8 | fp8 (default auto)")
    p.add_argument("--device", default="cpu", help="cpu | cuda (default cpu)")
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads of the engine (of each rank with --tensor-parallel-size), as each worker gets "
                        "in a deployment (default 1; nothing pinned)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N",
                   help="ranks of the measured engine (a worker of `pdserve up --tensor-parallel-size N`); take one "
                        "profile per size a deployment may run (default 1)")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048,
                   help="the engine's step budget: the largest prompt chunk measured (default 2048)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="the engine's largest batch (default 64)")
    p.add_argument("--max-model-len", type=int, default=None, help="the engine's context length (default: the model's)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--kv-cache-memory-bytes", type=int, default=256 * MIB,
                   help="KV cache budget when --num-kv-blocks is not given (default 256 MiB)")
    p.add_argument("--num-kv-blocks", type=int, default=None, help="KV blocks (overrides --kv-cache-memory-bytes)")
    p.add_argument("--reps", type=int, default=None, help="measured repetitions per point (default 5; 2 with --quick)")
    p.add_argument("--seed", type=int, default=0, help="seed of the random prompts (default 0)")
    p.add_argument("--skip-link", action="store_true", help="do not measure the KV link (the profile has no links)")
    p.add_argument("--skip-router", action="store_true", help="do not measure the router (its costs stay 0)")
    p.add_argument("--skip-corun", action="store_true",
                   help="do not measure co-running (steps beside busy sibling workers on this host's other cores)")
    p.add_argument("--corun-siblings", type=int, default=1,
                   help="busy sibling workers of the co-run phase (default 1; needs threads x (1 + this) cores)")
    p.add_argument("--quick", action="store_true", help="a coarse grid in a few seconds (tests, smoke checks)")
    p.add_argument("--refit", default=None, metavar="PROFILE",
                   help="measure nothing: fit PROFILE's own samples again with this version's step model, to --out")
    p.add_argument("--out", default="profile.json", help="where to write the profile (default profile.json)")
    return p


def _check(args: argparse.Namespace) -> None:
    """ValueError naming the flag for anything that would fail later; nothing is measured or written yet."""
    from engine.builtin import BUILTIN_NAMES
    from engine.config import parse_dtype
    from engine.quant import KV_CACHE_DTYPES, QUANTIZATIONS

    if args.model not in BUILTIN_NAMES and not (Path(args.model) / "config.json").is_file():
        raise ValueError(f"--model: {args.model!r} is neither a built-in model ({', '.join(BUILTIN_NAMES)}) nor a "
                         "Hugging Face model directory (with config.json)")
    try:
        args.dtype = str(parse_dtype(args.dtype)).removeprefix("torch.")
    except ValueError as e:
        raise ValueError(f"--dtype: {e}") from None
    if args.quantization not in ("none", *QUANTIZATIONS):
        raise ValueError(f"--quantization must be none or one of {', '.join(QUANTIZATIONS)}, got {args.quantization!r}")
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {args.kv_cache_dtype!r}")
    if args.device not in ("cpu", "cuda"):
        raise ValueError(f"--device must be cpu or cuda, got {args.device!r}")
    if args.device == "cuda":
        import torch

        if not torch.cuda.is_available():
            raise ValueError("--device cuda: torch sees no CUDA device here")
    for flag, lo in (("threads", 1), ("tensor_parallel_size", 1), ("max_num_batched_tokens", 2), ("max_num_seqs", 1), ("max_model_len", 3),
                     ("block_size", 1), ("kv_cache_memory_bytes", 1), ("num_kv_blocks", 1), ("reps", 1),
                     ("corun_siblings", 1)):
        v = getattr(args, flag)
        if v is not None and v < lo:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= {lo}, got {v}")
    out = Path(args.out)
    if out.is_dir():
        raise ValueError(f"--out {args.out!r} is a directory")
    parent = out.parent if str(out.parent) else Path(".")
    if not parent.is_dir() or not os.access(parent, os.W_OK | os.X_OK):
        raise ValueError(f"--out {args.out!r}: {str(parent)!r} is not a writable directory")


def save_profile(prof: Profile, path: Path) -> None:
    """Write ``prof`` as ``load_profile`` will read it (a round trip checks it first), through a temporary file
    renamed over ``path``: never half a profile. OSError when it cannot be written."""
    Profile.from_dict(json.loads(json.dumps(prof.to_dict())), where="the new profile")
    _write_atomic(path, prof.to_dict())


def _write_atomic(path: Path, data: dict) -> None:
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent if str(path.parent) else ".")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump(data, fh, indent=1)
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def profile(args: argparse.Namespace, argv: Sequence[str]) -> Profile:
    """Measure and fit (the module docstring); returns the profile, writes nothing."""
    import torch

    from engine.config import EngineConfig
    from engine.kv_cache import bytes_per_block, row_width
    from engine.llm_engine import LLMEngine
    from engine.tensor_parallel import TPLayout
    from simulator import PDSERVE_VERSION

    t_start = time.perf_counter()
    load_start = _loadavg()
    reps = args.reps or (2 if args.quick else 5)
    quant = None if args.quantization == "none" else args.quantization
    cfg = EngineConfig(model=args.model, dtype=args.dtype, device=args.device, block_size=args.block_size,
                       num_kv_blocks=args.num_kv_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                       max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                       max_model_len=args.max_model_len, seed=args.seed, num_threads=args.threads,
                       quantization=quant, kv_cache_dtype=args.kv_cache_dtype,
                       tensor_parallel_size=args.tensor_parallel_size)
    tp = args.tensor_parallel_size
    notes: list[str] = []
    try:
        engine = LLMEngine(cfg)
    except (ValueError, OSError) as e:
        raise ValueError(f"the engine did not start: {e}") from None
    mc, cache_dtype = engine.model_config, cfg.cache_dtype
    kvbpt = bytes_per_block(mc, cfg.block_size, cache_dtype) // cfg.block_size
    rank_mc = TPLayout(mc, tp, 0).local_config() if tp > 1 else mc
    kvbpt_rank = bytes_per_block(rank_mc, cfg.block_size, cache_dtype) // cfg.block_size
    weight_bytes = engine.runner.model.weight_bytes()
    elem = torch.empty((), dtype=cache_dtype).element_size()
    width = row_width(mc, cache_dtype)
    derivation = (f"2 (K,V) x {mc.num_hidden_layers} layers x {mc.num_key_value_heads} KV heads x {width} "
                  f"{'(head_dim + 4 bytes of float32 scale per row) ' if cache_dtype == torch.int8 else ''}"
                  f"x {elem} B ({str(cache_dtype).removeprefix('torch.')}) = {kvbpt} B")
    engine_info = {"max_model_len": engine.max_model_len, "num_kv_blocks": engine.num_total_blocks,
                   "block_size": engine.block_size}
    do_router = not args.skip_router and tp == 1
    stream = (32 if args.quick else 128) if do_router else 0
    try:
        probe = StepProbe(engine, args.device == "cuda", args.seed)
        t0 = time.perf_counter()
        samples, ref = measure_engine(probe, cfg, args.quick, reps, stream)
        fill = probe.fill
        engine_s = time.perf_counter() - t0
    finally:
        engine.close()  # its tensor-parallel ranks end here, whatever happened
    if engine.num_preemptions:
        notes.append(f"{engine.num_preemptions} preemption(s) while measuring steps: the KV cache is tight for the "
                     "grid (give more --kv-cache-memory-bytes)")
    del probe, engine
    gc.collect()
    allreduce: dict = {}
    allreduce_s = 0.0
    if tp > 1:
        t0 = time.perf_counter()
        rows = [n for n in (1, 8, 64, 512, cfg.max_num_batched_tokens) if n <= cfg.max_num_batched_tokens]
        allreduce = measure_all_reduce(tp, mc.hidden_size, sorted(set(rows)), reps, args.threads, args.dtype)
        allreduce_s = time.perf_counter() - t0
        per_layer = {r: 2 * mc.num_hidden_layers * sec for r, sec in zip(allreduce["rows"], allreduce["seconds"])}
        notes.append(f"tensor parallelism {tp}: every measured step includes its 2 all-reduces per layer; alone they "
                     f"take {per_layer[1] * 1e3:.2f} ms a step at 1 row, "
                     f"{per_layer[max(per_layer)] * 1e3:.1f} ms at {max(per_layer)} rows (meta.allreduce)")

    fit_samples = [s for s in samples if s["kind"] != "fill"]
    knots = choose_knots([s["tokens"] for s in fit_samples if s["kind"] in ("decode", "prefill", "prefill_batch")])
    step = fit_step_model([(_features(s), s["seconds"]) for s in fit_samples], knots)
    errors = fit_errors(step, fit_samples + fill)
    notes.extend(noisy_fit_notes(errors))

    links: dict[str, LinkModel] = {}
    link_samples: list[dict] = []
    link_s = 0.0
    if not args.skip_link:
        t0 = time.perf_counter()
        geom = (mc.num_hidden_layers, cfg.block_size, mc.num_key_value_heads, width,
                str(cache_dtype).removeprefix("torch."))
        link_samples = measure_link(geom, kvbpt, LINK_SIZES_QUICK if args.quick else LINK_SIZES, reps, args.threads)
        links["gloo"] = fit_link([s["bytes"] for s in link_samples], [s["seconds"] for s in link_samples])
        for s in link_samples:
            s.update(backend="gloo", predicted_s=links["gloo"].seconds(s["bytes"]))
        paths = sorted({s.get("link", "") for s in link_samples} - {""})
        if paths and paths != ["socket"]:
            notes.append(f"KV link measured between two processes on this host, over {'/'.join(paths)} (shared "
                         "memory): a pool on another host moves KV over the socket, slower (measure it there)")
        if args.device == "cuda":  # a prefill and a decode worker sharing this GPU: CUDA IPC
            try:
                ipc = measure_link(geom, kvbpt, LINK_SIZES_QUICK if args.quick else LINK_SIZES, reps, args.threads,
                                   device="cuda")
                links["cuda_ipc"] = fit_link([s["bytes"] for s in ipc], [s["seconds"] for s in ipc])
                for s in ipc:
                    s.update(backend="cuda_ipc", predicted_s=links["cuda_ipc"].seconds(s["bytes"]))
                link_samples += ipc
                took = sorted({s.get("link", "") for s in ipc} - {""})
                notes.append("cuda_ipc: KV between two processes on this GPU over "
                             + ("CUDA IPC (pdserve simulate/plan --kv-link cuda_ipc: a prefill and a decode worker "
                                "sharing it, --gpus-per-worker 0.5)" if took == ["pull"] else
                                f"{'/'.join(took) or 'nothing'}, not CUDA IPC: the two processes could not map "
                                "each other's memory"))
            except Exception as e:  # noqa: BLE001 - a link we could not measure is a note, not a lost profile
                notes.append(f"cuda_ipc not measured: {type(e).__name__}: {str(e)[:200]}")
        link_s = time.perf_counter() - t0
    if args.device == "cuda" and (torch.cuda.device_count() < 2 or args.skip_link):
        notes.append(f"nccl not measured: NCCL needs two GPUs, this machine has {torch.cuda.device_count()}"
                     if not args.skip_link else "links not measured (--skip-link)")
    elif args.skip_link:
        notes.append("links not measured (--skip-link)")
    elif args.device == "cuda":
        notes.append("nccl not measured: pdserve profile measures gloo and CUDA IPC (one GPU) only")

    router: dict = {}
    router_s = 0.0
    if do_router:
        t0 = time.perf_counter()
        try:
            router = measure_router(cfg, args.model, ref, args.quick, args.seed)
        except Exception as e:
            if args.device != "cuda":
                raise
            notes.append(f"router not measured on cuda: {type(e).__name__}: {e}")
        router_s = time.perf_counter() - t0
    elif tp > 1:
        notes.append(f"router not measured at tensor parallelism {tp}: the serving path's costs are the host's, "
                     "not the TP's; pdserve simulate/plan take them from a TP 1 profile given beside this one")
    else:
        notes.append("router not measured (--skip-router): its costs are 0")
    if router:
        where = ("the worker in its own process on its own core, router and client in this one on another"
                 if router.get("worker_apart") else
                 "router, worker and client in this one process (one GIL: too few cores to run them apart, so these "
                 "are upper bounds)")
        notes.append(f"router costs: prompts of {ROUTER_PROMPT_TOKENS} token ids (no tokenizing) through a colocated "
                     f"worker on loopback gRPC, {where}; the pair path's TTFT with all three in this process")

    corun: dict = {}
    corun_s = 0.0
    corun_model = None
    if args.skip_corun:
        notes.append("co-running not measured (--skip-corun): a simulation with several workers per host prices "
                     "no contention")
    elif tp > 1:
        notes.append(f"co-running not measured at tensor parallelism {tp} (a worker's ranks already share the host)")
    elif args.device != "cpu":
        notes.append("co-running not measured: measured on CPU workers only (one GPU per worker shares no memory bus)")
    else:
        t0 = time.perf_counter()
        corun = measure_corun(cfg, args.quick, reps, args.corun_siblings)
        corun_s = time.perf_counter() - t0
        if "skipped" in corun:
            notes.append(f"co-running not measured: {corun['skipped']}")
        else:
            corun_model = fit_corun(corun["samples"], corun["siblings"])

    cpu_name, cpu_flags = _cpu()
    meta = {
        "pdserve_version": PDSERVE_VERSION, "pdserve_commit": _git_commit(), "torch_version": torch.__version__,
        "python_version": platform.python_version(), "cpu_model": cpu_name, "cpu_flags": cpu_flags,
        "cpu_count": os.cpu_count(), "threads": args.threads,
        "device_name": torch.cuda.get_device_name() if args.device == "cuda" else cpu_name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": shlex.join(["pdserve", "profile", *argv]),
        "wall_s": round(time.perf_counter() - t_start, 3),
        "loadavg": {"start": load_start, "end": _loadavg()},
        "phase_s": {"engine": round(engine_s, 3), "link": round(link_s, 3), "router": round(router_s, 3),
                    "corun": round(corun_s, 3), "allreduce": round(allreduce_s, 3)},
        "tensor_parallel_size": tp, "allreduce": allreduce,
        "kv_bytes_per_token_derivation": derivation,
        "engine": {**engine_info, "max_num_batched_tokens": cfg.max_num_batched_tokens,
                   "max_num_seqs": cfg.max_num_seqs, "kv_cache_memory_bytes": cfg.kv_cache_memory_bytes,
                   "cpu_gemm": cfg.cpu_gemm, "reps": reps, "quick": args.quick},
        "fit": {"method": "non-negative least squares (Lawson-Hanson) on relative residuals", "errors": errors},
        "notes": notes, "samples": samples + fill, "link_samples": link_samples, "router": router,
        "corun": corun,
    }
    return Profile(model=args.model, dtype=args.dtype, quantization=quant, kv_cache_dtype=args.kv_cache_dtype,
                   device=args.device, threads=args.threads, block_size=cfg.block_size,
                   num_layers=mc.num_hidden_layers, kv_bytes_per_token=kvbpt,
                   max_model_len=engine_info["max_model_len"],
                   step=step, links=links, router_per_request_s=max(0.0, router.get("per_request_raw_s", 0.0)),
                   router_per_token_s=max(0.0, router.get("per_token_raw_s", 0.0)),
                   router_per_step_s=max(0.0, router.get("per_step_raw_s", 0.0)),
                   router_cpu_per_token_s=max(0.0, router.get("cpu_per_token_s", 0.0)),
                   router_per_request_pair_s=max(0.0, router.get("per_request_pair_raw_s",
                                                                 router.get("per_request_raw_s", 0.0))),
                   corun=corun_model, meta=meta, tensor_parallel_size=tp,
                   kv_bytes_per_token_rank=kvbpt_rank if tp > 1 else None, weight_bytes_per_rank=weight_bytes)


def summary(p: Profile, out: str) -> str:
    """The few lines ``pdserve profile`` prints: fitted numbers, fit errors, link, router, wall time."""
    s, m = p.step, p.meta
    errors = ", ".join(f"{k} median {v['median_rel_err']:.1%} max {v['max_rel_err']:.1%} (n={v['n']})"
                       for k, v in m["fit"]["errors"].items())
    tp = f", tensor parallel {p.tensor_parallel_size}" if p.tensor_parallel_size > 1 else ""
    lines = [f"pdserve profile: {p.model} {p.dtype} quantization={p.quantization} kv={p.kv_cache_dtype} on "
             f"{p.device} ({m['device_name']}, {p.threads} thread(s){tp}) in {m['wall_s']:.1f} s -> {out}",
             "  step lin(T): " + ", ".join(f"T={k}: {v * 1e3:.3f} ms" for k, v in zip(s.knots, s.knot_s)),
             f"  per sampled row {s.per_sampled_row_s * 1e6:.2f} us, per prefill pair "
             f"{s.per_prefill_pair_s * 1e9:.3f} ns, per decode ctx token {s.per_decode_ctx_s * 1e9:.2f} ns, "
             f"per prefill ctx key {s.per_prefill_ctx_s * 1e9:.1f} ns, per prefill chunk "
             f"{s.per_prefill_chunk_s * 1e6:.1f} us, per cached-context pair {s.per_prefill_cached_pair_s * 1e9:.3f} ns",
             f"  fit |pred/meas - 1|: {errors}"]
    for name, link in p.links.items():
        lines.append(f"  KV link {name}: latency {link.latency_s * 1e3:.3f} ms, "
                     f"{link.bytes_per_s / (1 << 30):.2f} GiB/s ({p.kv_bytes_per_token} B/token)")
    r = m.get("router") or {}
    if r:
        lines.append(f"  router: per request {p.router_per_request_s * 1e3:.3f} ms (TTFT {r['ttft_s'] * 1e3:.2f} - "
                     f"engine {r['engine_prefill_s'] * 1e3:.2f}), per streaming step {p.router_per_step_s * 1e6:.1f} us "
                     f"+ per token {p.router_per_token_s * 1e6:.1f} us (gap {r['token_gap_s'] * 1e3:.3f} - engine "
                     f"{r['engine_decode_s'] * 1e3:.3f} ms at 1 stream, "
                     f"{r.get('token_gap_batch_s', 0) * 1e3:.3f} - {r.get('engine_decode_batch_s', 0) * 1e3:.3f} ms at "
                     f"{r.get('batch', 0)}); its CPU (with the client) {p.router_cpu_per_token_s * 1e6:.1f} us per token")
    ar = m.get("allreduce") or {}
    if ar:
        lines.append(f"  all-reduce among {p.tensor_parallel_size} ranks (hidden {ar['width']}): "
                     + ", ".join(f"{r} row(s) {sec * 1e3:.3f} ms" for r, sec in zip(ar["rows"], ar["seconds"])))
    if p.weight_bytes_per_rank is not None:
        lines.append(f"  memory per rank: weights {p.weight_bytes_per_rank / MIB:.1f} MiB, KV "
                     f"{p.rank_kv_bytes_per_token} B/token")
    if p.corun is not None:
        c = p.corun
        lines.append(f"  co-run: per busy sibling a step takes {c.const_s * 1e3:.2f} ms + {c.ratio:.1%} longer ("
                     + ", ".join(f"{x['kind']} {x['size']}: {x['solo_s'] * 1e3:.1f} -> {x['corun_s'] * 1e3:.1f} ms"
                                 for x in (m.get("corun") or {}).get("samples", [])) + ")")
    lines += [f"  note: {n}" for n in m["notes"]]
    return "\n".join(lines)


def refit(prof: Profile, where: str = "--refit") -> Profile:
    """The same profile with its step model fitted again from its own samples (``meta.samples``) by this version's
    model and fit: how a profile taken before a fix of the fit or a new term is brought up to date without
    measuring again (the samples carry every feature by name; a feature they lack reads as 0)."""
    samples = list(prof.meta.get("samples") or [])
    fit_samples = [s for s in samples if s.get("kind") != "fill"]
    if len(fit_samples) < 2:
        raise ValueError(f"{where}: the profile carries no step samples to fit")
    knots = choose_knots([s["tokens"] for s in fit_samples if s["kind"] in ("decode", "prefill", "prefill_batch")])
    prof.step = fit_step_model([(_features(s), s["seconds"]) for s in fit_samples], knots)
    fit = dict(prof.meta.get("fit") or {})
    fit["errors"] = fit_errors(prof.step, samples)
    prof.meta["notes"] = ([n for n in prof.meta.get("notes") or [] if not n.startswith("noisy fit")]
                          + noisy_fit_notes(fit["errors"]))
    fit["refit"] = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    "pdserve_commit": _git_commit()}
    prof.meta["fit"] = fit
    return prof


NOISY_FIT_MEDIAN = 0.05
"""A step kind whose fit's median error is above this was most likely measured beside other work: on the idle CPU
host every kind with ``NOISY_FIT_MIN_SAMPLES`` or more samples fitted within 1-3.2% median (two profiles of 26 Nov;
docs/benchmarks.md), while one taken beside another job fitted decode at 6.6% and over-predicted TPOT by 17%."""
NOISY_FIT_MIN_SAMPLES = 5
"""Kinds with fewer samples (``mixed``: 3 on CPU) are not judged: one slow sample moves their median."""


def noisy_fit_notes(errors: dict[str, dict[str, float]]) -> list[str]:
    """Notes (for ``meta.notes`` and the summary) naming each measured step kind whose fit is noisy: its median
    error above ``NOISY_FIT_MEDIAN`` over at least ``NOISY_FIT_MIN_SAMPLES`` samples. ``fill`` (steps measured after
    the fit as a check) is not a fit, so it is left to the summary's own line."""
    noisy = sorted(k for k, e in errors.items()
                   if k not in ("all", "fill") and e.get("n", 0) >= NOISY_FIT_MIN_SAMPLES
                   and e.get("median_rel_err", 0.0) > NOISY_FIT_MEDIAN)
    if not noisy:
        return []
    what = ", ".join(f"{k} {errors[k]['median_rel_err']:.1%}" for k in noisy)
    return [f"noisy fit: median error {what} (above {NOISY_FIT_MEDIAN:.0%}): the host was probably busy while "
            "measuring, or the step model misses a cost of this device; retake the profile on an idle host, and if "
            "the error stays, read the simulator's predictions with it"]


def _loadavg() -> Optional[list[float]]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``pdserve profile ...``: 0 when the profile is written, 2 for bad input (nothing written), 1 if a part failed."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, or argparse's own usage error (it names the flag)
        return int(e.code or 0)
    try:
        if args.refit:
            from simulator.costs import load_profile

            prof = refit(load_profile(args.refit))
        else:
            _check(args)
            prof = profile(args, argv)
    except ValueError as e:
        print(f"pdserve profile: error: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # a part that could not run here: say which and why, write nothing
        print(f"pdserve profile: failed: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    try:
        save_profile(prof, Path(args.out))
    except OSError as e:
        print(f"pdserve profile: error: --out {args.out!r}: {e}", file=sys.stderr)
        return 2
    print(summary(prof, args.out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
