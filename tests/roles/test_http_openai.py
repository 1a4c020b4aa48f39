"""The OpenAI-compatible HTTP API, driven by the official ``openai`` client (and raw httpx for SSE details and a
disconnect), over the real router, prefill and decode workers and gloo KV. Greedy text equals the offline
engine's; errors come back in OpenAI's shape with the matching HTTP status; a client that goes away frees the
request's blocks on both workers."""
from __future__ import annotations

import concurrent.futures
import json
import re

import grpc
import httpx
import openai
import pytest
import torch

from engine import SamplingParams
from tests.roles.harness import counter_values, offline, start_roles
from tests.waiting import wait_until

KEY = "http-test-key-0123456789"


@pytest.fixture(scope="module")
def roles():
    torch.set_num_threads(1)
    r = start_roles(tag="http-", router=dict(http_port=0, api_keys=(KEY,), max_num_requests=8,
                                             allow_prefix_cache_reset=True))
    yield r
    r.close()


@pytest.fixture(scope="module")
def client(roles):
    return openai.OpenAI(base_url=f"http://{roles.router.http_address}/v1", api_key=KEY, max_retries=0, timeout=60)


def _offline_text(prompt, **kw) -> tuple:
    ids, text, reason, _ = offline([prompt], [SamplingParams(**kw)])[0]
    return ids, text, reason


def test_models_health_metrics(roles, client):
    assert [m.id for m in client.models.list().data] == ["tiny"]
    base = f"http://{roles.router.http_address}"
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200  # open without a key
    # vLLM's /ping (GET and POST, SageMaker's health check) and /version
    assert httpx.get(f"{base}/ping", timeout=10).status_code == httpx.post(f"{base}/ping", timeout=10).status_code == 200
    from importlib.metadata import version

    assert httpx.get(f"{base}/version", timeout=10).json() == {"version": version("pdserve")}
    m = httpx.get(f"{base}/metrics", timeout=10)
    assert m.status_code == 200 and "pdserve:request_success_total" in m.text


def test_completion_equals_offline_with_usage_and_logprobs(client):
    ids, text, reason = _offline_text("def add(a, b):", max_tokens=12, temperature=0.0, ignore_eos=True)
    r = client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=12, temperature=0,
                                  logprobs=2, extra_body={"ignore_eos": True})
    c = r.choices[0]
    assert (c.text, c.finish_reason) == (text, reason) == (text, "length")
    assert r.usage.completion_tokens == 12 and r.usage.total_tokens == r.usage.prompt_tokens + 12
    assert len(c.logprobs.tokens) == 12 and all(len(t) <= 3 for t in c.logprobs.top_logprobs)
    # 8 prompt tokens fill no 16-token block, so nothing of it can come from a prefix cache
    assert (r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens) == (8, 0)


def test_streamed_completion_and_chat(client, roles):
    _, text, _ = _offline_text("import os", max_tokens=10, temperature=0.0, ignore_eos=True)
    chunks = list(client.completions.create(model="tiny", prompt="import os", max_tokens=10, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == text
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    # chat: the template renders, the engine continues the rendered ids exactly as offline
    tok = roles.router.tokenizer
    msgs = [{"role": "system", "content": "You write Python."}, {"role": "user", "content": "A loop, please."}]
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False)
    want = offline([ids], [SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)])[0][1]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_completion_tokens=8, temperature=0,
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want and r.usage.prompt_tokens == len(ids)
    streamed = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=8, temperature=0,
                                              stream=True, extra_body={"ignore_eos": True})
    parts = list(streamed)
    assert parts[0].choices[0].delta.role == "assistant"
    assert "".join(p.choices[0].delta.content or "" for p in parts) == want


def test_batch_prompts_and_n_with_seeds(client):
    kw = dict(max_tokens=6, temperature=0.9, seed=11, ignore_eos=True)
    r = client.completions.create(model="tiny", prompt=["a = 1", "b = 2"], n=2, max_tokens=6, temperature=0.9,
                                  seed=11, extra_body={"ignore_eos": True})
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    want = [offline([p], [SamplingParams(**{**kw, "seed": 11 + i})])[0][1] for p in ("a = 1", "b = 2") for i in (0, 1)]
    assert [c.text for c in r.choices] == want
    ids = client.completions.create(model="tiny", prompt=[5, 6, 7, 8], max_tokens=4, temperature=0,
                                    extra_body={"ignore_eos": True})
    assert ids.choices[0].text == offline([[5, 6, 7, 8]], [SamplingParams(max_tokens=4, temperature=0.0,
                                                                          ignore_eos=True)])[0][1]


