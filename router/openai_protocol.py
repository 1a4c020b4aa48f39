"""The OpenAI-compatible request and response shapes the HTTP front end speaks.

Lifecycle: stateless. ``router.http_api`` parses a request body into ``CompletionRequest`` or
``ChatCompletionRequest`` (pydantic, at the external boundary; unknown fields are ignored as
OpenAI's own server does), turns it into the same ``pdserve.v1.GenerateRequest`` the gRPC front
end receives (``to_generate_request``), so both front ends share one validation path, and renders
the flow's ``FlowEvent``s back into OpenAI's JSON (``completion_choice``, ``chat_choice``, usage,
logprobs, errors). Field names follow OpenAI's API, plus vLLM's extras with vLLM's names.
"""
from __future__ import annotations

import time
import uuid
from typing import Any, Optional, Union

import grpc
from pydantic import BaseModel, ConfigDict, Field

from proto import pdserve_pb2
from router.events import FlowEvent, Usage

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: 400, grpc.StatusCode.FAILED_PRECONDITION: 400,
    grpc.StatusCode.OUT_OF_RANGE: 400, grpc.StatusCode.UNAUTHENTICATED: 401,
    grpc.StatusCode.PERMISSION_DENIED: 403, grpc.StatusCode.NOT_FOUND: 404,
    grpc.StatusCode.ALREADY_EXISTS: 409, grpc.StatusCode.RESOURCE_EXHAUSTED: 429,
    grpc.StatusCode.CANCELLED: 499, grpc.StatusCode.UNIMPLEMENTED: 501,
    grpc.StatusCode.UNAVAILABLE: 503, grpc.StatusCode.DEADLINE_EXCEEDED: 504,
}
"""The HTTP status of each gRPC status a flow can end with (500 for the rest)."""

_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
               429: "rate_limit_error", 503: "service_unavailable", 504: "timeout"}


def error_body(status: int, message: str, param: Optional[str] = None) -> dict:
    """OpenAI's error shape."""
    return {"error": {"message": message, "type": _ERROR_TYPE.get(status, "server_error"), "param": param,
                      "code": status}}


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Sampling(BaseModel):
    """Fields both endpoints share (OpenAI's, then vLLM's extras)."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    max_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    n: int = 1
    seed: Optional[int] = None
    stop: Optional[Union[str, list[str]]] = None
    stream: bool = False
    stream_options: Optional[StreamOptions] = None
    frequency_penalty: Optional[float] = None
    presence_penalty: Optional[float] = None
    logit_bias: Optional[dict[str, float]] = None
    user: Optional[str] = None
    # vLLM's extras
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    min_tokens: Optional[int] = None
    skip_special_tokens: bool = True
    stop_token_ids: Optional[list[int]] = None
    use_beam_search: bool = False
    """vLLM's: beam search with ``n`` beams; the n best sequences come back as the choices, best first."""
    length_penalty: Optional[float] = None
    early_stopping: Optional[Union[bool, str]] = None


class CompletionRequest(_Sampling):
    prompt: Union[str, list[str], list[int], list[list[int]]]
    logprobs: Optional[int] = None
    echo: bool = False
    best_of: Optional[int] = None
    suffix: Optional[str] = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: Optional[Union[str, list[dict[str, Any]]]] = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: Optional[int] = None
    logprobs: bool = False
    top_logprobs: Optional[int] = None


def message_dicts(req: ChatCompletionRequest) -> list[dict]:
    """Messages as the chat template takes them (text parts of a multi-part content joined)."""
    out = []
    for i, m in enumerate(req.messages):
        content = m.content
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ValueError(f"messages[{i}].content[{j}]: only text parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        out.append({"role": m.role, "content": content or ""})
    return out


def to_generate_request(req: _Sampling, *, prompt: Optional[str] = None, token_ids: Optional[list[int]] = None,
                        logprobs: Optional[int] = None, max_tokens: Optional[int] = None,
                        seed: Optional[int] = None) -> pdserve_pb2.GenerateRequest:
    """The gRPC-shaped request the router validates (one choice of one prompt)."""
    g = pdserve_pb2.GenerateRequest(ignore_eos=req.ignore_eos, skip_special_tokens_off=not req.skip_special_tokens)
    if prompt is not None:
        g.prompt = prompt
    if token_ids is not None:
        g.token_ids.extend(token_ids)
    if max_tokens is not None:
        g.max_tokens = max_tokens
    if isinstance(req.stop, str):
        g.stop.append(req.stop)
    elif req.stop:
        g.stop.extend(req.stop)
    if req.stop_token_ids:
        g.stop_token_ids.extend(req.stop_token_ids)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "frequency_penalty",
                 "presence_penalty", "min_tokens"):
        v = getattr(req, name)
        if v is not None:
            setattr(g, name, v)
    if seed is not None:
        if seed < 0:
            raise ValueError(f"seed must be >= 0, got {seed}")
        g.seed = seed
    if logprobs is not None:
        g.logprobs = logprobs
    if req.use_beam_search:
        if req.stream:
            raise ValueError("stream: beam search answers once the search ends; use stream: false")
        g.beam_width = req.n
        if req.length_penalty is not None:
            g.length_penalty = req.length_penalty
        if req.early_stopping is not None:
            g.early_stopping = str(req.early_stopping).lower()
    elif req.length_penalty is not None or req.early_stopping is not None:
        raise ValueError("length_penalty and early_stopping need use_beam_search: true")
    for t, b in (req.logit_bias or {}).items():
        try:
            g.logit_bias[int(t)] = b
        except (ValueError, OverflowError):
            raise ValueError(f"logit_bias keys must be token ids, got {t!r}") from None
    return g


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage_json(usages: list[Usage], prompt_tokens: int) -> dict:
    completion = sum(u.completion_tokens for u in usages)
    cached = max((u.cached_tokens for u in usages), default=0)
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
            "total_tokens": prompt_tokens + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def completion_logprobs(ev: FlowEvent, detok: Any, offset: int) -> Optional[dict]:
    """OpenAI completions' logprobs block for the tokens of one event."""
    if ev.logprobs is None:
        return None
    tokens = [detok(t) for t in ev.token_ids]
    offsets, pos = [], offset
    for t in tokens:
        offsets.append(pos)
        pos += len(t)
    return {"tokens": tokens, "token_logprobs": [lp.logprob for lp in ev.logprobs],
            "top_logprobs": [{detok(t): v for t, v in lp.top} for lp in ev.logprobs], "text_offset": offsets}


def chat_logprobs(ev: FlowEvent, detok: Any) -> Optional[dict]:
    """OpenAI chat's logprobs block for the tokens of one event."""
    if ev.logprobs is None:
        return None

    def entry(tok: int, lp: float) -> dict:
        s = detok(tok)
        return {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8"))}

    return {"content": [{**entry(t, lp.logprob), "top_logprobs": [entry(a, b) for a, b in lp.top]}
                        for t, lp in zip(ev.token_ids, ev.logprobs)]}


def created() -> int:
    return int(time.time())

