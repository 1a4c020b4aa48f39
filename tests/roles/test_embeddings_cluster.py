"""``POST /v1/embeddings`` through the cluster (router/embeddings.py, worker_common/embeddings.py), with the client
users run (``openai``): real prefill and decode workers, gRPC between them, the router's HTTP front end.

The reference is the offline engine's ``LLM.embed`` on the same model (tests/engine/test_pooling.py checks that
against transformers): the SDK's default base64 answers and float answers both equal it, for text and token-id
inputs, batched and beside generating requests whose answers do not change; bad input is a 400 naming the field,
an unknown model a 404, and nothing is left held; an input whose worker is gone is served by another; the colocated
pool serves them where there is no prefill pool (its engine in a process of its own); and an embedding model saved without an LM head serves embeddings
and refuses generation by name.
"""
from __future__ import annotations

import json
import re
import shutil
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
import requests
import torch

from engine import LLM, SamplingParams

from .harness import collect, counter_values, joined, start_colocated, start_roles

TEXTS = ["def fibonacci(n):", "import os\nimport sys\n", "class Stack:\n    def __init__(self):\n" * 4]


def _client(roles) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"http://{roles.router.http_address}/v1", api_key="none", max_retries=0, timeout=60)


def _close(a, b, tol: float = 1e-6) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


@pytest.fixture(scope="module")
def reference():
    return LLM("tiny", num_kv_blocks=256, num_threads=1)


@pytest.fixture(scope="module")
def roles():
    torch.set_num_threads(1)
    r = start_roles(tag="emb-", n_prefill=2, router=dict(http_port=0))
    yield r
    r.close()


def test_embeddings_through_the_split_equal_the_offline_engine(roles, reference):
    client = _client(roles)
    success = counter_values(roles.router.metrics, "pdserve:request_success", "finished_reason").get("stop", 0)
    prompt = counter_values(roles.router.metrics, "pdserve:prompt_tokens").get("", 0)
    want = [o.outputs.embedding for o in reference.embed(TEXTS)]
    got = client.embeddings.create(model="tiny", input=TEXTS)  # (the SDK asks for base64 and decodes it)
    assert [d.index for d in got.data] == [0, 1, 2]
    assert all(_close(d.embedding, w) for d, w in zip(got.data, want))
    n_tokens = sum(len(reference.get_tokenizer().encode(t)) for t in TEXTS)
    assert got.usage.prompt_tokens == got.usage.total_tokens == n_tokens
    assert counter_values(roles.router.metrics, "pdserve:request_success", "finished_reason")["stop"] == success + 1
    assert counter_values(roles.router.metrics, "pdserve:prompt_tokens")[""] == prompt + n_tokens
    ids = reference.get_tokenizer().encode(TEXTS[1])
    one = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    assert _close(one.data[0].embedding, want[1])
    raw = client.embeddings.create(model="tiny", input=[ids], encoding_format="float", extra_body={"normalize": False})
    assert _close(raw.data[0].embedding, reference.embed([ids], normalize=False)[0].outputs.embedding, 1e-4)
    cut = client.embeddings.create(model="tiny", input=[ids], extra_body={"truncate_prompt_tokens": 3})
    assert _close(cut.data[0].embedding, reference.embed([ids[-3:]])[0].outputs.embedding)
    assert roles.wait_idle(10.0)


def test_an_http_embedding_request_waits_on_the_routers_flow_pool(roles, monkeypatch):
    """It holds a thread while its workers compute: one of the router's flow pool (bounded by max_rpc_threads, as
    flows are), never one of the HTTP loop's few default threads, which every completion's preparation needs."""
    import threading

    from router.openai import embeddings_api

    names = []
    real = embeddings_api.run_embed

    def spy(*args, **kw):
        names.append(threading.current_thread().name)
        return real(*args, **kw)

    monkeypatch.setattr(embeddings_api, "run_embed", spy)
    _client(roles).embeddings.create(model="tiny", input=TEXTS[:1])
    assert len(names) == 1 and names[0].startswith("router-flow"), names


