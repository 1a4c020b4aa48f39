"""Cheap limits before costly work: oversized prompts and stop lists are refused before tokenizing, and a
message gRPC cannot parse (invalid UTF-8, truncated) is INVALID_ARGUMENT, over a real gRPC server."""
from __future__ import annotations

import grpc
import pytest

from proto import pdserve_pb2, pdserve_pb2_grpc
from router import RouterConfig, RouterServer, StaticWorkerSource
from router.validation import (MAX_STOP_STRING_CHARS, MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, ModelLimits,
                               validate_generate)

LIMITS = ModelLimits(model_name="m", max_context_length=64, vocab_size=100, max_prompt_bytes=63 * 4)


class CountingTokenizer:
    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, text: str) -> list[int]:
        self.calls += 1
        return [ord(c) % 100 for c in text][:10]


@pytest.mark.parametrize("kw, field", [
    (dict(prompt="x" * (63 * 4 + 1)), "prompt is 253 bytes"),
    (dict(prompt="é" * 127), "prompt is 254 bytes"),  # 2 bytes each: counted in bytes, not characters
    (dict(prompt="ab", stop=["s"] * (MAX_STOP_STRINGS + 1)), "stop has"),
    (dict(prompt="ab", stop=["ok", "s" * (MAX_STOP_STRING_CHARS + 1)]), "stop[1]"),
    (dict(prompt="ab", stop_token_ids=[1] * (MAX_STOP_TOKEN_IDS + 1)), "stop_token_ids has"),
    (dict(token_ids=[1] * 64), "token_ids has 64 tokens"),
])
def test_refused_before_tokenizing(kw, field):
    tok = CountingTokenizer()
    with pytest.raises(ValueError) as e:
        validate_generate(pdserve_pb2.GenerateRequest(**kw), LIMITS, tok)
    assert field in str(e.value)
    assert tok.calls == 0


def test_limits_admit_what_fits():
    tok = CountingTokenizer()
    r = validate_generate(pdserve_pb2.GenerateRequest(prompt="x" * (63 * 4), stop=["s" * MAX_STOP_STRING_CHARS] *
                                                      MAX_STOP_STRINGS, max_tokens=4), LIMITS, tok)
    assert tok.calls == 1 and len(r.params.stop) == MAX_STOP_STRINGS


def test_builtin_bound_is_sound():
    """No text of the built-in tokenizer's own vocabulary yields fewer tokens than its byte bound claims."""
    from engine import Tokenizer

    t = Tokenizer.builtin()
    per_token = t.max_input_bytes_per_token()
    for text in ("def f(x):\n    return x" * 50, " " * 5000, "\n" * 3000, "é€😀" * 300, "a" * 4000):
        assert len(t.encode(text, add_special_tokens=False)) * per_token >= len(text.encode())


@pytest.fixture(scope="module")
def router():
    r = RouterServer(RouterConfig(serve_metrics=False), StaticWorkerSource()).start()
    yield r
    r.stop()


def _raw_generate(addr: str, payload: bytes) -> grpc.RpcError:
    with grpc.insecure_channel(addr) as ch:
        call = ch.unary_stream("/pdserve.v1.PDServe/Generate", request_serializer=None,
                               response_deserializer=pdserve_pb2.GenerateResponse.FromString)
        with pytest.raises(grpc.RpcError) as e:
            list(call(payload, timeout=10))
        return e.value


def test_undecodable_messages_are_invalid_argument(router):
    good = pdserve_pb2.GenerateRequest(prompt="hello", max_tokens=2).SerializeToString()
    bad_utf8 = good.replace(b"hello", b"h\xffllo")
    truncated = good[:-3]
    for payload in (bad_utf8, truncated):
        err = _raw_generate(router.address, payload)
        assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err
        assert "pdserve.v1.GenerateRequest" in err.details()


def test_huge_prompt_is_rejected_by_size(router):
    huge = ("def f(x):\n" * 400_000)[:3_900_000]  # the 3.9 MB prompt of the issue (under gRPC's 4 MiB)
    with grpc.insecure_channel(router.address) as ch:
        stub = pdserve_pb2_grpc.PDServeStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            list(stub.Generate(pdserve_pb2.GenerateRequest(prompt=huge, max_tokens=1), timeout=30))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "prompt is 3900000 bytes" in e.value.details()