def test_errors_have_openai_shape_and_status(roles, client):
    with pytest.raises(openai.NotFoundError) as e:
        client.completions.create(model="gpt-4", prompt="x", max_tokens=2)
    assert "gpt-4" in str(e.value)
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, temperature=-1)
    assert "temperature" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=10**6)
    assert "max_tokens" in e.value.body["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model="tiny", messages=[], max_tokens=2)
    bad_key = openai.OpenAI(base_url=f"http://{roles.router.http_address}/v1", api_key="nope", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()
    raw = httpx.post(f"http://{roles.router.http_address}/v1/completions", content=b"{not json",
                     headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"}, timeout=10)
    assert raw.status_code == 400 and "error" in raw.json()


def test_disconnect_cancels_and_frees_blocks(roles):
    gen = lambda: counter_values(roles.router.metrics, "pdserve:generation_tokens").get("", 0.0)  # noqa: E731
    errors = lambda: counter_values(roles.router.metrics, "pdserve:request_errors", "code")  # noqa: E731
    before, errors_before = gen(), errors()
    url = f"http://{roles.router.http_address}/v1/completions"
    body = {"model": "tiny", "prompt": "def forever():", "max_tokens": 1500, "temperature": 0, "stream": True,
            "ignore_eos": True}
    with httpx.stream("POST", url, json=body, headers={"authorization": f"Bearer {KEY}"}, timeout=60) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["choices"][0]["index"] == 0
    # the client closed the stream after one chunk: both workers drop the request and free its blocks
    assert roles.wait_idle(20.0)
    # the router notices the disconnect on its own thread, possibly after the workers have freed everything
    wait_until(lambda: roles.router.num_in_flight == 0, timeout=20, interval=0.01,
               message="the router dropped the disconnected request")
    assert gen() - before < 1500  # it was cut short, not run to its 1500 tokens
    # a client that went away is not an error of the service (it was counted as UNAVAILABLE: a lost worker)
    assert errors() == errors_before, (errors_before, errors())


def test_logit_bias_reaches_the_workers(client):
    """logit_bias goes router -> wire -> worker sampler: the cluster's output equals offline with the same bias."""
    bias = {42: 100.0, 7: -100.0}
    want = offline(["x = "], [SamplingParams(max_tokens=5, temperature=0.0, ignore_eos=True, logit_bias=bias)])[0]
    assert want[0] == [42] * 5  # a +100 bias forces the token (independent of the model's weights)
    r = client.completions.create(model="tiny", prompt="x = ", max_tokens=5, temperature=0,
                                  logit_bias={"42": 100, "7": -100}, extra_body={"ignore_eos": True})
    assert r.choices[0].text == want[1]
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt="x", max_tokens=2, logit_bias={"99999": 1})
    assert "logit_bias" in e.value.body["message"]


def test_vllm_token_restrictions_reach_the_worker_that_draws_each_token(client):
    """vLLM's allowed_token_ids, bad_words and truncate_prompt_tokens through the split: the prefill worker draws
    the first token and the decode worker the rest (the router ships the words' tokens to both), the router cuts
    the prompt. Each answer equals the offline engine's under the same restrictions, which really change the
    plain answer: its first token (drawn by prefill) is not allowed, a word it says later is banned."""
    from tests.roles.harness import _offline_llm

    prompt = "def parse(argv):"
    base = dict(max_tokens=10, temperature=0.0, ignore_eos=True)
    plain_ids, plain, _, _ = offline([prompt], [SamplingParams(**base)])[0]
    allowed = [t for t in range(5, 300) if t != plain_ids[0]]
    words = plain.split()[:2]
    want_a = offline([prompt], [SamplingParams(**base, allowed_token_ids=allowed)])[0]
    want_b = offline([prompt], [SamplingParams(**base, bad_words=words)])[0]
    assert want_a[0][0] != plain_ids[0] and want_b[0][0] == plain_ids[0] and want_b[1] != plain
    extra = {"ignore_eos": True}
    r = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0,
                                  extra_body={**extra, "allowed_token_ids": allowed})
    assert r.choices[0].text == want_a[1]
    chunks = client.completions.create(model="tiny", prompt=prompt, max_tokens=10, temperature=0, stream=True,
                                       extra_body={**extra, "bad_words": words})
    assert "".join(c.choices[0].text for c in chunks) == want_b[1]
    # the prompt's last 4 tokens only: usage counts them, echo shows their text
    ids = _offline_llm().get_tokenizer().encode(prompt * 3)
    want_t = offline([ids[-4:]], [SamplingParams(**base)])[0]
    r = client.completions.create(model="tiny", prompt=prompt * 3, max_tokens=10, temperature=0, echo=True,
                                  extra_body={**extra, "truncate_prompt_tokens": 4})
    assert r.usage.prompt_tokens == 4
    assert r.choices[0].text == _offline_llm().get_tokenizer().decode(ids[-4:], False) + want_t[1]
    for body, field in (({"allowed_token_ids": [1, 10**6]}, "allowed_token_ids[1]"),
                        ({"allowed_token_ids": []}, "allowed_token_ids"),
                        ({"bad_words": ["ok", "  "]}, "bad_words[1]"),
                        ({"truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
                        ({"priority": 3}, "priority"),  # (this cluster schedules first-come-first-served)
                        ({"use_beam_search": True, "n": 2, "bad_words": ["x"]}, "bad_words")):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0, extra_body=body)
        assert field in e.value.body["message"], (body, e.value.body)


def test_return_tokens_as_token_ids_names_each_logprob_token_by_its_id(client):
    """vLLM's return_tokens_as_token_ids (what RL trainers read exact token ids from): the completions and chat
    logprobs blocks name every token, chosen and alternative, "token_id:<id>", the ids the offline engine gives."""
    kw = dict(max_tokens=6, temperature=0.0, ignore_eos=True)
    ids = offline(["def add(a, b):"], [SamplingParams(**kw, logprobs=2)])[0]
    want = [f"token_id:{t}" for t in ids[0]]
    extra = {"ignore_eos": True, "return_tokens_as_token_ids": True}
    r = client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=6, temperature=0, logprobs=2,
                                  extra_body=extra)
    lp = r.choices[0].logprobs
    assert lp.tokens == want and r.choices[0].text == ids[1]
    assert all(k.startswith("token_id:") for top in lp.top_logprobs for k in top) and lp.top_logprobs[0]
    assert lp.top_logprobs[0][want[0]] == pytest.approx(lp.token_logprobs[0])  # greedy: the top one is chosen
    plain = client.completions.create(model="tiny", prompt="def add(a, b):", max_tokens=6, temperature=0,
                                      logprobs=2, extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs.tokens != want  # without the flag: the tokens' text
    chat = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Say hi."}],
                                          max_tokens=4, temperature=0, logprobs=True, top_logprobs=1,
                                          extra_body=extra)
    content = chat.choices[0].logprobs.content
    assert len(content) == 4 and all(c.token.startswith("token_id:") for c in content)
    assert all(c.bytes == list(c.token.encode()) for c in content)
    from tests.roles.harness import _offline_llm

    chat_ids = [int(c.token.removeprefix("token_id:")) for c in content]
    assert _offline_llm().get_tokenizer().decode(chat_ids) == chat.choices[0].message.content


def test_continuous_usage_stats_give_every_chunk_its_choices_usage_so_far(client):
    """vLLM's stream_options.continuous_usage_stats: each chunk's usage counts its choice's tokens so far (rising to
    the final usage chunk's), its prompt's tokens and their sum; without it only the last chunk has usage."""
    opts = {"include_usage": True, "continuous_usage_stats": True}
    for kind in ("completions", "chat"):
        if kind == "chat":
            stream = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "Hi"}],
                                                    max_tokens=7, temperature=0, stream=True, stream_options=opts,
                                                    extra_body={"ignore_eos": True})
        else:
            stream = client.completions.create(model="tiny", prompt=["def f(", "import os"], n=2, max_tokens=7,
                                               temperature=0, stream=True, stream_options=opts,
                                               extra_body={"ignore_eos": True})
        chunks = list(stream)
        *body, last = chunks
        assert last.choices == [] and last.usage.completion_tokens == 7 * (1 if kind == "chat" else 4)
        seen: dict[int, int] = {}
        for c in body:
            (choice,) = c.choices
            assert c.usage is not None and c.usage.completion_tokens >= seen.get(choice.index, 0)
            assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
            seen[choice.index] = c.usage.completion_tokens
        assert seen == ({0: 7} if kind == "chat" else {0: 7, 1: 7, 2: 7, 3: 7}), seen
        if kind == "chat":
            assert {c.usage.prompt_tokens for c in body} == {last.usage.prompt_tokens}
        else:  # each choice counts its own prompt ("def f(" and "import os" differ in length)
            assert sum({c.choices[0].index // 2: c.usage.prompt_tokens for c in body}.values()) \
                == last.usage.prompt_tokens
    plain = list(client.completions.create(model="tiny", prompt="def f(", max_tokens=3, temperature=0, stream=True,
                                           stream_options={"include_usage": True}, extra_body={"ignore_eos": True}))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage.completion_tokens == 3


def test_reset_prefix_cache_forgets_every_workers_cached_blocks_and_refuses_where_blocks_are_held(roles, client):
    """vLLM's POST /reset_prefix_cache (--allow-prefix-cache-reset): a prompt that hit the cache computes all of it
    again after a reset, with the same text; a decode worker holding a reservation's blocks refuses by name (the
    prefill worker is reset) and accepts once they are freed."""
    from proto import worker_pb2, worker_pb2_grpc
    from router.wire import params_to_wire

    base, hdr = f"http://{roles.router.http_address}", {"authorization": f"Bearer {KEY}"}
    prompt = list(range(800, 841))  # 41 ids: 2 full blocks of 16
    want = offline([prompt], [SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True)])[0][1]

    def cached() -> int:
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=3, temperature=0,
                                      extra_body={"ignore_eos": True})
        assert r.choices[0].text == want
        return r.usage.prompt_tokens_details.cached_tokens

    cached()
    assert cached() > 0
    ids = sorted(w.cfg.worker_id for w in (*roles.prefills, *roles.decodes))
    r = httpx.post(f"{base}/reset_prefix_cache", headers=hdr, timeout=30)
    assert (r.status_code, r.json()) == (200, {"reset": ids})
    assert cached() == 0
    decode = roles.decodes[0]
    ch = grpc.insecure_channel(decode.address)
    stub = worker_pb2_grpc.DecodeWorkerStub(ch)
    try:
        stub.Reserve(worker_pb2.ReserveRequest(request_id="held", prompt_token_ids=[5] * 40,
                                               params=params_to_wire(SamplingParams(max_tokens=1)),
                                               prefill_kv_name=roles.prefills[0].cfg.worker_id, kv_timeout_s=30.0),
                     timeout=10)
        busy = httpx.post(f"{base}/reset_prefix_cache", headers=hdr, timeout=30)
        message = busy.json()["error"]["message"]
        assert busy.status_code == 409 and f"{decode.cfg.worker_id} (3 blocks)" in message, message
        assert f"reset: {roles.prefills[0].cfg.worker_id}" in message
    finally:
        stub.Abort(worker_pb2.AbortRequest(request_id="held"), timeout=10)
        ch.close()
    assert httpx.post(f"{base}/reset_prefix_cache", headers=hdr, timeout=30).status_code == 200