def test_the_grpc_embed_call_answers_as_the_http_route(roles, reference):
    """pdserve's gRPC API (``PDServe.Embed``) for gRPC clients: the same vectors, and its refusals as statuses
    naming the field."""
    import grpc

    from proto import pdserve_pb2

    want = reference.embed(TEXTS)
    got = roles.stub.Embed(pdserve_pb2.EmbedRequest(texts=TEXTS), timeout=60)
    assert [len(d.values) for d in got.data] == [384] * 3 and got.model == "tiny"
    assert all(_close(d.values, o.outputs.embedding) for d, o in zip(got.data, want))
    assert got.prompt_tokens == sum(len(o.prompt_token_ids) for o in want)
    ids = want[0].prompt_token_ids
    one = roles.stub.Embed(pdserve_pb2.EmbedRequest(inputs=[pdserve_pb2.EmbedInput(token_ids=ids)], normalize=False),
                           timeout=60)
    assert _close(one.data[0].values, reference.embed([ids], normalize=False)[0].outputs.embedding, 1e-4)
    for req, code, match in [
            (pdserve_pb2.EmbedRequest(), grpc.StatusCode.INVALID_ARGUMENT, "input must not be empty"),
            (pdserve_pb2.EmbedRequest(texts=["a"], inputs=[pdserve_pb2.EmbedInput(token_ids=[1])]),
             grpc.StatusCode.INVALID_ARGUMENT, "texts or inputs, not both"),
            (pdserve_pb2.EmbedRequest(texts=["a"], dimensions=4), grpc.StatusCode.INVALID_ARGUMENT, "dimensions"),
            (pdserve_pb2.EmbedRequest(texts=["a"], model="nope"), grpc.StatusCode.NOT_FOUND, "'nope'")]:
        with pytest.raises(grpc.RpcError) as e:
            roles.stub.Embed(req, timeout=30)
        assert e.value.code() == code and match in e.value.details(), e.value.details()
    assert roles.wait_idle(10.0)


def _post(roles, path: str, body: dict) -> tuple[int, dict]:
    r = requests.post(f"http://{roles.router.http_address}{path}", json={"model": "tiny", **body}, timeout=60)
    return r.status_code, r.json()


def _cos(a, b) -> float:
    return sum(x * y for x, y in zip(a, b))


def test_score_and_rerank_are_the_cosines_of_the_offline_embeddings(roles, reference):
    """vLLM's ``/v1/score`` and the Jina/Cohere ``/v1/rerank`` with an embedding model: cosine similarities."""
    vec = {t: o.outputs.embedding for t, o in zip(TEXTS, reference.embed(TEXTS))}
    status, body = _post(roles, "/v1/score", {"text_1": TEXTS[0], "text_2": TEXTS})
    assert status == 200 and [d["index"] for d in body["data"]] == [0, 1, 2], body
    assert all(abs(d["score"] - _cos(vec[TEXTS[0]], vec[t])) < 1e-5 for d, t in zip(body["data"], TEXTS))
    assert abs(body["data"][0]["score"] - 1) < 1e-5
    status, body = _post(roles, "/score", {"text_1": TEXTS[1:], "text_2": TEXTS[:2]})  # pairwise
    assert status == 200 and abs(body["data"][1]["score"] - _cos(vec[TEXTS[2]], vec[TEXTS[1]])) < 1e-5
    query = TEXTS[2]
    want = sorted(range(3), key=lambda i: -_cos(vec[query], vec[TEXTS[i]]))
    for path in ("/v1/rerank", "/rerank", "/v2/rerank"):
        status, body = _post(roles, path, {"query": query, "documents": TEXTS, "top_n": 2})
        assert status == 200 and [r["index"] for r in body["results"]] == want[:2], body
        assert body["results"][0]["document"]["text"] == TEXTS[want[0]]
    status, body = _post(roles, "/v1/rerank", {"query": query, "documents": TEXTS, "return_documents": False})
    assert [r["index"] for r in body["results"]] == want and "document" not in body["results"][0]
    assert body["usage"]["prompt_tokens"] == sum(len(reference.get_tokenizer().encode(t)) for t in TEXTS)
    for path, bad, param in [("/v1/score", {"text_1": "a", "text_2": []}, "text_2"),
                             ("/v1/score", {"text_1": ["a", "b"], "text_2": ["c", "d", "e"]}, "text_2"),
                             ("/v1/rerank", {"query": "a", "documents": []}, "documents"),
                             ("/v1/rerank", {"query": "a", "documents": ["b"], "top_n": -1}, "top_n"),
                             ("/v1/rerank", {"query": "a", "documents": ["b", "c" * 40000]}, "documents")]:
        status, body = _post(roles, path, bad)
        assert status == 400 and body["error"]["param"] == param, (bad, body)
    assert roles.wait_idle(10.0)


