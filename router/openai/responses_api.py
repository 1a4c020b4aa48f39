"""OpenAI's Responses API (``POST /v1/responses``, as vLLM serves it): a text answer, whole or streamed as typed events.

Lifecycle: stateless. ``router.openai.http_api`` parses the body into ``ResponsesRequest`` and ``to_chat_request``
turns it into the ``ChatCompletionRequest`` the chat path already serves (``instructions`` as the system message,
``input`` as the conversation, ``max_output_tokens`` as ``max_tokens``, ``text.format`` as ``response_format``,
function ``tools`` and ``tool_choice`` as chat's), so validation, the chat template, LoRA adapters, structured
outputs, tool-call parsing, quotas and cancellation are the chat path's; its error messages are relabelled with
the Responses field they came from (``ChatTranslation.relabel``). The answer is rendered here instead of as a chat
completion: ``ResponseCollector`` gathers the flow's events into one ``response`` object, ``ResponseEventStream``
streams OpenAI's events (``response.created``, ``response.in_progress``, ``response.output_item.added``,
``response.content_part.added``, ``response.output_text.delta`` per piece of text, ``response.output_text.done``,
``response.content_part.done``, ``response.output_item.done``, then ``response.completed``, or
``response.incomplete`` when ``max_output_tokens`` cut it, each with its ``sequence_number``), as the OpenAI SDK's
``client.responses.create`` reads them.

Function calling, as agents use it (OpenAI's Agents SDK, Codex-style loops that send the whole conversation each
turn): ``tools`` of ``type: "function"`` (flat: ``name``, ``description``, ``parameters``, ``strict``) and
``tool_choice`` (``none``, ``auto``, ``required``, ``{"type": "function", "name": ...}``, with
``parallel_tool_calls``) mean what they mean on /v1/chat/completions (``auto`` reads calls with the router's
``--tool-call-parser``; ``required`` and a named function are forced by a grammar). A call comes back as a
``function_call`` output item (``call_id``, ``name``, ``arguments`` as JSON text), streamed as
``response.output_item.added``, ``response.function_call_arguments.delta`` ..., ``...arguments.done``,
``response.output_item.done``. The next turn's ``input`` carries the ``function_call`` items back and a
``function_call_output`` for each (``call_id``, ``output``): they render as the assistant turn's ``tool_calls``
and ``tool`` messages through the model's chat template, exactly as the chat API's messages would.

Stored responses: on a router started with ``--responses-store-ttl-s`` a finished response is kept with its
conversation unless ``store`` is false (router/response_store.py; in the cluster's Redis), and a request with
``previous_response_id`` continues it: ``to_chat_request`` gets the kept conversation (its input items, then its
output items) as ``history``, put before this request's ``input`` (the earlier ``instructions`` are not carried
over, as OpenAI has it). Without the flag nothing is kept: ``store`` is answered ``false`` and
``previous_response_id`` is refused naming the flag.

``truncation: "auto"`` (``truncate``): a conversation (a long chain of stored responses, say) longer than the
context drops its earliest whole turns, the instructions kept, until it leaves room for ``max_output_tokens``.

What is refused, naming the field (400): ``conversation`` (conversation objects are not kept),
``previous_response_id`` where nothing is kept, tools other than functions (web search, file search...),
``background``, input items other than messages with text parts, ``function_call``, ``function_call_output``
(an output whose ``call_id`` no earlier call has, too) and ``reasoning`` (sent back, its text becomes the next
assistant turn's ``reasoning_content``, which thinking templates such as Qwen3's put back in tool loops), ``n``-like
fields (one answer per response).
"""
from __future__ import annotations

import dataclasses
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Union

from pydantic import BaseModel, ConfigDict

