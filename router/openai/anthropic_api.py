"""Anthropic's Messages API (``POST /v1/messages``, ``POST /v1/messages/count_tokens``, as vLLM serves it): what
clients built on Anthropic's SDK (and agents such as Claude Code pointed at ``ANTHROPIC_BASE_URL``) speak.

Lifecycle: stateless. ``router.openai.http_api`` parses the body into ``MessagesRequest`` and ``to_chat_request``
turns it into the ``ChatCompletionRequest`` the chat path already serves, so validation, the chat template, LoRA
adapters (``model`` naming one), structured outputs, tool-call parsing, quotas and cancellation are the chat path's;
its error messages are relabelled with the Messages field they came from (``MessagesTranslation.relabel``) and every
error is answered in Anthropic's shape (``error_body``: ``{"type": "error", "error": {"type", "message"}}``).

Request, as the chat path takes it: ``system`` (text, or text blocks) is the system message; each of ``messages``
is a ``user`` or ``assistant`` turn whose ``content`` is text or blocks: ``text``; on an assistant turn ``tool_use``
(``id``, ``name``, ``input``) becomes that turn's ``tool_calls``; on a user turn each ``tool_result``
(``tool_use_id``, ``content`` text or text blocks) becomes a ``tool`` message answering that call, before the
turn's text. An earlier assistant turn's ``thinking`` blocks become its ``reasoning_content`` (what thinking
templates such as Qwen3's read back in tool loops); ``redacted_thinking`` blocks are dropped. ``thinking``: on a
router with a reasoning parser (``--reasoning-parser``), ``{"type": "enabled", "budget_tokens": N}`` turns the
model's thinking on (the template variables ``enable_thinking`` and ``thinking`` true) with N as its
``thinking_token_budget`` (less than ``max_tokens``, as Anthropic has it), ``{"type": "adaptive"}`` on without a
budget, ``{"type": "disabled"}`` off; the answer's reasoning comes back as a ``thinking`` block before the text
(streamed as ``thinking_delta``s; its ``signature`` is empty: nothing is signed). Without a reasoning parser the
field is accepted and ignored. ``max_tokens``
(required), ``stop_sequences``, ``temperature``, ``top_p``, ``top_k``, and vLLM's sampling extras. ``tools``
(``name``, ``description``, ``input_schema``) and ``tool_choice`` (``auto``, ``any``, ``tool`` with its
``name``, ``none``; ``disable_parallel_tool_use``) mean what chat's ``tools`` / ``tool_choice`` (auto, required,
a named function, none; ``parallel_tool_calls``) mean. ``output_config.format`` (a JSON schema, as
``client.messages.parse`` sends it) is chat's ``response_format``. (Anthropic's current SDK no longer takes
``temperature`` / ``top_p`` / ``top_k`` as arguments; they are read from the body, so ``extra_body`` sets them.)

Answer: ``ResponseMessage`` gathers the flow's events into one ``message`` (``content``: a ``text`` block, then
one ``tool_use`` block per call, its ``input`` the parsed arguments); ``stop_reason`` is ``tool_use`` when calls
came back, ``stop_sequence`` (with ``stop_sequence``: the flow's ``stop_reason``) when one of ``stop_sequences``
ended it, ``max_tokens`` at the limit, else ``end_turn``; ``usage`` counts ``input_tokens`` not read from the
prefix cache, ``cache_read_input_tokens`` those that were, ``output_tokens``. ``MessageEventStream`` streams
Anthropic's events (``message_start``, ``ping``, per block ``content_block_start``, ``content_block_delta``
(``text_delta`` / ``input_json_delta``), ``content_block_stop``, then ``message_delta`` with the stop reason and
usage, ``message_stop``; a failure is an ``error`` event), as ``client.messages.stream`` assembles them.

Refused, naming the field (400): image, document and server-tool blocks, tools that are not custom (Anthropic's
built-in ``bash``, ``web_search``... types), a ``tool_result`` for a call no earlier turn made, ``mcp_servers``,
``container``.
"""
from __future__ import annotations

