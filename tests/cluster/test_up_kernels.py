"""``pdserve up`` prepares the CPU kernels in a child process before any worker starts, so the first start's
minutes of compiling (or a wait for another process's build) show on the user's terminal instead of inside
Ray's worker actors, whose logs never reach it. Not for a joined Ray cluster (each node builds its own), for
``--device cuda`` or with ``PDSERVE_CPU_KERNELS=0``."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _run(address, device: str, env_extra: dict) -> str:
    code = textwrap.dedent(f"""
        import argparse
        from cluster.serve_cli import prepare_cpu_kernels
        prepare_cpu_kernels(argparse.Namespace(address={address!r}, device={device!r}))
        print("RETURNED", flush=True)
    """)
    env = {**os.environ, **env_extra}
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, timeout=1200)
    assert out.returncode == 0, out.stdout[-2000:]
    return out.stdout


def test_a_local_cpu_start_prepares_the_kernels_where_the_user_sees_it():
    out = _run(None, "cpu", {})
    assert "preparing the CPU kernels" in out
    # the child's own report reached the same terminal, before up went on
    assert "pdserve CPU kernels:" in out and out.index("pdserve CPU kernels:") < out.index("RETURNED"), out


@pytest.mark.parametrize("address,device,env", [("auto", "cpu", {}), (None, "cuda", {}),
                                                (None, "cpu", {"PDSERVE_CPU_KERNELS": "0"})])
def test_no_preparation_where_the_workers_build_their_own_or_none(address, device, env):
    out = _run(address, device, env)
    assert "preparing" not in out and "pdserve CPU kernels:" not in out, out

