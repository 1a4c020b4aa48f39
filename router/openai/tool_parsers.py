"""Tool calls out of a model's text: the parsers of vLLM's ``--tool-call-parser`` names, whole and streamed.

Lifecycle: one ``ToolCallParser`` per request that may call tools (``parser_for``): ``extract(text)`` reads a
whole answer once, ``stream()`` gives one ``ToolCallStream`` per choice of a streamed answer, fed each new piece
of text (``feed``) and closed once (``finish``). A stream yields plain deltas (``ContentDelta``: text for
``message.content``; ``CallStart``: a new call's index and name; ``ArgsDelta``: more of a call's arguments
text), which ``router.openai.protocol`` renders as OpenAI's ``tool_calls`` deltas. ``extract`` runs the same
stream over the whole text, so a streamed answer assembles (as the OpenAI SDK does) to exactly the whole one.

Formats:

- ``hermes`` (Hermes 2 Pro and later, Qwen 2.5/3): ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``,
  any number; text before the first ``<tool_call>`` is the content, as vLLM's parser has it.
- ``llama3_json`` (Llama 3.1/3.2 JSON tool calling): the whole answer is ``{"name": ..., "parameters": {...}}``
  (or ``"arguments"``), optionally after ``<|python_tag|>``, several separated by ``;``. An answer that does
  not open with ``{`` is content.
- ``required`` (``tool_choice: "required"``, whose grammar forces it): a JSON array of ``{"name", "parameters"}``.
- ``named`` (``tool_choice`` naming a function): the whole answer is that function's arguments.

The arguments text of a call is the model's own JSON text of the value, byte for byte (so streaming can send it
as it comes); a call whose JSON does not parse makes ``extract`` answer the text as content with no calls (vLLM's
rule). Text is scanned character by character: answers are short next to the model time that made them.
"""
from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Optional, Union

TOOL_CALL_PARSERS = ("hermes", "llama3_json")
"""The ``--tool-call-parser`` names (vLLM's) this router knows."""


@dataclass(frozen=True)
class ContentDelta:
    text: str


@dataclass(frozen=True)
class CallStart:
    index: int
    name: str


@dataclass(frozen=True)
class ArgsDelta:
    index: int
    text: str


Delta = Union[ContentDelta, CallStart, ArgsDelta]


@dataclass
class ToolCall:
    """One parsed call: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=lambda: new_tool_call_id())


@dataclass
class Extracted:
    """A whole answer read by a parser: ``content`` (None when empty) and the calls found."""

    content: Optional[str]
    calls: list[ToolCall]


def new_tool_call_id() -> str:
    """vLLM's shape of a call id."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


_HEAD = re.compile(r'\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"(?:arguments|parameters)"\s*:')
"""The start of a call object whose name comes first (as the templates and the grammars write it): the name is
known, and the arguments can stream from the next character on."""
_ARGS_KEYS = ("arguments", "parameters")


