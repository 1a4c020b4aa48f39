"""Compile pdserve's Triton kernels for a GPU without one: every launch configuration the engine makes for the
model shapes it serves, built by Triton's real compiler (TTIR -> TTGIR -> LLVM -> PTX -> cubin, with the ptxas
Triton ships) for an NVIDIA target, so a kernel that does not compile, or spills registers, shows here and not in
the first minutes of a rented GPU. The interpreter tests (test_triton_kernels.py) check what the kernels compute;
this checks that the GPU compiler takes them.

How: ``engine.triton_kernels``' public wrappers run on CPU tensors of each shape with their kernels replaced by
recorders, so the launch arguments (tensor dtypes, constexprs, ``num_warps``, ``enable_fp_fusion``) are the ones
the wrappers compute; each recorded launch is then compiled with ``triton.compile(ASTSource(...), target=...)``
and its ptxas log read for registers and spills. Differences from a launch on a GPU: integer arguments are not
specialised by value (a GPU launch turns an argument equal to 1 into a constant and marks multiples of 16), so
the code is the general case's.

Run here as a subprocess (test_triton_aot.py): triton must be imported without ``TRITON_INTERPRET``, which the
interpreter tests' process cannot do. ``python tests/engine/triton_aot.py --arch 90`` prints one JSON line per
launch. Needs triton (the ``test`` extra), no GPU and no CUDA driver.
"""
from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, Callable

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    raise SystemExit("triton_aot.py compiles for a GPU: run it without TRITON_INTERPRET")
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

from engine import triton_kernels as tk  # noqa: E402

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.float8_e4m3fn: "fp8e4nv",
          torch.int64: "i64", torch.int32: "i32"}
_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")
BF16, FP16, FP32, FP8 = torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn


def record(calls: Callable[[], None]) -> list[tuple[Any, tuple, dict]]:
    """Run ``calls`` (which calls triton_kernels' wrappers) with every kernel launch recorded, not run:
    (the JITFunction, its positional arguments, its keyword arguments) per launch."""
    launches: list[tuple[Any, tuple, dict]] = []
    real = tk._kernels()

    class Recorder:
        def __init__(self, fn: Any) -> None:
            self.fn = fn

        def __getitem__(self, grid: Any) -> Callable[..., None]:
            return lambda *args, **kw: launches.append((self.fn, args, kw))

    saved = tk._kernels
    tk._kernels = lambda: SimpleNamespace(**{k: Recorder(v) for k, v in vars(real).items()})
    try:
        calls()
    finally:
        tk._kernels = saved
    return launches