import datetime
import json
import uuid
from dataclasses import dataclass
from typing import Any, Optional, Union

from pydantic import BaseModel, ConfigDict

from router.events import FlowError, FlowEvent
from router.openai.protocol import ChatCompletionRequest, relabel_chat_error
from router.openai.reasoning import ReasoningPlan, ReasoningStream
from router.openai.responses import flow_error
from router.openai.tool_parsers import ArgsDelta, CallStart, ContentDelta, ToolCallParser, ToolCallStream

_ERROR_TYPE = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
               404: "not_found_error", 413: "request_too_large", 429: "rate_limit_error", 503: "overloaded_error",
               504: "timeout_error"}
_SKIPPED_BLOCKS = ("thinking", "redacted_thinking")


def error_body(status: int, message: str) -> dict:
    """Anthropic's error shape."""
    return {"type": "error", "error": {"type": _ERROR_TYPE.get(status, "api_error"), "message": message}}


class MessagesRequest(BaseModel):
    """The body of ``POST /v1/messages`` (Anthropic's fields this server serves, and vLLM's sampling extras)."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[Any]
    max_tokens: int
    system: Optional[Union[str, list[Any]]] = None
    stop_sequences: Optional[list[str]] = None
    stream: bool = False
    temperature: Optional[float] = None
    top_p: Optional[float] = None
    top_k: Optional[int] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    metadata: Optional[dict[str, Any]] = None
    thinking: Optional[Any] = None
    """Anthropic's extended thinking (module docstring): with a reasoning parser, the model's thinking on or off and
    its budget; ignored without one."""
    output_config: Optional[dict[str, Any]] = None
    """``format`` (``{"type": "json_schema", "schema": ...}``): the answer follows the schema (structured outputs,
    as ``client.messages.parse`` asks); ``effort`` is accepted and ignored."""
    mcp_servers: Optional[list[Any]] = None
    container: Optional[Any] = None
    # vLLM's extras
    seed: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    structured_outputs: Optional[dict[str, Any]] = None
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    cache_salt: Optional[str] = None
    priority: Optional[int] = None


class CountTokensRequest(BaseModel):
    """The body of ``POST /v1/messages/count_tokens``: a Messages request's prompt, without sampling."""

    model_config = ConfigDict(extra="ignore")

    model: str
    messages: list[Any]
    system: Optional[Union[str, list[Any]]] = None
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None


def _text(value: Any, where: str) -> str:
    """Text, or text blocks joined."""
    if isinstance(value, list):
        parts = []
        for j, block in enumerate(value):
            if not isinstance(block, dict) or block.get("type") != "text" or not isinstance(block.get("text"), str):
                kind = block.get("type") if isinstance(block, dict) else None
                raise ValueError(f"{where}[{j}]: only text blocks are served here, got {kind!r}")
            parts.append(block["text"])
        return "".join(parts)
    if not isinstance(value, str):
        raise ValueError(f"{where} must be text or a list of text blocks")
    return value