class _Objects:
    """Calls written as a run of JSON objects (``{"name": ..., "arguments": {...}}``) with separator characters
    between them: pushes ``CallStart``/``ArgsDelta`` into ``out`` as characters arrive. An object whose name is not
    its first key streams nothing until it is complete, then comes whole."""

    def __init__(self, separators: str, out: list[Delta], first_index: int = 0) -> None:
        self.separators = separators
        self.out = out
        self.index = first_index - 1
        self.ok = True
        """False once something did not parse: ``extract`` then answers the text as content."""
        self._buf = ""  # the current object's text
        self._depth = 0
        self._in_str = self._esc = False
        self._mode = "between"  # between | head | args | whole_args | tail | whole
        self._args_depth = 0
        self._args_started = False

    @property
    def between(self) -> bool:
        return self._mode == "between"

    def feed_char(self, c: str) -> None:
        if self._mode == "between":
            if c == "{":
                self._begin()
            elif not (c.isspace() or c in self.separators):
                self.ok = False  # stray text between calls: dropped
            return
        self._buf += c
        closed_value = self._track(c)
        if self._mode == "head":
            m = _HEAD.match(self._buf)
            if m is not None:
                try:
                    name = json.loads(m.group(1))
                except ValueError:
                    name = None
                if isinstance(name, str) and name:
                    self.index += 1
                    self.out.append(CallStart(self.index, name))
                    self._mode, self._args_started = "args", False
                else:
                    self._mode = "whole"
        elif self._mode == "args":
            self._args_char(c)
        if self._depth == 0 and closed_value:
            self._end_object()

    def _begin(self) -> None:
        self._buf, self._depth, self._in_str, self._esc = "{", 1, False, False
        self._mode = "head"

    def _track(self, c: str) -> bool:
        """Brace depth of the current object, strings skipped; True when this character closed a brace."""
        if self._in_str:
            if self._esc:
                self._esc = False
            elif c == "\\":
                self._esc = True
            elif c == '"':
                self._in_str = False
            return False
        if c == '"':
            self._in_str = True
        elif c in "{[":
            self._depth += 1
        elif c in "}]":
            self._depth -= 1
            return True
        return False

    def _args_char(self, c: str) -> None:
        if not self._args_started:
            if c.isspace():
                return
            if c not in "{[":  # a string or a number as arguments: sent whole at the end
                self._mode = "whole_args"
                return
            self._args_started, self._args_depth = True, self._depth - 1
        self.out.append(ArgsDelta(self.index, c))
        if self._depth == self._args_depth:  # the value's closing bracket
            self._mode = "tail"

    def _end_object(self) -> None:
        text, mode = self._buf, self._mode
        self._mode, self._buf = "between", ""
        try:
            obj = json.loads(text)
        except ValueError:
            obj = None
        if mode == "tail":
            self.ok = self.ok and isinstance(obj, dict)
            return
        args_key = next((k for k in _ARGS_KEYS if isinstance(obj, dict) and k in obj), None)
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or args_key is None:
            self.ok = False
            return
        if mode in ("head", "whole"):
            self.index += 1
            self.out.append(CallStart(self.index, obj["name"]))
        self.out.append(ArgsDelta(self.index, json.dumps(obj[args_key], ensure_ascii=False)))

    def finish(self) -> None:
        if self._mode != "between":
            self.ok = False  # an unterminated call


class ToolCallStream:
    """One choice's streamed answer through a parser (see module docstring)."""

    def feed(self, text: str) -> list[Delta]:
        raise NotImplementedError

    def finish(self) -> list[Delta]:
        raise NotImplementedError

    @property
    def ok(self) -> bool:
        return True


class _Hermes(ToolCallStream):
    START, END = "<tool_call>", "</tool_call>"

    def __init__(self) -> None:
        self._out: list[Delta] = []
        self._objs = _Objects("", self._out)
        self._pending = ""  # text that may be the start of a tag
        self._inside = False
        self._calls_seen = False

    @property
    def ok(self) -> bool:
        return self._objs.ok

    def feed(self, text: str) -> list[Delta]:
        for c in text:
            self._char(c)
        return _drain(self._out)

    def _char(self, c: str) -> None:
        if not self._inside:
            self._pending += c
            if self._pending == self.START:
                self._pending, self._inside, self._calls_seen = "", True, True
            elif not self.START.startswith(self._pending):
                # not a tag: content before the first call, dropped after it (vLLM's rule)
                head, self._pending = self._pending, ""
                for i, ch in enumerate(head):
                    if ch == "<" and self.START.startswith(head[i:]):
                        self._pending = head[i:]
                        head = head[:i]
                        break
                if head and not self._calls_seen:
                    self._out.append(ContentDelta(head))
            return
        if self._objs.between and (self._pending or c == "<"):
            self._pending += c
            if self._pending == self.END:
                self._pending, self._inside = "", False
            elif not self.END.startswith(self._pending):
                self._objs.ok, self._pending = False, ""
            return
        self._objs.feed_char(c)

    def finish(self) -> list[Delta]:
        if not self._inside and self._pending and not self._calls_seen:
            self._out.append(ContentDelta(self._pending))
        elif self._inside:
            self._objs.finish()
            if self._pending:
                self._objs.ok = False
        self._pending = ""
        return _drain(self._out)