def test_cache_salt_keeps_each_tenants_prefix_cache_hits_to_itself(client):
    """vLLM's cache_salt through the split: a prompt's second request under the same salt hits the cache, the
    first under another salt (or none) does not, and the text is the offline engine's every time."""
    prompt = list(range(700, 741))  # 41 ids: 2 full blocks of 16
    want = offline([prompt], [SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)])[0][1]

    def cached(salt) -> int:
        extra = {"ignore_eos": True, **({"cache_salt": salt} if salt else {})}
        r = client.completions.create(model="tiny", prompt=prompt, max_tokens=4, temperature=0, extra_body=extra)
        assert r.choices[0].text == want
        return r.usage.prompt_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-a") > 0
    assert cached("tenant-b") == 0 and cached(None) == 0
    assert cached(None) > 0 and cached("tenant-b") > 0
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model="tiny", prompt=prompt, max_tokens=2, extra_body={"cache_salt": ""})
    assert "cache_salt" in e.value.body["message"]


def test_async_client_streams_equal_offline(roles):
    import asyncio

    _, text, _ = _offline_text("for i in range(", max_tokens=9, temperature=0.0, ignore_eos=True)

    async def run() -> tuple[str, str]:
        aclient = openai.AsyncOpenAI(base_url=f"http://{roles.router.http_address}/v1", api_key=KEY,
                                     max_retries=0, timeout=60)
        try:
            done = await aclient.completions.create(model="tiny", prompt="for i in range(", max_tokens=9,
                                                    temperature=0, extra_body={"ignore_eos": True})
            parts = []
            async for c in await aclient.completions.create(model="tiny", prompt="for i in range(", max_tokens=9,
                                                            temperature=0, stream=True,
                                                            extra_body={"ignore_eos": True}):
                parts.append(c.choices[0].text)
            return done.choices[0].text, "".join(parts)
        finally:
            await aclient.close()

    assert asyncio.run(run()) == (text, text)


