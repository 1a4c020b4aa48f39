"""The OpenAI-compatible HTTP API's OpenAPI document: what ``/openapi.json`` says each operation takes and answers.

Lifecycle: ``install(app)`` is called once when ``router.openai.http_api`` builds its FastAPI app; the document is
built on the first ``GET /openapi.json`` and cached by FastAPI. The request bodies are the pydantic models the
handlers validate with (``router.openai.protocol``), so the schema cannot drift from what is accepted; the
response models below only document the JSON the handlers render (``responses.ResponseBody``,
``tokenize_json``, ``error_body``): the handlers return ``JSONResponse``s and never pass through them.
tests/security/test_fuzz_http.py fuzzes the API from this document and checks every answer against it, so a
renderer that drifts from these models fails there.
"""
from __future__ import annotations

from typing import Any, Literal, Optional, Union

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel, ConfigDict


class _Open(BaseModel):
    model_config = ConfigDict(extra="allow")


class ErrorDetail(_Open):
    message: str
    type: str
    param: Optional[str] = None
    code: int


class ErrorResponse(_Open):
    """OpenAI's error body (every 4xx and 5xx)."""

    error: ErrorDetail


class AnthropicErrorDetail(_Open):
    type: str
    message: str


class AnthropicErrorResponse(_Open):
    """Anthropic's error body (every 4xx and 5xx of /v1/messages)."""

    type: Literal["error"]
    error: AnthropicErrorDetail


class PromptTokensDetails(_Open):
    cached_tokens: int


class PdserveTimings(_Open):
    """pdserve's ``pdserve_timings`` extension (asked for with the request's ``pdserve_timings: true``): seconds;
    ttft_s = placement_s + worker_queue_s + prefill_s + delivery_s."""

    ttft_s: float
    placement_s: float
    worker_queue_s: float
    prefill_s: float
    delivery_s: float
    kv_transfer_s: float
    decode_s: float
    total_s: float


class UsageInfo(_Open):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: Optional[PromptTokensDetails] = None
    pdserve_timings: Optional[list[PdserveTimings]] = None
    """One per prompt, only when the request set ``pdserve_timings``."""


class FunctionCall(_Open):
    name: str
    arguments: str


class ToolCall(_Open):
    id: str
    type: Literal["function"]
    function: FunctionCall


class AssistantMessage(_Open):
    role: Literal["assistant"]
    content: Optional[str] = None
    tool_calls: Optional[list[ToolCall]] = None


class ChatChoice(_Open):
    index: int
    message: AssistantMessage
    logprobs: Optional[dict[str, Any]] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    """vLLM's: the stop string or ``stop_token_ids`` id that ended the choice (null: EOS or the length limit)."""


class ChatCompletionResponse(_Open):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: Optional[list[Optional[dict[str, Any]]]] = None
    """vLLM's, when asked: null, then per prompt token {token id: {logprob, rank, decoded_token}}."""


class CompletionChoice(_Open):
    index: int
    text: str
    logprobs: Optional[dict[str, Any]] = None
    finish_reason: Optional[str] = None
    stop_reason: Optional[Union[int, str]] = None
    """vLLM's: the stop string or ``stop_token_ids`` id that ended the choice (null: EOS or the length limit)."""
    prompt_logprobs: Optional[list[Optional[dict[str, Any]]]] = None
    """vLLM's, when asked: null, then per prompt token {token id: {logprob, rank, decoded_token}}."""


class CompletionResponse(_Open):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo


class ModelCard(_Open):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    root: str
    parent: Optional[str] = None  # a LoRA adapter's base model (None: the base model itself)
    max_model_len: int


class ModelList(_Open):
    object: Literal["list"]
    data: list[ModelCard]


class TokenizeResponse(_Open):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: Optional[list[str]] = None


class DetokenizeResponse(_Open):
    prompt: str


class EmbeddingData(_Open):
    object: str
    index: int
    embedding: Union[list[float], str]
    """The vector's floats, or (``encoding_format: "base64"``) the base64 of its little-endian float32 bytes."""


class EmbeddingUsage(_Open):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(_Open):
    id: str
    object: str
    created: int
    model: str
    data: list[EmbeddingData]
    usage: EmbeddingUsage


class ScoreData(_Open):
    object: str
    index: int
    score: float


class ScoreResponse(_Open):
    id: str
    object: str
    created: int
    model: str
    data: list[ScoreData]
    usage: EmbeddingUsage


class RerankResult(_Open):
    index: int
    relevance_score: float
    document: Optional[dict[str, str]] = None


class RerankResponse(_Open):
    id: str
    model: str
    results: list[RerankResult]
    usage: EmbeddingUsage


class ClassificationData(_Open):
    index: int
    label: str
    probs: list[float]
    num_classes: int


class ClassificationResponse(_Open):
    id: str
    object: str
    created: int
    model: str
    data: list[ClassificationData]
    usage: EmbeddingUsage


_ERRORS = {400: "invalid request (the message names the field)", 401: "missing or invalid API key",
           404: "no such model", 429: "overloaded: retry later", 503: "not serving (starting or draining)",
           504: "the request's deadline passed"}
