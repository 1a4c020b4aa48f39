"""pdserve's CPU kernels (engine/csrc: one file per op family over a shared SIMD header), built for the machine
at first use.

Lifecycle: ``cpu_kernels()`` compiles the C++ sources once per machine and source version with
``torch.utils.cpp_extension.load`` (``-O3 -march=native``, so the vector code uses whatever the CPU
offers: AVX-512, AVX2, ...) and returns the module; later calls return the same module. The build is
named by a hash of the sources' and headers' bytes (not their paths, so two checkouts with the same
sources share one build), the flags, the CPU's instruction-set flags (an image moved to another CPU
rebuilds instead of faulting), torch's version and Python's ABI, and lives in ``<root>/<name>/`` under
torch's extensions root (``TORCH_EXTENSIONS_DIR``, else ``~/.cache/torch_extensions/py311_cpu``):

1. ``<root>/<name>/<name>.so`` exists: import it. No lock, no ninja, no compiler: a finished build is
   only ever read.
2. Else take ``<root>/<name>.lock`` (``fcntl.flock``, which the kernel drops when its holder exits,
   SIGKILL included, so an interrupted build never blocks a later start; the file itself stays and
   names its last holder). A start that finds it held logs one warning naming the lock and its holder
   (pid, host, since when) and waits: for the build to land (then loads it), for the lock (then builds),
   or ``BUILD_WAIT_S`` seconds (then builds on its own, so a stopped or hung holder costs one wait, never
   a start).
3. Build in a private ``<root>/<name>.build-<pid>-<random>/`` (torch's own file lock and ninja work there,
   out of everyone else's way) and ``rename`` it to ``<root>/<name>/`` when complete: the final directory
   appears whole or not at all. Losing that rename to a concurrent builder deletes ours (the loaded module
   stays mapped). Private directories of builders that died (their ``owner`` file is no longer flocked)
   are deleted by the next build.

Each load notes its build in ``~/.cache/pdserve/cpu-kernels-<key>`` (the key hashes what the name hashes, torch's
version read from its ``version.py``), so ``built_without_torch()`` finds a finished build without importing torch:
``pdserve up`` then skips the child it would start to build or find one (that child's torch import is most of its
cost). A note naming a build that is gone is ignored.

``scripts/setup`` calls ``python -m engine.kernels`` so a fresh machine builds it before the tests and the
service run. Where it cannot build (no compiler, an exotic platform) or ``PDSERVE_CPU_KERNELS=0`` is set,
``cpu_kernels()`` returns None after one warning and every caller falls back to plain torch ops
(slower, same results within float rounding).

The oneDNN layout reader (which packed weights the panel kernels can read) is engine/onednn_layout.py; the
per-model tuning of the panel kernels' prefetch distances is engine/prefetch_tuning.py.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import importlib.util
import logging
import os
import platform
import secrets
import shutil
import socket
import sys
import threading
import time
from pathlib import Path
from types import ModuleType
from typing import Callable, Optional


log = logging.getLogger(__name__)

_CSRC = Path(__file__).parent / "csrc"

BUILD_WAIT_S = 600.0
"""How long a start waits for another process's build (a first build takes a minute or two, longer while
other workers compete for the cores) before it builds on its own."""


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


def _cflags() -> list[str]:
    return ["-O3", f"-march={_march()}", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]


_LDFLAGS = ("-fopenmp",)  # a tuple: torch appends its library paths to the list it is given


def _build_name() -> str:
    """The module's name: hashed from every source and header (name and bytes, never their directory), the
    flags, the CPU's flags, torch's version and Python's ABI: everything a finished build is reused for."""
    import torch

    h = hashlib.sha256()
    for f in _hashed_files():
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(" ".join(cpu_isa_flags() + _cflags() + list(_LDFLAGS)).encode())
    h.update(f"\0torch {torch.__version__} {sys.implementation.cache_tag}".encode())
    return "pdserve_cpu_kernels_" + h.hexdigest()[:12]


