"""pdserve's Triton kernels compiled for NVIDIA GPUs without one (tests/engine/triton_aot.py): every launch
configuration the engine makes, at the head shapes and hidden sizes of the models it serves, goes through Triton's
real compiler and ptxas for sm_90a (H100/H200, the fp8 cache included) and sm_80 (A100). A kernel the GPU compiler
refuses fails here, not in a rented GPU's first minutes; so does a tile choice that spills registers where the
configurations were chosen not to (16-bit attention at head_dim <= 128, and every norm, RoPE, silu * mul and GEMM).
Known spills, written down in triton_kernels._decode_warps / _prefill_config: head_dim 256 and float32 prefill
above head_dim 64 on sm_80.

A subprocess: triton must be imported without TRITON_INTERPRET, which test_triton_kernels.py's process cannot do.
"""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("triton_aot.py")

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed")


def _compile(arch: int, tmp_path: Path, only: str = "") -> list[dict]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = str(tmp_path / "triton-cache")  # a fresh cache: every build runs ptxas, and logs
    proc = subprocess.run([sys.executable, str(SCRIPT), "--arch", str(arch), "--only", only], env=env,
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def _must_not_spill(row: dict, arch: int) -> bool:
    label = row["label"]
    if label.startswith(("rms_norm", "silu_mul", "rope", "matmul")):
        return True
    D = int(label.split(" D")[1].split()[0])
    if D > 128:
        return False
    return "float32" not in label or (label.startswith("decode") and arch >= 90)


@pytest.mark.parametrize("arch,only", [(90, ""), (80, "bfloat16 H32/8")], ids=["sm90-all", "sm80-llama-bf16"])
def test_every_launch_configuration_compiles_for_the_gpu(arch, only, tmp_path):
    rows = _compile(arch, tmp_path, only)
    kernels = {r["kernel"] for r in rows}
    attention = {"_decode_attention_kernel", "_prefill_attention_kernel"}
    assert kernels == (attention if only else attention | {"_rms_norm_kernel", "_silu_mul_kernel", "_rope_kernel",
                                                           "_matmul_kernel"})
    assert any("cache float8" in r["label"] for r in rows) == (arch >= 89)
    errors = [(r["label"], r["error"][:600]) for r in rows if "error" in r]
    assert not errors, errors
    assert all(r["registers"] is not None for r in rows), "ptxas's log was not read"
    spills = [(r["label"], r["options"], r["registers"], r["spill_bytes"]) for r in rows
              if r["spill_bytes"] and _must_not_spill(r, arch)]
    assert not spills, spills
