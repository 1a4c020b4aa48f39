"""Sampling a benchmark's processes with py-spy (the ``[bench]`` extra): where their threads spend a point's time.

Lifecycle: ``start(pid, seconds, path)`` launches ``py-spy record`` in the background (collapsed stacks, ``raw``
format, into ``path``) and returns its process; the caller runs its load, waits for the process, then reads the
file with ``top_functions``. ``idle=True`` keeps the samples of threads that wait (a queue, a lock, a socket), which
is where a request's time goes when no thread is busy.
"""
from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path
from typing import Optional


def py_spy_bin() -> Optional[str]:
    """py-spy on PATH, or beside this interpreter (a venv's bin/ when it is not activated)."""
    beside = Path(sys.executable).parent / "py-spy"
    return shutil.which("py-spy") or (str(beside) if beside.exists() else None)


def start(pid: int, seconds: float, path: Path, idle: bool = False) -> subprocess.Popen:
    """``py-spy record`` of ``pid`` for ``seconds`` into ``path`` (raw collapsed stacks), in the background."""
    cmd = [str(py_spy_bin()), "record", "--pid", str(pid), "--duration", str(int(max(1, seconds))),
           "--format", "raw", "--output", str(path), "--nonblocking"]
    if idle:
        cmd += ["--idle", "--threads"]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)


def top_functions(raw: Path, n: int = 15) -> list[tuple[str, float]]:
    """Share of samples in which each function is on the stack's leaf (py-spy's raw = collapsed stacks)."""
    leaf: dict[str, int] = {}
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = stack.split(";")
        total += int(count)
        leaf[frames[-1]] = leaf.get(frames[-1], 0) + int(count)
    return [(f, c / total) for f, c in sorted(leaf.items(), key=lambda kv: -kv[1])[:n]] if total else []
