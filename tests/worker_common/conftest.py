"""Fixtures for the worker_common tests: a real engine on the built-in ``tiny`` model.

Lifecycle: ``tiny_engine`` builds a fresh ``LLMEngine`` per test (a few MB of random
weights on CPU, a small KV pool) so each test starts with every block free.
"""
from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.llm_engine import LLMEngine


@pytest.fixture(autouse=True)
def _one_thread():
    # tiny matmuls: a second OpenMP thread only adds barrier waits on a shared 2-core box
    torch.set_num_threads(1)
    yield


@pytest.fixture
def tiny_engine() -> LLMEngine:
    return LLMEngine(EngineConfig(model="tiny", num_kv_blocks=16, num_threads=1, max_num_batched_tokens=256))