def extensions_root() -> Path:
    """torch's extensions root, as ``cpp_extension`` lays it out: ``TORCH_EXTENSIONS_DIR``, else
    ``~/.cache/torch_extensions/py<ver>_<cpu|cuXXX|rocmXXX>``."""
    if os.environ.get("TORCH_EXTENSIONS_DIR"):
        return Path(os.environ["TORCH_EXTENSIONS_DIR"])
    import torch
    from torch.utils.cpp_extension import get_default_build_root

    accel = (f"rocm{torch.version.hip.replace('.', '')}" if torch.version.hip
             else f"cu{torch.version.cuda.replace('.', '')}" if torch.version.cuda else "cpu")
    py = f"py{sys.version_info.major}{sys.version_info.minor}{getattr(sys, 'abiflags', '')}"
    return Path(get_default_build_root()) / f"{py}_{accel}"


def _import(so: Path, name: str) -> ModuleType:
    import torch  # noqa: F401 - the module links against libtorch, which must be loaded first

    spec = importlib.util.spec_from_file_location(name, so)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _try_flock(fd: int) -> bool:
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False


def _acquire_build_lock(path: Path, wait_s: float, ready: Callable[[], bool],
                        poll_s: float = 0.2) -> Optional[int]:
    """Take the build lock at ``path``: its fd (close it to release), with this process named in the file.
    None, without the lock, once ``ready()`` (another process's build landed) or after ``wait_s`` seconds;
    a wait logs one warning naming the lock and its holder when it starts, and one line when it ends."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    start = time.monotonic()
    if not _try_flock(fd):
        try:
            holder = os.pread(fd, 512, 0).decode(errors="replace").strip() or "a process that has not named itself yet"
        except OSError:
            holder = "an unknown process"
        log.warning("pdserve CPU kernels: waiting for another process's build of them: %s holds %s; waiting up "
                    "to %.0f s, then building here (the lock ends with its holder: there is nothing to delete)",
                    holder, path, wait_s)
        while True:
            if ready():
                os.close(fd)
                log.warning("pdserve CPU kernels: that build finished after %.0f s; loading it",
                            time.monotonic() - start)
                return None
            if _try_flock(fd):
                log.warning("pdserve CPU kernels: %s came free after %.0f s with no finished build (its holder "
                            "stopped); building here", path, time.monotonic() - start)
                break
            if time.monotonic() - start >= wait_s:
                os.close(fd)
                log.warning("pdserve CPU kernels: gave up waiting for %s after %.0f s; building here", path, wait_s)
                return None
            time.sleep(poll_s)
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()} since "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
    return fd


def _remove_dead_builds(root: Path) -> None:
    """Delete private build directories whose builder is gone (nobody holds their ``owner`` file's flock)."""
    for d in root.glob("pdserve_cpu_kernels_*.build-*"):
        try:
            fd = os.open(d / "owner", os.O_RDWR)
        except OSError:  # gone already, or its builder died before creating owner: only an old one is surely dead
            with contextlib.suppress(OSError):
                if not (d / "owner").exists() and time.time() - d.stat().st_mtime > 3600:
                    shutil.rmtree(d, ignore_errors=True)
            continue
        try:
            if _try_flock(fd):
                log.info("removing %s, left by an interrupted build", d)
                shutil.rmtree(d, ignore_errors=True)
        finally:
            os.close(fd)


def _build(name: str, root: Path, locked: bool) -> ModuleType:
    """Compile into a private directory, then rename it to ``<root>/<name>``; the loaded module."""
    from torch.utils.cpp_extension import load

    _remove_dead_builds(root)
    private = root / f"{name}.build-{os.getpid()}-{secrets.token_hex(4)}"
    private.mkdir()
    owner = os.open(private / "owner", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        fcntl.flock(owner, fcntl.LOCK_EX)
        log.warning("pdserve CPU kernels: compiling them for this CPU in %s (once per machine and source version; "
                    "a minute or two)", private)
        try:
            mod = load(name=name, sources=[str(s) for s in kernel_sources()], extra_include_paths=[str(_CSRC)],
                       extra_cflags=_cflags(), extra_ldflags=list(_LDFLAGS), build_directory=str(private),
                       verbose=False)
        except BaseException:
            shutil.rmtree(private, ignore_errors=True)
            raise
        final = root / name
        if locked and final.exists() and not (final / f"{name}.so").exists():
            shutil.rmtree(final)  # holds no finished build (an older layout's leftovers), so nobody reads it
        try:
            os.rename(private, final)
        except OSError:  # a concurrent builder's landed first: use ours (it stays mapped) and drop its files
            shutil.rmtree(private, ignore_errors=True)
        return mod
    finally:
        os.close(owner)


def _load_or_build() -> ModuleType:
    name = _build_name()
    root = extensions_root()
    so = root / name / f"{name}.so"
    if so.exists():
        return _stamped(_import(so, name), so)
    root.mkdir(parents=True, exist_ok=True)
    fd = _acquire_build_lock(root / f"{name}.lock", BUILD_WAIT_S, so.exists)
    try:
        if so.exists():
            return _stamped(_import(so, name), so)
        return _stamped(_build(name, root, locked=fd is not None), so)
    finally:
        if fd is not None:
            os.close(fd)


def _stamp_path() -> Optional[Path]:
    """Where a finished build is noted for ``built_without_torch``: ``~/.cache/pdserve/cpu-kernels-<key>``, the
    key hashing what ``_build_name`` hashes (torch's version as its ``version.py`` file says it, with its CUDA and
    HIP versions) plus where torch puts extensions; read without importing torch. None where torch is absent."""
    spec = importlib.util.find_spec("torch")
    if spec is None or spec.origin is None:
        return None
    h = hashlib.sha256()
    for f in _hashed_files():
        h.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    h.update(" ".join(cpu_isa_flags() + _cflags() + list(_LDFLAGS)).encode())
    h.update((Path(spec.origin).parent / "version.py").read_bytes())
    for part in (sys.implementation.cache_tag, os.environ.get("TORCH_EXTENSIONS_DIR", ""),
                 os.environ.get("XDG_CACHE_HOME", ""), str(Path.home())):
        h.update(b"\0" + part.encode())
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return cache / "pdserve" / f"cpu-kernels-{h.hexdigest()[:16]}"


def _stamped(mod: ModuleType, so: Path) -> ModuleType:
    """Note that ``so`` is this machine's finished build (best effort: a start that cannot write it only loses
    the shortcut)."""
    with contextlib.suppress(OSError):
        stamp = _stamp_path()
        if stamp is not None and not (stamp.exists() and stamp.read_text() == str(so)):
            stamp.parent.mkdir(parents=True, exist_ok=True)
            tmp = stamp.with_name(f"{stamp.name}.{os.getpid()}")
            tmp.write_text(str(so))
            os.replace(tmp, stamp)
    return mod


def built_without_torch() -> Optional[Path]:
    """The finished build for this machine, these sources and this torch, when a load noted it and it is still
    there, found without importing torch (``pdserve up`` asks before it would start a child to build or find it:
    that child's torch import is most of a second start's cost); None otherwise (then ``cpu_kernels()`` decides)."""
    try:
        stamp = _stamp_path()
        so = Path(stamp.read_text()) if stamp is not None else None
    except (OSError, ValueError):
        return None
    return so if so is not None and so.is_file() else None


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
                mod = _load_or_build()
            except Exception as e:  # noqa: BLE001 - any build failure means: fall back, once, loudly
                log.warning("pdserve CPU kernels could not be built (%s); falling back to plain torch ops "
                            "(slower, same results)", type(e).__name__)
                log.info("kernel build error: %s", e)
        _state["mod"] = mod
        return mod


def report(built: bool) -> str:
    """The line ``python -m engine.kernels`` (and ``pdserve up``) prints: built or not, for which vector ISA."""
    return (f"pdserve CPU kernels: {'built' if built else 'NOT built (fallback)'} "
            f"for {' '.join(f for f in cpu_isa_flags() if f.startswith('avx')) or platform.machine()}")


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO)
    print(report(cpu_kernels() is not None))