def _messages(body: Union[MessagesRequest, CountTokensRequest]) -> tuple[list[dict], list[str]]:
    """The chat messages of ``system`` and ``messages`` and each one's field (see module docstring)."""
    msgs: list[dict] = []
    where: list[str] = []
    if body.system:
        msgs.append({"role": "system", "content": _text(body.system, "system")})
        where.append("system")
    if not body.messages:
        raise ValueError("messages: must not be empty")
    calls: set[str] = set()
    for i, m in enumerate(body.messages):
        at = f"messages[{i}]"
        if not isinstance(m, dict):
            raise ValueError(f"{at} must be an object")
        role = m.get("role")
        if role not in ("user", "assistant"):
            raise ValueError(f"{at}.role must be 'user' or 'assistant', got {role!r}")
        content = m.get("content")
        if isinstance(content, str):
            msgs.append({"role": role, "content": content})
            where.append(at)
            continue
        if not isinstance(content, list):
            raise ValueError(f"{at}.content must be text or a list of content blocks")
        texts: list[str] = []
        thoughts: list[str] = []
        tool_calls: list[dict] = []
        results = 0
        for j, block in enumerate(content):
            bat = f"{at}.content[{j}]"
            kind = block.get("type") if isinstance(block, dict) else None
            if kind == "text" and isinstance(block.get("text"), str):
                texts.append(block["text"])
            elif kind in _SKIPPED_BLOCKS:  # (an assistant turn's thinking: its reasoning_content; redacted: dropped)
                if kind == "thinking" and role == "assistant" and isinstance(block.get("thinking"), str):
                    thoughts.append(block["thinking"])
            elif kind == "tool_use" and role == "assistant":
                call_id, name, args = block.get("id"), block.get("name"), block.get("input", {})
                if not isinstance(call_id, str) or not call_id or call_id in calls:
                    raise ValueError(f"{bat}.id must be a string no earlier tool_use has")
                if not isinstance(name, str) or not name:
                    raise ValueError(f"{bat}.name must be a non-empty string")
                if not isinstance(args, dict):
                    raise ValueError(f"{bat}.input must be an object")
                calls.add(call_id)
                tool_calls.append({"id": call_id, "type": "function",
                                   "function": {"name": name, "arguments": json.dumps(args)}})
            elif kind == "tool_result" and role == "user":
                call_id = block.get("tool_use_id")
                if call_id not in calls:
                    raise ValueError(f"{bat}.tool_use_id: no earlier tool_use has id {call_id!r}")
                msgs.append({"role": "tool", "tool_call_id": call_id,
                             "content": _text(block.get("content", ""), f"{bat}.content")})
                where.append(bat)
                results += 1
            else:
                raise ValueError(f"{bat}.type: {kind!r} blocks are not served on a {role} turn here (text"
                                 + (", tool_use" if role == "assistant" else ", tool_result") + ")")
        if texts or tool_calls or not results:  # (a turn of tool results alone is its tool messages)
            msg: dict[str, Any] = {"role": role, "content": "".join(texts)}
            if tool_calls:
                msg["tool_calls"] = tool_calls
            if thoughts:
                msg["reasoning_content"] = "".join(thoughts)
            msgs.append(msg)
            where.append(at)
    return msgs, where


def _tools(tools: Optional[list[Any]]) -> Optional[list[dict]]:
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict):
            raise ValueError(f"tools[{i}] must be an object")
        kind = tool.get("type", "custom")
        if kind not in ("custom", None):
            raise ValueError(f"tools[{i}].type: only custom tools (name, input_schema) are served here, got "
                             f"{kind!r}")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].name must be a non-empty string")
        fn: dict[str, Any] = {"name": name, "parameters": tool.get("input_schema") or {"type": "object"}}
        if tool.get("description") is not None:
            fn["description"] = tool["description"]
        out.append({"type": "function", "function": fn})
    return out


def _tool_choice(choice: Any) -> tuple[Any, Optional[bool]]:
    """Chat's ``tool_choice`` and ``parallel_tool_calls`` of Anthropic's ``tool_choice``."""
    if choice is None:
        return None, None
    kind = choice.get("type") if isinstance(choice, dict) else None
    parallel = False if isinstance(choice, dict) and choice.get("disable_parallel_tool_use") else None
    if kind == "auto":
        return "auto", parallel
    if kind == "any":
        return "required", parallel
    if kind == "none":
        return "none", None
    if kind == "tool":
        if not isinstance(choice.get("name"), str):
            raise ValueError("tool_choice.name must be the name of one of the tools")
        return {"type": "function", "function": {"name": choice["name"]}}, parallel
    raise ValueError(f"tool_choice.type must be 'auto', 'any', 'tool' or 'none', got {kind!r}")


