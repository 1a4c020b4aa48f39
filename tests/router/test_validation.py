"""router.validation: each bad field is named; good requests become engine values."""
import pytest

from proto import pdserve_pb2
from router.validation import ModelLimits, validate_generate

LIMITS = ModelLimits(model_name="m", max_context_length=64, vocab_size=100, eos_token_id=2)


def tok(text: str) -> list[int]:
    # a stand-in tokenizer: one id per character, inside the vocabulary
    return [ord(c) % 100 for c in text]


def v(**kw):
    return validate_generate(pdserve_pb2.GenerateRequest(**kw), LIMITS, tok)


@pytest.mark.parametrize("kw, field", [
    (dict(), "prompt"),
    (dict(prompt="ab", token_ids=[1]), "token_ids"),
    (dict(token_ids=[1, 100]), "token_ids[1]"),
    (dict(token_ids=[-1]), "token_ids[0]"),
    (dict(prompt="ab", max_tokens=0), "max_tokens"),
    (dict(prompt="ab", max_tokens=-5), "max_tokens"),
    (dict(prompt="ab", max_tokens=63), "max_tokens"),          # 2 + 63 > 64
    (dict(prompt="x" * 64, max_tokens=1), "prompt"),
    (dict(prompt="ab", temperature=-1.0), "temperature"),
    (dict(prompt="ab", top_p=0.0), "top_p"),
    (dict(prompt="ab", top_p=1.5), "top_p"),
    (dict(prompt="ab", top_k=-2), "top_k"),
    (dict(prompt="ab", min_p=2.0), "min_p"),
    (dict(prompt="ab", repetition_penalty=0.0), "repetition_penalty"),
    (dict(prompt="ab", frequency_penalty=3.0), "frequency_penalty"),
    (dict(prompt="ab", presence_penalty=-3.0), "presence_penalty"),
    (dict(prompt="ab", typical_p=0.0), "typical_p"),
    (dict(prompt="ab", seed=2**63), "seed"),
    (dict(prompt="ab", logprobs=21), "logprobs"),
    (dict(prompt="ab", logprobs=-1), "logprobs"),
    (dict(prompt="ab", min_tokens=5, max_tokens=4), "min_tokens"),
    (dict(prompt="ab", stop=[""]), "stop"),
    (dict(prompt="ab", stop_token_ids=[100]), "stop_token_ids[0]"),
    (dict(prompt="ab", request_id="x" * 300), "request_id"),
    (dict(prompt="ab", allowed_token_ids=[3, 100]), "allowed_token_ids[1]"),
    (dict(prompt="ab", bad_words=["ok", " "]), "bad_words[1]"),
    (dict(prompt="ab", truncate_prompt_tokens=0), "truncate_prompt_tokens"),
    (dict(prompt="ab", beam_width=2, bad_words=["x"]), "bad_words"),
    (dict(prompt="ab", beam_width=2, allowed_token_ids=[5]), "allowed_token_ids"),
])
def test_bad_field_is_named(kw, field):
    with pytest.raises(ValueError) as ei:
        v(**kw)
    assert field in str(ei.value)


def test_defaults_and_values_carry_over():
    r = v(prompt="hello", max_tokens=5, temperature=0.7, top_k=3, seed=9, stop=["\n"], logprobs=2,
          stop_token_ids=[7], ignore_eos=True)
    assert r.prompt_token_ids == tok("hello")
    p = r.params
    assert (p.max_tokens, p.top_k, p.seed, p.stop, p.logprobs, p.stop_token_ids, p.ignore_eos) == \
        (5, 3, 9, ["\n"], 2, [7], True)
    # float32 on the wire: 0.7 arrives as 0.699999988; the request meant 0.7
    assert p.temperature == 0.7
    assert r.request_id  # one is made when the client gives none
    d = v(token_ids=[1, 2, 3]).params
    assert (d.max_tokens, d.temperature, d.top_p, d.seed, d.logprobs) == (16, 1.0, 1.0, None, None)


def test_exactly_fits_context():
    r = v(token_ids=[1] * 60, max_tokens=4)
    assert len(r.prompt_token_ids) + r.params.max_tokens == LIMITS.max_context_length


def test_limits_are_checked():
    with pytest.raises(ValueError, match="vocab_size"):
        ModelLimits(model_name="m", max_context_length=8, vocab_size=0)


class CharTokenizer:
    """A stand-in tokenizer object (what bad_words need): one id per character, except that a space and the
    character after it are one id (ord % 50), as words carry their leading space in a BPE vocabulary."""

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        out, i = [], 0
        while i < len(text):
            if text[i] == " " and i + 1 < len(text):
                out.append(ord(text[i + 1]) % 50)
                i += 2
            else:
                out.append(ord(text[i]) % 100)
                i += 1
        return out