from router.events import FlowError, FlowEvent
from router.openai.protocol import ChatCompletionRequest, relabel_chat_error
from router.openai.reasoning import ReasoningPlan, ReasoningStream
from router.openai.responses import flow_error
from router.openai.tool_parsers import ArgsDelta, CallStart, ContentDelta, ToolCallParser, ToolCallStream, \
    new_tool_call_id

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    """The body of ``POST /v1/responses`` (OpenAI's fields this server serves, and vLLM's sampling extras)."""

    model_config = ConfigDict(extra="ignore")

    model: Optional[str] = None
    input: Union[str, list[Any]]
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
    tools: Optional[list[Any]] = None
    tool_choice: Optional[Any] = None
    parallel_tool_calls: Optional[bool] = None
    truncation: Optional[str] = None
    """"auto": a conversation longer than the context drops its earliest turns until it fits (``truncate``);
    "disabled" (the default): it is refused."""
    # vLLM's extras
    seed: Optional[int] = None
    top_k: Optional[int] = None
    min_p: Optional[float] = None
    repetition_penalty: Optional[float] = None
    ignore_eos: bool = False
    structured_outputs: Optional[dict[str, Any]] = None
    """vLLM's output constraint (regex, choice, grammar, json), as on the chat path."""
    allowed_token_ids: Optional[list[int]] = None
    bad_words: Optional[list[str]] = None
    cache_salt: Optional[str] = None
    priority: Optional[int] = None
    chat_template_kwargs: Optional[dict[str, Any]] = None
    """vLLM's: extra chat template variables (``{"enable_thinking": true}``), as on the chat path."""
    thinking_token_budget: Optional[int] = None
    """vLLM's: at most this many reasoning tokens (a router with a reasoning parser)."""
    include_reasoning: bool = True
    """vLLM's: false leaves the reasoning item out."""


def _text(value: Any, where: str) -> str:
    """A message's (or a call output's) text: a string, or a list of text parts joined."""
    if isinstance(value, list):
        texts = []
        for j, part in enumerate(value):
            if not isinstance(part, dict) or part.get("type") not in _TEXT_PARTS or \
                    not isinstance(part.get("text"), str):
                raise ValueError(f"{where}[{j}]: only text parts ({', '.join(_TEXT_PARTS)}) are served")
            texts.append(part["text"])
        value = "".join(texts)
    if not isinstance(value, str):
        raise ValueError(f"{where} must be text or a list of text parts")
    return value


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or (key != "arguments" and not value):
        raise ValueError(f"{where}.{key} must be a non-empty string" if key != "arguments"
                         else f"{where}.arguments must be the call's arguments as JSON text")
    return value


def input_items(body: ResponsesRequest) -> list[Any]:
    """``input`` as a list of items (a string is one user message)."""
    if isinstance(body.input, str):
        if not body.input:
            raise ValueError("input: must not be empty")
        return [{"type": "message", "role": "user", "content": body.input}]
    if not body.input:
        raise ValueError("input: must not be empty")
    return list(body.input)


