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



def test_a_build_a_load_noted_is_found_without_torch_and_without_a_child(tmp_path):
    """After a load (which notes its build), ``pdserve up``'s preparation finds the build without importing torch
    and without its child process; a note naming a build that is gone, or made for other flags, is not trusted."""
    from engine.kernels import extensions_root

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path), "TORCH_EXTENSIONS_DIR": str(extensions_root())}
    probe = textwrap.dedent("""
        import argparse, subprocess, sys
        from engine.kernels import built_without_torch
        print("FOUND", built_without_torch(), "torch" in sys.modules)
        def no_child(*a, **k):
            raise AssertionError("a child was started")
        subprocess.run = no_child
        from cluster.serve_cli import prepare_cpu_kernels
        try:
            prepare_cpu_kernels(argparse.Namespace(address=None, device="cpu"))
            print("NO CHILD", "torch" in sys.modules)
        except AssertionError:
            print("STARTED A CHILD")
    """)

    def run(code: str, **extra: str) -> str:
        out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env={**env, **extra}, capture_output=True,
                             text=True, timeout=1200)
        assert out.returncode == 0, out.stderr[-2000:]
        return out.stdout + out.stderr

    assert "FOUND None False" in run(probe) and "STARTED A CHILD" in run(probe)
    run("import runpy; runpy.run_module('engine.kernels', run_name='__main__')")  # loads the build: notes it
    out = run(probe)
    assert ".so False" in out and "NO CHILD False" in out and "pdserve CPU kernels: built" in out, out
    (stamp,) = (tmp_path / "pdserve").glob("cpu-kernels-*")
    assert stamp.read_text().endswith(".so")
    assert "FOUND None" in run(probe, PDSERVE_CPU_KERNELS_MARCH="haswell")  # other flags: another build's key
    stamp.write_text(str(tmp_path / "gone.so"))
    assert "FOUND None" in run(probe) and "STARTED A CHILD" in run(probe)
