"""Encoders served by the cluster (engine/encoder.py): a BERT embedding model and an XLM-R cross-encoder reranker
through real workers and the router's HTTP front end, with the clients users run (``openai``, plain HTTP for the
Jina/Cohere rerank API).

The reference is the offline engine (``LLM.embed``, ``LLM.score``) on the same directory, which
tests/engine/test_encoder.py holds to transformers' numbers.
"""
from __future__ import annotations

import grpc
import openai
import pytest
import requests
import torch

from engine import LLM
from proto import pdserve_pb2

from ..engine.test_encoder import _bert, _save, _tokenizer, _xlmr
from .harness import start_colocated, start_roles

DOCS = ["paris is the capital of france.", "the cat sat on the mat", "a big red house", "what is a city?"]
QUERY = "what is the capital of france?"


def _close(a, b, tol: float = 1e-5) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) < tol


@pytest.fixture(scope="module")
def dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("encoders")
    return (_save(_bert(), _tokenizer("bert"), root / "bge", "mean_tokens", normalize=True),
            _save(_xlmr(), _tokenizer("roberta"), root / "reranker"))


def test_a_bert_embedding_model_serves_embeddings_and_scores_and_refuses_generation(dirs):
    emb_dir = str(dirs[0])
    ref = LLM(emb_dir)
    want = [o.outputs.embedding for o in ref.embed(DOCS)]
    cut = [o.outputs.embedding for o in ref.embed(DOCS, truncate_prompt_tokens=4)]
    torch.set_num_threads(1)
    r = start_roles(tag="encb-", engine=dict(model=emb_dir), router=dict(model=emb_dir, http_port=0))
    try:
        client = openai.OpenAI(base_url=f"http://{r.router.http_address}/v1", api_key="none", max_retries=0,
                               timeout=60)
        name = client.models.list().data[0].id
        got = client.embeddings.create(model=name, input=DOCS)
        assert all(_close(d.embedding, w) for d, w in zip(got.data, want, strict=True))
        # an encoder's text is cut at its end, its [CLS] and [SEP] kept (what its tokenizer does)
        short = client.embeddings.create(model=name, input=DOCS, extra_body={"truncate_prompt_tokens": 4})
        assert all(_close(d.embedding, w) for d, w in zip(short.data, cut, strict=True))
        not_cls = requests.post(f"http://{r.router.http_address}/v1/classify", json={"input": "a"}, timeout=30)
        assert not_cls.status_code == 400 and not_cls.json()["error"]["param"] == "model", not_cls.text
        assert short.usage.prompt_tokens == 4 * len(DOCS)
        full = [2] + [5 + i % 20 for i in range(62)] + [3]  # (exactly the context: nothing follows an embedding)
        got = client.embeddings.create(model=name, input=[full], encoding_format="float")
        assert _close(got.data[0].embedding, ref.embed([full])[0].outputs.embedding)
        with pytest.raises(openai.BadRequestError, match="65 tokens; the context length is 64"):
            client.embeddings.create(model=name, input=[full + [5]])
        body = requests.post(f"http://{r.router.http_address}/v1/rerank",
                             json={"model": name, "query": QUERY, "documents": DOCS}, timeout=60).json()
        q = ref.embed([QUERY])[0].outputs.embedding
        cos = [sum(x * y for x, y in zip(q, w)) for w in want]
        assert [x["index"] for x in body["results"]] == sorted(range(len(DOCS)), key=lambda i: -cos[i])
        with pytest.raises(openai.BadRequestError, match="is an encoder: it serves embeddings .*not generation"):
            client.completions.create(model=name, prompt="the cat", max_tokens=4)
        with pytest.raises(openai.BadRequestError, match="is an encoder: it serves embeddings .*not chat"):
            client.chat.completions.create(model=name, messages=[{"role": "user", "content": "a"}])
        assert r.wait_idle(10.0)
    finally:
        r.close()


def test_a_cross_encoder_reranks_as_the_offline_engine_scores(dirs):
    """bge-reranker's shape on the colocated pool: ``/v1/rerank`` and ``/v1/score`` give the offline scores (each
    pair one input), best first; its embeddings are refused naming the model; a long document is cut, not refused,
    when truncate_prompt_tokens asks."""
    rr_dir = str(dirs[1])
    ref = LLM(rr_dir)
    want = [o.outputs.score for o in ref.score(QUERY, DOCS)]
    long_doc = "big red house, small blue tree. " * 20
    want_cut = ref.score(QUERY, long_doc, truncate_prompt_tokens=-1)[0].outputs.score
    torch.set_num_threads(1)
    r = start_colocated(tag="encx-", engine=dict(model=rr_dir), router=dict(model=rr_dir, http_port=0))
    try:
        base = f"http://{r.router.http_address}"
        name = requests.get(f"{base}/v1/models", timeout=30).json()["data"][0]["id"]
        body = requests.post(f"{base}/v1/rerank", json={"model": name, "query": QUERY, "documents": DOCS,
                                                         "top_n": 3}, timeout=60).json()
        order = sorted(range(len(DOCS)), key=lambda i: -want[i])
        assert [x["index"] for x in body["results"]] == order[:3], body
        assert all(abs(x["relevance_score"] - want[x["index"]]) < 1e-6 for x in body["results"])
        assert body["results"][0]["document"]["text"] == DOCS[order[0]]
        scored = requests.post(f"{base}/v1/score", json={"model": name, "text_1": QUERY, "text_2": DOCS},
                               timeout=60).json()
        assert [round(d["score"], 6) for d in scored["data"]] == [round(w, 6) for w in want]
        status = requests.post(f"{base}/v1/rerank", json={"model": name, "query": QUERY, "documents": [long_doc]},
                               timeout=60)
        assert status.status_code == 400 and status.json()["error"]["param"] == "documents", status.text
        cut = requests.post(f"{base}/v1/rerank", json={"model": name, "query": QUERY, "documents": [long_doc],
                                                       "truncate_prompt_tokens": -1}, timeout=60).json()
        assert abs(cut["results"][0]["relevance_score"] - want_cut) < 1e-6, cut
        # vLLM's /classify: a one-label model's sigmoid, as LLM.classify answers it
        cls = requests.post(f"{base}/classify", json={"model": name, "input": DOCS[:2]}, timeout=60).json()
        offline = ref.classify(DOCS[:2])
        assert [d["index"] for d in cls["data"]] == [0, 1] and cls["data"][0]["num_classes"] == 1, cls
        assert all(abs(d["probs"][0] - o.outputs.probs[0]) < 1e-6 and d["label"] == o.label
                   for d, o in zip(cls["data"], offline))
        assert cls["usage"]["prompt_tokens"] == sum(len(o.prompt_token_ids) for o in offline)
        emb = requests.post(f"{base}/v1/embeddings", json={"model": name, "input": "a"}, timeout=30)
        assert emb.status_code == 400 and emb.json()["error"]["param"] == "model", emb.text
        assert "cross-encoder" in emb.json()["error"]["message"]
        gen = requests.post(f"{base}/v1/completions", json={"model": name, "prompt": "a", "max_tokens": 2}, timeout=30)
        assert gen.status_code == 400 and "serves pair scores" in gen.json()["error"]["message"], gen.text
        with pytest.raises(grpc.RpcError) as e:
            list(r.stub.Generate(pdserve_pb2.GenerateRequest(prompt="a", max_tokens=2), timeout=30))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "is an encoder" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:
            r.stub.Embed(pdserve_pb2.EmbedRequest(texts=["a"]), timeout=30)
        assert e.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "cross-encoder" in e.value.details()
        assert r.wait_idle(10.0)
    finally:
        r.close()