class _JsonCalls(ToolCallStream):
    """``llama3_json`` (``content_unless_json``: an answer not opening with ``{`` is content) and ``required``."""

    PYTHON_TAG = "<|python_tag|>"

    def __init__(self, separators: str, content_unless_json: bool) -> None:
        self._out: list[Delta] = []
        self._objs = _Objects(separators, self._out)
        self._decided = not content_unless_json
        self._content = False
        self._lead = ""

    @property
    def ok(self) -> bool:
        return self._objs.ok

    def feed(self, text: str) -> list[Delta]:
        for c in text:
            if self._decided:
                if self._content:
                    self._out.append(ContentDelta(c))
                else:
                    self._objs.feed_char(c)
                continue
            self._lead += c
            body = self._lead.lstrip()
            if not body or (self.PYTHON_TAG.startswith(body) and body != self.PYTHON_TAG):
                continue
            self._decided = True
            if body.startswith(self.PYTHON_TAG):
                body = body[len(self.PYTHON_TAG):]
            elif not body.startswith("{"):
                self._content = True
                self._out.append(ContentDelta(self._lead))
                continue
            for ch in body:
                self._objs.feed_char(ch)
        return self._drain()

    def finish(self) -> list[Delta]:
        if not self._decided and self._lead:
            self._out.append(ContentDelta(self._lead))
        elif not self._content:
            self._objs.finish()
        return self._drain()

    def _drain(self) -> list[Delta]:
        return _drain(self._out)


class _Named(ToolCallStream):
    """``tool_choice`` naming a function: the whole answer is its arguments."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._started = False

    def feed(self, text: str) -> list[Delta]:
        out: list[Delta] = []
        if not self._started:
            self._started = True
            out.append(CallStart(0, self.name))
        if text:
            out.append(ArgsDelta(0, text))
        return out

    def finish(self) -> list[Delta]:
        return self.feed("") if not self._started else []


class ToolCallParser:
    """Reads tool calls out of answers in one format (see module docstring)."""

    def __init__(self, kind: str, name: Optional[str] = None) -> None:
        if kind not in (*TOOL_CALL_PARSERS, "required", "named"):
            raise ValueError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {kind!r}")
        if kind == "named" and not name:
            raise ValueError("a named tool choice needs the function's name")
        self.kind, self.name = kind, name

    @property
    def forced(self) -> bool:
        """True when the grammar forces the calls (``required``, named): the answer has no content."""
        return self.kind in ("required", "named")

    def stream(self) -> ToolCallStream:
        if self.kind == "hermes":
            return _Hermes()
        if self.kind == "llama3_json":
            return _JsonCalls(";", content_unless_json=True)
        if self.kind == "required":
            return _JsonCalls("[],", content_unless_json=False)
        return _Named(self.name or "")

    def extract(self, text: str) -> Extracted:
        """A whole answer: its content and calls (the text as content, no calls, when a call does not parse)."""
        s = self.stream()
        deltas = s.feed(text) + s.finish()
        content, calls = assemble(deltas)
        if self.kind == "named":
            return Extracted(None, calls)
        if not s.ok or not all(_is_json(c.arguments) for c in calls):
            return Extracted(text or None, [])
        return Extracted(content or None, calls)


def assemble(deltas: list[Delta]) -> tuple[str, list[ToolCall]]:
    """Content and calls from a run of deltas, as a client joins them."""
    content, calls = "", []
    for d in deltas:
        if isinstance(d, ContentDelta):
            content += d.text
        elif isinstance(d, CallStart):
            calls.append(ToolCall(d.name, ""))
        else:
            calls[d.index].arguments += d.text
    return content, calls


def _drain(out: list[Delta]) -> list[Delta]:
    """Take the deltas gathered so far, neighbours of one kind joined (one message per run, not per character)."""
    joined: list[Delta] = []
    for d in out:
        last = joined[-1] if joined else None
        if isinstance(d, ContentDelta) and isinstance(last, ContentDelta):
            joined[-1] = ContentDelta(last.text + d.text)
        elif isinstance(d, ArgsDelta) and isinstance(last, ArgsDelta) and last.index == d.index:
            joined[-1] = ArgsDelta(d.index, last.text + d.text)
        else:
            joined.append(d)
    out.clear()
    return joined


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


def parser_for(kind: str, name: Optional[str] = None) -> ToolCallParser:
    """The parser of a ``--tool-call-parser`` name, ``"required"``, or ``"named"`` with the function's name."""
    return ToolCallParser(kind, name)
