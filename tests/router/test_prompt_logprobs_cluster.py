"""``prompt_logprobs`` and ``echo`` + ``logprobs`` through a real cluster: a router (gRPC and HTTP), a prefill and a
decode worker (gloo KV) on the built-in ``tiny`` model. A prompt of more than 8 tokens is prefilled on the prefill
worker (the logprobs come with its first token), a shorter one on the decode worker itself (conditional
disaggregation: its colocated Generate's first chunk carries them); both must equal the offline engine's. Over
HTTP the official ``openai`` client reads vLLM's fields: ``choices[i].prompt_logprobs`` (completions), the top-level
``prompt_logprobs`` (chat), and with ``echo`` the prompt's tokens first in the choice's ``logprobs`` block (the
first one null). One cluster for the module."""
from __future__ import annotations

import grpc
import httpx
import openai
import pytest
import torch

from engine import SamplingParams
from proto import pdserve_pb2
from tests.roles.harness import _offline_llm, start_roles

KEY = "prompt-logprobs-key-0123456789"
LONG = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"
SHORT = "import os"
K = 3


@pytest.fixture(scope="module")
def roles():
    torch.set_num_threads(1)
    r = start_roles(tag="plp-", router=dict(http_port=0, api_keys=(KEY,), local_prefill_max_tokens=8))
    yield r
    r.close()


@pytest.fixture(scope="module")
def client(roles):
    return openai.OpenAI(base_url=f"http://{roles.router.http_address}/v1", api_key=KEY, max_retries=0, timeout=120)


def reference(prompt, k: int = K, max_tokens: int = 4):
    """The offline engine's RequestOutput for the prompt (text or ids), greedy, asking prompt_logprobs=k."""
    return _offline_llm().generate([prompt], SamplingParams(max_tokens=max_tokens, temperature=0.0,
                                                            prompt_logprobs=k, logprobs=k))[0]


def collect(stub, **kw) -> list:
    return list(stub.Generate(pdserve_pb2.GenerateRequest(**kw), timeout=60,
                              metadata=(("authorization", f"Bearer {KEY}"),)))


def same(got_lp: float, want_lp: float) -> bool:
    return abs(got_lp - want_lp) < 1e-5


@pytest.mark.parametrize("prompt,pair", [(LONG, True), (SHORT, False)])
def test_grpc_prompt_logprobs_equal_the_offline_engines(roles, prompt, pair):
    ref = reference(prompt)
    assert len(ref.prompt_token_ids) > 8 if pair else len(ref.prompt_token_ids) <= 8
    steps = roles.prefills[0].engine.num_steps
    resps = collect(roles.stub, prompt=prompt, max_tokens=4, temperature=0.0, prompt_logprobs=K)
    assert (roles.prefills[0].engine.num_steps > steps) == pair  # the path this case means to test
    got = resps[0].prompt_logprobs
    assert len(got) == len(ref.prompt_token_ids) - 1
    assert all(not r.prompt_logprobs for r in resps[1:])
    for m, want in zip(got, ref.prompt_logprobs[1:]):
        assert m.token_id == want.token_id and same(m.logprob, want.logprob) and m.rank == want.rank
        assert [t.token_id for t in m.top] == [t for t, _ in want.top]
        assert all(same(t.logprob, v) for t, (_, v) in zip(m.top, want.top))
    assert [t for r in resps for t in r.token_ids] == ref.token_ids  # its output is the plain greedy one
    plain = collect(roles.stub, prompt=prompt, max_tokens=4, temperature=0.0)
    assert not plain[0].prompt_logprobs and [t for r in plain for t in r.token_ids] == ref.token_ids
    roles.wait_idle(10)


