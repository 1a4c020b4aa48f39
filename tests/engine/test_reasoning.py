"""A reasoning block at the start of the answer (engine/reasoning.py): structured outputs constrain only what
follows it, and a thinking budget forces its end, on the real ``tiny`` model and tokenizer.

The tiny model never writes ``</think>`` by itself, so the budget is what closes its blocks here; its greedy text
is what it is, so every expectation comes from another run: the first tokens equal an unrestricted run's (nothing
constrained the thinking), the tokens after the block equal a run whose prompt already holds the block (the
grammar started fresh there), and speculative, asynchronous and resumed runs equal the plain one token for token.
"""
from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from engine import LLM, SamplingParams, StructuredOutputsParams
from engine.reasoning import drafts_before_end, find_end, forced_token
from tests.engine.test_structured_outputs import PERSON, Oracle

PROMPTS = ["def add(a, b):", "import os\nimport sys\n", "x = 1\ny = 1\nx = 1\ny = 1\n"]
REGEX = r"[a-z]{3,6} = [0-9]{1,3}"


@pytest.fixture(scope="module", autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM("tiny", num_kv_blocks=256)


@pytest.fixture(scope="module")
def marks(llm) -> tuple[list[int], list[int]]:
    tok = llm.get_tokenizer()
    start, end = tok.encode("<think>", add_special_tokens=False), tok.encode("</think>", add_special_tokens=False)
    assert len(end) > 1  # (several tokens in this tokenizer: the multi-token paths are the ones exercised)
    return start, end


def _ids(llm: LLM, prompt: str) -> list[int]:
    return llm.get_tokenizer().encode(prompt)


def test_marker_functions():
    end = [7, 8, 9]
    assert find_end([1, 7, 8, 9, 7, 8, 9], end) == 4 and find_end([7, 8], end) is None
    # the budget counts from the output's start, after a leading start sequence, then forces the end in order
    seen = [[], [1], [1, 1], [1, 1, 7], [1, 1, 7, 8], [1, 1, 7, 8, 9], [1, 1, 7, 8, 9, 1]]
    assert [forced_token(out, end, None, 2) for out in seen] == [None, None, 7, 8, 9, None, None]
    assert forced_token([5, 6, 1, 1], end, [5, 6], 2) == 7 and forced_token([5, 6, 1], end, [5, 6], 2) is None
    assert forced_token([7, 8, 9, 1], end, None, 4) is None  # the model closed the block itself
    assert forced_token([1, 1], end, None, None) is None
    # while the output may still be writing the start sequence nothing is forced; once it diverges, the budget
    # (0 here) is spent and the end comes next
    assert forced_token([5], end, [5, 6], 0) is None and forced_token([], end, [5, 6], 0) is None
    assert forced_token([4], end, [5, 6], 0) == 7 and forced_token([4, 7], end, [5, 6], 0) == 8
    assert forced_token([5, 6], end, [5, 6], 0) == 7
    # a draft that would close the block, and any after it, are cut: the closing token is drawn last in its step
    assert drafts_before_end([1, 7], [8, 9, 4], end) == [8]
    assert drafts_before_end([1], [7, 8, 9], end) == [7, 8]
    assert drafts_before_end([1], [2, 3], end) == [2, 3]
    assert drafts_before_end([], [7, 8, 9, 1], end) == [7, 8]


@pytest.mark.parametrize("budget", [0, 3, 6])
def test_the_budget_closes_the_block_after_exactly_that_many_tokens(llm, marks, budget):
    start, end = marks
    prompt = PROMPTS[0]
    plain = llm.generate(prompt, SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))[0].token_ids
    p = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, reasoning_end_token_ids=end,
                       thinking_token_budget=budget)
    got = llm.generate(prompt, p)[0].token_ids
    cut = budget + len(end)
    assert got[:budget] == plain[:budget] and got[budget:cut] == end
    ref = llm.generate({"prompt_token_ids": _ids(llm, prompt) + got[:cut]},
                       SamplingParams(max_tokens=24 - cut, temperature=0, ignore_eos=True))[0].token_ids
    assert got[cut:] == ref  # nothing is forced after the block: the model goes on as from that text
    # a leading start sequence (here: the model's own first two tokens) is not counted against the budget
    lead = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, reasoning_end_token_ids=end,
                          reasoning_start_token_ids=plain[:2], thinking_token_budget=budget)
    assert llm.generate(prompt, lead)[0].token_ids[2 + budget:2 + cut] == end
    # a seeded draw is forced at the same place
    seeded = SamplingParams(max_tokens=24, temperature=1.0, seed=11, ignore_eos=True, reasoning_end_token_ids=end,
                            thinking_token_budget=budget)
    assert llm.generate(prompt, seeded)[0].token_ids[budget:cut] == end


