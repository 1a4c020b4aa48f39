"""n > 1 for real: the choices of one prompt share one prefill and one KV transfer, each with its own seeded
stream (choice i samples with seed + i), through the real router, workers and gloo KV.

References: the offline engine, one request per choice with that choice's seed. Sharing is read from the
engines' own counters: the prefill engine admits the prompt once; on the decode worker every sibling finds the
prompt's full blocks in its prefix cache (they arrived by the one transfer) and computes only the tail.
"""
from __future__ import annotations

from collections import defaultdict

import grpc
import pytest
import torch

from engine import SamplingParams
from proto import pdserve_pb2
from tests.roles.harness import offline, start_colocated, start_roles

PROMPT_IDS = list(range(300, 341))  # 41 tokens: 2 full blocks of 16 + 9
SEEDED = dict(max_tokens=12, temperature=0.9, top_p=0.95, seed=40, ignore_eos=True)


def _by_choice(resps) -> tuple[dict, dict, list]:
    ids, reasons = defaultdict(list), {}
    for r in resps:
        ids[r.index] += list(r.token_ids)
        if r.finish_reason:
            reasons[r.index] = r.finish_reason
    return dict(ids), reasons, [r for r in resps if r.HasField("usage")]


def _want(n: int, **kw) -> list:
    seed = kw.pop("seed", None)
    return [offline([PROMPT_IDS], [SamplingParams(**kw, seed=None if seed is None else seed + i)])[0][0]
            for i in range(n)]


@pytest.fixture(scope="module")
def roles():
    torch.set_num_threads(1)
    r = start_roles(tag="nch-")
    yield r
    r.close()


def test_seeded_choices_share_one_prefill_and_one_transfer(roles):
    p_eng, d_eng = roles.prefills[0].engine, roles.decodes[0].engine
    q_p, h_d = p_eng.prefix_cache_queries, d_eng.prefix_cache_hits
    resps = list(roles.stub.Generate(pdserve_pb2.GenerateRequest(token_ids=PROMPT_IDS, n=3, **SEEDED), timeout=60))
    ids, reasons, with_usage = _by_choice(resps)
    assert ids == dict(enumerate(_want(3, **SEEDED)))
    assert reasons == {0: "length", 1: "length", 2: "length"}
    assert len(with_usage) == 1 and resps[-1] is with_usage[0]  # usage once, on the request's last message
    assert (with_usage[0].usage.prompt_tokens, with_usage[0].usage.completion_tokens) == (41, 36)
    assert p_eng.prefix_cache_queries - q_p == 41  # the prefill worker saw the prompt once
    assert d_eng.prefix_cache_hits - h_d == 2 * 32  # each sibling reused the 2 full blocks that arrived
    assert roles.wait_idle(5.0)


def test_greedy_choices_are_identical_and_equal_offline(roles):
    greedy = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
    resps = list(roles.stub.Generate(pdserve_pb2.GenerateRequest(token_ids=PROMPT_IDS, n=2, **greedy), timeout=60))
    ids, _, _ = _by_choice(resps)
    want = _want(1, **greedy)[0]
    assert ids == {0: want, 1: want}
    assert roles.wait_idle(5.0)


def test_a_stop_string_ends_only_its_choice(roles):
    """Choice 1 meets a stop string early: it alone is aborted on the decode worker (the engine computes far fewer
    tokens than when it runs to max_tokens); the others run on, each equal to offline."""
    kw = {**SEEDED, "max_tokens": 60}
    tok = roles.router.tokenizer
    texts = [tok.decode(t) for t in _want(3, **kw)]
    # a 3-character piece early in choice 1's text that the other choices never produce (seed 40 has one)
    stop = next((texts[1][i:i + 3] for i in range(2, min(30, len(texts[1]) - 3))
                 if texts[1][i:i + 3].strip() and texts[1][i:i + 3] not in texts[0] + texts[2]), None)
    assert stop is not None, texts
    want = [offline([PROMPT_IDS], [SamplingParams(**{**kw, "seed": 40 + i}, stop=[stop])])[0] for i in range(3)]
    d_eng = roles.decodes[0].engine

    def run(stops: list[str]) -> tuple[list, int]:
        before = d_eng.num_scheduled_tokens
        resps = list(roles.stub.Generate(pdserve_pb2.GenerateRequest(token_ids=PROMPT_IDS, n=3, stop=stops, **kw),
                                         timeout=60))
        assert roles.wait_idle(5.0)
        return resps, d_eng.num_scheduled_tokens - before

    _, full_work = run([])
    resps, stopped_work = run([stop])
    got_text, reasons = defaultdict(str), {}
    for r in resps:
        got_text[r.index] += r.text
        if r.finish_reason:
            reasons[r.index] = r.finish_reason
    assert [got_text[i] for i in range(3)] == [w[1] for w in want]
    assert reasons == {0: "length", 1: "stop", 2: "length"}
    stopped_at = len(want[1][0])
    # choice 1 stopped after stopped_at of 60 tokens; without the worker-side abort it would run all 60
    assert stopped_work < full_work - (60 - stopped_at) // 2, (stopped_work, full_work, stopped_at)


@pytest.mark.parametrize("mode", ["local-prefill", "colocated"])
def test_whole_request_paths_share_the_prompt_too(mode):
    torch.set_num_threads(1)
    r = (start_roles(tag="nchl-", router=dict(local_prefill_max_tokens=1000)) if mode == "local-prefill"
         else start_colocated(n=1, tag="nchc-"))
    try:
        eng = r.decodes[0].engine
        h = eng.prefix_cache_hits
        resps = list(r.stub.Generate(pdserve_pb2.GenerateRequest(token_ids=PROMPT_IDS, n=3, **SEEDED), timeout=60))
        ids, _, _ = _by_choice(resps)
        assert ids == dict(enumerate(_want(3, **SEEDED)))
        assert eng.prefix_cache_hits - h == 2 * 32  # siblings started after choice 0's prefill, from its blocks
        assert r.wait_idle(5.0)
    finally:
        r.close()


@pytest.mark.parametrize("n", [0, 17])
def test_bad_n_is_invalid_argument(roles, n):
    with pytest.raises(grpc.RpcError) as e:
        list(roles.stub.Generate(pdserve_pb2.GenerateRequest(token_ids=[5, 6], n=n), timeout=10))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n must be" in e.value.details()


def test_cancel_frees_every_choice(roles):
    s = roles.stub.Generate(pdserve_pb2.GenerateRequest(token_ids=PROMPT_IDS, n=3, max_tokens=1500,
                                                        temperature=0.0, ignore_eos=True), timeout=60)
    seen = set()
    for r in s:
        seen.add(r.index)
        if len(seen) == 3:
            break
    s.cancel()
    assert roles.wait_idle(10.0)