def test_n3_with_seed_is_reproducible_and_shares_one_prefill(roles, client):
    """n=3 over HTTP: one prefill on the prefill worker, the siblings reuse the transferred blocks on the decode
    worker (engine counters), each choice equals offline with seed + i, and a second call gives the same."""
    prompt = list(range(500, 541))  # 41 token ids: 2 full blocks of 16
    kw = dict(max_tokens=6, temperature=0.8, seed=3, ignore_eos=True)
    want = [offline([prompt], [SamplingParams(**{**kw, "seed": 3 + i})])[0][1] for i in range(3)]
    p_eng, d_eng = roles.prefills[0].engine, roles.decodes[0].engine
    q_p, h_d = p_eng.prefix_cache_queries, d_eng.prefix_cache_hits
    r = client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=6, temperature=0.8, seed=3,
                                  extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(r.choices, key=lambda c: c.index)] == want
    assert p_eng.prefix_cache_queries - q_p == 41 and d_eng.prefix_cache_hits - h_d == 2 * 32
    again = client.completions.create(model="tiny", prompt=prompt, n=3, max_tokens=6, temperature=0.8, seed=3,
                                      extra_body={"ignore_eos": True})
    assert [c.text for c in sorted(again.choices, key=lambda c: c.index)] == want
    assert r.usage.completion_tokens == 18 and r.usage.prompt_tokens == 41


