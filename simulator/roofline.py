"""``pdserve roofline``: a profile from a model's shape and a device's datasheet, for planning on hardware you do
not have (or an engine pdserve does not have yet).

Lifecycle: ``main(argv)`` checks its flags (exit 2 naming the flag, nothing written), reads the model's shape (a
built-in model, a Hugging Face directory's ``config.json``, or one of ``SHAPES``), takes the device from
``HARDWARE`` (datasheet numbers, each with its source) or from ``--peak-tflops`` / ``--memory-gbps`` /
``--interconnect-gbps`` / ``--memory-gib``, computes a ``simulator.costs.Profile`` with ``roofline_profile`` and
writes it like ``pdserve profile`` does (temporary file and rename). ``pdserve simulate`` and ``pdserve plan``
read it as they read a measured one; its ``meta.synthetic`` says it is not one, and every parameter it was made
from is in ``meta.roofline``.

The model (one step of one rank; Williams et al.'s roofline, as LLM-Viewer and the inference literature use it):

    lin(T) = max(W' / (B x mbu), 2 x P x T / (F x mfu)) + L x 2 x allreduce(T) + step_overhead
    per_sampled_row_s = 2 x hidden x vocab / (F_dtype x mfu)      the LM head's rows (its bytes are in W)
    per_decode_ctx_s = per_prefill_ctx_s = kv_bytes_per_token / (B x mbu)   every context key read once
    per_prefill_pair_s = 4 x heads x head_dim x L / (F_attn x attention_mfu)  QK^T and PV, 2 FLOPs a MAC
    per_prefill_chunk_s = chunk_overhead                            an attention call's fixed cost

with W' the rank's weight bytes a step reads (layers and LM head; the embedding only where the LM head shares it,
a step gathering just its rows otherwise; quantization scales not counted), P its linear
layers' parameters (the LM head apart), F the device's dense peak for the layers' arithmetic (bfloat16, or int8 /
fp8 where the weights and activations are), F_attn = F_dtype the model dtype's peak, B the memory bandwidth, L the layers,
and allreduce(T) = 20 us + 2 (N - 1) / N x T x hidden x dtype bytes / (interconnect x link_efficiency) at
tensor parallelism N (0 at N = 1), two per layer. A step's memory time and compute time do not add: the larger
one is the step (the kernels overlap loads with math). What a real engine adds, launches, the sampler, Python,
is ``step_overhead`` (per step) and ``chunk_overhead`` (per prefill chunk). The KV links: ``cuda_ipc`` and
``nccl`` at the interconnect's bandwidth (NVLink or PCIe, one direction) x ``link_efficiency`` and 30 us.

So the profile prices an engine that streams the weights and the context at ``mbu`` of the bandwidth and runs
its matrix products at ``mfu`` of the peak: the defaults (0.8, 0.5) are what a CUDA-graph engine with
FlashAttention-class kernels reaches on Hopper (gpt-fast streams ~82% of bandwidth; issue 43's prefill goal is
50% MFU), not what pdserve's CUDA engine measures today (docs/capacity.md, "If the engine ran at the roofline",
and ``benchmarks/roofline_check.py``, which sets a measured profile against this model).
"""
from __future__ import annotations

import argparse
import datetime
import math
import shlex
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from simulator.costs import LinkModel, Profile, StepModel, load_profile

GB = 1e9
TFLOP = 1e12

ALLREDUCE_LATENCY_S = 20e-6
"""Fixed cost of one all-reduce of a decode step's rows (NCCL over NVLink: tens of microseconds)."""
LINK_LATENCY_S = 30e-6
"""Fixed cost of one KV hand-off over ``cuda_ipc`` or ``nccl`` (a handle or a kernel launch, an event)."""
KNOTS = tuple(2 ** i for i in range(16))
"""Token counts where lin(T) is evaluated (1 .. 32768): the simulator interpolates between them."""


@dataclass(frozen=True)
class Hardware:
    """One accelerator's datasheet: dense peaks (no sparsity), memory, the link between devices of one node."""

    name: str
    flops: dict[str, float]
    """Dense peak FLOP/s by arithmetic: 'float32', 'bfloat16', 'float16', and 'fp8' / 'int8' where it has them."""
    memory_bytes_per_s: float
    memory_bytes: float
    interconnect_bytes_per_s: float
    """One direction, one device: NVLink's total / 2, or the PCIe link."""
    source: str = ""


