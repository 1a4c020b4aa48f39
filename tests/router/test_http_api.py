"""router.openai.http_api over a real RouterCore whose workers are in-process fakes (tests/router/fakes.py): OpenAI's
JSON and SSE shapes with exact usage, errors with their HTTP status, the API key, and a client that goes away
cancelling its flows through the server's disconnect message (never ``Request.is_disconnected`` polling)."""
from __future__ import annotations

import json
import socket

import grpc
import httpx
import pytest
from starlette.requests import Request

from router.config import RouterConfig
from router.core import RouterCore
from router.openai.http_api import HttpApi
from router.worker_source import StaticWorkerSource
from transport.errors import StatusRpcError
from tests.router.fakes import FakeClients, FakeStream, FakeWorker, chunk, first_token, info, \
    transfer_done
from tests.waiting import wait_until

KEY = "unit-test-key-0123456789"
HE, L, LO = 627, 80, 338
"""The tiny tokenizer's " he", "l", "lo"."""
PROMPT = list(range(100, 140))  # 40 token ids: two full blocks of 16


@pytest.fixture(scope="module")
def server():
    p0, d0 = FakeWorker(info("p0", "prefill")), FakeWorker(info("d0", "decode"))
    core = RouterCore(RouterConfig(serve_metrics=False), StaticWorkerSource([p0.info, d0.info]))
    core.calls.clients = FakeClients([p0, d0])
    core.load()
    api = HttpApi(core, "127.0.0.1", 0, api_keys=(KEY,))
    api.start()
    yield api, p0, d0
    api.stop()
    core.close()


@pytest.fixture
def workers(server):
    api, p0, d0 = server
    for w in (p0, d0):
        w.calls.clear()
        w.aborted.clear()
    p0.prefill = lambda req: FakeStream([first_token(HE, cached=32), transfer_done()])
    d0.decode = lambda req: FakeStream([chunk([L, LO], "length")])
    d0.reserve = None
    return p0, d0


def _post(api, path: str, body: dict, key: str = KEY) -> httpx.Response:
    return httpx.post(f"http://{api.address}{path}", json=body, headers={"authorization": f"Bearer {key}"},
                      timeout=30)


def test_completion_json_with_exact_usage(server, workers):
    api = server[0]
    r = _post(api, "/v1/completions", {"model": "tiny", "prompt": PROMPT, "max_tokens": 3})
    assert r.status_code == 200
    body = r.json()
    assert (body["object"], body["model"], body["id"][:5]) == ("text_completion", "tiny", "cmpl-")
    assert body["choices"] == [{"index": 0, "text": " hello", "logprobs": None, "finish_reason": "length",
                               "stop_reason": None}]
    assert body["usage"] == {"prompt_tokens": 40, "completion_tokens": 3, "total_tokens": 43,
                             "prompt_tokens_details": {"cached_tokens": 32}}
    assert api.core.num_in_flight == 0


def test_streamed_chat_chunks_usage_and_done(server, workers):
    api = server[0]
    with httpx.stream("POST", f"http://{api.address}/v1/chat/completions", timeout=30,
                      headers={"authorization": f"Bearer {KEY}"},
                      json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "stream": True,
                            "stream_options": {"include_usage": True}}) as r:
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    chunks = [json.loads(x) for x in lines[:-1]]
    deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
    assert deltas == [{"role": "assistant", "content": " he"}, {"content": "llo"}]
    assert [c["choices"][0]["finish_reason"] for c in chunks if c["choices"]] == [None, "length"]
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3
    assert chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 32}
    assert all(c["object"] == "chat.completion.chunk" and c["usage"] is None for c in chunks[:-1])


