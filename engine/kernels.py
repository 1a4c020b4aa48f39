"""pdserve's CPU kernels (engine/csrc/cpu_kernels.cpp), built for the machine at first use.

Lifecycle: ``cpu_kernels()`` compiles the C++ source once per machine and source version with
``torch.utils.cpp_extension.load`` (``-O3 -march=native``, so the vector code uses whatever the CPU
offers: AVX-512, AVX2, ...), caches the build under torch's extensions directory (keyed by the
source, the flags and the CPU's instruction-set flags, so an image moved to another CPU rebuilds
instead of faulting), and returns the module; later calls return the same module. ``scripts/setup``
calls ``python -m engine.kernels`` so a fresh machine builds it before the tests and the service run.

Where it cannot build (no compiler, an exotic platform) or ``PDSERVE_CPU_KERNELS=0`` is set,
``cpu_kernels()`` returns None after one warning and every caller falls back to plain torch ops
(slower, same results within float rounding).

``tune_panel_prefetch`` (called by ``CausalLM.finalize`` when a model is loaded) measures, on the machine
and the model's weights, how far ahead the panel kernels should prefetch their weight stream, and sets it
in the module (process-wide, like torch's thread count; it changes speed, never a result).
"""
from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Callable, Optional, Sequence

import torch

log = logging.getLogger(__name__)

_SRC = Path(__file__).parent / "csrc" / "cpu_kernels.cpp"
_lock = threading.Lock()
_state: dict = {}


