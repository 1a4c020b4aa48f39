"""vLLM's token restrictions on the offline engine: ``allowed_token_ids``, ``bad_words`` and
``truncate_prompt_tokens`` (engine/sampling_params.py, engine/sampler.py).

The greedy references are transformers' own processors on the same weights (``prefix_allowed_tokens_fn`` and
``bad_words_ids``), not pdserve's code; the truncation reference is the engine given the kept tokens directly.
"""
from __future__ import annotations

import pytest
import torch

from engine import LLM, SamplingParams, bad_words_token_ids
from engine.builtin import save_builtin
from engine.sampler import Sampler, SamplingRequest

PROMPTS = ["def parse(argv):", "import os\nimport sys\n", "class Foo:\n    "]


def greedy(n: int = 12, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, **kw)


@pytest.fixture(scope="module")
def llm() -> LLM:
    torch.set_num_threads(1)
    return LLM("tiny", num_kv_blocks=128, block_size=16, num_threads=1)


@pytest.fixture(scope="module")
def hf(llm, tmp_path_factory):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(
        save_builtin("tiny", tmp_path_factory.mktemp("hf") / "tiny"), dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


def _hf_greedy(model, prompt_ids: list[int], n: int, **kw) -> list[int]:
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=n, do_sample=False,
                             attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long), **kw)
    return out[0, len(prompt_ids):].tolist()


def _contains(ids: list[int], word: list[int]) -> bool:
    return any(ids[i:i + len(word)] == word for i in range(len(ids)))


def test_allowed_token_ids_and_bad_words_greedy_equal_transformers(llm, hf):
    """In one batch with an unrestricted request (which they leave alone): allowed_token_ids equals transformers
    with ``prefix_allowed_tokens_fn``, bad words (a one-token word and a two-token one taken from the plain output,
    so both bans fire) equal transformers with ``bad_words_ids`` of the same tokenization."""
    tok = llm.get_tokenizer()
    V = llm.llm_engine.model_config.vocab_size
    plain = llm.generate(PROMPTS[0], greedy())[0]
    # a two-token word of the plain continuation (as text, stripped: the rule spells it alone and after a space)
    two = tok.decode(plain.token_ids[3:5]).strip()
    one = tok.decode(plain.token_ids[1:2]).strip()
    words = bad_words_token_ids([two, one], tok, V)
    assert plain.token_ids[3:5] in words and any(len(w) == 1 for w in words), (two, one, words)
    assert not any(len(w) > 1 and plain.prompt_token_ids[-(len(w) - 1):] == w[:-1] for w in words)  # (transformers
    # also matches a word's first tokens against the prompt's end; pdserve, like vLLM, only the output's)
    allowed = sorted({*range(5, 120), *plain.token_ids[::3]})
    outs = llm.generate([PROMPTS[0]] * 3, [greedy(allowed_token_ids=allowed), greedy(bad_words=[two, one]),
                                           greedy()])
    assert outs[2].token_ids == plain.token_ids
    assert set(outs[0].token_ids) <= set(allowed) and outs[0].token_ids != plain.token_ids
    assert not any(_contains(outs[1].token_ids, w) for w in words) and outs[1].token_ids != plain.token_ids
    ids = plain.prompt_token_ids
    assert outs[0].token_ids == _hf_greedy(hf, ids, 12, prefix_allowed_tokens_fn=lambda b, x: allowed)
    assert outs[1].token_ids == _hf_greedy(hf, ids, 12, bad_words_ids=words)
    eng = llm.llm_engine
    assert not eng.has_unfinished_requests() and eng.num_free_blocks == eng.num_total_blocks


def test_bad_words_are_tokenized_alone_and_after_a_space(llm):
    """vLLM's rule over a tokenizer whose words carry their leading space: both spellings, each of the same length."""
    tok = llm.get_tokenizer()
    seqs = bad_words_token_ids(["  self"], tok, 10**6)
    assert seqs == [tok.encode("self", add_special_tokens=False), tok.encode(" self", add_special_tokens=False)]
    assert seqs[0] != seqs[1]
    with pytest.raises(ValueError, match=r"bad_words\[0\] tokenizes to id"):
        bad_words_token_ids(["self"], tok, 5)


