"""The OpenAI-compatible HTTP API fuzzed from its own OpenAPI schema (``/openapi.json``), with schemathesis.

A real router (HTTP front end on a free port, API keys on) in front of a real prefill + decode worker pair. For
every operation the schema describes, schemathesis draws bodies that fit the schema and bodies that do not, and
each call must end in a status a client can act on: never a 5xx (the router answers 503 only when it cannot
serve at all, which it always can here), every 4xx with an OpenAI error body whose message says what was wrong,
every 2xx with a body that matches the documented response schema. After the run the cluster still serves a
plain completion and the workers hold no request and no KV block (nothing leaked). Examples are derandomized;
``PDSERVE_FUZZ_EXAMPLES`` raises their number for a soak run (default 25 per operation here).
"""
from __future__ import annotations

import json
import os
import re
import urllib.request

import pytest
import schemathesis
from schemathesis import GenerationMode
from schemathesis.checks import content_type_conformance, response_schema_conformance, status_code_conformance
import torch
from hypothesis import HealthCheck, given, settings

from router.openai import protocol as oa
from router.openai import anthropic_api as aa
from router.openai.classify_api import ClassifyRequest
from router.openai.embeddings_api import EmbeddingRequest
from router.openai.score_api import RerankRequest, ScoreRequest
from router.openai.responses_api import ResponsesRequest
from tests.loadtest.test_bench_real_cluster import Cluster
from tests.waiting import wait_until

KEY = "fuzz-http-key-1"
FIELD_NAMES = sorted({name for model in (oa.CompletionRequest, oa.ChatCompletionRequest, oa.TokenizeCompletionRequest,
                                         oa.TokenizeChatRequest, oa.DetokenizeRequest, oa.LoadLoRAAdapterRequest,
                                         oa.UnloadLoRAAdapterRequest, ResponsesRequest, aa.MessagesRequest,
                                         aa.CountTokensRequest, EmbeddingRequest, ScoreRequest, RerankRequest,
                                         ClassifyRequest)
                      for name in model.model_fields} | {"body", "JSON", "allow-runtime-lora-updating", "response_id",
                                                         "limit", "order", "after"},
                     key=len, reverse=True)
"""What an error message may name: any request field of the API, or the body as a whole (or, for the runtime LoRA
calls on this router, which does not allow them, the flag that would)."""
EXAMPLES = int(os.environ.get("PDSERVE_FUZZ_EXAMPLES", "25"))
MAX_MODEL_LEN = 64


@pytest.fixture(scope="module")
def http_cluster(redis_url):
    torch.set_num_threads(1)
    # A short context: a chat body without max_tokens takes the rest of the context (vLLM's default, kept in the
    # fuzz), which at the tiny model's 512 positions made each such example a few hundred tokens (78 s of the run).
    c = Cluster("disaggregated", redis_url, http=True, api_keys=(KEY,), max_model_len=MAX_MODEL_LEN)
    yield c
    c.close()


def _operations(http_cluster: Cluster) -> list:
    schema = schemathesis.openapi.from_url(f"{http_cluster.http_url}/openapi.json")
    return [r.ok() for r in schema.get_all_operations()]


def test_openapi_document_describes_the_api(http_cluster):
    with urllib.request.urlopen(f"{http_cluster.http_url}/openapi.json", timeout=30) as r:  # open: no key needed
        doc = json.load(r)
    paths = doc["paths"]
    for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/v1/models"):
        assert path in paths, sorted(paths)
    chat = paths["/v1/chat/completions"]["post"]
    body = chat["requestBody"]["content"]["application/json"]["schema"]
    assert "$ref" in body or "properties" in body
    # the success and error bodies are described, not left as "any"
    assert "200" in chat["responses"] and "400" in chat["responses"], chat["responses"].keys()
    ok = chat["responses"]["200"]["content"]["application/json"]["schema"]
    assert ok.get("$ref", "").endswith("ChatCompletionResponse") or ok.get("anyOf"), ok


def _short(case) -> None:
    """Accepted requests stay short and whole (their bodies are checked against the schema)."""
    if isinstance(case.body, dict):
        for name in ("max_tokens", "max_completion_tokens", "max_output_tokens"):
            if isinstance(case.body.get(name), int) and case.body[name] > 4:
                case.body[name] = 4
        case.body.pop("stream", None)
        if isinstance(case.body.get("model"), str) and case.body["model"] != "tiny":
            # a made-up model name is a 404 every time; the server's own is the default (Anthropic's Messages API
            # requires one: the server's)
            if case.operation.path.startswith("/v1/messages"):
                case.body["model"] = "tiny"
            else:
                case.body.pop("model")


@pytest.mark.parametrize("mode", [GenerationMode.POSITIVE, GenerationMode.NEGATIVE])
def test_fuzzed_http_requests_get_an_actionable_status(http_cluster, mode):
    ops = _operations(http_cluster)
    assert {op.path for op in ops} >= {"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"}
    seen: dict[str, set[int]] = {}
    for op in ops:
        if mode is GenerationMode.NEGATIVE and op.method.upper() in ("GET", "DELETE"):
            continue  # nothing to violate: they take no body, and a stored response's id may be any string
        @settings(max_examples=EXAMPLES, derandomize=True, deadline=None, database=None,
                  suppress_health_check=list(HealthCheck))
        @given(op.as_strategy(generation_mode=mode))
        def one(case) -> None:
            _short(case)
            response = case.call(base_url=http_cluster.http_url, headers={"Authorization": f"Bearer {KEY}"},
                                 timeout=60)
            seen.setdefault(op.label, set()).add(response.status_code)
            assert response.status_code < 500, (op.label, response.status_code, response.text[:500], case.body)
            if 400 <= response.status_code < 500:
                msg = response.json().get("error", {}).get("message")
                assert isinstance(msg, str) and len(msg) >= 8, response.text[:500]
                # the message names what was wrong: a field of the API (or the body itself)
                assert any(re.search(rf"\b{re.escape(f)}\b", msg) for f in FIELD_NAMES), (op.label, msg, case.body)
            case.validate_response(response, checks=[response_schema_conformance, status_code_conformance,
                                                     content_type_conformance])

        one()
    # the schema is looser than validation (it has no bounds for n, say), so schema-valid bodies are refused too;
    # both modes must reach the refusals, and the body-less operations answer
    assert any(400 in codes for codes in seen.values()), seen
    if mode is GenerationMode.POSITIVE:
        assert seen.get("GET /v1/models") == {200} and seen.get("GET /health") == {200}, seen


def test_cluster_is_clean_after_the_fuzz(http_cluster):
    req = urllib.request.Request(f"{http_cluster.http_url}/v1/completions", method="POST",
                                 data=json.dumps({"prompt": "import os", "max_tokens": 3, "temperature": 0}).encode(),
                                 headers={"Authorization": f"Bearer {KEY}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        assert json.load(r)["choices"][0]["finish_reason"] in ("length", "stop")

    def idle() -> bool:
        return all(i.num_running == 0 and i.num_waiting == 0 and i.num_free_blocks == i.num_total_blocks
                   for i in (w.info() for w in http_cluster.workers))

    wait_until(idle, timeout=60, message="every worker idle with all KV blocks free after the HTTP fuzz")
    # the workers' short context reached the router through their records (it was not configured with it)
    assert [w.info().max_model_len for w in http_cluster.workers] == [MAX_MODEL_LEN] * 2
    assert http_cluster.router.core.limits.max_context_length == MAX_MODEL_LEN