HARDWARE: dict[str, Hardware] = {
    "h100-sxm": Hardware(
        "NVIDIA H100 SXM", {"float32": 67 * TFLOP, "bfloat16": 989.4 * TFLOP, "float16": 989.4 * TFLOP,
                            "fp8": 1978.9 * TFLOP, "int8": 1978.9 * TFLOP},
        3.35e12, 80 * GB, 450 * GB, "NVIDIA H100 Tensor Core GPU datasheet (SXM column; dense = half the sparse "
                                    "figures); NVLink 900 GB/s total"),
    "h200": Hardware(
        "NVIDIA H200 SXM", {"float32": 67 * TFLOP, "bfloat16": 989.4 * TFLOP, "float16": 989.4 * TFLOP,
                            "fp8": 1978.9 * TFLOP, "int8": 1978.9 * TFLOP},
        4.8e12, 141 * GB, 450 * GB, "NVIDIA H200 Tensor Core GPU datasheet (SXM column; dense = half the sparse "
                                    "figures); NVLink 900 GB/s total"),
    "a100-80gb": Hardware(
        "NVIDIA A100 80GB SXM", {"float32": 19.5 * TFLOP, "bfloat16": 312 * TFLOP, "float16": 312 * TFLOP,
                                 "int8": 624 * TFLOP},
        2.039e12, 80 * GB, 300 * GB, "NVIDIA A100 Tensor Core GPU datasheet (80GB SXM column, dense); NVLink "
                                     "600 GB/s total; no FP8"),
    "l40s": Hardware(
        "NVIDIA L40S", {"float32": 91.6 * TFLOP, "bfloat16": 362.05 * TFLOP, "float16": 362.05 * TFLOP,
                        "fp8": 733 * TFLOP, "int8": 733 * TFLOP},
        0.864e12, 48 * GB, 32 * GB, "NVIDIA L40S datasheet (dense); PCIe Gen4 x16, 64 GB/s both ways, no NVLink"),
}
"""Datasheet numbers (dense tensor-core peaks, HBM or GDDR bandwidth). ``--hardware custom`` takes them from flags."""

SHAPES: dict[str, dict[str, Any]] = {
    # config.json fields of the public checkpoints (decoder shape only; the simulator never needs the weights)
    "llama-3.2-1b": dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=64, intermediate_size=8192, vocab_size=128256, tie_word_embeddings=True,
                         max_position_embeddings=131072),
    "llama-3.1-8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                         head_dim=128, intermediate_size=14336, vocab_size=128256, tie_word_embeddings=False,
                         max_position_embeddings=131072),
    "llama-3.1-70b": dict(hidden_size=8192, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                          head_dim=128, intermediate_size=28672, vocab_size=128256, tie_word_embeddings=False,
                          max_position_embeddings=131072),
}
# the random-weight checkpoints of benchmarks/cuda_engine.py (pdserve's GPU benchmarks and the H200 profiles in
# docs/profiles/): the same decoders with the built-in tokenizer's 8,192-token vocabulary
SHAPES["cuda-bench-1b"] = {**SHAPES["llama-3.2-1b"], "vocab_size": 8192, "tie_word_embeddings": False,
                           "max_position_embeddings": 16384}
SHAPES["cuda-bench-8b"] = {**SHAPES["llama-3.1-8b"], "vocab_size": 8192, "max_position_embeddings": 16384}
"""Named model shapes (meta-llama's config.json values) for planning without the checkpoint."""

WEIGHT_BYTES = {"int8": 1.0, "w8a8": 1.0, "fp8": 1.0, "int4": 0.5, "w4a8": 0.5}
"""Bytes per linear-layer weight of each quantization (scales not counted)."""
MATH = {"w8a8": "int8", "w4a8": "int8", "fp8": "fp8"}
"""The arithmetic a quantization's matrix products run in (weight-only formats run in the model dtype)."""


@dataclass(frozen=True)
class Efficiency:
    """What share of the datasheet an engine reaches, and what it adds (see the module docstring)."""

    mbu: float = 0.8
    """Share of the memory bandwidth the weights and the KV stream at."""
    mfu: float = 0.5
    """Share of the peak the linear layers run at (large steps)."""
    attention_mfu: float = 0.5
    """Share of the peak prefill attention runs at."""
    step_overhead_s: float = 300e-6
    """Per step: launches (one graph replay), the sampler, the scheduler's host work not overlapped."""
    chunk_overhead_s: float = 20e-6
    """Per prefill chunk in a step: its attention call and metadata."""
    link_efficiency: float = 0.8
    """Share of the interconnect a KV hand-off or an all-reduce reaches."""

    def check(self) -> None:
        for name in ("mbu", "mfu", "attention_mfu", "link_efficiency"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and 0 < v <= 1):
                raise ValueError(f"--{name.replace('_', '-')} must be in (0, 1], got {v!r}")
        for name in ("step_overhead_s", "chunk_overhead_s"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and math.isfinite(v) and v >= 0):
                raise ValueError(f"--{name.replace('_s', '_ms').replace('_', '-')} must be >= 0, got {v!r}")