def _router_hist(roles, name: str) -> dict[str, tuple[float, float]]:
    """label value ("" when none) -> (count, sum) of a router histogram, from the router's /metrics."""
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(f"http://{roles.router.http_address}/metrics", timeout=10).text
    out: dict[str, list[float]] = {}
    for fam in text_string_to_metric_families(text):
        if fam.name != name:
            continue
        for s in fam.samples:
            key = s.labels.get("phase", "")
            if s.name.endswith("_count"):
                out.setdefault(key, [0.0, 0.0])[0] += s.value
            elif s.name.endswith("_sum"):
                out.setdefault(key, [0.0, 0.0])[1] += s.value
    return {k: (c, v) for k, (c, v) in out.items()}


def test_ttft_phases_add_up_in_the_response_the_grpc_timings_and_the_router_histogram(roles, client):
    """Issue 48 part 2: asked with ``pdserve_timings``, the usage block says where each prompt's TTFT went
    (placement + worker queue + prefill + delivery = TTFT, each >= 0; prefill and the KV transfer > 0 on this
    disaggregated pair), streamed or not, and not unless asked; the gRPC API's last message carries the same
    phases; the router's ``pdserve:ttft_phase_seconds`` observes each phase once a request, and the phases' sums
    move by what TTFT's does."""
    from proto import pdserve_pb2

    phases = ("placement", "worker_queue", "prefill", "delivery")
    before_phases = _router_hist(roles, "pdserve:ttft_phase_seconds")
    before_ttft = _router_hist(roles, "pdserve:time_to_first_token_seconds")[""]
    r = client.completions.create(model="tiny", prompt="def mul(a, b):", max_tokens=6, temperature=0,
                                  extra_body={"ignore_eos": True, "pdserve_timings": True})
    [t] = r.usage.model_extra["pdserve_timings"]
    assert all(t[f"{p}_s"] >= 0 for p in phases)
    assert sum(t[f"{p}_s"] for p in phases) == pytest.approx(t["ttft_s"], abs=1e-9)
    assert t["prefill_s"] > 0 and t["kv_transfer_s"] > 0 and t["total_s"] >= t["ttft_s"] > 0
    chunks = list(client.completions.create(model="tiny", prompt="def sub(a, b):", max_tokens=4, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True, "pdserve_timings": True}))
    [ts] = chunks[-1].usage.model_extra["pdserve_timings"]
    assert sum(ts[f"{p}_s"] for p in phases) == pytest.approx(ts["ttft_s"], abs=1e-9) and ts["prefill_s"] > 0
    plain = client.completions.create(model="tiny", prompt="def div(a, b):", max_tokens=4, temperature=0)
    assert "pdserve_timings" not in (plain.usage.model_extra or {})
    last = list(roles.stub.Generate(pdserve_pb2.GenerateRequest(prompt="def neg(a):", max_tokens=4,
                                                                temperature=0.0), timeout=60,
                                    metadata=(("authorization", f"Bearer {KEY}"),)))[-1].timings
    assert last.placement_s + last.worker_queue_s + last.prefill_s <= last.ttft_s and last.prefill_s > 0
    assert last.queue_s == pytest.approx(last.placement_s + last.worker_queue_s, abs=1e-9)
    after_phases = _router_hist(roles, "pdserve:ttft_phase_seconds")
    after_ttft = _router_hist(roles, "pdserve:time_to_first_token_seconds")[""]
    counts = {p: after_phases[p][0] - before_phases.get(p, (0.0, 0.0))[0] for p in phases}
    assert counts == {p: 4.0 for p in phases}  # four requests, each phase once
    moved = sum(after_phases[p][1] - before_phases.get(p, (0.0, 0.0))[1] for p in phases)
    assert moved == pytest.approx(after_ttft[1] - before_ttft[1], rel=1e-6, abs=1e-9)


