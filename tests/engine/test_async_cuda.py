"""Async scheduling on a GPU (engine/llm_engine.py, ``async_scheduling``): skipped without one;
benchmarks/device_session.sh runs it. With captured decode graphs a step is launched while the one before still
runs, its input ids read from that step's sampled ids on the device. Where no request stops early every step holds
the same rows as the synchronous engine's, so the tokens and logprobs must be the same to the bit; with stop tokens
(a stopped request's wasted row may move a step to another bucket, and a GEMM may round it otherwise) every request
must end and every block come back.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams

from .test_async_scheduling import PROMPTS, _params, _same

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU "
                                                                      "(device_session.sh)")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_async_scheduling_replays_the_sync_engine_on_cuda(dtype):
    kw = dict(device="cuda", dtype=dtype, max_num_seqs=8, enable_prefix_caching=True)
    sync, ahead = LLM("tiny", **kw), LLM("tiny", async_scheduling=True, **kw)
    assert ahead.llm_engine.runner.graphs.graphs  # captured, not the static path
    # (every third request with a penalty: its rows' draws wait for the step in flight, the forward still runs ahead)
    params = [SamplingParams(max_tokens=12 + 2 * i, temperature=0.0 if i % 2 else 0.8, seed=i, logprobs=1,
                             ignore_eos=True, frequency_penalty=1.0 if i % 3 == 1 else 0.0)
              for i in range(len(PROMPTS))]
    _same(sync.generate(PROMPTS, params), ahead.generate(PROMPTS, params))
    eng = ahead.llm_engine
    assert eng.ahead_steps >= 10
    stops = ahead.generate(PROMPTS, _params(sync.generate(PROMPTS, SamplingParams(max_tokens=30, temperature=0.0,
                                                                                  ignore_eos=True))))
    assert all(o.finish_reason in ("stop", "length") for o in stops)
    assert eng.num_free_blocks == eng.num_total_blocks and not eng.has_unfinished_requests()