@dataclass
class RankShape:
    """One rank's share of the model, in the numbers the roofline needs."""

    weight_bytes: float
    step_bytes: float
    """What a step reads of them: all but the embedding table (a step gathers its T rows; tied, the LM head reads
    it whole anyway)."""
    linear_params: float
    """The decoder layers' linear parameters (q, k, v, o, gate, up, down): 2 FLOPs each per token."""
    head_rows: int
    """LM head rows on this rank."""
    kv_bytes_per_token: int
    heads: int
    parts: dict[str, float] = field(default_factory=dict)
    """Weight bytes by part (embedding, layers, lm_head): the summary's breakdown."""


def model_config_of(model: str, dtype: str) -> Any:
    """The ``ModelConfig`` of a named shape (``SHAPES``), a built-in model or a Hugging Face directory."""
    from engine.config import EngineConfig, ModelConfig
    from engine.loader import load_model_config

    if model in SHAPES:
        return ModelConfig(architecture="LlamaForCausalLM", dtype=dtype, **SHAPES[model])
    return load_model_config(EngineConfig(model=model, dtype=dtype))


def cache_dtype_of(dtype: str, kv_cache_dtype: str) -> Any:
    import torch

    from engine.config import parse_dtype

    if kv_cache_dtype == "auto":
        return parse_dtype(dtype)
    return {"int8": torch.int8, "fp8": torch.float8_e4m3fn}[kv_cache_dtype]


def rank_shape(mc: Any, tp: int, dtype: str, quantization: Optional[str], kv_cache_dtype: str,
               block_size: int) -> RankShape:
    """Rank 0's shard at tensor parallelism ``tp`` (``engine.tensor_parallel.TPLayout``: its checks on heads and
    sizes are the engine's), with its bytes in these numerics."""
    from engine.config import parse_dtype
    from engine.kv_cache import bytes_per_block
    from engine.tensor_parallel import TPLayout, check_tensor_parallel

    # the engine's checks of the model's split (heads, KV heads, MLP columns, int4 groups); the device and this
    # machine's cores are not the planned deployment's, so they are not checked here
    check_tensor_parallel(mc, tp, quantization=quantization, flag="--tensor-parallel-size", cpus=tp)
    local = TPLayout(mc, tp, 0).local_config() if tp > 1 else mc
    elem = parse_dtype(dtype).itemsize
    wq = WEIGHT_BYTES.get(quantization, elem) if quantization else elem
    h, d = local.hidden_size, local.head_dim
    per_layer = (h * d * (local.num_attention_heads + 2 * local.num_key_value_heads)
                 + local.num_attention_heads * d * h + 3 * h * local.intermediate_size)
    linear = local.num_hidden_layers * per_layer
    embed = local.vocab_size * h * elem
    head = 0 if local.tie_word_embeddings else local.vocab_size * h * elem
    norms = (2 * local.num_hidden_layers + 1) * h * elem
    parts = {"embedding": embed, "layers": linear * wq + norms, "lm_head": head}
    kvbpt = bytes_per_block(local, block_size, cache_dtype_of(dtype, kv_cache_dtype)) // block_size
    step_bytes = sum(parts.values()) - (0 if local.tie_word_embeddings else embed)
    return RankShape(weight_bytes=sum(parts.values()), step_bytes=step_bytes, linear_params=linear,
                     head_rows=local.vocab_size,
                     kv_bytes_per_token=kvbpt, heads=local.num_attention_heads, parts=parts)