def test_embeddings_beside_generation_leave_its_answers_unchanged(roles, reference):
    client = _client(roles)
    prompts = ["for i in range(10):\n    print(", "while True:\n"]
    want = reference.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True))
    vectors = [o.outputs.embedding for o in reference.embed(TEXTS)]
    with ThreadPoolExecutor(6) as pool:
        gens = [pool.submit(lambda p=p: joined(collect(roles.stub, prompt=p, max_tokens=24, temperature=0.0,
                                                       ignore_eos=True))) for p in prompts]
        embs = [pool.submit(client.embeddings.create, model="tiny", input=TEXTS) for _ in range(4)]
        for f, o in zip(gens, want):
            assert f.result()[0] == o.token_ids
        for f in embs:
            assert all(_close(d.embedding, v) for d, v in zip(f.result().data, vectors))
    assert roles.wait_idle(10.0)


@pytest.mark.parametrize("body, status, param, match", [
    ({"input": []}, 400, "input", "input must not be empty"),
    ({"input": [[5, 6], []]}, 400, "input", r"input\[1\] is empty"),
    ({"input": [3, 99999]}, 400, "input", "99999 is not a token id"),
    ({"input": [[1] * 5000]}, 400, "input", "the context length is"),
    ({"input": "x", "dimensions": 8}, 400, "dimensions", "not a Matryoshka embedding model"),
    ({"input": "x", "truncate_prompt_tokens": 0}, 400, "truncate_prompt_tokens", ">= 1 or -1"),
    ({"input": "x", "model": "nope"}, 404, "model", "'nope' does not exist"),
    ({"input": [1, "a"]}, 400, None, ""),
    ({"input": "x", "encoding_format": "int8"}, 400, None, ""),
])
def test_bad_embedding_requests_get_a_status_naming_the_field_and_leave_nothing(roles, body, status, param, match):
    r = requests.post(f"http://{roles.router.http_address}/v1/embeddings", json={"model": "tiny", **body},
                      timeout=30)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    if param is not None:
        assert err["param"] == param and re.search(match, err["message"]), err
    assert roles.wait_idle(10.0)


