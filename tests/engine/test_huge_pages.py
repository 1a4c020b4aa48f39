"""Importing ``engine`` asks torch's CPU allocator for transparent huge pages (THP_MEM_ALLOC_ENABLE), unless the
user set the variable: checked in fresh interpreters, by the variable and by the page faults of large tensors."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# 4 tensors of 32 MB, each filled once: 32768 faults of 4 KB pages, or ~64 of 2 MB ones (plus torch's own)
PROBE = """
import os, resource
import engine, torch
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(4):
    x = torch.empty(8 << 20)
    x.fill_(1.0)
    del x
print(os.environ.get("THP_MEM_ALLOC_ENABLE"), resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


def _probe(value):
    env = {k: v for k, v in os.environ.items() if k != "THP_MEM_ALLOC_ENABLE"}
    if value is not None:
        env["THP_MEM_ALLOC_ENABLE"] = value
    out = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()
    return out[0], int(out[1])


def _thp_mode() -> str:
    """The kernel's THP policy: always, madvise or never (the bracketed word)."""
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[", 1)[1].split("]", 1)[0] if "[" in text else "never"


def test_importing_engine_turns_huge_pages_on_unless_the_user_chose():
    mode = _thp_mode()
    value, faults = _probe(None)
    assert value == "1"
    off_value, off_faults = _probe("0")
    assert off_value == "0"  # the user's choice stands
    if mode != "never":  # the kernel grants them: far fewer faults than one per 4 KB page
        assert faults < 8000, (mode, faults)
    if mode == "madvise":  # without the advice every 4 KB page of the 128 MB faults
        assert off_faults > 30000, off_faults