def roofline_profile(mc: Any, hw: Hardware, *, model: str, dtype: str = "bfloat16",
                     quantization: Optional[str] = None, kv_cache_dtype: str = "auto", tensor_parallel_size: int = 1,
                     eff: Efficiency = Efficiency(), block_size: int = 16, max_model_len: Optional[int] = None,
                     router_from: Optional[Profile] = None) -> Profile:
    """The roofline ``Profile`` of ``mc`` on ``hw`` (module docstring). ValueError naming the flag when the
    device lacks the arithmetic, or one rank's weights do not fit its memory."""
    from engine.config import parse_dtype

    eff.check()
    tp = tensor_parallel_size
    math_dtype = MATH.get(quantization or "", dtype)
    if math_dtype not in hw.flops:
        raise ValueError(f"--quantization {quantization}: {hw.name} has no {math_dtype} arithmetic "
                         f"(it has {', '.join(sorted(hw.flops))})")
    if dtype not in hw.flops:
        raise ValueError(f"--dtype {dtype}: {hw.name} lists no {dtype} peak")
    if kv_cache_dtype == "fp8" and "fp8" not in hw.flops:
        raise ValueError(f"--kv-cache-dtype fp8: {hw.name} has no FP8 support")
    shape = rank_shape(mc, tp, dtype, quantization, kv_cache_dtype, block_size)
    if shape.weight_bytes >= hw.memory_bytes:
        raise ValueError(f"the weights of one rank ({shape.weight_bytes / GB:.1f} GB at --tensor-parallel-size {tp}) "
                         f"do not fit {hw.name}'s {hw.memory_bytes / GB:.0f} GB; raise --tensor-parallel-size or "
                         "quantize")
    bw = hw.memory_bytes_per_s * eff.mbu
    flops = hw.flops[math_dtype] * eff.mfu
    attn_flops = hw.flops[dtype] * eff.attention_mfu
    head_flops = hw.flops[dtype] * eff.mfu  # the LM head stays in the model dtype under every quantization
    link_bw = hw.interconnect_bytes_per_s * eff.link_efficiency
    elem = parse_dtype(dtype).itemsize

    def allreduce(tokens: int) -> float:
        if tp == 1:
            return 0.0
        return ALLREDUCE_LATENCY_S + 2 * (tp - 1) / tp * tokens * mc.hidden_size * elem / link_bw

    knot_s = [max(shape.step_bytes / bw, 2 * shape.linear_params * t / flops)
              + mc.num_hidden_layers * 2 * allreduce(t) + eff.step_overhead_s for t in KNOTS]
    step = StepModel(knots=list(KNOTS), knot_s=knot_s,
                     per_sampled_row_s=2 * mc.hidden_size * shape.head_rows / head_flops,
                     per_prefill_pair_s=4 * shape.heads * mc.head_dim * mc.num_hidden_layers / attn_flops,
                     per_decode_ctx_s=shape.kv_bytes_per_token / bw,
                     per_prefill_ctx_s=shape.kv_bytes_per_token / bw,
                     per_prefill_chunk_s=eff.chunk_overhead_s)
    full = rank_shape(mc, 1, dtype, quantization, kv_cache_dtype, block_size) if tp > 1 else shape
    links = {name: LinkModel(LINK_LATENCY_S, link_bw) for name in ("cuda_ipc", "nccl")}
    from simulator import PDSERVE_VERSION
    from simulator.profile import _git_commit

    meta = {
        "synthetic": "roofline", "pdserve_version": PDSERVE_VERSION, "pdserve_commit": _git_commit(),
        "roofline": {"hardware": asdict(hw), "efficiency": asdict(eff), "math_dtype": math_dtype,
                     "weight_bytes_per_rank": shape.weight_bytes, "weight_parts": shape.parts,
                     "linear_params_per_rank": shape.linear_params, "allreduce_latency_s": ALLREDUCE_LATENCY_S,
                     "link_latency_s": LINK_LATENCY_S},
        "device_name": hw.name,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "notes": [f"synthetic: a roofline of {model} on {hw.name} (mbu {eff.mbu}, mfu {eff.mfu}, attention mfu "
                  f"{eff.attention_mfu}, {eff.step_overhead_s * 1e3:g} ms a step), not a measurement",
                  "router costs from " + (router_from.meta.get("command", "a measured profile") if router_from
                                          else "nowhere: 0 (pass --router-from a measured profile)")],
    }
    return Profile(**(router_from.serving_costs() if router_from else {}),
                   model=model, dtype=dtype, quantization=quantization, kv_cache_dtype=kv_cache_dtype,
                   device="cuda" if hw.name.startswith("NVIDIA") else "custom", threads=None, block_size=block_size,
                   num_layers=mc.num_hidden_layers, kv_bytes_per_token=full.kv_bytes_per_token,
                   max_model_len=int(max_model_len or mc.max_position_embeddings), step=step, links=links,
                   meta=meta, tensor_parallel_size=tp,
                   kv_bytes_per_token_rank=shape.kv_bytes_per_token if tp > 1 else None,
                   weight_bytes_per_rank=int(shape.weight_bytes))