def _messages(instructions: Optional[str], items: list[Any], n_history: int,
              string_input: bool) -> tuple[list[dict], list[str]]:
    """The chat messages of ``instructions`` and the input items (the first ``n_history`` of them a previous
    response's conversation), and each one's field (for error messages). A ``function_call`` item is an assistant
    turn's call (joined to the assistant turn before it, as a chat completion carries content and calls in one
    message); a ``function_call_output`` is the ``tool`` turn answering it, by ``call_id``."""
    msgs: list[dict] = []
    where: list[str] = []
    if instructions:
        msgs.append({"role": "system", "content": instructions})
        where.append("instructions")
    calls: set[str] = set()
    thought: Optional[str] = None  # a reasoning item's text, for the assistant turn after it

    def assistant(msg: dict) -> dict:
        nonlocal thought
        if thought is not None:
            msg["reasoning_content"], thought = thought, None
        return msg

    for k, item in enumerate(items):
        i = k - n_history
        at = "previous_response_id" if i < 0 else "input" if string_input else f"input[{i}]"
        if not isinstance(item, dict):
            raise ValueError(f"{at} must be an object")
        kind = item.get("type", "message")
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise ValueError(f"{at}.role must be one of {sorted(_ROLES)}, got {item.get('role')!r}")
            msg = {"role": role, "content": _text(item.get("content"), f"{at}.content")}
            if role == "assistant":
                assistant(msg)
            else:
                thought = None  # (reasoning with no answer after it: nothing to attach it to)
            msgs.append(msg)
            where.append(at)
        elif kind == "function_call":
            call_id = _string(item, "call_id", at)
            if call_id in calls:
                raise ValueError(f"{at}.call_id: {call_id!r} is the id of an earlier call too")
            calls.add(call_id)
            call = {"id": call_id, "type": "function",
                    "function": {"name": _string(item, "name", at), "arguments": _string(item, "arguments", at)}}
            if msgs and msgs[-1]["role"] == "assistant" and where[-1] != "instructions" and thought is None:
                msgs[-1].setdefault("tool_calls", []).append(call)
            else:
                msgs.append(assistant({"role": "assistant", "content": "", "tool_calls": [call]}))
                where.append(at)
        elif kind == "reasoning":  # an earlier answer's reasoning, sent back: its assistant turn's reasoning_content
            parts = [p.get("text") for p in item.get("content") or () if isinstance(p, dict)]
            thought = "".join(t for t in parts if isinstance(t, str)) or None
        elif kind == "function_call_output":
            call_id = _string(item, "call_id", at)
            if call_id not in calls:
                raise ValueError(f"{at}.call_id: no function_call item before it has call_id {call_id!r}")
            msgs.append({"role": "tool", "tool_call_id": call_id, "content": _text(item.get("output"),
                                                                                   f"{at}.output")})
            where.append(at)
        else:
            raise ValueError(f"{at}.type: {kind!r} items are not served here (messages with text, function_call, "
                             "function_call_output and reasoning)")
    return msgs, where


def _tools(body: ResponsesRequest) -> Optional[list[dict]]:
    """The Responses API's function tools (flat: ``name``, ``parameters`` beside ``type``) as chat's."""
    if not body.tools:
        return None
    out = []
    for i, tool in enumerate(body.tools):
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            raise ValueError(f"tools[{i}].type: only function tools are served here, got {kind!r}")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise ValueError(f"tools[{i}].name must be a non-empty string")
        out.append({"type": "function", "function": {k: tool[k] for k in ("name", "description", "parameters",
                                                                          "strict") if tool.get(k) is not None}})
    return out


def _tool_choice(choice: Any) -> Any:
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function":
        if not isinstance(choice.get("name"), str):
            raise ValueError("tool_choice.name must be the name of one of the tools")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise ValueError(f'tool_choice must be "none", "auto", "required" or {{"type": "function", "name": ...}}, '
                     f"got {choice!r}")


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


@dataclass
class ChatTranslation:
    """A Responses request as the chat request that serves it, and how to name the Responses field in the chat
    path's error messages (``relabel``)."""

    request: ResponsesRequest
    chat: ChatCompletionRequest
    where: list[str]
    """Each chat message's Responses field (``instructions``, ``input[3]``)."""
    conversation: list[Any]
    """The input items answered (a previous response's conversation first): what a stored response keeps."""

    def relabel(self, message: str) -> str:
        """A chat path's error message -> naming the Responses field it came from (``relabel_chat_error``)."""
        return relabel_chat_error(message, self.where, _RENAMES, messages_field="input")


_RENAMES = (("tool_choice.function.name", "tool_choice.name"), ("response_format.json_schema", "text.format"),
            ("response_format", "text.format"), ("max_tokens", "max_output_tokens"))
"""Chat fields -> the Responses API's, in error messages."""


