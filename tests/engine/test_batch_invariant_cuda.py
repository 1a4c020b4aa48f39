"""Batch invariance on a GPU (EngineConfig.batch_invariant): a request's greedy tokens, logprobs and alternatives
are the same bits alone, batched with others, chunked beside decodes and replayed from the decode graphs, in
bfloat16 and float32. Without the flag cuBLAS picks its GEMM algorithm by row count, so they need not be (the
27 Nov H100 run saw 25-26 of 32 streams equal to the offline engine). Skipped without a GPU; device_session.sh's
engine phase runs it. The same wiring is checked on CPU under Triton's interpreter (test_triton_kernels.py)."""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device_session.sh)")

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n",
           "for i in range(10):\n", "x = [", "def binary_search(items, target):\n", "while True:", "# a"]


def _outputs(llm, prompts, one_by_one=False):
    from engine import SamplingParams

    params = SamplingParams(max_tokens=24, temperature=0.0, logprobs=2)
    outs = [o for p in prompts for o in llm.generate([p], params)] if one_by_one else llm.generate(prompts, params)
    return [(o.token_ids, [(lp.logprob, lp.top) for lp in o.logprobs]) for o in outs]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_request_gets_the_same_bits_alone_batched_chunked_and_from_graphs(dtype):
    from engine import LLM

    kw = dict(device="cuda", dtype=dtype, max_num_seqs=8, enable_prefix_caching=False, batch_invariant=True)
    alone = _outputs(LLM("tiny", enforce_eager=True, **kw), PROMPTS, one_by_one=True)
    graphs = LLM("tiny", max_num_batched_tokens=16, **kw)  # chunked prefills beside decodes, then the graphs
    assert graphs.llm_engine.runner.graphs is not None
    batched = _outputs(graphs, PROMPTS)
    assert graphs.llm_engine.runner.graphs.replays > 0
    assert alone == batched