@dataclass
class MessagesTranslation:
    """A Messages request as the chat request that serves it, and how to name the Messages field in the chat
    path's error messages (``relabel``)."""

    request: MessagesRequest
    chat: ChatCompletionRequest
    where: list[str]
    """Each chat message's Messages field (``system``, ``messages[2]``, ``messages[3].content[0]``)."""

    def relabel(self, message: str) -> str:
        """A chat path's error message -> naming the Messages field it came from (``relabel_chat_error``)."""
        return relabel_chat_error(message, self.where, _RENAMES, parameters_field="input_schema")


_RENAMES = (("tool_choice.function.name", "tool_choice.name"), ("stop", "stop_sequences"),
            ("response_format.json_schema.schema", "output_config.format.schema"),
            ("response_format", "output_config.format"))
"""Chat fields -> the Messages API's, in error messages."""


def _thinking(body: MessagesRequest, chat: dict) -> None:
    """Anthropic's ``thinking`` as the chat path's template switch and ``thinking_token_budget``."""
    t = body.thinking
    kind = t.get("type") if isinstance(t, dict) else None
    if kind not in ("enabled", "adaptive", "disabled"):
        raise ValueError(f"thinking.type must be 'enabled', 'adaptive' or 'disabled', got {kind!r}")
    on = kind != "disabled"
    chat["chat_template_kwargs"] = {"enable_thinking": on, "thinking": on}
    if kind == "enabled":
        budget = t.get("budget_tokens")
        if not isinstance(budget, int) or isinstance(budget, bool) or not 0 <= budget < body.max_tokens:
            raise ValueError(f"thinking.budget_tokens must be an integer >= 0 and less than max_tokens "
                             f"({body.max_tokens}), got {budget!r}")
        chat["thinking_token_budget"] = budget


def to_chat_request(body: MessagesRequest, reasoning: bool = False) -> MessagesTranslation:
    """The chat request that serves ``body`` (``reasoning``: the router has a reasoning parser, which ``thinking``
    drives); ValueError naming the field for what this server does not serve."""
    for field in ("mcp_servers", "container"):
        if getattr(body, field):
            raise ValueError(f"{field}: not served by this server")
    if body.max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {body.max_tokens}")
    msgs, where = _messages(body)
    chat: dict[str, Any] = {"messages": msgs, "model": body.model, "stream": body.stream,
                            "max_tokens": body.max_tokens, "ignore_eos": body.ignore_eos}
    tools = _tools(body.tools)
    if tools is not None:
        chat["tools"] = tools
    choice, parallel = _tool_choice(body.tool_choice)
    if choice is not None:
        chat["tool_choice"] = choice
    if parallel is not None:
        chat["parallel_tool_calls"] = parallel
    if body.stop_sequences:
        chat["stop"] = body.stop_sequences
    fmt = (body.output_config or {}).get("format")
    if fmt is not None:
        if not isinstance(fmt, dict) or fmt.get("type") != "json_schema" or not isinstance(fmt.get("schema"), dict):
            raise ValueError('output_config.format must be {"type": "json_schema", "schema": {...}}')
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": "output", "schema": fmt["schema"]}}
    for name in ("temperature", "top_p", "top_k", "seed", "min_p", "repetition_penalty", "structured_outputs",
                 "allowed_token_ids", "bad_words", "cache_salt", "priority"):
        if getattr(body, name) is not None:
            chat[name] = getattr(body, name)
    if reasoning and body.thinking is not None:
        _thinking(body, chat)
    return MessagesTranslation(body, ChatCompletionRequest.model_validate(chat), where)


def count_tokens_chat(body: CountTokensRequest) -> tuple[ChatCompletionRequest, MessagesTranslation]:
    """The chat request whose rendered prompt ``count_tokens`` counts."""
    msgs, where = _messages(body)
    chat: dict[str, Any] = {"messages": msgs, "model": body.model}
    tools = _tools(body.tools)
    if tools is not None:
        chat["tools"] = tools
    req = ChatCompletionRequest.model_validate(chat)
    shell = MessagesRequest(model=body.model, messages=body.messages, max_tokens=1)
    return req, MessagesTranslation(shell, req, where)