def to_chat_request(body: ResponsesRequest, history: Optional[list[dict]] = None) -> ChatTranslation:
    """The chat request that serves ``body`` (``history``: the conversation of its ``previous_response_id``, read
    from the response store); ValueError naming the field for what this server does not serve."""
    if body.conversation is not None:
        raise ValueError("conversation: this server keeps no conversations; send the whole conversation as input "
                         "(or continue a stored response with previous_response_id)")
    if body.previous_response_id is not None and history is None:
        raise ValueError("previous_response_id: this router keeps no responses (start it with "
                         "--responses-store-ttl-s); send the whole conversation as input")
    if body.background:
        raise ValueError("background: responses are answered in the request, not in the background")
    if body.max_output_tokens is not None and body.max_output_tokens < 1:
        raise ValueError(f"max_output_tokens must be >= 1, got {body.max_output_tokens}")
    if body.truncation not in (None, "auto", "disabled"):
        raise ValueError(f"truncation must be 'auto' or 'disabled', got {body.truncation!r}")
    history = history or []
    items = history + input_items(body)
    msgs, where = _messages(body.instructions, items, len(history), isinstance(body.input, str))
    if not msgs:
        raise ValueError("input: holds no message to answer (reasoning items alone are not a conversation)")
    chat: dict[str, Any] = {"messages": msgs, "model": body.model, "stream": body.stream,
                            "ignore_eos": body.ignore_eos}
    tools = _tools(body)
    if tools is not None:
        chat["tools"] = tools
    choice = _tool_choice(body.tool_choice)
    if choice is not None:
        chat["tool_choice"] = choice
    for src, dst in (("max_output_tokens", "max_tokens"), ("temperature", "temperature"), ("top_p", "top_p"),
                     ("seed", "seed"), ("top_k", "top_k"), ("min_p", "min_p"),
                     ("repetition_penalty", "repetition_penalty"), ("parallel_tool_calls", "parallel_tool_calls"),
                     ("structured_outputs", "structured_outputs"), ("allowed_token_ids", "allowed_token_ids"),
                     ("bad_words", "bad_words"), ("cache_salt", "cache_salt"), ("priority", "priority"),
                     ("chat_template_kwargs", "chat_template_kwargs"),
                     ("thinking_token_budget", "thinking_token_budget"), ("include_reasoning", "include_reasoning")):
        if getattr(body, src) is not None:
            chat[dst] = getattr(body, src)
    fmt = _response_format(body.text)
    if fmt is not None:
        chat["response_format"] = fmt
    return ChatTranslation(body, ChatCompletionRequest.model_validate(chat), where, items)


def kept_items(items: list[Any]) -> list[dict]:
    """Input items as a stored response keeps them (and ``GET /v1/responses/{id}/input_items`` lists them): each
    with an id, a message's content as typed parts (``input_text``, or ``output_text`` on an assistant turn), as
    OpenAI lists them; ``_messages`` reads them back to the same chat messages."""
    out = []
    for item in items:
        item = dict(item)
        kind = item.setdefault("type", "message")
        if kind == "message":
            part = "output_text" if item.get("role") == "assistant" else "input_text"
            content = item.get("content")
            if isinstance(content, str):
                item["content"] = [{"type": part, "text": content, **({"annotations": []} if part == "output_text"
                                                                       else {})}]
            item.setdefault("status", "completed")
        item.setdefault("id", f"{_ITEM_PREFIX.get(kind, 'item')}_{uuid.uuid4().hex}")
        out.append(item)
    return out


_ITEM_PREFIX = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def page_items(items: list[dict], limit: int, order: str, after: Optional[str]) -> dict:
    """One page of ``GET /v1/responses/{id}/input_items`` (OpenAI's list: newest first by default; ``after`` an
    item id of the previous page; ValueError naming the parameter)."""
    if not 1 <= limit <= 100:
        raise ValueError(f"limit must be in [1, 100], got {limit}")
    if order not in ("asc", "desc"):
        raise ValueError(f"order must be 'asc' or 'desc', got {order!r}")
    seq = items if order == "asc" else items[::-1]
    start = 0
    if after is not None:
        ids = [i.get("id") for i in seq]
        if after not in ids:
            raise ValueError(f"after: no input item {after[:80]!r} in this response")
        start = ids.index(after) + 1
    page = seq[start:start + limit]
    return {"object": "list", "data": page, "first_id": page[0]["id"] if page else None,
            "last_id": page[-1]["id"] if page else None, "has_more": start + limit < len(seq)}


