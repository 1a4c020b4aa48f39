"""The CPU kernel build's lifecycle (engine/kernels.py) under interruption and concurrency.

A first start killed mid-build (people press Ctrl-C while a first ``pdserve up`` compiles) must not block the
next one, as torch's own lock file did; a finished build is loaded by any checkout with the same sources
without a lock; a start that finds another build running says what it waits for, goes on the moment that
holder dies or its build lands, and waits a bounded time at most.

The end-to-end test runs real starts (real torch ``load``, ninja and compiler) in subprocesses against a
private extensions root (``TORCH_EXTENSIONS_DIR``), on a one-file module so that it takes seconds, not the
minutes of engine/csrc; ``PDSERVE_TEST_REAL_KERNEL_BUILD=1`` runs it on engine/csrc instead.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

import engine.kernels as kernels
from tests.waiting import wait_until

REPO = Path(__file__).resolve().parents[2]
REAL = os.environ.get("PDSERVE_TEST_REAL_KERNEL_BUILD") == "1"
TINY = """#include <pybind11/pybind11.h>
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { m.def("answer", [] { return 42; }); }
"""
# A start as a worker makes one: cpu_kernels() with engine/kernels.py's csrc pointed at argv[1] ("-" keeps it).
START = """
import logging, sys, time
from pathlib import Path
logging.basicConfig(level=logging.INFO)
import engine.kernels as k
if sys.argv[1] != "-":
    k._CSRC = Path(sys.argv[1])
k.BUILD_WAIT_S = float(sys.argv[2])
t = time.monotonic()
m = k.cpu_kernels()
print("loaded" if m is not None else "fallback", k._build_name(), f"{time.monotonic() - t:.1f}s", flush=True)
"""
COMPILERS = {"cc1plus", "c++", "g++", "clang", "clang++"}
HOLD = """
import sys, time
from pathlib import Path
import engine.kernels as k
fd = k._acquire_build_lock(Path(sys.argv[1]), 0, lambda: False)
print("held" if fd is not None else "busy", flush=True)
time.sleep(600)
"""


def _csrc(at: Path) -> Path:
    """A checkout's csrc: a copy of engine/csrc, or the one-file module."""
    if REAL:
        shutil.copytree(kernels._CSRC, at)
    else:
        at.mkdir(parents=True)
        (at / "tiny.cpp").write_text(TINY)
    return at


def _env(root: Path) -> dict:
    return {**os.environ, "TORCH_EXTENSIONS_DIR": str(root), "PYTHONPATH": str(REPO)}


def _start(csrc: Path, root: Path, log: Path, wait_s: float = 600) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", START, str(csrc), str(wait_s)], cwd=REPO, env=_env(root),
                            stdout=subprocess.PIPE, stderr=log.open("w"), text=True, start_new_session=True)


