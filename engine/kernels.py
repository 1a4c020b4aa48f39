"""pdserve's CPU kernels (engine/csrc: one file per op family over a shared SIMD header), built for the machine
at first use.

Lifecycle: ``cpu_kernels()`` compiles the C++ sources once per machine and source version with
``torch.utils.cpp_extension.load`` (``-O3 -march=native``, so the vector code uses whatever the CPU
offers: AVX-512, AVX2, ...), caches the build under torch's extensions directory (keyed by
every source and header of engine/csrc, the flags and the CPU's instruction-set flags, so an image moved to another CPU rebuilds
instead of faulting), and returns the module; later calls return the same module. ``scripts/setup``
calls ``python -m engine.kernels`` so a fresh machine builds it before the tests and the service run.

Where it cannot build (no compiler, an exotic platform) or ``PDSERVE_CPU_KERNELS=0`` is set,
``cpu_kernels()`` returns None after one warning and every caller falls back to plain torch ops
(slower, same results within float rounding).

The oneDNN layout reader (which packed weights the panel kernels can read) is engine/onednn_layout.py; the
per-model tuning of the panel kernels' prefetch distances is engine/prefetch_tuning.py.
"""
from __future__ import annotations

import hashlib
import logging
import os
import platform
import threading
from pathlib import Path
from types import ModuleType
from typing import Optional


log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"


def kernel_sources() -> list[Path]:
    """The .cpp files compiled into the module (every one in engine/csrc), sorted."""
    return sorted(_CSRC.glob("*.cpp"))


def _hashed_files() -> list[Path]:
    """Every file the build reads: the sources and the headers they include."""
    return sorted([*_CSRC.glob("*.cpp"), *_CSRC.glob("*.h")])


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
    """The module's name: hashed from every source and header (name and bytes), the CPU's flags and -march."""
    h = hashlib.sha256()
    for f in _hashed_files():
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
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
                mod = load(name=_build_name(), sources=[str(s) for s in kernel_sources()],
                           extra_include_paths=[str(_CSRC)],
                           extra_cflags=["-O3", f"-march={_march()}", "-fopenmp", "-ffast-math", "-fno-finite-math-only"],
                           extra_ldflags=["-fopenmp"], verbose=False)
            except Exception as e:  # noqa: BLE001 - any build failure means: fall back, once, loudly
                log.warning("pdserve CPU kernels could not be built (%s); falling back to plain torch ops "
                            "(slower, same results)", type(e).__name__)
                log.info("kernel build error: %s", e)
        _state["mod"] = mod
        return mod


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    m = cpu_kernels()
    print(f"pdserve CPU kernels: {'built' if m is not None else 'NOT built (fallback)'} "
          f"for {' '.join(f for f in cpu_isa_flags() if f.startswith('avx')) or platform.machine()}")
