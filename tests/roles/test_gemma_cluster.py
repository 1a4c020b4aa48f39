"""A Gemma 3 checkpoint through the disaggregated cluster: the prefill worker computes the prompt (local layers
with their own RoPE base and a sliding window, global ones linear-scaled), its KV goes to the decode worker over gloo
and decoding goes on there; greedy answers over gRPC and the OpenAI API equal the offline engine's on the same
directory (which tests/engine/test_model_parity.py checks against transformers).

The checkpoint is a random ``transformers.Gemma3ForCausalLM`` over the built-in tokenizer's vocabulary, saved with
that tokenizer, so the router tokenizes text as it would for a Hub model.
"""
from __future__ import annotations

import shutil
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import torch

from engine import LLM, SamplingParams

from .harness import collect, joined, start_roles

PROMPTS = ["def fibonacci(n):", "import os\nimport sys\n\n\ndef main(argv):\n",
           "class Stack:\n    def __init__(self):\n        self._items = []\n" * 3]


@pytest.fixture(scope="module")
def gemma_dir(tmp_path_factory):
    import transformers

    from engine.builtin import tokenizer_dir

    d = tmp_path_factory.mktemp("gemma3")
    cfg = transformers.Gemma3TextConfig(
        vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, query_pre_attn_scalar=20, sliding_window=8, max_position_embeddings=512,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], initializer_range=0.1,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 100.0}},
        bos_token_id=0, eos_token_id=1, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.normal_(1.0, 0.3)
    model.save_pretrained(d)
    for f in tokenizer_dir().iterdir():
        shutil.copy(f, d / f.name)
    return str(d)


@pytest.fixture(scope="module")
def reference(gemma_dir):
    llm = LLM(model=gemma_dir, num_kv_blocks=256, num_threads=1)
    return llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))


@pytest.fixture(scope="module")
def roles(gemma_dir):
    torch.set_num_threads(1)
    r = start_roles(tag="gemma-", engine=dict(model=gemma_dir), router=dict(model=gemma_dir, http_port=0))
    yield r
    r.close()


def test_gemma3_through_the_split_equals_the_offline_engine(roles, reference):
    with ThreadPoolExecutor(len(PROMPTS)) as pool:  # (concurrent: one decode batch)
        got = list(pool.map(lambda p: joined(collect(roles.stub, prompt=p, max_tokens=24, temperature=0.0,
                                                     ignore_eos=True)), PROMPTS))
    for (ids, text, _), o in zip(got, reference):
        assert (ids, text) == (list(o.token_ids), o.text)
    assert len(set(reference[-1].token_ids)) > 4  # (not a degenerate continuation)
    client = openai.OpenAI(base_url=f"http://{roles.router.http_address}/v1", api_key="none", max_retries=0,
                           timeout=60)
    c = client.completions.create(model=client.models.list().data[0].id, prompt=PROMPTS[1], max_tokens=24,
                                  temperature=0.0, extra_body={"ignore_eos": True})
    assert c.choices[0].text == reference[1].text
    assert roles.wait_idle(10.0)
