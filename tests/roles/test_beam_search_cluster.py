"""Beam search through the cluster: gRPC ``beam_width`` and HTTP ``use_beam_search`` (the official ``openai``
client), over the real router, prefill and decode workers and gloo KV, and a colocated cluster.

The reference is the offline engine's ``LLM.beam_search`` (itself held to transformers' ``generate(num_beams=...)``
by tests/engine/test_beam_search.py): the same ranked sequences, finish reasons and texts, scores within 1e-4.
The router runs the search over per-beam top-2W log-probs the workers send; these tests also hold it to its
routing (only the first step prefills on the prefill pool), its validation (INVALID_ARGUMENT / 400 naming the
field), cancellation and its cleanup (every worker idle with all blocks free afterwards).
"""
from __future__ import annotations

import threading
import time

import grpc
import httpx
import openai
import pytest
import torch

from engine import BeamSearchParams
from proto import pdserve_pb2
from tests.roles.harness import offline_beams, start_colocated, start_roles
from tests.waiting import wait_until

KEY = "unused"  # the openai client needs one; this router checks none
TOKEN_PROMPT = list(range(300, 341))
# A finished-looking module: the trained tiny's beams then really choose EOS (one beam ranks first with it at
# length_penalty 1), so "stop" hypotheses and their scores are part of the comparison.
CODE_PROMPT = "        return x\n\n\nif __name__ == \"__main__\":\n    test()\n"

CASES = [  # (prompt, beam_width, max_tokens, length_penalty, early_stopping)
    ("code", 4, 10, 1.0, False),
    ("code", 2, 8, 0.0, True),
    ("ids", 3, 8, 2.0, "never"),
    ("ids", 1, 6, 1.0, False),
]


@pytest.fixture(scope="module")
def roles():
    torch.set_num_threads(1)
    r = start_roles(tag="beam-", router=dict(http_port=0))
    yield r
    r.close()


def _ids(roles, prompt: str) -> list[int]:
    return TOKEN_PROMPT if prompt == "ids" else roles.router.tokenizer.encode(CODE_PROMPT)


def _grpc_beams(roles, ids: list[int], timeout: float = 120, **kw) -> list:
    return list(roles.stub.Generate(pdserve_pb2.GenerateRequest(token_ids=ids, **kw), timeout=timeout))


def _same(resps: list, want: list, n_prompt: int) -> None:
    """The cluster's ranked answer equals the offline search's."""
    assert [r.index for r in resps] == list(range(len(want)))
    for r, w in zip(resps, want):
        assert list(r.token_ids) == w.tokens[n_prompt:]
        assert (r.finish_reason, r.text) == (w.finish_reason, w.text)
        assert r.score == pytest.approx(w.score, abs=1e-4) and r.cum_logprob == pytest.approx(w.cum_logprob, abs=1e-4)
    scores = [r.score for r in resps]
    assert scores == sorted(scores, reverse=True)


@pytest.mark.parametrize("prompt,width,max_tokens,penalty,early", CASES)
def test_grpc_beams_equal_offline(roles, prompt, width, max_tokens, penalty, early):
    ids = _ids(roles, prompt)
    want = offline_beams(ids, BeamSearchParams(beam_width=width, max_tokens=max_tokens, length_penalty=penalty,
                                               early_stopping=early))
    assert len(want) == width
    p_eng = roles.prefills[0].engine
    queried = p_eng.prefix_cache_queries
    resps = _grpc_beams(roles, ids, beam_width=width, max_tokens=max_tokens, length_penalty=penalty,
                        early_stopping=str(early).lower())
    _same(resps, want, len(ids))
    # usage and timings once, on the last message; completion tokens over every returned beam
    assert [r.HasField("usage") for r in resps] == [False] * (width - 1) + [True]
    assert resps[-1].usage.prompt_tokens == len(ids)
    assert resps[-1].usage.completion_tokens == sum(len(r.token_ids) for r in resps)
    assert resps[-1].timings.total_s > 0
    # only the first step (the prompt) goes to the prefill pool; the beams run on where their history is cached
    assert p_eng.prefix_cache_queries - queried == len(ids)
    assert roles.wait_idle(10.0)