def _chat_reference(roles, msgs: list[dict], n: int) -> tuple[str, int]:
    """The offline engine's greedy answer to ``msgs`` rendered with the model's template, and the prompt's length."""
    tok = roles.router.tokenizer
    ids = tok.encode(tok.apply_chat_template(msgs, add_generation_prompt=True), add_special_tokens=False)
    return offline([ids], [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)])[0][1], len(ids)


def test_responses_api_answers_as_the_chat_path_whole_and_streamed(roles, client):
    """OpenAI's Responses API through the official client (``client.responses.create``): ``instructions`` are the
    system message and ``input`` the conversation, so the answer is the offline engine's greedy continuation of the
    rendered chat; whole, and streamed as typed events (created .. deltas .. completed, numbered in order), whose
    deltas add up to the same text. ``max_output_tokens`` cutting it makes it ``incomplete``, as OpenAI says it."""
    want, n_prompt = _chat_reference(roles, [{"role": "system", "content": "You write Python."},
                                             {"role": "user", "content": "A loop, please."}], 8)
    r = client.responses.create(model="tiny", instructions="You write Python.", input="A loop, please.",
                                max_output_tokens=8, temperature=0, extra_body={"ignore_eos": True})
    assert r.output_text == want and r.object == "response" and r.id.startswith("resp_")
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (n_prompt, 8, n_prompt + 8)
    assert r.output[0].type == "message" and r.output[0].role == "assistant"
    events = list(client.responses.create(model="tiny", instructions="You write Python.",
                                          input=[{"role": "user", "content": [{"type": "input_text",
                                                                               "text": "A loop, please."}]}],
                                          max_output_tokens=8, temperature=0, stream=True,
                                          extra_body={"ignore_eos": True}))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == want
    assert events[-1].response.output_text == want and events[-1].response.usage.output_tokens == 8
    # a conversation with an earlier assistant turn, answered to its end (EOS or the budget): "completed"
    msgs = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello."},
            {"role": "user", "content": "Count to three."}]
    r = client.responses.create(model="tiny", input=msgs, max_output_tokens=6, temperature=0,
                                extra_body={"ignore_eos": True})
    assert r.output_text == _chat_reference(roles, msgs, 6)[0]
    # text.format: the answer follows the schema (the chat path's structured outputs)
    r = client.responses.create(model="tiny", input="Yes or no?", max_output_tokens=8, temperature=0,
                                text={"format": {"type": "json_schema", "name": "answer",
                                                 "schema": {"type": "string", "enum": ["yes", "no"]}}})
    assert json.loads(r.output_text) in ("yes", "no") and r.status == "completed"