_SSE = {"text/event-stream": {"schema": {"type": "string", "description": "server-sent events (stream: true): "
                                                                           "one chunk object per `data:` line, then "
                                                                           "`data: [DONE]`"}}}


def _ref(model: type[BaseModel]) -> dict:
    return {"$ref": f"#/components/schemas/{model.__name__}"}


def install(app: FastAPI, completion_request: type[BaseModel], chat_request: type[BaseModel],
            tokenize_requests: tuple[type[BaseModel], ...], detokenize_request: type[BaseModel],
            extra_bodies: Optional[dict[str, type[BaseModel]]] = None) -> None:
    """``extra_bodies``: the request body of each further route (path -> its model)."""
    """Give ``app`` an ``openapi()`` that documents the real request and response bodies."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema:
            return app.openapi_schema
        doc = get_openapi(title=app.title, version=app.version, routes=app.routes,
                          description="pdserve's OpenAI-compatible API (vLLM's extensions included)")
        schemas = doc.setdefault("components", {}).setdefault("schemas", {})
        models: list[type[BaseModel]] = [ErrorResponse, AnthropicErrorResponse, ChatCompletionResponse, CompletionResponse, ModelList,
                                         TokenizeResponse, DetokenizeResponse, EmbeddingResponse, *tokenize_requests,
                                         detokenize_request, ScoreResponse, RerankResponse, ClassificationResponse,
                                         *dict.fromkeys((extra_bodies or {}).values())]
        for m in models:
            js = m.model_json_schema(ref_template="#/components/schemas/{model}")
            schemas.update(js.pop("$defs", {}))
            schemas[m.__name__] = js
        schemas.pop("HTTPValidationError", None)
        schemas.pop("ValidationError", None)
        ok: dict[str, Union[dict, Any]] = {
            "/v1/completions": {"application/json": {"schema": _ref(CompletionResponse)}, **_SSE},
            "/v1/chat/completions": {"application/json": {"schema": _ref(ChatCompletionResponse)}, **_SSE},
            "/v1/models": {"application/json": {"schema": _ref(ModelList)}},
            "/tokenize": {"application/json": {"schema": _ref(TokenizeResponse)}},
            "/detokenize": {"application/json": {"schema": _ref(DetokenizeResponse)}},
            "/v1/embeddings": {"application/json": {"schema": _ref(EmbeddingResponse)}},
            "/v1/score": {"application/json": {"schema": _ref(ScoreResponse)}},
            "/v1/rerank": {"application/json": {"schema": _ref(RerankResponse)}},
            "/v1/classify": {"application/json": {"schema": _ref(ClassificationResponse)}},
            "/metrics": {"text/plain": {"schema": {"type": "string", "description": "Prometheus exposition"}}},
            "/v1/responses": {"application/json": {"schema": {"type": "object", "description": "OpenAI's response "
                                                                          "object"}},
                              "text/event-stream": {"schema": {"type": "string", "description": "stream: true: "
                                                               "OpenAI's Responses events, one per `data:` line"}}},
            "/v1/messages": {"application/json": {"schema": {"type": "object", "description": "Anthropic's message"}},
                             "text/event-stream": {"schema": {"type": "string", "description": "stream: true: "
                                                              "Anthropic's message events"}}},
            "/v1/messages/count_tokens": {"application/json": {"schema": {
                "type": "object", "required": ["input_tokens"],
                "properties": {"input_tokens": {"type": "integer"}}}}},
            "/v1/load_lora_adapter": {"text/plain": {"schema": {"type": "string", "description": "success"}}},
            "/v1/unload_lora_adapter": {"text/plain": {"schema": {"type": "string", "description": "success"}}},
            "/version": {"application/json": {"schema": {"type": "object", "required": ["version"],
                                                         "properties": {"version": {"type": "string"}}}}},
        }
        bodies = {"/tokenize": {"anyOf": [_ref(m) for m in tokenize_requests]}, "/detokenize": _ref(detokenize_request),
                  **{path: _ref(m) for path, m in (extra_bodies or {}).items()}}
        for path, ops in doc.get("paths", {}).items():
            for method, op in ops.items():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                if path in ok:
                    responses["200"] = {"description": "the answer", "content": ok[path]}
                if path in ("/health", "/ping"):  # no body: the status is the answer
                    responses.clear()
                    responses["200"] = {"description": "serving"}
                    responses["503"] = {"description": "starting or draining"}
                if path in bodies:
                    op["requestBody"] = {"required": True, "content": {"application/json": {"schema": bodies[path]}}}
                if method == "post" or path.startswith("/v1"):
                    shape = AnthropicErrorResponse if path.startswith("/v1/messages") else ErrorResponse
                    for status, what in _ERRORS.items():
                        responses[str(status)] = {"description": what,
                                                  "content": {"application/json": {"schema": _ref(shape)}}}
        app.openapi_schema = doc
        return doc

    app.openapi = openapi  # type: ignore[method-assign]