def cpu_isa_flags() -> list[str]:
    """The CPU's vector instruction-set flags (avx2, avx512f, ...) as /proc/cpuinfo lists them."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return sorted(f for f in line.split(":", 1)[1].split()
                              if f.startswith(("avx", "amx", "fma", "f16c", "sse", "neon", "asimd")))
    except OSError:
        pass
    return [platform.machine()]


def _march() -> str:
    """-march value: ``native`` unless PDSERVE_CPU_KERNELS_MARCH names another (e.g. ``haswell`` to
    build and measure the AVX2 code on an AVX-512 machine)."""
    return os.environ.get("PDSERVE_CPU_KERNELS_MARCH", "native")


def _build_name() -> str:
    h = hashlib.sha256(_SRC.read_bytes())
    h.update(" ".join(cpu_isa_flags() + [_march()]).encode())
    return "pdserve_cpu_kernels_" + h.hexdigest()[:12]


def cpu_kernels() -> Optional[ModuleType]:
    """The compiled kernel module, or None (after one warning) where it cannot be built."""
    if "mod" in _state:
        return _state["mod"]
    with _lock:
        if "mod" in _state:
            return _state["mod"]
        mod = None
        if os.environ.get("PDSERVE_CPU_KERNELS", "1") == "0":
            log.warning("PDSERVE_CPU_KERNELS=0: using plain torch ops instead of pdserve's CPU kernels")
        else:
            try:
                from torch.utils.cpp_extension import load
                mod = load(name=_build_name(), sources=[str(_SRC)],
                           extra_cflags=["-O3", f"-march={_march()}", "-fopenmp", "-ffast-math", "-fno-finite-math-only"],
                           extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as e:  # noqa: BLE001 - any build failure means: fall back, once, loudly
                log.warning("pdserve CPU kernels could not be built (%s); falling back to plain torch ops "
                            "(slower, same results)", type(e).__name__)
                log.info("kernel build error: %s", e)
        _state["mod"] = mod
        return mod


# panel widths to try, most likely first (torch 2.13's oneDNN uses 64 on AVX2 and AVX-512)
_PANEL_WIDTHS = (64, 32, 16, 48, 96, 128)


def onednn_panels(packed: torch.Tensor, dense: torch.Tensor) -> Optional[torch.Tensor]:
    """A float32 [NP, K, B] view of a weight oneDNN prepacked (``torch.ops.mkldnn._reorder_linear_weight``)
    in panels of B outputs, K-major inside a panel (p[n // B][k][n % B] = W[n, k]), for pdserve's
    ``linear_panel`` kernel; None where the packed bytes are not that layout.

    oneDNN chooses its layout by CPU and version and does not publish it, so this does not assume it: it
    compares the packed bytes with the dense [N, K] original under each candidate width and returns a view
    only where every weight is equal. A view that passes therefore computes this weight's product exactly
    as the dense one would, whatever oneDNN does elsewhere. The view shares the packed tensor's memory
    without holding it: keep ``packed`` alive as long as the view (engine/model.py Linear keeps both)."""
    if dense.dtype != torch.float32 or dense.dim() != 2 or packed.device.type != "cpu":
        return None
    N, K = dense.shape
    try:
        nbytes, ptr = torch.ops.mkldnn._nbytes(packed), torch.ops.mkldnn.data_ptr(packed)
    except (AttributeError, RuntimeError):  # not an opaque oneDNN tensor, or a torch without these ops
        return None
    for B in _PANEL_WIDTHS:
        NP = -(-N // B)
        if nbytes != NP * B * K * 4:
            continue
        view = torch.frombuffer((ctypes.c_float * (nbytes // 4)).from_address(ptr), dtype=torch.float32)
        view = view.view(NP, K, B)
        full = N // B
        same = torch.equal(view[:full], dense[:full * B].view(full, B, K).transpose(1, 2))
        if same and N % B:
            same = torch.equal(view[full, :, :N % B], dense[full * B:].t())
        if same:
            return view
    return None


# prefetch distances (bytes of a panel tile's weight stream ahead of its loads) tune_panel_prefetch tries
PREFETCH_CANDIDATES = (0, 2048, 8192)
# a tuning pass runs the model's panel linears until this many weight bytes (beyond any last-level cache),
# so a large model costs about what a small one does
_TUNE_BYTES = 512 << 20


def _parse_prefetch(text: str) -> tuple[int, int]:
    parts = [p.strip() for p in text.split(",")]
    if len(parts) == 1:
        parts = parts * 2
    if len(parts) != 2 or not all(p.isdigit() for p in parts):  # isdigit: no sign, so no negatives
        raise ValueError(f"PDSERVE_PANEL_PREFETCH must be 'BYTES' or 'ONE_ROW,ROWS' (non-negative integers), "
                         f"got {text!r}")
    return int(parts[0]), int(parts[1])


def tune_panel_prefetch(products: Sequence[tuple[Callable[[torch.Tensor], object], int, int]],
                        rounds: int = 3) -> Optional[tuple[int, int]]:
    """Choose, on this machine and these weights, how far ahead the panel kernels prefetch their weight
    stream, for products of one input row and of several, and set it in the kernel module.

    ``products``: (run, in_features, weight bytes) of the model's panel linears (run(x) computes one
    product). Whether software prefetch pays depends on the CPU: measured, it cost a third of the batch-1
    rate on a Zen 4 and sped 8 to 32 rows up 1.3-1.4x (and int8 / int4 batch 1 1.6-1.8x) on an Emerald Rapids
    Xeon (docs/benchmarks.md, runs M and U), so it is measured here, once per load: each of ``PREFETCH_CANDIDATES`` runs
    the linears (up to ``_TUNE_BYTES`` of weights) at 1 and at 8 rows, interleaved over ``rounds`` rounds,
    best time of each; a distance replaces "none" only when it is at least 3% faster. Prefetches change no
    result, only speed. ``PDSERVE_PANEL_PREFETCH=BYTES`` or ``ONE_ROW,ROWS`` sets the distances instead (the
    value is checked). Returns the distances set, or None where the kernels are not built."""
    mod = cpu_kernels()
    if mod is None:
        return None
    env = os.environ.get("PDSERVE_PANEL_PREFETCH")
    if env is not None:
        chosen = _parse_prefetch(env)
        mod.set_panel_prefetch(*chosen)
        return chosen
    picked, total = [], 0
    for run, k, nbytes in products:
        if total >= _TUNE_BYTES:
            break
        picked.append((run, k))
        total += nbytes
    if not picked:
        return tuple(mod.panel_prefetch())
    chosen = []
    gen = torch.Generator().manual_seed(0)  # its own: loading a model must not move the global RNG
    with torch.inference_mode():
        for m in (1, 8):
            xs = {k: torch.randn(m, k, generator=gen) for k in sorted({k for _, k in picked})}
            best = {pf: float("inf") for pf in PREFETCH_CANDIDATES}
            for r in range(rounds + 1):  # the first round warms up
                for pf in PREFETCH_CANDIDATES:
                    mod.set_panel_prefetch(pf, pf)
                    t = time.perf_counter()
                    for run, k in picked:
                        run(xs[k])
                    if r:
                        best[pf] = min(best[pf], time.perf_counter() - t)
            fastest = min(best, key=best.get)
            chosen.append(fastest if best[fastest] < 0.97 * best[0] else 0)
    mod.set_panel_prefetch(*chosen)
    log.info("panel kernels prefetch %d bytes ahead at one row, %d at several (measured at load)", *chosen)
    return chosen[0], chosen[1]


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    m = cpu_kernels()
    print(f"pdserve CPU kernels: {'built' if m is not None else 'NOT built (fallback)'} "
          f"for {' '.join(f for f in cpu_isa_flags() if f.startswith('avx')) or platform.machine()}")
