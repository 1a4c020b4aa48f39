"""``SamplingParams.prompt_logprobs``: the prompt's log-probabilities match transformers' on the same weights.

Reference: a random-initialised transformers Llama saved with ``save_pretrained`` (tests/engine/conftest.py);
its logits for every prompt position, log-softmaxed, against what the engine returns, with the prompt split
into chunks (a small token budget), with its prefix already in the prefix cache, and batched with a request
that does not ask (whose tokens must not change).
"""
from __future__ import annotations

import pytest
import torch

from engine.llm import LLM
from engine.sampling_params import SamplingParams

from .conftest import make_checkpoint, make_engine, prompts_of

K = 5


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("pl"), "llama")


def hf_logprobs(hf, prompt: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        return torch.log_softmax(hf(torch.tensor([prompt])).logits[0].float(), -1)


def check_against(ref: torch.Tensor, prompt: list[int], got: list) -> None:
    """got: vLLM's shape, None first, then one TokenLogprob per prompt token (actual token + top-K)."""
    assert len(got) == len(prompt) and got[0] is None
    for p in range(1, len(prompt)):
        lp, row = got[p], ref[p - 1]
        assert lp.token_id == prompt[p]
        assert abs(lp.logprob - row[prompt[p]].item()) < 1e-4, p
        assert lp.rank == int((row >= row[prompt[p]]).sum()), p  # vLLM's rank (ties aside)
        top = row.topk(K)
        assert [t for t, _ in lp.top] == top.indices.tolist(), p
        assert max(abs(v - r) for (_, v), r in zip(lp.top, top.values.tolist())) < 1e-4


def run(eng, reqs: dict) -> dict:
    """Add (prompt, params) per id and step to the end: id -> (tokens, prompt_logprobs, cached tokens)."""
    for rid, (p, sp) in reqs.items():
        eng.add_request(rid, p, sp)
    out = {rid: [[], None, 0] for rid in reqs}
    while eng.has_unfinished_requests():
        for o in eng.step():
            r = out[o.request_id]
            r[0] += o.new_token_ids
            r[2] = o.num_cached_tokens
            if o.prompt_logprobs is not None:
                assert r[1] is None, "prompt_logprobs came twice"
                r[1] = o.prompt_logprobs
    return out


def test_chunked_prompt_matches_transformers_and_others_unchanged(ckpt):
    d, hf = ckpt
    # a token budget of 7: the 23-token prompt runs in chunks that start mid-block (block_size 4)
    eng = make_engine(d, max_num_batched_tokens=7)
    a, b = prompts_of([23, 11], seed=3)
    ask = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True, prompt_logprobs=K)
    plain = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    both = run(eng, {"a": (a, ask), "b": (b, plain)})
    check_against(hf_logprobs(hf, a), a, both["a"][1])
    assert both["b"][1] is None
    alone = run(eng, {"b2": (b, plain)})
    assert both["b"][0] == alone["b2"][0]  # the neighbour's greedy tokens do not change
    assert eng.num_free_blocks == eng.num_total_blocks


def test_prefix_cache_hit_recomputes_the_prompt(ckpt):
    d, hf = ckpt
    eng = make_engine(d)
    (p,) = prompts_of([18], seed=5)
    first = run(eng, {"warm": (p, SamplingParams(max_tokens=1, temperature=0.0))})
    again = run(eng, {"warm2": (p, SamplingParams(max_tokens=1, temperature=0.0))})
    assert again["warm2"][2] > 0  # the prompt's blocks are in the prefix cache
    got = run(eng, {"pl": (p, SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=K))})
    assert got["pl"][2] == 0  # it skipped the cache: every position has logits
    check_against(hf_logprobs(hf, p), p, got["pl"][1])
    assert got["pl"][0] == first["warm"][0]


def test_offline_llm_shape_and_k0(ckpt):
    d, hf = ckpt
    llm = LLM(model=str(d), num_kv_blocks=64, block_size=4)
    (p,) = prompts_of([9], seed=8)
    (o,) = llm.generate([p], SamplingParams(max_tokens=2, temperature=0.0, prompt_logprobs=0))
    ref = hf_logprobs(hf, p)
    assert o.prompt_logprobs[0] is None and len(o.prompt_logprobs) == len(p)
    assert all(lp.top == [] for lp in o.prompt_logprobs[1:])
    assert max(abs(lp.logprob - ref[i][p[i + 1]].item()) for i, lp in enumerate(o.prompt_logprobs[1:])) < 1e-4
    (q,) = llm.generate([p], SamplingParams(max_tokens=2, temperature=0.0))
    assert q.prompt_logprobs is None and q.token_ids == o.token_ids


@pytest.mark.parametrize("bad", [-1, SamplingParams.MAX_LOGPROBS + 1, 1.5, True])
def test_validation_names_the_field(bad):
    with pytest.raises(ValueError, match="prompt_logprobs"):
        SamplingParams(prompt_logprobs=bad)


def test_preempted_mid_prompt_recomputes_its_chunks_once(ckpt):
    d, hf = ckpt
    # 10 blocks of 4: "b" decoding grows until it needs a block held by "a", which is preempted mid-prompt
    # (after some chunks reported their logprobs) and re-prefills from position 0
    eng = make_engine(d, num_kv_blocks=10, max_num_batched_tokens=8)
    b, a = prompts_of([6, 30], seed=11)
    got = run(eng, {"b": (b, SamplingParams(max_tokens=28, temperature=0.0, ignore_eos=True)),
                    "a": (a, SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True, prompt_logprobs=K))})
    assert eng.num_preemptions > 0
    check_against(hf_logprobs(hf, a), a, got["a"][1])