def hardware_from_args(args: argparse.Namespace) -> Hardware:
    """``--hardware`` with any of the datasheet flags overriding it; ``custom`` needs them all."""
    overrides = {"peak_tflops": args.peak_tflops, "memory_gbps": args.memory_gbps,
                 "interconnect_gbps": args.interconnect_gbps, "memory_gib": args.memory_gib}
    for name, v in overrides.items():
        if v is not None and not (math.isfinite(v) and v > 0):
            raise ValueError(f"--{name.replace('_', '-')} must be > 0, got {v}")
    if args.hardware == "custom":
        missing = [f"--{k.replace('_', '-')}" for k, v in overrides.items() if v is None]
        if missing:
            raise ValueError(f"--hardware custom needs {', '.join(missing)}")
        return Hardware("custom", {args.dtype: args.peak_tflops * TFLOP}, args.memory_gbps * GB,
                        args.memory_gib * (1 << 30), args.interconnect_gbps * GB, "flags")
    if args.hardware not in HARDWARE:
        raise ValueError(f"--hardware must be one of {', '.join(sorted(HARDWARE))} or custom, got {args.hardware!r}")
    hw = HARDWARE[args.hardware]
    flops = dict(hw.flops)
    if args.peak_tflops is not None:
        flops = {k: args.peak_tflops * TFLOP * v / hw.flops.get(args.dtype, v) for k, v in flops.items()}
    return Hardware(hw.name, flops,
                    hw.memory_bytes_per_s if args.memory_gbps is None else args.memory_gbps * GB,
                    hw.memory_bytes if args.memory_gib is None else args.memory_gib * (1 << 30),
                    hw.interconnect_bytes_per_s if args.interconnect_gbps is None else args.interconnect_gbps * GB,
                    hw.source + ("; overridden by flags" if any(v is not None for v in overrides.values()) else ""))


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="pdserve roofline",
        description="Write a profile for `pdserve simulate` / `pdserve plan` from a model's shape and a device's "
                    "datasheet (a roofline: weights and KV streamed at --mbu of the bandwidth, matrix products at "
                    "--mfu of the peak, plus fixed per-step costs), for hardware or an engine you cannot measure.")
    p.add_argument("--model", required=True,
                   help=f"a named shape ({', '.join(SHAPES)}), a built-in model (tiny, bench) or a Hugging Face "
                        "model directory (only config.json is read)")
    p.add_argument("--hardware", required=True, help=f"{', '.join(HARDWARE)} or custom")
    p.add_argument("--dtype", default="bfloat16", help="bfloat16 | float16 | float32 (default bfloat16)")
    p.add_argument("--quantization", default="none", help="none | int8 | int4 | w8a8 | w4a8 | fp8 (default none)")
    p.add_argument("--kv-cache-dtype", default="auto", help="auto | int8 | fp8 (default auto)")
    p.add_argument("--tensor-parallel-size", type=int, default=1, metavar="N", help="ranks of a worker (default 1)")
    p.add_argument("--mbu", type=float, default=Efficiency.mbu, help="share of memory bandwidth (default 0.8)")
    p.add_argument("--mfu", type=float, default=Efficiency.mfu, help="share of peak FLOP/s, linears (default 0.5)")
    p.add_argument("--attention-mfu", type=float, default=Efficiency.attention_mfu,
                   help="share of peak FLOP/s, prefill attention (default 0.5)")
    p.add_argument("--step-overhead-ms", type=float, default=Efficiency.step_overhead_s * 1e3,
                   help="fixed host and launch cost of a step (default 0.3)")
    p.add_argument("--chunk-overhead-ms", type=float, default=Efficiency.chunk_overhead_s * 1e3,
                   help="fixed cost of each prefill chunk in a step (default 0.02)")
    p.add_argument("--link-efficiency", type=float, default=Efficiency.link_efficiency,
                   help="share of the interconnect for KV hand-offs and all-reduces (default 0.8)")
    p.add_argument("--peak-tflops", type=float, default=None,
                   help="dense peak TFLOP/s in --dtype (custom; else scales the preset's peaks)")
    p.add_argument("--memory-gbps", type=float, default=None, help="memory bandwidth, GB/s")
    p.add_argument("--interconnect-gbps", type=float, default=None, help="device-to-device, one direction, GB/s")
    p.add_argument("--memory-gib", type=float, default=None, help="device memory, GiB")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    p.add_argument("--router-from", default=None, metavar="PROFILE",
                   help="take the serving path's costs (router_*) from this measured profile (default: 0)")
    p.add_argument("--out", default="profile.json", help="where to write the profile (default profile.json)")
    return p