def test_eos_is_really_chosen(roles):
    """The comparison above covers finished-on-EOS hypotheses, not only max_tokens ones."""
    ids = _ids(roles, "code")
    resps = _grpc_beams(roles, ids, beam_width=4, max_tokens=10)
    assert {r.finish_reason for r in resps} == {"stop", "length"}
    assert roles.wait_idle(10.0)


@pytest.mark.parametrize("fields,named", [
    (dict(beam_width=0), "beam_width"),
    (dict(beam_width=11), "beam_width"),
    (dict(beam_width=2, n=2), "n"),
    (dict(beam_width=2, temperature=0.7), "temperature"),
    (dict(beam_width=2, seed=3), "seed"),
    (dict(beam_width=2, logprobs=1), "logprobs"),
    (dict(beam_width=2, top_k=5), "top_k"),
    (dict(beam_width=2, stop=["\n"]), "stop"),
    (dict(beam_width=2, logit_bias={5: 1.0}), "logit_bias"),
    (dict(beam_width=2, early_stopping="sometimes"), "early_stopping"),
    (dict(beam_width=2, length_penalty=float("nan")), "length_penalty"),
    (dict(length_penalty=2.0), "length_penalty"),
    (dict(early_stopping="true"), "early_stopping"),
    (dict(beam_width=2, max_tokens=5000), "max_tokens"),
])
def test_bad_beam_requests_are_invalid_argument(roles, fields, named):
    with pytest.raises(grpc.RpcError) as e:
        _grpc_beams(roles, TOKEN_PROMPT, timeout=30, **{"max_tokens": 4, **fields})
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert named in e.value.details()
    assert roles.wait_idle(5.0)


def test_temperature_zero_is_accepted(roles):
    resps = _grpc_beams(roles, TOKEN_PROMPT, beam_width=2, max_tokens=3, temperature=0.0)
    assert len(resps) == 2 and roles.wait_idle(10.0)


def test_cancel_stops_the_search_and_frees_everything(roles):
    """A long search (8 beams x 200 steps) cancelled once it is under way: the flow ends at once (the router
    holds nothing in flight) and every worker is idle with all blocks free."""
    d_eng = roles.decodes[0].engine
    before = d_eng.prefix_cache_queries
    call = roles.stub.Generate(pdserve_pb2.GenerateRequest(token_ids=TOKEN_PROMPT, beam_width=8, max_tokens=200,
                                                           ignore_eos=True), timeout=300)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(_drain(call)), daemon=True)
    reader.start()
    # the decode worker scores beams: step 2 is under way
    wait_until(lambda: d_eng.prefix_cache_queries != before, timeout=60, interval=0.01,
               message="the search started")
    start_queries = d_eng.prefix_cache_queries
    call.cancel()
    reader.join(30)
    assert got == [grpc.StatusCode.CANCELLED]
    wait_until(lambda: not roles.router.num_in_flight, timeout=10, interval=0.01,
               message="the beam search ended after the cancel")
    assert roles.wait_idle(10.0)
    # 8 beams x 200 steps is ~1600 sub-requests; a cancelled search stopped far short of that
    assert d_eng.prefix_cache_queries - start_queries < 400 * (len(TOKEN_PROMPT) + 200)


