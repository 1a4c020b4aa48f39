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