def _check(args: argparse.Namespace) -> None:
    from engine.config import KV_CACHE_DTYPES, QUANTIZATIONS

    if args.dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"--dtype must be bfloat16, float16 or float32, got {args.dtype!r}")
    if args.quantization not in ("none", *QUANTIZATIONS):
        raise ValueError(f"--quantization must be none or one of {', '.join(QUANTIZATIONS)}, got {args.quantization!r}")
    if args.kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(f"--kv-cache-dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {args.kv_cache_dtype!r}")
    for name in ("tensor_parallel_size", "block_size"):
        if getattr(args, name) < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_model_len is not None and args.max_model_len < 1:
        raise ValueError(f"--max-model-len must be >= 1, got {args.max_model_len}")


def summary(p: Profile, out: str) -> str:
    """What the profile says a step costs, in the units a reader checks against a benchmark."""
    r = p.meta["roofline"]
    hw, s = r["hardware"], p.step
    peak = hw["flops"][r["math_dtype"]]

    def dec(b: int, ctx: int) -> float:
        return (s.lin(b) + s.per_sampled_row_s * b + s.per_decode_ctx_s * b * ctx) * 1e3

    t2k = s.lin(2048) + s.per_sampled_row_s + s.per_prefill_pair_s * 2048 * 2049 / 2 + s.per_prefill_ctx_s * 2048 \
        + s.per_prefill_chunk_s
    useful = 2 * r["linear_params_per_rank"] * 2048
    lines = [f"wrote {out}: a roofline of {p.model} ({p.dtype}, quantization {p.quantization or 'none'}, KV "
             f"{p.kv_cache_dtype}, TP {p.tensor_parallel_size}) on {hw['name']}; synthetic, not measured",
             f"  weights per rank {p.weight_bytes_per_rank / GB:.2f} GB; KV {p.rank_kv_bytes_per_token} B/token a rank",
             f"  decode step, 1K context: batch 1 {dec(1, 1024):.2f} ms, 64 {dec(64, 1024):.2f} ms, "
             f"256 {dec(256, 1024):.2f} ms",
             f"  prefill 2048 tokens: {t2k * 1e3:.2f} ms, {useful / t2k / peak:.0%} of the peak in the linear layers",
             f"  KV hand-off (cuda_ipc/nccl): {p.links['cuda_ipc'].bytes_per_s / GB:.0f} GB/s; memory left for KV "
             f"at 90% use: {(0.9 * hw['memory_bytes'] - p.weight_bytes_per_rank) / GB:.1f} GB a rank "
             f"(`--rank-memory-bytes {int(0.9 * hw['memory_bytes'])}`)"]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """``pdserve roofline ...``: 0 when the profile is written, 2 for bad input (nothing written)."""
    from simulator.profile import save_profile

    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return int(e.code or 0)
    try:
        _check(args)
        hw = hardware_from_args(args)
        eff = Efficiency(args.mbu, args.mfu, args.attention_mfu, args.step_overhead_ms / 1e3,
                         args.chunk_overhead_ms / 1e3, args.link_efficiency)
        router = load_profile(args.router_from) if args.router_from else None
        mc = model_config_of(args.model, args.dtype)
        prof = roofline_profile(mc, hw, model=args.model, dtype=args.dtype,
                                quantization=None if args.quantization == "none" else args.quantization,
                                kv_cache_dtype=args.kv_cache_dtype, tensor_parallel_size=args.tensor_parallel_size,
                                eff=eff, block_size=args.block_size, max_model_len=args.max_model_len,
                                router_from=router)
        prof.meta["command"] = shlex.join(["pdserve", "roofline", *argv])
        save_profile(prof, Path(args.out))
    except ValueError as e:
        print(f"pdserve roofline: error: {e}", file=sys.stderr)
        return 2
    except OSError as e:
        print(f"pdserve roofline: error: --out {args.out!r}: {e}", file=sys.stderr)
        return 2
    print(summary(prof, args.out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