def truncate(translation: ChatTranslation, count: Callable[[ChatCompletionRequest], Optional[int]],
             context: int) -> ChatTranslation:
    """``truncation: "auto"``, as OpenAI has it: a conversation whose prompt (``count``: its tokens, None when it
    cannot even be rendered within the context) leaves no room for ``max_output_tokens`` (else one token) in
    ``context`` drops its earliest turns (whole: from the first user message after the instructions up to the next
    one, so no tool output is left without its call) until it fits; the instructions stay. The shortest that still
    does not fit (the last turn alone) is left as it is, for the chat path to refuse by name."""
    msgs = translation.chat.messages
    lead = 1 if msgs and translation.where[0] == "instructions" else 0
    budget = translation.request.max_output_tokens or 1

    def cut(start: int) -> ChatCompletionRequest:
        return translation.chat.model_copy(update={"messages": msgs[:lead] + msgs[start:]})

    def fits(start: int) -> bool:
        n = count(cut(start))
        return n is not None and n + budget <= context

    if fits(lead):
        return translation
    starts = [i for i in range(lead + 1, len(msgs)) if msgs[i].role == "user"]
    lo, hi = 0, len(starts)  # the first start that fits, by bisection (a later start is a shorter prompt)
    while lo < hi:
        mid = (lo + hi) // 2
        if fits(starts[mid]):
            hi = mid
        else:
            lo = mid + 1
    if lo == len(starts):
        return translation
    start = starts[lo]
    return dataclasses.replace(translation, chat=cut(start), where=translation.where[:lead] + translation.where[start:])