def models_json(names: list[str], context: int, max_tokens: int) -> dict:
    """``GET /v1/models`` as Anthropic's SDK reads it (``client.models.list()``; asked with an
    ``anthropic-version`` header): the served model, then its LoRA adapters."""
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat().replace("+00:00", "Z")
    data = [{"id": n, "type": "model", "display_name": n, "created_at": now, "lifecycle": "active",
             "max_input_tokens": context, "max_tokens": max_tokens} for n in names]
    return {"data": data, "has_more": False, "first_id": names[0] if names else None,
            "last_id": names[-1] if names else None}


def _new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _input(arguments: str) -> Optional[dict]:
    try:
        value = json.loads(arguments) if arguments.strip() else {}
    except ValueError:
        return None
    return value if isinstance(value, dict) else None


class ResponseMessage:
    """One answer as Anthropic's ``message`` (see module docstring): ``add`` each event, then ``json_body()``."""

    def __init__(self, body: MessagesRequest, model: str, n_prompt: int,
                 tool_parser: Optional[ToolCallParser] = None, reasoning: Optional[ReasoningPlan] = None) -> None:
        self.body, self.model, self.n_prompt, self.tool_parser = body, model, n_prompt, tool_parser
        self.reasoning = reasoning
        self.id = _new_id("msg")
        self.text = ""
        self.reason: Optional[str] = None
        self.stop_reason: Optional[Union[str, int]] = None
        self.usage: Any = None

    def add(self, ev: FlowEvent) -> None:
        self.text += ev.text
        if ev.finish_reason:
            self.reason, self.stop_reason = ev.finish_reason, ev.stop_reason
        if ev.usage is not None:
            self.usage = ev.usage

    def _stop(self, called: bool) -> tuple[str, Optional[str]]:
        """Anthropic's ``stop_reason`` and ``stop_sequence``."""
        if called:
            return "tool_use", None
        if self.reason == "length":
            return "max_tokens", None
        if isinstance(self.stop_reason, str):
            return "stop_sequence", self.stop_reason
        return "end_turn", None

    def usage_json(self) -> dict:
        cached = getattr(self.usage, "cached_tokens", 0) or 0
        out = self.usage.completion_tokens if self.usage is not None else 0
        return {"input_tokens": self.n_prompt - cached, "cache_creation_input_tokens": 0,
                "cache_read_input_tokens": cached, "output_tokens": out}

    def head(self) -> dict:
        """The message before its answer (``message_start``'s)."""
        return {"id": self.id, "type": "message", "role": "assistant", "model": self.model, "content": [],
                "stop_reason": None, "stop_sequence": None,
                "usage": {**self.usage_json(), "output_tokens": 0}}

    def content(self) -> list[dict]:
        text, head = self.text, []
        if self.reasoning is not None:
            thought, text = self.reasoning.split(text)
            if thought is not None:
                head = [{"type": "thinking", "thinking": thought, "signature": ""}]
        if self.tool_parser is None:
            return head + [{"type": "text", "text": text}]
        found = self.tool_parser.extract(text)
        calls = [(c, _input(c.arguments)) for c in found.calls]
        if any(args is None for _, args in calls):  # cut off mid-call (max_tokens): the text as it came
            return head + [{"type": "text", "text": text}]
        blocks = [{"type": "text", "text": found.content}] if found.content else []
        return head + blocks + [{"type": "tool_use", "id": _new_id("toolu"), "name": c.name, "input": args}
                                for c, args in calls]

    def json_body(self) -> dict:
        content = self.content()
        reason, sequence = self._stop(any(b["type"] == "tool_use" for b in content))
        return {**self.head(), "content": content, "stop_reason": reason, "stop_sequence": sequence,
                "usage": self.usage_json()}