def test_a_bad_word_bans_its_last_token_only_after_its_first_ones_and_gives_way_to_an_empty_row():
    V = 50
    torch.manual_seed(0)
    logits = torch.randn(6, V)
    a, b, c = 11, int(logits[1].argmax()), int(logits[3].argmax())
    s = Sampler(V)
    words = [[a, b], [c]]
    reqs = [SamplingRequest(greedy(bad_words_token_ids=words), [1], [4, a]),       # prefix matches: b banned
            SamplingRequest(greedy(bad_words_token_ids=words), [1], [a, 4]),       # prefix does not: b allowed
            SamplingRequest(greedy(bad_words_token_ids=[[a, b]]), [a], []),        # the prompt is not the output
            SamplingRequest(greedy(bad_words_token_ids=words), [1], []),           # one token: banned everywhere
            SamplingRequest(greedy(allowed_token_ids=[c], bad_words_token_ids=[[c]]), [1], []),  # ban gives way
            SamplingRequest(greedy(allowed_token_ids=[7, 9, 49]), [1], [])]
    logits[0] = logits[1]
    logits[2] = logits[1]
    toks, _ = s.sample(logits.clone(), reqs)
    second = logits[1].clone()
    second[[b, c]] = float("-inf")  # (its one-token word c is banned too)
    assert toks[0] == int(second.argmax()) != b
    assert toks[1] == b and toks[2] == b
    third = logits[3].clone()
    third[c] = float("-inf")
    assert toks[3] == int(third.argmax()) != c
    assert toks[4] == c
    assert toks[5] == [7, 9, 49][int(logits[5][[7, 9, 49]].argmax())]
    # the processed distribution: -inf exactly at the banned / disallowed ids
    x = s.processed_logits(logits.clone(), reqs)
    assert torch.isneginf(x[0]).nonzero().flatten().tolist() == sorted({b, c})
    assert torch.isneginf(x[5]).sum() == V - 3


def test_truncate_prompt_tokens_keeps_the_last_tokens(llm):
    tok = llm.get_tokenizer()
    eng = llm.llm_engine
    prompt = PROMPTS[2] * 3
    ids = tok.encode(prompt)
    got = llm.generate(prompt, greedy(truncate_prompt_tokens=5))[0]
    want = llm.generate([ids[-5:]], greedy())[0]
    assert got.prompt_token_ids == ids[-5:] and got.token_ids == want.token_ids
    assert llm.generate([ids], greedy(truncate_prompt_tokens=len(ids) + 4))[0].prompt_token_ids == ids
    # -1: a prompt longer than the context keeps what fits beside max_tokens
    long_ids = (ids * (eng.max_model_len // len(ids) + 2))[: eng.max_model_len + 7]
    out = llm.generate([long_ids], greedy(8, truncate_prompt_tokens=-1))[0]
    assert out.prompt_token_ids == long_ids[-(eng.max_model_len - 8):]
    assert out.token_ids == llm.generate([out.prompt_token_ids], greedy(8))[0].token_ids
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        llm.generate([ids], greedy(eng.max_model_len, truncate_prompt_tokens=-1))
    assert not eng.has_unfinished_requests() and eng.num_free_blocks == eng.num_total_blocks


@pytest.mark.parametrize("kw, match", [
    (dict(allowed_token_ids=[]), "allowed_token_ids is empty"),
    (dict(allowed_token_ids=[3, -1]), r"allowed_token_ids\[1\]"),
    (dict(allowed_token_ids="abc"), "allowed_token_ids must be a list"),
    (dict(bad_words="word"), "bad_words must be a list"),
    (dict(bad_words=["ok", "  "]), r"bad_words\[1\]"),
    (dict(bad_words=["x" * 513]), r"bad_words\[0\] is 513 characters"),
    (dict(bad_words_token_ids=[[1], []]), r"bad_words_token_ids\[1\]"),
    (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(truncate_prompt_tokens=-2), "truncate_prompt_tokens"),
])
def test_bad_values_name_the_field(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)


def test_ids_outside_the_vocabulary_are_refused_before_any_work(llm):
    eng = llm.llm_engine
    V = eng.model_config.vocab_size
    for kw, match in ((dict(allowed_token_ids=[1, V]), "allowed_token_ids"),
                      (dict(bad_words_token_ids=[[2, V + 3]]), r"bad_words_token_ids\[0\]")):
        with pytest.raises(ValueError, match=match):
            eng.add_request("r", [5, 6], greedy(**kw))
    assert not eng.has_unfinished_requests() and eng.num_free_blocks == eng.num_total_blocks


def test_a_structured_outputs_constraint_wins_over_allowed_token_ids_it_leaves_nothing_of(llm):
    """allowed_token_ids naming only letters under a digits-only regex: every step's intersection is empty, so the
    constraint's logits are kept (its output is the unrestricted constrained one); a list that meets the regex
    restricts it."""
    tok = llm.get_tokenizer()
    letters = [tok.encode(c, add_special_tokens=False)[0] for c in "abc"]
    digits = [tok.encode(c, add_special_tokens=False)[0] for c in "13"]
    regex = {"regex": "[0-9]{3}"}
    free = llm.generate(PROMPTS[0], greedy(8, structured_outputs=regex))[0]
    boxed = llm.generate(PROMPTS[0], greedy(8, structured_outputs=regex, allowed_token_ids=letters))[0]
    some = llm.generate(PROMPTS[0], greedy(8, structured_outputs=regex, allowed_token_ids=digits))[0]
    assert boxed.text == free.text and len(free.text) == 3 and free.text.isdigit()
    assert len(some.text) == 3 and set(some.text) <= set("13")
