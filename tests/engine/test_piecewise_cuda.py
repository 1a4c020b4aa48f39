"""Piecewise CUDA graphs on a GPU (engine/piecewise_graphs.py): skipped without one; benchmarks/device_session.sh
runs it. Replaying the captured pieces must give the uncaptured static path's tokens and log-probabilities to the
bit (the same kernels on the same padded rows), and in float32 the eager engine's greedy tokens; the graphs' memory
must fit what the KV budget gave up for them.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM

from .test_piecewise_graphs import PROMPTS, SMALL_STEPS, _params, _same

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graph capture needs a GPU "
                                                                      "(device_session.sh)")


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_captured_pieces_replay_the_static_path(dtype):
    kw = dict(device="cuda", dtype=dtype, **SMALL_STEPS)
    graphs_llm = LLM("tiny", **kw)
    static = LLM("tiny", static_decode_buffers=True, **kw)
    eng = graphs_llm.llm_engine
    pw = eng.runner.piecewise
    assert sorted(pw.graphs) == [8, 16, 24] and len(pw.graphs[8]) == len(eng.runner.model.layers)
    assert 0 < pw.memory_bytes and pw.memory_bytes + eng.runner.graphs.memory_bytes <= eng.graph_memory_estimate
    params = _params()
    got = graphs_llm.generate(PROMPTS, params)
    _same(got, static.generate(PROMPTS, params))
    # the same tokens make the same schedule: as many steps through the captured pieces as through the static ones
    assert pw.replays == static.llm_engine.runner.piecewise.replays > 0
    if dtype == "float32":
        eager = LLM("tiny", enforce_eager=True, **kw)
        greedy = [i for i, p in enumerate(params) if p.temperature == 0.0]
        want = eager.generate(PROMPTS, params)
        assert [got[i].token_ids for i in greedy] == [want[i].token_ids for i in greedy]
