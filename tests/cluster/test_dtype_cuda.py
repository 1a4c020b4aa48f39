"""`pdserve up --dtype auto` on a GPU: the workers' engines run bfloat16 where the GPU has it (every GPU the engine
is measured on: A100, H100, H200), not float32. Skipped without a GPU; benchmarks/device_session.sh's engine phase
runs it (the CPU side of the choice is tests/cluster/test_cli_args.py)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device_session.sh)")


def test_cuda_workers_default_to_bfloat16():
    from cluster.config import ClusterConfig, auto_dtype, build_role_worker
    from kvtransfer import StoreConfig

    assert torch.cuda.is_bf16_supported() and auto_dtype(cuda=True) == "bfloat16"
    cfg = ClusterConfig(model="tiny", device="cuda")
    for role in ("prefill", "decode", "colocated"):
        store = None if role == "colocated" else StoreConfig("tcp://127.0.0.1:1")  # (built, never started)
        worker = build_role_worker(role, f"{role}-0", cfg, store, "127.0.0.1", "n0")
        assert (worker.cfg.engine.device, worker.cfg.engine.dtype) == ("cuda", "bfloat16"), role
