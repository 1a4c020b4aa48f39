"""OpenAI's Responses API (``POST /v1/responses``, as vLLM serves it): a text answer, whole or streamed as typed events.

Lifecycle: stateless. ``router.openai.http_api`` parses the body into ``ResponsesRequest`` and ``to_chat_request``
turns it into the ``ChatCompletionRequest`` the chat path already serves (``instructions`` as the system message,
``input`` as the conversation, ``max_output_tokens`` as ``max_tokens``, ``text.format`` as ``response_format``), so
validation, the chat template, LoRA adapters, structured outputs, quotas and cancellation are the chat path's. The
answer is rendered here instead of as a chat completion: ``ResponseCollector`` gathers the flow's events into one
``response`` object, ``ResponseEventStream`` streams OpenAI's events (``response.created``, ``response.in_progress``,
``response.output_item.added``, ``response.content_part.added``, ``response.output_text.delta`` per piece of text,
``response.output_text.done``, ``response.content_part.done``, ``response.output_item.done``, then
``response.completed``, or ``response.incomplete`` when ``max_output_tokens`` cut it, each with its
``sequence_number``), as the OpenAI SDK's ``client.responses.create`` reads them.

What is refused, naming the field (400): ``previous_response_id`` and ``conversation`` (this server keeps no
responses: send the whole conversation as ``input``), ``tools`` and ``tool_choice`` other than none (function calls
are served on /v1/chat/completions), ``background``, input items other than messages with text parts, ``n``-like
fields (one answer per response). ``store`` is accepted and answered ``false`` (nothing is kept).
"""
from __future__ import annotations

import json
import time
import uuid
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict

from router.events import FlowError, FlowEvent
from router.openai.protocol import ChatCompletionRequest
from router.openai.responses import flow_error

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses`` (OpenAI's fields this server serves, and vLLM's sampling extras)."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    input: Union[str, list[dict[str, Any]]]
    instructions: Optional[str] = None
    max_output_tokens: Optional[int] = None
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    stream: bool = False
    store: Optional[bool] = None
    text: Optional[dict[str, Any]] = None
    metadata: Optional[dict[str, str]] = None
    user: Optional[str] = None
    previous_response_id: Optional[str] = None
    conversation: Optional[Any] = None
    background: Optional[bool] = None
    tools: Optional[list[dict[str, Any]]] = None
    tool_choice: Optional[Any] = None
    # vLLM's extras
    seed: Optional[int] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False


def _messages(body: ResponsesRequest) -> list[dict]:
    msgs: list[dict] = []
    if body.instructions:
        msgs.append({"role": "system", "content": body.instructions})
    if isinstance(body.input, str):
        if not body.input:
            raise ValueError("input: must not be empty")
        return msgs + [{"role": "user", "content": body.input}]
    if not body.input:
        raise ValueError("input: must not be empty")
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind != "message":
            raise ValueError(f"input[{i}].type: {kind!r} items are not served here (messages with text only)")
        role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
        if role is None:
            raise ValueError(f"input[{i}].role must be one of {sorted(_ROLES)}, got {item.get('role')!r}")
        content = item.get("content")
        if isinstance(content, list):
            texts = []
            for j, part in enumerate(content):
                if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or \
                        not isinstance(part.get("text"), str):
                    raise ValueError(f"input[{i}].content[{j}]: only text parts ({', '.join(_TEXT_PARTS)}) are "
                                     "served")
                texts.append(part["text"])
            content = "".join(texts)
        if not isinstance(content, str):
            raise ValueError(f"input[{i}].content must be text or a list of text parts")
        msgs.append({"role": role, "content": content})
    return msgs


def _response_format(text: Optional[dict]) -> Optional[dict]:
    """``text.format`` as chat's ``response_format``."""
    if not text or text.get("format") is None:
        return None
    fmt = text["format"]
    if not isinstance(fmt, dict):
        raise ValueError("text.format must be an object")
    kind = fmt.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return {"type": "json_object"}
    if kind == "json_schema":
        schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
        return {"type": "json_schema", "json_schema": schema}
    raise ValueError(f"text.format.type must be 'text', 'json_object' or 'json_schema', got {kind!r}")