def test_vllm_token_restrictions_carry_over_and_truncation_keeps_the_last_tokens():
    r = validate_generate(pdserve_pb2.GenerateRequest(prompt="hi", allowed_token_ids=[5, 9], bad_words=[" ab", "c"]),
                          LIMITS, tok, CharTokenizer())
    # each word (leading space stripped) alone, then after a space: " a" is one id (97 % 50), so both spellings
    assert r.params.allowed_token_ids == [5, 9]
    assert r.params.bad_words_token_ids == [[97, 98], [47, 98], [99], [49]]
    # a spelling after a space of another length is not a second spelling (vLLM's rule)
    assert validate_generate(pdserve_pb2.GenerateRequest(prompt="hi", bad_words=["ab"]), LIMITS, tok,
                             type("Plain", (), {"encode": lambda self, t, add_special_tokens=True: tok(t)})()
                             ).params.bad_words_token_ids == [[97, 98]]
    assert r.params.truncate_prompt_tokens is None and r.prompt == "hi"
    with pytest.raises(ValueError, match="bad_words needs the model's tokenizer"):
        v(prompt="hi", bad_words=["c"])
    # a prompt longer than the context is cut to its last tokens (the response's prompt is the kept tokens)
    cut = v(prompt="x" * 100 + "yz", truncate_prompt_tokens=5)
    assert cut.prompt_token_ids == tok("xxxyz") and cut.prompt is None
    assert v(prompt="abc", truncate_prompt_tokens=5).prompt == "abc"  # nothing cut: the text stays
    fit = v(token_ids=list(range(1, 81)), truncate_prompt_tokens=-1, max_tokens=4)
    assert fit.prompt_token_ids == list(range(21, 81))


def test_priority_needs_the_priority_policy():
    with pytest.raises(ValueError, match="--scheduling-policy priority"):
        v(prompt="hi", priority=-3)
    assert v(prompt="hi").params.priority == 0
    r = validate_generate(pdserve_pb2.GenerateRequest(prompt="hi", priority=-3), LIMITS, tok, allow_priority=True)
    assert r.params.priority == -3
    beams = validate_generate(pdserve_pb2.GenerateRequest(prompt="hi", priority=4, beam_width=2), LIMITS, tok,
                              allow_priority=True)
    assert beams.params.priority == 4  # (each beam step's sub-requests run at it: router/beam_search.py)


def test_reasoning_takes_the_routers_markers_and_the_budget_needs_it():
    from router.openai.reasoning import ReasoningMarkers

    marks = ReasoningMarkers(start=(60, 61), end=(62, 63))

    def r(**kw):
        return validate_generate(pdserve_pb2.GenerateRequest(**kw), LIMITS, tok, reasoning=marks)

    p = r(token_ids=[5, 6, 7], reasoning=True, thinking_token_budget=4).params
    assert (p.reasoning_end_token_ids, p.reasoning_start_token_ids, p.thinking_token_budget) == ([62, 63], [60, 61], 4)
    # a prompt that opened the block itself (DeepSeek-R1's "<think>\n"): the answer writes no start marker
    p = r(token_ids=[5, 60, 61, 10], reasoning=True, thinking_token_budget=0).params
    assert p.reasoning_start_token_ids is None and p.thinking_token_budget == 0
    plain = r(token_ids=[5, 6]).params
    assert plain.reasoning_end_token_ids is None and plain.thinking_token_budget is None
    with pytest.raises(ValueError, match="^thinking_token_budget needs reasoning"):
        r(token_ids=[5], thinking_token_budget=3)
    with pytest.raises(ValueError, match="^thinking_token_budget must be >= 0"):
        r(token_ids=[5], reasoning=True, thinking_token_budget=-1)
    with pytest.raises(ValueError, match="^reasoning needs a router started with --reasoning-parser"):
        v(token_ids=[5], reasoning=True)
    with pytest.raises(ValueError, match="^thinking_token_budget cannot be used with beam_width"):
        r(token_ids=[5], reasoning=True, thinking_token_budget=2, beam_width=2)


@pytest.mark.parametrize("labels, serves", [(0, r"embeddings \(/v1/embeddings"), (1, r"pair scores \(/v1/score"),
                                            (3, r"classifications \(/classify\)")])
def test_generation_to_an_encoder_is_refused_naming_what_it_serves(labels, serves):
    import dataclasses

    from engine import PoolingConfig

    enc = dataclasses.replace(LIMITS, pooling=PoolingConfig(encoder=True, num_labels=labels))
    with pytest.raises(ValueError, match=rf"^model: m is an encoder: it serves {serves}.*, not generation$"):
        validate_generate(pdserve_pb2.GenerateRequest(prompt="a", max_tokens=2), enc, lambda s: [1])
    # a decoder embedding model (pooling known, not an encoder) still generates
    dec = dataclasses.replace(LIMITS, pooling=PoolingConfig())
    assert validate_generate(pdserve_pb2.GenerateRequest(prompt="a", max_tokens=2), dec, lambda s: [1]) is not None
