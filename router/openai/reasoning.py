"""Reasoning out of a thinking model's answer: the parsers of vLLM's ``--reasoning-parser`` names, whole and streamed.

Lifecycle: the router resolves its ``RouterConfig.reasoning_parser`` once (``format_of``) and tokenizes the
format's markers (``ReasoningFormat.markers``: the token sequences the engine watches for, ``engine.reasoning``).
Per chat request the HTTP front end decides from the rendered prompt whether the answer opens inside a reasoning
block (``opens_in_reasoning``) and, if so, marks the request (``GenerateRequest.reasoning``) so the workers'
grammar waits for the block to close and a ``thinking_token_budget`` can close it. Each choice's text then goes
through one ``ReasoningStream`` (``feed`` each new piece, ``finish`` once): reasoning text for ``reasoning`` (and
vLLM's older name ``reasoning_content``), content text for ``content`` and the tool-call parser (tool calls are
read from the content only, as vLLM does). ``split`` runs the same stream over a whole answer, so a streamed
answer assembles to exactly the whole one.

Formats (both write ``<think>...</think>``):

- ``deepseek_r1`` (DeepSeek-R1 and its distills, QwQ): the template opens the block in the prompt; everything
  before ``</think>`` is reasoning, all of it when the answer has no ``</think>`` (cut short by max_tokens).
- ``qwen3`` (Qwen3, Qwen3-Thinking): the same, and ``chat_template_kwargs.enable_thinking: false`` (the template
  then writes an empty, closed block into the prompt) makes the whole answer content.

Where a block opens: in the answer unless the prompt already closed it (the rendered prompt ends with the end
marker, as Qwen3's ``enable_thinking=false`` and DeepSeek-V3.1's non-thinking templates write it) or the format's
switch is off; a ``continue_final_message`` answer continues the final assistant message, so it is in a block
only when that message opened one it did not close. A leading start marker in the answer (the model writing its
own ``<think>``) is not reasoning text. Text is scanned as it comes; a piece that may be the start of a marker is
held back until the next piece decides it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

REASONING_PARSERS = ("deepseek_r1", "qwen3")
"""The ``--reasoning-parser`` names (vLLM's) this router knows."""


@dataclass(frozen=True)
class ReasoningMarkers:
    """A format's markers as the model's tokenizer writes them (the engine's ``reasoning_*_token_ids``)."""

    start: tuple[int, ...]
    end: tuple[int, ...]


@dataclass(frozen=True)
class ReasoningFormat:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    switch: Optional[str] = None
    """The ``chat_template_kwargs`` key whose false value turns thinking off (the template closes the block)."""

    def markers(self, tokenizer: Any) -> ReasoningMarkers:
        """The markers tokenized (ValueError when the tokenizer writes one as no tokens)."""
        start = tuple(tokenizer.encode(self.start, add_special_tokens=False))
        end = tuple(tokenizer.encode(self.end, add_special_tokens=False))
        if not start or not end:
            raise ValueError(f"reasoning_parser {self.name!r}: the model's tokenizer writes {self.start!r} or "
                             f"{self.end!r} as no tokens")
        return ReasoningMarkers(start, end)


_FORMATS = {"deepseek_r1": ReasoningFormat("deepseek_r1"),
            "qwen3": ReasoningFormat("qwen3", switch="enable_thinking")}


def format_of(name: str) -> ReasoningFormat:
    """The format of a ``--reasoning-parser`` name (ValueError naming the known ones)."""
    fmt = _FORMATS.get(name)
    if fmt is None:
        raise ValueError(f"reasoning_parser must be one of {REASONING_PARSERS}, got {name!r}")
    return fmt


def opens_in_reasoning(fmt: ReasoningFormat, prompt_tail: str, template_kwargs: Optional[dict] = None,
                       continued: Optional[str] = None) -> bool:
    """Whether the answer to a chat starts inside a reasoning block. ``prompt_tail``: the end of the rendered
    prompt; ``continued``: with ``continue_final_message``, the final message's text (the answer continues it)."""
    if fmt.switch is not None and template_kwargs and template_kwargs.get(fmt.switch) is False:
        return False
    if continued is not None:
        at = continued.rfind(fmt.start)
        return at >= 0 and fmt.end not in continued[at:]
    return not prompt_tail.rstrip().endswith(fmt.end)


@dataclass(frozen=True)
class ReasoningPlan:
    """One chat request's reasoning, as its renderers read it."""

    fmt: ReasoningFormat
    open: bool
    """The answer opens inside a block (else it is all content)."""
    include: bool = True
    """``include_reasoning``: the reasoning is shown."""
    end_ids: tuple[int, ...] = ()
    """The end marker's token ids (``reasoning_tokens`` counts the answer's tokens up to and through it)."""

    def stream(self) -> "ReasoningStream":
        return ReasoningStream(self.fmt, self.open)

    def split(self, text: str) -> tuple[Optional[str], str]:
        """``split`` of a whole answer; the reasoning None when there is none or it is not to be shown."""
        thought, content = split(self.fmt, text, self.open)
        return (thought if self.include else None), content

    def reasoning_tokens(self, ids: list[int]) -> int:
        """How many of an answer's tokens are its reasoning block (through the end marker; all of them when the
        block never closed), as OpenAI's ``reasoning_tokens`` counts them."""
        if not self.open:
            return 0
        k = len(self.end_ids)
        for i in range(len(ids) - k + 1):
            if tuple(ids[i:i + k]) == self.end_ids:
                return i + k
        return len(ids)


def _held(text: str, marker: str) -> int:
    """The length of the longest end of ``text`` that is a proper beginning of ``marker``."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0


class ReasoningStream:
    """One choice's answer split as it streams: ``feed(text)`` and ``finish()`` give (reasoning, content) pieces."""

    def __init__(self, fmt: ReasoningFormat, open_: bool) -> None:
        self.fmt = fmt
        self.open = open_
        """Inside the block (False: every piece is content)."""
        self._lead = open_
        """Nothing of the block written yet: a leading start marker may still come (and is dropped)."""
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        if not self.open:
            return "", text
        buf = self._buf + text
        if self._lead:
            s = buf.lstrip()
            if len(s) < len(self.fmt.start) and self.fmt.start.startswith(s):
                self._buf = buf  # (whitespace, or the start of the start marker: wait)
                return "", ""
            self._lead = False
            if s.startswith(self.fmt.start):
                buf = s[len(self.fmt.start):]
        at = buf.find(self.fmt.end)
        if at >= 0:
            self.open, self._buf = False, ""
            return buf[:at], buf[at + len(self.fmt.end):]
        k = _held(buf, self.fmt.end)
        self._buf = buf[len(buf) - k:] if k else ""
        return buf[:len(buf) - k], ""

    def finish(self) -> tuple[str, str]:
        """What is held back, at the answer's end: reasoning (a block never closed)."""
        rest, self._buf = self._buf, ""
        return (rest, "") if self.open else ("", rest)

    def step(self, text: str, final: bool) -> tuple[str, str]:
        """``feed`` of one event's text, and ``finish`` too on the answer's last event."""
        thought, content = self.feed(text)
        if final:
            more, rest = self.finish()
            thought, content = thought + more, content + rest
        return thought, content


def split(fmt: ReasoningFormat, text: str, open_: bool) -> tuple[Optional[str], str]:
    """A whole answer's (reasoning, content): reasoning None when there is none (as vLLM answers it)."""
    stream = ReasoningStream(fmt, open_)
    r1, c1 = stream.feed(text)
    r2, c2 = stream.finish()
    return (r1 + r2) or None, c1 + c2