def _usage(usage: Any, n_prompt: int, reasoning_tokens: int = 0) -> dict:
    out = usage.completion_tokens if usage is not None else 0
    cached = getattr(usage, "cached_tokens", 0) if usage is not None else 0
    return {"input_tokens": n_prompt,
            "input_tokens_details": {"cached_tokens": cached or 0, "cache_write_tokens": 0},
            "output_tokens": out, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": n_prompt + out}


def _reasoning_item(text: str, item_id: str, status: str) -> dict:
    """OpenAI's reasoning output item with the model's own reasoning text (``reasoning_text`` content, as vLLM
    serves it; no summary)."""
    return {"type": "reasoning", "id": item_id, "summary": [], "content": [{"type": "reasoning_text", "text": text}],
            "encrypted_content": None, "status": status}


def _call_item(call_id: str, name: str, arguments: str, item_id: str, status: str) -> dict:
    return {"type": "function_call", "id": item_id, "call_id": call_id, "name": name, "arguments": arguments,
            "status": status}


class ResponseCollector:
    """One response's identity, the request fields it echoes and its answer so far (OpenAI's ``response`` object):
    a whole (non-streamed) one is ``add`` of each event, then ``json_body()``. With a ``tool_parser`` (the chat
    path's plan for the request's tools) the answer is read into a message (its content, when any) and one
    ``function_call`` item per call, as the chat path reads ``tool_calls`` (a call that does not parse leaves the
    whole text as the message). With a ``reasoning`` plan (a router with a reasoning parser) the reasoning comes
    first, as a ``reasoning`` item, and ``reasoning_tokens`` counts it."""

    def __init__(self, body: ResponsesRequest, model: str, n_prompt: int,
                 tool_parser: Optional[ToolCallParser] = None, reasoning: Optional[ReasoningPlan] = None) -> None:
        self.body, self.model, self.n_prompt, self.tool_parser = body, model, n_prompt, tool_parser
        self.reasoning = reasoning
        self.token_ids: list[int] = []
        self.id = f"resp_{uuid.uuid4().hex}"
        self.msg_id = f"msg_{uuid.uuid4().hex}"
        self.created_at = int(time.time())
        self.text = ""
        self.reason: Optional[str] = None
        self.usage: Any = None
        self._output: Optional[list[dict]] = None
        self.stored = False
        """The response is kept (the response store is on, ``store`` not false, and keeping it worked)."""
        self.keep: Optional[Callable[[], Awaitable[None]]] = None
        """Keeps the finished response (before its last event or its body goes out); set by the HTTP API."""

    def message(self, status: str, text: Optional[str] = None, msg_id: Optional[str] = None) -> dict:
        content = [] if status == "in_progress" else [self.part(self.text if text is None else text)]
        return {"type": "message", "id": msg_id or self.msg_id, "status": status, "role": "assistant",
                "content": content}

    @staticmethod
    def part(text: str) -> dict:
        return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}

    def output(self) -> list[dict]:
        """The finished answer's output items (read once: their ids stay)."""
        if self._output is None:
            text, self._output = self.text, []
            if self.reasoning is not None:
                thought, text = self.reasoning.split(text)
                if thought is not None:
                    self._output.append(_reasoning_item(thought, f"rs_{uuid.uuid4().hex}", "completed"))
            if self.tool_parser is None:
                self._output.append(self.message("completed", text))
            else:
                found = self.tool_parser.extract(text)
                if found.content or not found.calls:
                    self._output.append(self.message("completed", found.content))
                self._output += [_call_item(c.id, c.name, c.arguments, f"fc_{uuid.uuid4().hex}", "completed")
                                 for c in found.calls]
        return self._output

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
            "model": self.model, "output": self.output() if done else [],
            "parallel_tool_calls": b.parallel_tool_calls is not False,
            "previous_response_id": b.previous_response_id, "reasoning": None, "store": self.stored,
            "temperature": b.temperature, "text": {"format": fmt},
            "tool_choice": b.tool_choice if b.tool_choice is not None else "auto", "tools": b.tools or [],
            "top_p": b.top_p, "truncation": b.truncation or "disabled",
            "usage": _usage(self.usage, self.n_prompt, self.reasoning.reasoning_tokens(self.token_ids)
                            if self.reasoning is not None else 0) if done else None, "user": b.user,
        }

    def add(self, ev: FlowEvent) -> None:
        self.text += ev.text
        self.token_ids += ev.token_ids
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
    OpenAI's Responses events (module docstring). With a ``tool_parser`` the text goes through its
    ``ToolCallStream``: content opens a message item (``response.output_text.delta``), a call closes the open item
    and opens a ``function_call`` item (``response.output_item.added`` with its name, then
    ``response.function_call_arguments.delta`` per piece of its arguments, ``...arguments.done`` and
    ``response.output_item.done`` when the next item starts or the answer ends), as the OpenAI SDK and the
    Agents SDK read them."""

    def __init__(self, body: ResponsesRequest, model: str, n_prompt: int,
                 tool_parser: Optional[ToolCallParser] = None, reasoning: Optional[ReasoningPlan] = None) -> None:
        super().__init__(body, model, n_prompt, tool_parser, reasoning)
        self._thinking: Optional[ReasoningStream] = reasoning.stream() if reasoning is not None else None
        self._seq = 0
        self._started = False
        self._stream: Optional[ToolCallStream] = tool_parser.stream() if tool_parser is not None else None
        self._items: list[dict] = []
        """The output items so far; the last is open until the next starts or the answer ends."""
        self._open = False
        self._calls: dict[int, int] = {}
        """A call's index (the parser's) -> its output index."""

    def _event(self, kind: str, **fields: Any) -> str:
        data = {"type": kind, "sequence_number": self._seq, **fields}
        self._seq += 1
        return f"event: {kind}\ndata: {json.dumps(data)}\n\n"

    def _ids(self) -> dict:
        return {"item_id": self._items[-1]["id"], "output_index": len(self._items) - 1, "content_index": 0}

    def _close(self) -> str:
        if not self._open:
            return ""
        self._open = False
        item, index = self._items[-1], len(self._items) - 1
        if item["type"] == "reasoning":
            text = item["content"][0]["text"]
            return (self._event("response.reasoning_text.done", **self._ids(), text=text)
                    + self._event("response.output_item.done", output_index=index,
                                  item={**item, "status": "completed"}))
        if item["type"] == "message":
            text = item["content"][0]["text"]
            return (self._event("response.output_text.done", **self._ids(), text=text, logprobs=[])
                    + self._event("response.content_part.done", **self._ids(), part=self.part(text))
                    + self._event("response.output_item.done", output_index=index,
                                  item={**item, "status": "completed"}))
        item["status"] = "completed"
        return (self._event("response.function_call_arguments.done", item_id=item["id"], output_index=index,
                            arguments=item["arguments"])
                + self._event("response.output_item.done", output_index=index, item=item))

    def _text(self, text: str) -> str:
        out = ""
        if not (self._open and self._items[-1]["type"] == "message"):
            out += self._close()
            msg_id = self.msg_id if not self._items else f"msg_{uuid.uuid4().hex}"
            self._items.append({**self.message("in_progress", msg_id=msg_id), "content": [self.part("")]})
            self._open = True
            out += (self._event("response.output_item.added", output_index=len(self._items) - 1,
                                item=self.message("in_progress", msg_id=msg_id))
                    + self._event("response.content_part.added", **self._ids(), part=self.part("")))
        if text:
            self._items[-1]["content"][0]["text"] += text
            out += self._event("response.output_text.delta", **self._ids(), delta=text, logprobs=[])
        return out

    def _thought(self, text: str) -> str:
        """Reasoning text: into the open reasoning item (opened first, before anything else is said)."""
        out = ""
        if not (self._open and self._items[-1]["type"] == "reasoning"):
            out += self._close()
            item = _reasoning_item("", f"rs_{uuid.uuid4().hex}", "in_progress")
            self._items.append(item)
            self._open = True
            out += self._event("response.output_item.added", output_index=len(self._items) - 1,
                               item={**item, "content": []})
        self._items[-1]["content"][0]["text"] += text
        return out + self._event("response.reasoning_text.delta", **self._ids(), delta=text)

    def start(self) -> str:
        self._started = True
        out = (self._event("response.created", response=self.json("in_progress"))
               + self._event("response.in_progress", response=self.json("in_progress")))
        if self._stream is not None or (self.reasoning is not None and self.reasoning.open):
            return out  # (the message opens with its first text: reasoning or a call may come first)
        return out + self._text("")

    def chunk(self, idx: int, ev: FlowEvent) -> str:
        out = "" if self._started else self.start()
        self.add(ev)
        text = ev.text
        if self._thinking is not None:
            thought, text = self._thinking.step(text, bool(ev.finish_reason))
            if thought and self.reasoning.include:
                out += self._thought(thought)
        if self._stream is None:
            out += self._text(text) if text else ""
            if ev.finish_reason and not any(i["type"] == "message" for i in self._items):
                out += self._text("")  # (a whole answer has its message, empty or not)
            return out
        for d in self._stream.feed(text) + (self._stream.finish() if ev.finish_reason else []):
            if isinstance(d, ContentDelta):
                out += self._text(d.text)
            elif isinstance(d, CallStart):
                out += self._close()
                item = _call_item(new_tool_call_id(), d.name, "", f"fc_{uuid.uuid4().hex}", "in_progress")
                self._items.append(item)
                self._calls[d.index], self._open = len(self._items) - 1, True
                out += self._event("response.output_item.added", output_index=len(self._items) - 1, item=item)
            elif isinstance(d, ArgsDelta):
                index = self._calls[d.index]
                self._items[index]["arguments"] += d.text
                out += self._event("response.function_call_arguments.delta", item_id=self._items[index]["id"],
                                   output_index=index, delta=d.text)
        if ev.finish_reason and not any(i["type"] != "reasoning" for i in self._items):
            out += self._text("")  # nothing at all was said: an empty message, as a whole one has
        return out

    def error(self, e: FlowError) -> str:
        body = flow_error(e)[1]["error"]
        return self._event("error", code=body.get("type"), message=body.get("message"), param=body.get("param"))

    def output(self) -> list[dict]:
        return [{**i, "status": "completed"} for i in self._items]

    def end(self) -> list[str]:
        if self.reason is None:  # (an error ended it: its event is out already)
            return []
        out = [self._close()]
        status = self.status
        out.append(self._event("response.completed" if status == "completed" else "response.incomplete",
                               response=self.json(status)))
        return out