def test_a_cancel_before_the_flow_exists_still_stops_it(roles):
    """The race behind a CI failure: the client cancels between the router taking the call and registering the
    flow's cancel. The gRPC front end's ``_Cancels`` then runs the flow's cancel as it registers: the flow must
    be cancelled at once, not run its 1600 sub-requests to the end."""
    from router.events import FlowError
    from router.server import _Cancels
    from router.validation import validate_generate

    core = roles.router.core
    cancels = _Cancels()
    cancels.fire()  # the RPC ended before the flow existed
    d_eng = roles.decodes[0].engine
    before = d_eng.prefix_cache_queries
    req = pdserve_pb2.GenerateRequest(token_ids=TOKEN_PROMPT, beam_width=8, max_tokens=200, ignore_eos=True)
    vreq = validate_generate(req, core.limits, core.tokenize)
    with pytest.raises(FlowError) as err:
        list(core.generate(vreq, time.monotonic(), None, cancels.register, push=True))
    assert err.value.code == grpc.StatusCode.CANCELLED, err.value
    assert d_eng.prefix_cache_queries == before  # no beam reached a decode worker
    assert roles.wait_idle(10.0)


def _drain(call) -> object:
    try:
        list(call)
        return "finished"
    except grpc.RpcError as e:
        return e.code()


# ---- HTTP: vLLM's use_beam_search through the official openai client ------------------------------------------
@pytest.fixture(scope="module")
def client(roles):
    return openai.OpenAI(base_url=f"http://{roles.router.http_address}/v1", api_key=KEY, max_retries=0, timeout=120)


def test_http_completion_beams_equal_offline(roles, client):
    ids = _ids(roles, "code")
    want = offline_beams(ids, BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=0.5))
    r = client.completions.create(model="tiny", prompt=CODE_PROMPT, n=3, max_tokens=8,
                                  extra_body={"use_beam_search": True, "length_penalty": 0.5})
    assert [(c.index, c.text, c.finish_reason) for c in r.choices] == \
        [(i, w.text, w.finish_reason) for i, w in enumerate(want)]
    assert r.usage.prompt_tokens == len(ids)
    assert r.usage.completion_tokens == sum(len(w.tokens) - len(ids) for w in want)
    assert roles.wait_idle(10.0)


def test_http_chat_beams_equal_offline(roles, client):
    tok = roles.router.tokenizer
    msgs = [{"role": "user", "content": "A loop, please."}]
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False)
    want = offline_beams(ids, BeamSearchParams(beam_width=2, max_tokens=6, early_stopping=True))
    r = client.chat.completions.create(model="tiny", messages=msgs, n=2, max_completion_tokens=6,
                                       extra_body={"use_beam_search": True, "early_stopping": True})
    assert [c.message.content for c in r.choices] == [w.text for w in want]
    assert roles.wait_idle(10.0)


@pytest.mark.parametrize("body,named", [
    (dict(n=2, stream=True), "stream"),
    (dict(n=11), "n"),
    (dict(n=2, logprobs=2), "logprobs"),
    (dict(n=2, temperature=0.8), "temperature"),
])
def test_http_bad_beam_requests_are_400(roles, body, named):
    r = httpx.post(f"http://{roles.router.http_address}/v1/completions", timeout=30,
                   json={"model": "tiny", "prompt": "x = 1", "max_tokens": 4, "use_beam_search": True, **body})
    assert r.status_code == 400, r.text
    assert named in r.json()["error"]["message"]


def test_http_length_penalty_without_beams_is_400(roles):
    r = httpx.post(f"http://{roles.router.http_address}/v1/completions", timeout=30,
                   json={"model": "tiny", "prompt": "x = 1", "max_tokens": 4, "length_penalty": 2.0})
    assert r.status_code == 400 and "use_beam_search" in r.json()["error"]["message"]


# ---- colocated mode ---------------------------------------------------------------------------------------------
def test_colocated_beams_equal_offline():
    torch.set_num_threads(1)
    r = start_colocated(tag="beamco-")
    try:
        want = offline_beams(TOKEN_PROMPT, BeamSearchParams(beam_width=3, max_tokens=8, length_penalty=1.5))
        resps = _grpc_beams(r, TOKEN_PROMPT, beam_width=3, max_tokens=8, length_penalty=1.5)
        _same(resps, want, len(TOKEN_PROMPT))
        assert r.wait_idle(10.0)
    finally:
        r.close()