def test_grpc_n2_only_choice0_and_bad_values(roles):
    d_eng = roles.decodes[0].engine
    hits = d_eng.prefix_cache_hits
    resps = collect(roles.stub, prompt=LONG, max_tokens=3, temperature=0.0, n=2, prompt_logprobs=0)
    assert d_eng.prefix_cache_hits > hits  # choice 1 does not ask: it reuses the prompt's blocks as usual
    with_lps = [r for r in resps if r.prompt_logprobs]
    assert len(with_lps) == 1 and with_lps[0].index == 0
    ref = reference(LONG, 0)
    assert [m.token_id for m in with_lps[0].prompt_logprobs] == ref.prompt_token_ids[1:]
    assert all(not m.top for m in with_lps[0].prompt_logprobs)
    for kw in (dict(prompt_logprobs=SamplingParams.MAX_LOGPROBS + 1), dict(prompt_logprobs=-1),
               dict(prompt_logprobs=1, beam_width=2)):
        with pytest.raises(grpc.RpcError) as e:
            collect(roles.stub, prompt=SHORT, max_tokens=2, **kw)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "prompt_logprobs" in e.value.details()
    roles.wait_idle(10)


def check_vllm_shape(got: list, ref) -> None:
    """vLLM's prompt_logprobs JSON: None, then {token id: {logprob, rank, decoded_token}} with the actual token."""
    assert got[0] is None and len(got) == len(ref.prompt_token_ids)
    for entry, want in zip(got[1:], ref.prompt_logprobs[1:]):
        assert same(entry[str(want.token_id)]["logprob"], want.logprob)
        assert entry[str(want.token_id)]["rank"] == want.rank >= 1
        for rank, (t, v) in enumerate(want.top, 1):
            assert same(entry[str(t)]["logprob"], v)
            assert entry[str(t)]["rank"] == (want.rank if t == want.token_id else rank)


def test_openai_completions_and_chat_prompt_logprobs(roles, client):
    ref = reference(LONG)
    r = client.completions.create(model="tiny", prompt=LONG, max_tokens=4, temperature=0,
                                  extra_body={"prompt_logprobs": K})
    check_vllm_shape(r.choices[0].prompt_logprobs, ref)
    assert r.choices[0].text == ref.text
    msgs = [{"role": "user", "content": "Say hi."}]
    chat = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=3, temperature=0,
                                          extra_body={"prompt_logprobs": 1})
    ids = httpx.post(f"http://{roles.router.http_address}/tokenize", json={"model": "tiny", "messages": msgs},
                     headers={"authorization": f"Bearer {KEY}"}, timeout=60).json()["tokens"]
    check_vllm_shape(chat.prompt_logprobs, reference(ids, 1))
    plain = client.completions.create(model="tiny", prompt=LONG, max_tokens=4, temperature=0)
    assert getattr(plain.choices[0], "prompt_logprobs", None) is None
    with pytest.raises(openai.BadRequestError, match="prompt_logprobs"):
        client.completions.create(model="tiny", prompt=LONG, max_tokens=2, stream=True,
                                  extra_body={"prompt_logprobs": 1})
    roles.wait_idle(10)


@pytest.mark.parametrize("prompt", [LONG, SHORT])
def test_openai_echo_with_logprobs_puts_the_prompts_first(roles, client, prompt):
    ref = reference(prompt, 2)
    P = len(ref.prompt_token_ids)
    answer = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=2)
    echoed = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=2,
                                       echo=True, n=2)
    assert len(echoed.choices) == 2
    for c in echoed.choices:
        lp = c.logprobs
        assert c.text == prompt + answer.choices[0].text
        assert len(lp.tokens) == P + 4 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
        assert all(same(g, w.logprob) for g, w in zip(lp.token_logprobs[1:P], ref.prompt_logprobs[1:]))
        assert lp.token_logprobs[P:] == answer.choices[0].logprobs.token_logprobs
        assert lp.tokens[P:] == answer.choices[0].logprobs.tokens
        assert lp.text_offset[0] == 0 and lp.text_offset == sorted(lp.text_offset)
    parts = list(client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, logprobs=2,
                                           echo=True, stream=True))
    streamed = [t for p in parts if p.choices and p.choices[0].logprobs for t in p.choices[0].logprobs.token_logprobs]
    assert streamed == echoed.choices[0].logprobs.token_logprobs
    offsets = [o for p in parts if p.choices and p.choices[0].logprobs for o in p.choices[0].logprobs.text_offset]
    assert offsets == echoed.choices[0].logprobs.text_offset
    assert "".join(p.choices[0].text for p in parts if p.choices) == echoed.choices[0].text
    roles.wait_idle(10)