def _session(sid: int) -> dict[int, str]:
    """pid -> command name of every live process (zombies aside) in session ``sid`` (ninja starts each compiler
    in a process group of its own, so the session is what holds a start's whole process tree)."""
    procs = {}
    for d in Path("/proc").iterdir():
        try:
            stat = (d / "stat").read_text()
        except (OSError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if d.name.isdigit() and int(fields[3]) == sid and fields[0] != "Z":
            procs[int(d.name)] = stat[stat.index("(") + 1:stat.rindex(")")]
    return procs


def _kill_session(sid: int) -> None:
    def gone():
        for pid in _session(sid):
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return not _session(sid)
    wait_until(gone, timeout=60, message=f"session {sid} still has processes")


def _name_for(csrc: Path, monkeypatch) -> str:
    if not REAL:
        monkeypatch.setattr(kernels, "_CSRC", csrc)
    return kernels._build_name()


def _holder(lock: Path) -> subprocess.Popen:
    """Another process holding the build lock (as a live builder does), started and holding."""
    p = subprocess.Popen([sys.executable, "-c", HOLD, str(lock)], cwd=REPO, env=_env(lock.parent),
                         stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "held"
    return p


@pytest.mark.timeout(1800)
def test_an_interrupted_first_start_never_blocks_the_next_and_a_build_is_shared_across_checkouts(
        tmp_path, monkeypatch):
    root = tmp_path / "torch_extensions"
    a = _csrc(tmp_path / "checkout_a" / "csrc")
    name = _name_for(a, monkeypatch)
    so = root / name / f"{name}.so"

    # 1. a first start, killed (with its ninja and compilers) while a compiler runs
    first = _start(a, root, tmp_path / "first.log")
    try:
        wait_until(lambda: COMPILERS & set(_session(first.pid).values()), timeout=600,
                   message=lambda: f"no compiler ever ran; the start said: {(tmp_path / 'first.log').read_text()}")
    finally:
        _kill_session(first.pid)
        first.wait()
    assert not so.exists(), "the build finished before it was interrupted: nothing was tested"
    left = list(root.glob(f"{name}.build-*"))

    # 2. the next start builds and loads, without waiting on anything the killed one left
    second = _start(a, root, tmp_path / "second.log")
    try:
        out, _ = second.communicate(timeout=1200 if REAL else 600)
    finally:
        _kill_session(second.pid)
    said = (tmp_path / "second.log").read_text()
    assert second.returncode == 0 and out.split()[:2] == ["loaded", name], said
    assert "waiting" not in said and "compiling" in said, said
    assert so.exists() and not list(root.glob(f"{name}.build-*")), "the finished build is not in place, or " \
        f"a private build directory stayed: {sorted(p.name for p in root.iterdir())}"
    assert left, "the interrupted build left no private directory: it did not build in one"

    # 3. another checkout with the same sources loads that build at once: no lock (another start holds it), no
    # compiler (its sources' paths differ)
    b = _csrc(tmp_path / "checkout_b" / "csrc")
    holder = _holder(root / f"{name}.lock")
    try:
        third = _start(b, root, tmp_path / "third.log", wait_s=30)
        out, _ = third.communicate(timeout=120)
    finally:
        holder.kill()
        holder.wait()
    said = (tmp_path / "third.log").read_text()
    assert third.returncode == 0 and out.split()[:2] == ["loaded", name], said
    assert "waiting" not in said and "compiling" not in said, said


# ---- the build lock ---------------------------------------------------------------------------------------------
def _acquire_in_thread(lock: Path, wait_s: float, ready=lambda: False):
    result = {}
    t = threading.Thread(target=lambda: result.update(fd=kernels._acquire_build_lock(lock, wait_s, ready)),
                         daemon=True)
    t.start()
    return t, result


def _waiting_messages(caplog):
    return [r.getMessage() for r in caplog.records if "waiting for another process's build" in r.getMessage()]


def test_a_start_says_what_it_waits_for_and_goes_on_the_moment_the_holder_dies(tmp_path, caplog):
    lock = tmp_path / "pdserve_cpu_kernels_x.lock"
    holder = _holder(lock)
    try:
        with caplog.at_level(logging.WARNING, logger="engine.kernels"):
            t, result = _acquire_in_thread(lock, wait_s=600)
            said = wait_until(lambda: _waiting_messages(caplog), timeout=30, message="no waiting message")
            assert len(said) == 1 and str(lock) in said[0] and f"pid {holder.pid} " in said[0], said
            assert t.is_alive(), "it did not wait for a live holder"
            holder.send_signal(signal.SIGKILL)  # a build killed mid-way: its lock must go with it
            holder.wait()
            t.join(timeout=30)
        assert not t.is_alive(), "the lock outlived its killed holder"
        assert result["fd"] is not None
        assert lock.read_text().startswith(f"pid {os.getpid()} "), "the new holder is not named in the lock"
        assert len(_waiting_messages(caplog)) == 1, "the wait was announced more than once"
    finally:
        holder.kill()
        holder.wait()
        if result.get("fd") is not None:
            os.close(result["fd"])


def test_a_wait_ends_when_the_build_lands_and_is_bounded_when_it_never_does(tmp_path, caplog):
    lock = tmp_path / "pdserve_cpu_kernels_x.lock"
    holder = _holder(lock)
    landed = threading.Event()
    try:
        with caplog.at_level(logging.WARNING, logger="engine.kernels"):
            t, result = _acquire_in_thread(lock, wait_s=600, ready=landed.is_set)
            wait_until(lambda: _waiting_messages(caplog), timeout=30, message="no waiting message")
            landed.set()  # the holder renamed its finished build into place: load it, without the lock
            t.join(timeout=30)
            assert not t.is_alive() and result["fd"] is None

            t0 = time.monotonic()
            t, result = _acquire_in_thread(lock, wait_s=1.0)  # a holder that never finishes (stopped, hung)
            t.join(timeout=60)
            assert not t.is_alive() and result["fd"] is None, "the wait is not bounded"
            assert time.monotonic() - t0 >= 1.0
            assert any("gave up waiting" in r.getMessage() for r in caplog.records)
    finally:
        holder.kill()
        holder.wait()


def test_the_build_name_keys_on_contents_not_paths_and_dead_builders_directories_are_removed(tmp_path, monkeypatch):
    a, b = _csrc(tmp_path / "a" / "csrc"), _csrc(tmp_path / "b" / "csrc")
    assert _name_for(a, monkeypatch) == _name_for(b, monkeypatch)

    dead, alive = tmp_path / "pdserve_cpu_kernels_x.build-1-aa", tmp_path / "pdserve_cpu_kernels_x.build-2-bb"
    for d in (dead, alive):
        d.mkdir()
        (d / "owner").touch()
    holder = _holder(alive / "owner")  # a builder still at work holds its owner file
    try:
        kernels._remove_dead_builds(tmp_path)
        assert not dead.exists() and alive.exists()
    finally:
        holder.kill()
        holder.wait()
