"""Token ids -> streamed text: incremental detokenization and stop strings.

Lifecycle: one ``OutputProcessor`` per request, made when the request starts
(offline ``LLM``, router) and fed every ``CoreOutput`` of that request in order
through ``process``; each call returns a ``Delta`` with the text that is safe to
show now. It finishes once: on a stop string (it then reports finish_reason
"stop" and the caller aborts the core request) or when the core reports a
finish reason (held text is flushed). The offline API and the router both use
this class, so the cluster's text equals the offline text.

``IncrementalDetokenizer`` is the prefix-offset method of TGI and vLLM: decode
a short window of tokens twice (with and without the newest ones) and emit the
difference, but only when the window does not end in U+FFFD, i.e. when no
multi-byte UTF-8 character is still waiting for its remaining byte tokens. The
window starts with the prompt's last few tokens so tokenizers whose decoders
strip a leading space (SentencePiece) still emit the space between prompt and
completion.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence, Union

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.tokenizer import Tokenizer

# Prompt tokens used as left context; vLLM uses 5 as well.
_PROMPT_CONTEXT = 5
_REPLACEMENT = "\ufffd"
# Core finish reasons that do not end the user's request.
_NOT_FINAL = frozenset({"prefill_done"})


class IncrementalDetokenizer:
    """Turns a stream of token ids into text deltas that never split a UTF-8 character."""

    def __init__(self, tokenizer: Optional[Tokenizer], prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        context = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        # The window must start on a character boundary: a leading partial character
        # decodes to U+FFFD and (with byte fallback) can swallow the space a decoder
        # would otherwise keep, so drop tokens until it decodes cleanly.
        while context and self._decode(context).startswith(_REPLACEMENT):
            context = context[1:]
        # A prompt that ends inside a character would leave U+FFFD in the prefix and
        # make every later diff wrong; start from an empty window instead.
        if context and self._decode(context).endswith(_REPLACEMENT):
            context = []
        self._tokens: list[int] = context
        self._prefix_offset = 0
        self._read_offset = len(context)
        self.output_token_ids: list[int] = []
        self.output_text = ""

    def add(self, token_ids: Sequence[int]) -> str:
        """Append generated tokens; return the newly complete text (possibly "")."""
        delta = []
        for t in token_ids:
            self._tokens.append(int(t))
            self.output_token_ids.append(int(t))
            prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
            new_text = self._decode(self._tokens[self._prefix_offset:])
            if len(new_text) > len(prefix_text) and not new_text.endswith(_REPLACEMENT):
                delta.append(new_text[len(prefix_text):])
                self._prefix_offset = self._read_offset
                self._read_offset = len(self._tokens)
        out = "".join(delta)
        self.output_text += out
        return out

    def flush(self) -> str:
        """Text still held back (an incomplete character at the very end), as the full decode shows it."""
        if self._read_offset == len(self._tokens):
            return ""
        prefix_text = self._decode(self._tokens[self._prefix_offset:self._read_offset])
        new_text = self._decode(self._tokens[self._prefix_offset:])
        self._prefix_offset = self._read_offset = len(self._tokens)
        out = new_text[len(prefix_text):] if len(new_text) > len(prefix_text) else ""
        self.output_text += out
        return out

    def _decode(self, ids: list[int]) -> str:
        if self.tokenizer is None:  # a model without tokenizer files: token ids only, no text
            return ""
        return self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)


@dataclass
class Delta:
    """What one ``OutputProcessor.process`` call lets the caller emit."""

    text: str
    """New text safe to show (never part of a stop string)."""
    token_ids: list[int] = field(default_factory=list)
    """New tokens, up to and including the one that completed a stop string."""
    logprobs: Optional[list[TokenLogprob]] = None
    """Logprobs of ``token_ids`` when the request asked for them."""
    finish_reason: Optional[str] = None
    """None while running; else "stop", "length" or "abort"."""
    stop_matched: Optional[str] = None
    """The stop string that ended the request, if one did."""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class OutputProcessor:
    """Per-request detokenization, stop-string matching and hold-back (see module docstring)."""

    def __init__(self, tokenizer: Optional[Tokenizer], prompt_token_ids: Sequence[int],
                 params: SamplingParams) -> None:
        if tokenizer is None and params.stop:
            raise ValueError("stop strings need a tokenizer; this model has none (use stop_token_ids)")
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self._stops: list[str] = list(params.stop)
        self._max_stop = max((len(s) for s in self._stops), default=0)
        self.text = ""
        """Generated text so far (after a stop, cut before the stop string)."""
        self._emitted = 0
        self.token_ids: list[int] = []
        self.logprobs: Optional[list[TokenLogprob]] = [] if params.logprobs is not None else None
        self.finish_reason: Optional[str] = None
        self.stop_matched: Optional[str] = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def stop_reason(self) -> Optional[Union[str, int]]:
        """vLLM's ``stop_reason`` of a finished request: the stop string that ended it, or the id of the
        ``stop_token_ids`` token that did; None for EOS, the length limit, or while running."""
        if self.finish_reason != "stop":
            return None
        if self.stop_matched is not None:
            return self.stop_matched
        if self.token_ids and self.token_ids[-1] in self.params.stop_token_ids:
            return self.token_ids[-1]
        return None

    def process(self, new_token_ids: Sequence[int], logprobs: Optional[Sequence[TokenLogprob]] = None,
                finish_reason: Optional[str] = None) -> Delta:
        """Take one CoreOutput's tokens (and its finish reason, if any); return what to emit."""
        if self.finished:
            # The core may still report a step that raced with our abort; it adds nothing.
            return Delta(text="")
        if logprobs is not None and len(logprobs) != len(new_token_ids):
            raise ValueError(f"logprobs has {len(logprobs)} entries for {len(new_token_ids)} new_token_ids")
        if finish_reason in _NOT_FINAL:
            finish_reason = None
        ids: list[int] = []
        lps: list[TokenLogprob] = []
        for j, t in enumerate(new_token_ids):
            ids.append(int(t))
            if logprobs is not None:
                lps.append(logprobs[j])
            if self._append_text(self.detokenizer.add([t])):
                break
        if not self.finished and finish_reason is not None:
            self._append_text(self.detokenizer.flush())
            if not self.finished:
                self.finish_reason = finish_reason

        self.token_ids.extend(ids)
        if self.logprobs is not None:
            self.logprobs.extend(lps)
        end = len(self.text) if self.finished else len(self.text) - self._held_back()
        out = self.text[self._emitted:end]
        self._emitted = max(self._emitted, end)
        return Delta(text=out, token_ids=ids, logprobs=lps if self.logprobs is not None else None,
                     finish_reason=self.finish_reason, stop_matched=self.stop_matched)

    def _append_text(self, piece: str) -> bool:
        """Add detokenized text; on a stop string cut the text there and finish. True if stopped."""
        if not piece:
            return False
        old_len = len(self.text)
        self.text += piece
        if not self._stops:
            return False
        # A new match must end inside the new piece, so it starts at most max_stop-1 chars earlier.
        start = max(0, old_len - self._max_stop + 1)
        best: Optional[tuple[int, str]] = None
        for s in self._stops:
            pos = self.text.find(s, start)
            if pos != -1 and (best is None or pos < best[0]):
                best = (pos, s)
        if best is None:
            return False
        self.text = self.text[: best[0]]
        self.finish_reason = "stop"
        self.stop_matched = best[1]
        return True

    def _held_back(self) -> int:
        """Length of the longest tail of the text that could still grow into a stop string."""
        held = 0
        for s in self._stops:
            for k in range(min(len(s) - 1, len(self.text)), held, -1):
                if self.text.endswith(s[:k]):
                    held = k
                    break
        return held