def test_responses_api_refuses_what_it_does_not_serve_by_name(client):
    for kw, field in ((dict(previous_response_id="resp_x"), "previous_response_id"),
                      (dict(tools=[{"type": "web_search_preview"}]), "tools"),
                      (dict(input=[{"type": "function_call_output", "call_id": "c", "output": "1"}]), "input"),
                      (dict(input=[{"role": "robot", "content": "x"}]), "input"),
                      (dict(max_output_tokens=0), "max_output_tokens"),
                      (dict(text={"format": {"type": "xml"}}), "text")):
        args = {"model": "tiny", "input": "x", **kw}
        with pytest.raises(openai.BadRequestError) as e:
            client.responses.create(**args)
        assert e.value.body["param"] == field and e.value.body["message"].startswith(field), (kw, e.value.body)
    with pytest.raises(openai.NotFoundError):
        client.responses.create(model="nope", input="x")


def test_stop_reason_names_the_stop_string_or_token_that_ended_a_choice(client):
    """vLLM's ``stop_reason``: the stop string that ended the choice, or the ``stop_token_ids`` id; null when the
    length limit (or EOS) did: whole and streamed, completions and chat."""
    ids, text, _ = _offline_text("def add(a, b):", max_tokens=12, temperature=0.0, ignore_eos=True)
    stop = text[4:7]
    assert stop and text.index(stop) == 4, text  # (the first place it shows: the text is cut there)
    kw = dict(model="tiny", prompt="def add(a, b):", max_tokens=12, temperature=0, extra_body={"ignore_eos": True})
    c = client.completions.create(**kw, stop=[stop, "\x00never"]).choices[0]
    assert (c.finish_reason, c.stop_reason, c.text) == ("stop", stop, text[:4])
    k = next(i for i in range(2, 12) if ids[i] not in ids[:i])  # a token whose first showing ends the answer
    c = client.completions.create(**{**kw, "extra_body": {"ignore_eos": True, "stop_token_ids": [ids[k]]}}).choices[0]
    assert (c.finish_reason, c.stop_reason) == ("stop", ids[k])
    c = client.completions.create(**kw).choices[0]
    assert (c.finish_reason, c.stop_reason) == ("length", None)
    last = list(client.completions.create(**kw, stop=[stop], stream=True))[-1].choices[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", stop)
    msgs = [{"role": "user", "content": "Hi"}]
    chat_text = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0,
                                               extra_body={"ignore_eos": True}).choices[0].message.content
    cut = chat_text[2:5]
    ch = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, stop=cut,
                                        extra_body={"ignore_eos": True}).choices[0]
    assert (ch.finish_reason, ch.stop_reason, ch.message.content) == ("stop", cut, chat_text[:chat_text.index(cut)])
    last = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=10, temperature=0, stop=cut,
                                               stream=True, extra_body={"ignore_eos": True}))[-1].choices[0]
    assert (last.finish_reason, last.stop_reason) == ("stop", cut)


def test_x_request_id_names_the_answer_and_leads_every_worker_log_line(roles, client, caplog):
    """vLLM's request ids: the ``X-Request-Id`` header (or the body's ``request_id``) is the answer's id and comes
    back as the header; the workers know the request by it plus a unique suffix, so two requests with the same
    header both run; a bad one is a 400 naming ``request_id`` before any work."""
    import logging

    url = f"http://{roles.router.http_address}/v1/chat/completions"
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "temperature": 0}
    auth = {"authorization": f"Bearer {KEY}"}
    with caplog.at_level(logging.DEBUG, logger="engine.llm_engine"):
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            got = list(pool.map(lambda _: httpx.post(url, json=body, timeout=60,
                                                     headers={**auth, "X-Request-Id": "trace-7f3a"}), range(2)))
    for r in got:
        assert r.status_code == 200 and r.headers["x-request-id"] == "trace-7f3a", r.text
        assert r.json()["id"] == "chatcmpl-trace-7f3a"
    ids = {m for rec in caplog.records for m in re.findall(r"request (trace-7f3a-\w+) added", rec.getMessage())}
    assert len(ids) == 2  # one per request, each unique, each led by the client's id
    # the body's request_id wins over the header; a streamed answer carries it too; none given: one is made
    with httpx.stream("POST", url, json={**body, "stream": True, "request_id": "mine-1"}, timeout=60,
                      headers={**auth, "X-Request-Id": "theirs"}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
        assert r.headers["x-request-id"] == "mine-1" and {c["id"] for c in chunks} == {"chatcmpl-mine-1"}
    made = httpx.post(url, json=body, headers=auth, timeout=60)
    assert made.json()["id"] == "chatcmpl-" + made.headers["x-request-id"]
    bad = httpx.post(url, json={**body, "request_id": "x" * 300}, headers=auth, timeout=60)
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "request_id"