class MessageEventStream(ResponseMessage):
    """A streamed answer: the ``chunk`` / ``error`` / ``end`` of the chat path's ``EventStream``, speaking
    Anthropic's events (module docstring). With a ``tool_parser`` content text opens a ``text`` block and each call
    a ``tool_use`` block whose arguments stream as ``input_json_delta``; a block stops when the next starts."""

    def __init__(self, body: MessagesRequest, model: str, n_prompt: int,
                 tool_parser: Optional[ToolCallParser] = None, reasoning: Optional[ReasoningPlan] = None) -> None:
        super().__init__(body, model, n_prompt, tool_parser, reasoning)
        self._thinking: Optional[ReasoningStream] = reasoning.stream() if reasoning is not None else None
        self._started = False
        self._stream: Optional[ToolCallStream] = tool_parser.stream() if tool_parser is not None else None
        self._blocks: list[str] = []
        """The kind of each block opened so far; the last is open (``_open``)."""
        self._open = False
        self._calls: dict[int, int] = {}
        """A call's index (the parser's) -> its block index."""

    @staticmethod
    def _event(kind: str, **fields: Any) -> str:
        return f"event: {kind}\ndata: {json.dumps({'type': kind, **fields})}\n\n"

    def _close(self) -> str:
        if not self._open:
            return ""
        self._open = False
        return self._event("content_block_stop", index=len(self._blocks) - 1)

    def _begin(self, block: dict) -> str:
        out = self._close()
        self._blocks.append(block["type"])
        self._open = True
        return out + self._event("content_block_start", index=len(self._blocks) - 1, content_block=block)

    def _text(self, text: str) -> str:
        out = ""
        if not (self._open and self._blocks[-1] == "text"):
            out += self._begin({"type": "text", "text": ""})
        if text:
            out += self._event("content_block_delta", index=len(self._blocks) - 1,
                               delta={"type": "text_delta", "text": text})
        return out

    def chunk(self, idx: int, ev: FlowEvent) -> str:
        out = ""
        if not self._started:
            self._started = True
            out += self._event("message_start", message=self.head()) + self._event("ping")
        self.add(ev)
        text = ev.text
        if self._thinking is not None:
            thought, text = self._thinking.step(text, bool(ev.finish_reason))
            if thought and self.reasoning.include:
                if not (self._open and self._blocks[-1] == "thinking"):
                    out += self._begin({"type": "thinking", "thinking": "", "signature": ""})
                out += self._event("content_block_delta", index=len(self._blocks) - 1,
                                   delta={"type": "thinking_delta", "thinking": thought})
        if self._stream is None:
            said = any(b != "thinking" for b in self._blocks)
            if text or (not said and (ev.finish_reason or self._thinking is None)):
                out += self._text(text)
        else:
            for d in self._stream.feed(text) + (self._stream.finish() if ev.finish_reason else []):
                if isinstance(d, ContentDelta):
                    out += self._text(d.text)
                elif isinstance(d, CallStart):
                    self._calls[d.index] = len(self._blocks)
                    out += self._begin({"type": "tool_use", "id": _new_id("toolu"), "name": d.name, "input": {}})
                elif isinstance(d, ArgsDelta):
                    out += self._event("content_block_delta", index=self._calls[d.index],
                                       delta={"type": "input_json_delta", "partial_json": d.text})
        if ev.finish_reason and all(b == "thinking" for b in self._blocks):
            out += self._text("")  # nothing was said: an empty text block, as a whole answer has
        return out

    def error(self, e: FlowError) -> str:
        status, body = flow_error(e)
        return self._event("error", error=error_body(status, body["error"]["message"])["error"])

    def end(self) -> list[str]:
        if self.reason is None:  # (an error ended it: its event is out already)
            return []
        reason, sequence = self._stop("tool_use" in self._blocks)
        usage = self.usage_json()
        return [self._close(),
                self._event("message_delta", delta={"stop_reason": reason, "stop_sequence": sequence},
                            usage={"output_tokens": usage["output_tokens"],
                                   "input_tokens": usage["input_tokens"],
                                   "cache_read_input_tokens": usage["cache_read_input_tokens"]}),
                self._event("message_stop")]