def to_chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that serves ``body``; ValueError naming the field for what this server does not serve."""
    for field in ("previous_response_id", "conversation"):
        if getattr(body, field) is not None:
            raise ValueError(f"{field}: this server keeps no responses; send the whole conversation as input")
    if body.background:
        raise ValueError("background: responses are answered in the request, not in the background")
    if body.tools:
        raise ValueError("tools: function calling is served on /v1/chat/completions, not here yet")
    if body.tool_choice not in (None, "none", "auto"):
        raise ValueError(f"tool_choice: no tools are served here (got {body.tool_choice!r})")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise ValueError(f"max_output_tokens must be >= 1, got {body.max_output_tokens}")
    chat: dict[str, Any] = {"messages": _messages(body), "model": body.model, "stream": body.stream,
                            "ignore_eos": body.ignore_eos}
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("seed", "seed"), ("top_k", "top_k"), ("min_p", "min_p"),
                     ("repetition_penalty", "repetition_penalty")):
        if getattr(body, src) is not None:
            chat[dst] = getattr(body, src)
    fmt = _response_format(body.text)
    if fmt is not None:
        chat["response_format"] = fmt
    return ChatCompletionRequest.model_validate(chat)


def _usage(usage: Any, n_prompt: int) -> dict:
    out = usage.completion_tokens if usage is not None else 0
    cached = getattr(usage, "cached_tokens", 0) if usage is not None else 0
    return {"input_tokens": n_prompt, "input_tokens_details": {"cached_tokens": cached or 0},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": n_prompt + out}


class ResponseCollector:
    """One response's identity, the request fields it echoes and its answer so far (OpenAI's ``response`` object):
    a whole (non-streamed) one is ``add`` of each event, then ``json_body()``."""

    def __init__(self, body: ResponsesRequest, model: str, n_prompt: int) -> None:
        self.body, self.model, self.n_prompt = body, model, n_prompt
        self.id = f"resp_{uuid.uuid4().hex}"
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.text = ""
        self.reason: Optional[str] = None
        self.usage: Any = None

    def message(self, status: str) -> dict:
        content = [] if status == "in_progress" else [self.part()]
        return {"type": "message", "id": self.msg_id, "status": status, "role": "assistant", "content": content}

    def part(self) -> dict:
        return {"type": "output_text", "text": self.text, "annotations": [], "logprobs": []}

    def json(self, status: str) -> dict:
        """The ``response`` object: ``in_progress`` (no output yet), ``completed`` or ``incomplete``."""
        b = self.body
        fmt = (b.text or {}).get("format") or {"type": "text"}
        done = status != "in_progress"
        return {
            "id": self.id, "object": "response", "created_at": self.created_at, "status": status,
            "background": False, "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": b.instructions, "max_output_tokens": b.max_output_tokens, "metadata": b.metadata or {},
            "model": self.model, "output": [self.message(status)] if done else [], "parallel_tool_calls": True,
            "previous_response_id": None, "reasoning": None, "store": False, "temperature": b.temperature,
            "text": {"format": fmt}, "tool_choice": "auto", "tools": [], "top_p": b.top_p, "truncation": "disabled",
            "usage": _usage(self.usage, self.n_prompt) if done else None, "user": b.user,
        }

    def add(self, ev: FlowEvent) -> None:
        self.text += ev.text
        if ev.finish_reason:
            self.reason = ev.finish_reason
        if ev.usage is not None:
            self.usage = ev.usage

    @property
    def status(self) -> str:
        return "incomplete" if self.reason == "length" else "completed"

    def json_body(self) -> dict:
        return self.json(self.status)


class ResponseEventStream(ResponseCollector):
    """A streamed response: the same ``chunk`` / ``error`` / ``end`` the chat path's ``EventStream`` has, speaking
    OpenAI's Responses events (module docstring)."""

    def __init__(self, body: ResponsesRequest, model: str, n_prompt: int) -> None:
        super().__init__(body, model, n_prompt)
        self._seq = 0
        self._started = False

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def _ids(self) -> dict:
        return {"item_id": self.msg_id, "output_index": 0, "content_index": 0}

    def start(self) -> str:
        self._started = True
        return (self._event("response.created", response=self.json("in_progress"))
                + self._event("response.in_progress", response=self.json("in_progress"))
                + self._event("response.output_item.added", output_index=0, item=self.message("in_progress"))
                + self._event("response.content_part.added", **self._ids(),
                              part={"type": "output_text", "text": "", "annotations": [], "logprobs": []}))

    def chunk(self, idx: int, ev: FlowEvent) -> str:
        out = "" if self._started else self.start()
        self.add(ev)
        if ev.text:
            out += self._event("response.output_text.delta", **self._ids(), delta=ev.text, logprobs=[])
        return out

    def error(self, e: FlowError) -> str:
        body = flow_error(e)[1]["error"]
        return self._event("error", code=body.get("type"), message=body.get("message"), param=body.get("param"))

    def end(self) -> list[str]:
        if self.reason is None:  # (an error ended it: its event is out already)
            return []
        out = [] if self._started else [self.start()]
        status = self.status
        out += [self._event("response.output_text.done", **self._ids(), text=self.text, logprobs=[]),
                self._event("response.content_part.done", **self._ids(), part=self.part()),
                self._event("response.output_item.done", output_index=0, item=self.message("completed")),
                self._event("response.completed" if status == "completed" else "response.incomplete",
                            response=self.json(status))]
        return out