@pytest.mark.parametrize("constraint", [dict(regex=REGEX), dict(json=PERSON)], ids=["regex", "json"])
def test_the_grammar_constrains_only_what_follows_the_block(llm, marks, constraint):
    start, end = marks
    so = StructuredOutputsParams(**constraint)
    budget, cut = 5, 5 + len(end)
    for prompt in PROMPTS[:2]:
        plain = llm.generate(prompt, SamplingParams(max_tokens=budget, temperature=0, ignore_eos=True))[0]
        p = SamplingParams(max_tokens=120, temperature=0, reasoning_end_token_ids=end, thinking_token_budget=budget,
                           structured_outputs=so)
        got = llm.generate(prompt, p)[0]
        assert got.token_ids[:budget] == plain.token_ids and got.token_ids[budget:cut] == end
        answer = llm.get_tokenizer().decode(got.token_ids[cut:])
        if "regex" in constraint:
            assert re.fullmatch(REGEX, answer), answer
        else:
            jsonschema.validate(json.loads(answer), PERSON)
        assert got.finish_reason == "stop"
        ref = llm.generate({"prompt_token_ids": _ids(llm, prompt) + got.token_ids[:cut]},
                           SamplingParams(max_tokens=120 - cut, temperature=0, structured_outputs=so))[0]
        assert got.token_ids[cut:] == ref.token_ids
    # a block that never closes leaves the whole answer unconstrained (the grammar is for the answer after it)
    never = llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0, reasoning_end_token_ids=end,
                                                    structured_outputs=so))[0]
    assert never.token_ids == llm.generate(PROMPTS[0], SamplingParams(max_tokens=12, temperature=0))[0].token_ids


def _params(end: list[int]) -> list[SamplingParams]:
    so = StructuredOutputsParams(regex=REGEX)
    return [SamplingParams(max_tokens=60, temperature=0, reasoning_end_token_ids=end, thinking_token_budget=4,
                           structured_outputs=so),
            SamplingParams(max_tokens=60, temperature=0.8, seed=5, reasoning_end_token_ids=end,
                           thinking_token_budget=7, structured_outputs=so),
            SamplingParams(max_tokens=30, temperature=0, ignore_eos=True, reasoning_end_token_ids=end,
                           thinking_token_budget=9)]


def test_speculative_and_async_engines_give_the_same_tokens(llm, marks):
    _, end = marks
    params = _params(end)
    plain = [[o.token_ids for o in llm.generate(PROMPTS, p)] for p in params]
    spec = LLM("tiny", num_kv_blocks=256, speculative_config={"method": "ngram", "num_speculative_tokens": 4})
    assert [[o.token_ids for o in spec.generate(PROMPTS, p)] for p in params] == plain
    assert spec.llm_engine.spec_stats.num_drafts > 0
    # drafts of the right answer cross the block's end: cut before it, the first answer token is drawn masked
    for p, outs in zip(params, plain):
        tok = spec.get_tokenizer()
        spec.llm_engine._proposer = Oracle({tuple(tok.encode(pr)): o for pr, o in zip(PROMPTS, outs)}, 0, None)
        assert [o.token_ids for o in spec.generate(PROMPTS, p)] == outs
    asy = LLM("tiny", num_kv_blocks=256, async_scheduling=True, static_decode_buffers=True)
    assert [[o.token_ids for o in asy.generate(PROMPTS, p)] for p in params] == plain


def test_a_resumed_request_rebuilds_its_grammar_after_the_block(llm, marks):
    """Migration: resume_token_ids before, across and after the block's end; the new engine's grammar starts
    where the block closed, so the answer goes on as in one run."""
    _, end = marks
    p = _params(end)[0]
    ref = llm.generate(PROMPTS[0], p)[0].token_ids
    cut = 4 + len(end)
    eng = LLM("tiny", num_kv_blocks=256).llm_engine
    for k in (2, cut - 1, cut, cut + 3):
        eng.add_request(f"r{k}", _ids(llm, PROMPTS[0]), p, resume_token_ids=ref[:k])
        rest: list[int] = []
        while eng.has_unfinished_requests():
            for o in eng.step():
                rest += o.new_token_ids
        assert ref[:k] + rest == ref, k
    with pytest.raises(ValueError, match="resume_token_ids do not follow"):
        eng.add_request("bad", _ids(llm, PROMPTS[0]), p,
                        resume_token_ids=ref[:cut] + eng.tokenizer.encode("HELLO", add_special_tokens=False))
    assert not eng.has_unfinished_requests()


@pytest.mark.parametrize("kw, field", [
    (dict(thinking_token_budget=3), "thinking_token_budget needs reasoning_end_token_ids"),
    (dict(reasoning_end_token_ids=[1], thinking_token_budget=-1), "thinking_token_budget"),
    (dict(reasoning_end_token_ids=[]), "reasoning_end_token_ids must hold"),
    (dict(reasoning_end_token_ids=[1, -2]), r"reasoning_end_token_ids\[1\]"),
    (dict(reasoning_start_token_ids=[1]), "reasoning_start_token_ids needs"),
])
def test_bad_reasoning_params_are_refused_by_name(kw, field):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**kw)


def test_markers_outside_the_vocabulary_are_refused_at_add_request(llm):
    eng = llm.llm_engine
    V = eng.model_config.vocab_size
    for kw in (dict(reasoning_end_token_ids=[5, V]), dict(reasoning_end_token_ids=[5], reasoning_start_token_ids=[V])):
        name = "reasoning_start_token_ids" if "reasoning_start_token_ids" in kw else "reasoning_end_token_ids"
        with pytest.raises(ValueError, match=f"{name}: {V} is not a token id"):
            eng.add_request("bad", [1, 2, 3], SamplingParams(max_tokens=2, **kw))
    assert not eng.has_unfinished_requests()