def signature(fn: Any, args: tuple, kw: dict) -> tuple[dict, dict, dict]:
    """(signature, constexprs, compile options) of one recorded launch, typed as Triton types a GPU launch's."""
    values = dict(zip(fn.arg_names, args))
    values.update({k: v for k, v in kw.items() if k not in _OPTIONS})
    sig, consts = {}, {}
    for p in fn.params:
        v = values[p.name]
        if p.is_constexpr:
            sig[p.name], consts[p.name] = "constexpr", v
        elif isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _TYPES[v.dtype]
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i32" if -2 ** 31 <= v < 2 ** 31 else "i64"
        elif isinstance(v, float):
            sig[p.name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: argument {p.name} of type {type(v).__name__}")
    return sig, consts, {k: kw[k] for k in _OPTIONS if k in kw}


def model_launches(arch: int) -> list[tuple[str, Callable[[], None]]]:
    """(label, calls) of the launch configurations a CUDA engine makes: decode and prefill attention at the head
    shapes of the built-in and Llama-family models (head_dim 64, 128, 256; 1-4 query heads per KV head; block
    sizes 16 and 32 in bfloat16), the fp8 cache where the target has FP8 (>= 8.9); the norms, RoPE and silu * mul
    at their hidden sizes; float16 and float32 at fewer shapes (one compile each is what CI can afford)."""
    out: list[tuple[str, Callable[[], None]]] = []
    dtypes = (BF16, FP16, FP32)
    for dt in dtypes:
        # bfloat16 (the serving dtype) at every shape; float16 and float32 (parity runs) at the Llama shapes
        heads = ((32, 8, 64), (32, 8, 128), (6, 2, 64), (16, 16, 128), (8, 4, 256)) if dt == BF16 else \
            ((32, 8, 64), (32, 8, 128), (8, 4, 256))
        for H, Hkv, D in heads:
            for bs in ((16, 32) if dt == BF16 else (16,)):
                caches = [dt] + ([FP8] if arch >= 89 and dt != FP32 else [])
                for cdt in caches:
                    def decode(H=H, Hkv=Hkv, D=D, bs=bs, dt=dt, cdt=cdt) -> None:
                        kc = torch.empty(4, bs, Hkv, D, dtype=cdt)
                        tk.paged_decode_attention(torch.empty(3, H, D, dtype=dt), kc, kc,
                                                  torch.zeros(3, 2, dtype=torch.long),
                                                  torch.ones(3, dtype=torch.long), 64, D ** -0.5)
                    out.append((f"decode {str(dt)[6:]} H{H}/{Hkv} D{D} bs{bs} cache {str(cdt)[6:]}", decode))
            for n in ((48, 300) if dt != FP32 else (48,)):  # a 16-bit chunk's two tile choices (<= 64 rows, more)
                def prefill(H=H, Hkv=Hkv, D=D, n=n, dt=dt) -> None:
                    kc = torch.empty(40, 16, Hkv, D, dtype=dt)
                    tk.paged_prefill_attention(torch.empty(n, H, D, dtype=dt), kc, kc,
                                               torch.zeros(40, dtype=torch.long), 100, None, D ** -0.5)
                out.append((f"prefill {str(dt)[6:]} H{H}/{Hkv} D{D} n{n}", prefill))
        for h in ((384, 2048, 4096, 8192) if dt == BF16 else (4096,)):
            out.append((f"rms_norm {str(dt)[6:]} h{h}",
                        lambda h=h, dt=dt: tk.rms_norm(torch.empty(4, h, dtype=dt), torch.empty(h, dtype=dt), 1e-6)))
        for inter in ((1024, 8192, 14336) if dt == BF16 else (8192,)):
            out.append((f"silu_mul {str(dt)[6:]} I{inter}",
                        lambda inter=inter, dt=dt: tk.silu_mul(torch.empty(4, 2 * inter, dtype=dt))))
        # the batch-invariant GEMM (one tile shape per dtype: the shapes change no code, a few are enough)
        for K, N in (((2048, 3072), (8192, 2048), (4096, 128256)) if dt == BF16 else ((2048, 3072),)):
            out.append((f"matmul {str(dt)[6:]} K{K} N{N}",
                        lambda K=K, N=N, dt=dt: tk.matmul(torch.empty(5, K, dtype=dt), torch.empty(K, N, dtype=dt))))
        for D in ((64, 128, 256) if dt == BF16 else (128,)):
            def rope(D=D, dt=dt) -> None:
                tk.rope_(torch.empty(4, 48, D, dtype=dt), torch.empty(4, 1, D // 2, dtype=dt),
                         torch.empty(4, 1, D // 2, dtype=dt), 40)
            out.append((f"rope {str(dt)[6:]} D{D}", rope))
    return out


def compile_all(arch: int, only: str = "") -> list[dict]:
    """Compile every ``model_launches`` configuration (label containing ``only``) for ``sm_<arch>``, each once:
    one dict per distinct kernel build (label, kernel, registers, spill bytes, seconds, error). The wrappers
    choose their tiles for that GPU (``triton_kernels._capability`` made to answer ``arch``)."""
    target = GPUTarget("cuda", arch, 32)
    tk._capability = lambda device: divmod(arch, 10)
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"  # Triton prints ptxas -v's log: registers and spills
    seen: set[str] = set()
    results = []
    for label, calls in model_launches(arch):
        if only not in label:
            continue
        for fn, args, kw in record(calls):
            sig, consts, opts = signature(fn, args, kw)
            key = repr((fn.__name__, sorted(sig.items()), sorted(consts.items()), sorted(opts.items())))
            if key in seen:
                continue
            seen.add(key)
            row: dict[str, Any] = {"label": label, "kernel": fn.__name__, "options": opts}
            log = io.StringIO()
            t0 = time.perf_counter()
            try:
                with contextlib.redirect_stdout(log):
                    triton.compile(ASTSource(fn, sig, consts), target=target, options=opts)
            except Exception as e:  # noqa: BLE001 - reported per build, the caller decides
                row["error"] = f"{type(e).__name__}: {str(e)[:2000]}"
            row["seconds"] = round(time.perf_counter() - t0, 2)
            text = log.getvalue()
            regs = re.findall(r"Used (\d+) registers", text)
            spills = re.findall(r"(\d+) bytes spill stores", text)
            row["registers"] = int(regs[-1]) if regs else None
            row["spill_bytes"] = int(spills[-1]) if spills else None
            results.append(row)
    return results


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", type=int, default=90, help="compute capability as an integer: 90 (H100/H200), 80 (A100)")
    ap.add_argument("--only", default="", help="compile only configurations whose label contains this")
    args = ap.parse_args()
    for row in compile_all(args.arch, args.only):
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