def test_errors_have_openai_shape_and_the_matching_status(server, workers):
    api = server[0]
    r = _post(api, "/v1/completions", {"prompt": PROMPT, "n": 17})
    assert r.status_code == 400 and r.json()["error"]["message"] == "n must be in [1, 16], got 17"
    r = _post(api, "/v1/completions", {"model": "gpt-4", "prompt": PROMPT})
    assert (r.status_code, r.json()["error"]["param"]) == (404, "model")
    assert _post(api, "/v1/completions", {"prompt": PROMPT}, key="wrong").status_code == 401
    assert httpx.get(f"http://{api.address}/health", timeout=10).status_code == 200  # open without a key
    for raw in ("null", "[1, 2]", "7"):  # JSON, but no object: nothing to name but the body (found by the fuzz)
        r = httpx.post(f"http://{api.address}/v1/chat/completions", content=raw, timeout=30,
                       headers={"authorization": f"Bearer {KEY}", "content-type": "application/json"})
        assert r.status_code == 400 and r.json()["error"]["message"].startswith("body: "), (raw, r.text)
    # a flow's failure: every decode worker refuses for good -> its status as HTTP
    workers[1].reserve = StatusRpcError(grpc.StatusCode.INVALID_ARGUMENT, "bad params")
    r = _post(api, "/v1/completions", {"prompt": PROMPT, "max_tokens": 3})
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "reserve on decode worker d0 failed: bad params" in r.json()["error"]["message"]


@pytest.mark.parametrize("stream", [False, True])
def test_a_client_that_goes_away_cancels_its_flow_without_polling(server, workers, monkeypatch, stream):
    """The decode stream never ends on its own: only the client's disconnect can end the request. Polling
    ``Request.is_disconnected`` is made blind, so only the server's http.disconnect message can notice it."""
    async def never(self) -> bool:
        return False

    monkeypatch.setattr(Request, "is_disconnected", never)
    api, (p0, d0) = server[0], workers
    d_stream = FakeStream([chunk([L])], block=True)
    d0.decode = lambda req: d_stream
    body = json.dumps({"prompt": PROMPT, "max_tokens": 50, "stream": stream}).encode()
    host, port = api.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                  b"authorization: Bearer " + KEY.encode() + b"\r\ncontent-length: " + str(len(body)).encode()
                  + b"\r\n\r\n" + body)
        wait_until(lambda: d0.called("Decode"), timeout=20, message="the decode call started")
    wait_until(lambda: d_stream.cancelled, timeout=20, message="the disconnect cancelled the decode call")
    wait_until(lambda: api.core.num_in_flight == 0, timeout=20, message="the request left the router")
    assert len(d0.aborted) == 1 and d0.aborted == p0.aborted  # both workers free its blocks


def test_a_context_shorter_than_the_models_on_the_workers_is_checked_by_the_router(server, workers):
    """Workers publish their engines' context length (``WorkerInfo.max_model_len``); a router started without their
    ``--max-model-len`` checks requests against the shortest one: a prompt that fits the model but not the workers
    is refused by the router, naming the prompt, before any worker is asked (the HTTP fuzz found the worker's own
    refusal reaching clients naming no field). Workers that publish nothing (0, older ones) leave the model's."""
    api, p0, d0 = server
    model_len = api.core.limits.max_context_length
    prompt = list(range(100, 150))  # 50 tokens: within the model's context, not within the workers' 48
    try:
        for w in (p0, d0):
            w.info.max_model_len = 48
        wait_until(lambda: api.core.limits.max_context_length == 48, timeout=30, interval=0.05,
                   message="the router checking against the workers' context")
        r = _post(api, "/v1/completions", {"prompt": prompt, "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "prompt has 50 tokens; the context length is 48", r.text
        assert p0.calls == [] and d0.calls == []  # refused before placement
        models = httpx.get(f"http://{api.address}/v1/models", headers={"authorization": f"Bearer {KEY}"}, timeout=30)
        assert models.json()["data"][0]["max_model_len"] == 48
        p0.info.max_model_len = model_len + 100  # the shortest counts, and a longer one than the model's is not used
        assert api.core.view.max_model_len() == 48
        d0.info.max_model_len = 0
        wait_until(lambda: api.core.limits.max_context_length == model_len, timeout=30, interval=0.05,
                   message="the model's context again once no worker publishes a shorter one")
        assert _post(api, "/v1/completions", {"prompt": prompt, "max_tokens": 2}).status_code == 200
    finally:
        p0.info.max_model_len = d0.info.max_model_len = 0


def test_prefix_cache_reset_is_off_by_default_and_needs_the_key(server, workers):
    api = server[0]
    off = _post(api, "/reset_prefix_cache", {})
    assert off.status_code == 404 and "--allow-prefix-cache-reset" in off.json()["error"]["message"]
    assert _post(api, "/reset_prefix_cache", {}, key="wrong-key-0123456789").status_code == 401