def test_a_client_that_goes_away_cancels_its_inputs_on_the_workers(roles):
    """An embeddings request far longer than its client waits (200 inputs of 500 tokens): the client's disconnect
    (HTTP) or cancelled call (gRPC) cancels the inputs still out (their workers abort them) instead of computing the rest for nobody, and the
    cluster serves the next request."""
    def computed() -> int:
        return sum(w.ctx.engine.make_stats().num_scheduled_tokens for w in roles.prefills)

    import grpc

    from proto import pdserve_pb2

    inputs = [[5 + (i + j) % 4000 for j in range(500)] for i in range(200)]

    def http_client_leaves() -> None:
        with pytest.raises(requests.exceptions.ReadTimeout):
            requests.post(f"http://{roles.router.http_address}/v1/embeddings",
                          json={"model": "tiny", "input": inputs}, timeout=1.0)

    def grpc_client_cancels() -> None:  # (PDServe.Embed: the call cancelled, no deadline of its own)
        call = roles.stub.Embed.future(pdserve_pb2.EmbedRequest(
            inputs=[pdserve_pb2.EmbedInput(token_ids=ids) for ids in inputs]))
        with pytest.raises(grpc.FutureTimeoutError):
            call.result(timeout=1.0)
        call.cancel()

    for leave in (http_client_leaves, grpc_client_cancels):
        before = computed()
        leave()
        assert roles.wait_idle(60.0)
        done = computed() - before
        assert done < 0.75 * 200 * 500, f"{leave.__name__}: {done} tokens computed for a client that left"
        assert not any(w.requests for w in roles.prefills)
        got = _client(roles).embeddings.create(model="tiny", input=TEXTS[:1])
        assert len(got.data) == 1


def test_an_input_whose_worker_is_gone_is_embedded_by_another(reference):
    torch.set_num_threads(1)
    r = start_roles(tag="embf-", n_prefill=2, router=dict(http_port=0))
    try:
        gone = r.prefills[0]
        last = gone.info()  # (as a registry would still list a worker that died without a word)
        gone.stop()
        r.source.remove_where(last.worker_id)
        r.source.add(last)
        got = _client(r).embeddings.create(model="tiny", input=TEXTS * 2)
        want = [o.outputs.embedding for o in reference.embed(TEXTS * 2)]
        assert all(_close(d.embedding, w) for d, w in zip(got.data, want))
        assert not r.prefills[1].requests
    finally:
        r.close()


def test_the_colocated_pool_serves_embeddings_from_an_engine_in_its_own_process(reference):
    """Where there is no prefill pool the colocated workers embed; the vector crosses the engine process's pipe."""
    torch.set_num_threads(1)
    r = start_colocated(tag="embc-", router=dict(http_port=0), worker=dict(engine_process=True))
    try:
        got = _client(r).embeddings.create(model="tiny", input=TEXTS[:2])
        assert all(_close(d.embedding, o.outputs.embedding) for d, o in zip(got.data, reference.embed(TEXTS[:2])))
        with pytest.raises(openai.BadRequestError, match="the context length is"):
            _client(r).embeddings.create(model="tiny", input=[[1] * 3000])
        assert r.wait_idle(10.0)
    finally:
        r.close()


def test_an_embedding_model_without_an_lm_head_serves_embeddings_and_refuses_generation(tmp_path):
    """An embedding model saved as its base model (``Qwen3Model``: no LM head, as Qwen3-Embedding-8B), with the
    built-in tokenizer beside it and sentence-transformers' last-token pooling."""
    import transformers

    from engine.builtin import tokenizer_dir

    cfg = transformers.Qwen3Config(vocab_size=8192, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                                   max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=0,
                                   eos_token_id=1)
    torch.manual_seed(3)
    transformers.Qwen3Model(cfg).save_pretrained(tmp_path)
    for f in tokenizer_dir().iterdir():
        shutil.copy(f, tmp_path / f.name)
    (tmp_path / "modules.json").write_text(json.dumps([
        {"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
        {"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}]))
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    want = [o.outputs.embedding for o in LLM(str(tmp_path), num_kv_blocks=64).embed(TEXTS)]
    torch.set_num_threads(1)
    r = start_roles(tag="embq-", engine=dict(model=str(tmp_path)), router=dict(model=str(tmp_path), http_port=0))
    try:
        client = _client(r)
        name = client.models.list().data[0].id
        got = client.embeddings.create(model=name, input=TEXTS)
        assert all(_close(d.embedding, w) for d, w in zip(got.data, want))
        with pytest.raises(openai.BadRequestError, match="no LM head .* embeddings only"):
            client.completions.create(model=name, prompt="hello", max_tokens=4)
        assert r.wait_idle(10.0)
    finally:
        r.close()
