"""Text <-> token ids for any Hugging Face model directory, and the built-in tokenizer.

Lifecycle: built once per engine (``Tokenizer.from_dir(path)`` for a HF model
directory, ``Tokenizer.builtin()`` for the tokenizer shipped in
``engine/assets/tokenizer`` that the ``tiny`` and ``bench`` models share), then
shared read-only by the router (encode, chat template), the offline API and the
output processors (decode). It wraps a ``tokenizers.Tokenizer`` (the Rust
backend transformers' fast tokenizers use) and reads the few fields of
``tokenizer_config.json`` that change behaviour: bos/eos tokens (plain strings or
AddedToken dicts), ``add_bos_token`` and the Jinja chat template, which is
rendered in a sandboxed environment because templates ship with downloaded models.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import tokenizers
from jinja2.exceptions import SecurityError, TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

BUILTIN_DIR = Path(__file__).parent / "assets" / "tokenizer"


def _token_content(tok: Any) -> Optional[str]:
    """A special token given as a string or as an AddedToken dict -> its text."""
    if tok is None:
        return None
    if isinstance(tok, str):
        return tok
    if isinstance(tok, dict) and isinstance(tok.get("content"), str):
        return tok["content"]
    raise ValueError(f"special token must be a string or an AddedToken dict, got {tok!r}")


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Optional[int] = None,
            separators: Optional[tuple] = None, sort_keys: bool = False) -> str:
    # transformers' filter: jinja2's own tojson escapes <, >, & and ' for HTML, which tool schemas in a
    # prompt must not get (the model was trained on plain JSON)
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _longest_first(n1: int, n2: int, target: int) -> tuple[int, int]:
    """The lengths ``tokenizers``' LongestFirst truncation keeps of a pair of ``n1`` and ``n2`` tokens within
    ``target``: the shorter kept whole where the longer can take the cut, else an even split (the second gets
    the odd one); a lone text (``n2`` 0) its first ``target``."""
    if n1 + n2 <= target:
        return n1, n2
    swap = n1 > n2
    if swap:
        n1, n2 = n2, n1
    n2 = n1 if n1 > target else max(n1, target - n1)
    if n1 + n2 > target:
        n1 = target // 2
        n2 = n1 + target % 2
    return (n2, n1) if swap else (n1, n2)


class Tokenizer:
    """A fast tokenizer plus the special-token and chat-template settings of one model."""

    def __init__(self, backend: tokenizers.Tokenizer, config: Optional[dict] = None,
                 eos_token_id_fallback: Optional[int] = None) -> None:
        config = dict(config or {})
        self._tok = backend
        self.bos_token: Optional[str] = _token_content(config.get("bos_token"))
        self.eos_token: Optional[str] = _token_content(config.get("eos_token"))
        self.pad_token: Optional[str] = _token_content(config.get("pad_token"))
        self.bos_token_id: Optional[int] = self._id_of(self.bos_token)
        eos_id = self._id_of(self.eos_token)
        self.eos_token_id: Optional[int] = eos_id if eos_id is not None else eos_token_id_fallback
        self.pad_token_id: Optional[int] = self._id_of(self.pad_token)
        # HF's fast tokenizers prepend bos themselves when add_bos_token is set; a
        # tokenizer.json post-processor may also do it, so we never add a second one.
        self.add_bos_token: bool = bool(config.get("add_bos_token", False)) and self.bos_token_id is not None
        self.chat_template: Optional[str] = self._pick_template(config.get("chat_template"))
        added = backend.get_added_tokens_decoder()
        self.all_special_ids: list[int] = sorted(i for i, t in added.items() if t.special)
        self._special_set = frozenset(self.all_special_ids)
        self.vocab_size: int = backend.get_vocab_size(with_added_tokens=True)
        self._template_cache = None

    # -- construction ---------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: Union[str, Path]) -> "Tokenizer":
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``, ``chat_template.jinja``) from a HF dir."""
        d = Path(path)
        tj = d / "tokenizer.json"
        if not tj.is_file():
            raise ValueError(f"model path {str(d)!r} has no tokenizer.json")
        backend = tokenizers.Tokenizer.from_file(str(tj))
        config: dict = {}
        cfg_path = d / "tokenizer_config.json"
        if cfg_path.is_file():
            config = json.loads(cfg_path.read_text(encoding="utf-8"))
        # transformers v5 writes the template beside the config instead of inside it.
        jinja_path = d / "chat_template.jinja"
        if jinja_path.is_file() and not config.get("chat_template"):
            config["chat_template"] = jinja_path.read_text(encoding="utf-8")
        if "bos_token" not in config or "eos_token" not in config:
            stm = d / "special_tokens_map.json"
            if stm.is_file():
                for k, v in json.loads(stm.read_text(encoding="utf-8")).items():
                    config.setdefault(k, v)
        eos_fallback = None
        for name in ("generation_config.json", "config.json"):
            p = d / name
            if p.is_file():
                eos = json.loads(p.read_text(encoding="utf-8")).get("eos_token_id")
                if isinstance(eos, list) and eos:
                    eos = eos[0]
                if isinstance(eos, int):
                    eos_fallback = eos
                    break
        return cls(backend, config, eos_token_id_fallback=eos_fallback)

    @classmethod
    def builtin(cls) -> "Tokenizer":
        """The byte-level BPE (vocab 8192) shared by the built-in ``tiny`` and ``bench`` models."""
        return cls.from_dir(BUILTIN_DIR)

    # -- encode / decode ------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; with ``add_special_tokens`` the model's bos (if it uses one) leads."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a string, got {type(text).__name__}")
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if add_special_tokens and self.add_bos_token and (not ids or ids[0] != self.bos_token_id):
            ids = [self.bos_token_id] + ids
        return ids

    def encode_encoder(self, first: str, second: Optional[str] = None, max_tokens: Optional[int] = None) -> list[int]:
        """An encoder's input (engine/encoder.py): ``first``, or the pair (``first``, ``second``) a cross-encoder
        scores, through the tokenizer's own template (``[CLS] a [SEP] b [SEP]``, ``<s> a </s></s> b </s>``). With
        ``max_tokens`` the texts are cut at their ends, longest first (transformers' ``truncation=True`` for an
        encoder's right-side tokenizer), so the special tokens stay; ValueError if they alone do not fit."""
        for name, t in (("first", first), ("second", second)):
            if t is not None and not isinstance(t, str):
                raise ValueError(f"{name} must be a string, got {type(t).__name__}")
        a = self._tok.encode(first, add_special_tokens=False)
        b = self._tok.encode(second, add_special_tokens=False) if second is not None else None
        if max_tokens is not None:
            post = self._tok.post_processor
            room = max_tokens - (post.num_special_tokens_to_add(b is not None) if post is not None else 0)
            if room < 1:
                raise ValueError(f"truncate_prompt_tokens={max_tokens} leaves no room past the special tokens")
            la, lb = _longest_first(len(a.ids), len(b.ids) if b is not None else 0, room)
            a.truncate(la)
            if b is not None:
                b.truncate(lb)
        return self._tok.post_process(a, b, add_special_tokens=True).ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        """Text of ``ids``; invalid UTF-8 byte runs decode to U+FFFD (as in transformers)."""
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def convert_ids_to_tokens(self, ids: Union[int, Sequence[int]]) -> Union[Optional[str], list[Optional[str]]]:
        """Vocabulary strings of ``ids`` (one id -> one string, like transformers)."""
        if isinstance(ids, int):
            return self._tok.id_to_token(ids)
        return [self._tok.id_to_token(int(i)) for i in ids]

    def convert_tokens_to_ids(self, tokens: Union[str, Sequence[str]]) -> Union[Optional[int], list[Optional[int]]]:
        if isinstance(tokens, str):
            return self._tok.token_to_id(tokens)
        return [self._tok.token_to_id(t) for t in tokens]

    def max_input_bytes_per_token(self) -> int:
        """An upper bound on the UTF-8 input bytes one token can stand for, so a server can reject a text
        that cannot fit a context from its length alone, before encoding it: the longest token's text in
        UTF-8 (byte-level and sentencepiece pieces spell a byte with at least one byte), times 4 when a
        normalizer could shrink the input first (NFKC and friends shrink at most that much)."""
        longest = max((len(t.encode("utf-8")) for t in self._tok.get_vocab(with_added_tokens=True)), default=1)
        return max(1, longest) * (4 if self._tok.normalizer is not None else 1)

    def is_special(self, token_id: int) -> bool:
        return token_id in self._special_set

    def __len__(self) -> int:
        return self.vocab_size

    # -- chat -----------------------------------------------------------------------------------

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True,
                            tools: Optional[list[dict]] = None, continue_final_message: bool = False,
                            **kwargs: Any) -> str:
        """Render ``messages`` ([{role, content}, ...]) with the model's chat template, as transformers does:
        ``tools`` (OpenAI-style ``{"type": "function", "function": {...}}`` dicts) is the template's ``tools``
        variable; ``continue_final_message`` leaves the last message open (no end-of-turn after its content) so
        the model continues it instead of starting a new turn."""
        if self.chat_template is None:
            raise ValueError("this tokenizer has no chat_template")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise ValueError("messages must be a list of {'role': ..., 'content': ...} dicts")
        for i, m in enumerate(messages):
            if not isinstance(m.get("role"), str):
                raise ValueError(f"messages[{i}].role must be a string")
        if tools is not None and (not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools)):
            raise ValueError("tools must be a list of dicts")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        if self._template_cache is None:
            # Same settings as transformers: sandboxed (templates come with downloaded
            # models), trim/lstrip blocks so templates written for HF render identically.
            env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=["jinja2.ext.loopcontrols"])
            env.globals["raise_exception"] = _raise_exception
            env.globals["strftime_now"] = _strftime_now
            env.filters["tojson"] = _tojson
            self._template_cache = env.from_string(self.chat_template)
        try:
            text = self._template_cache.render(
                messages=messages, add_generation_prompt=add_generation_prompt, tools=tools,
                bos_token=self.bos_token or "", eos_token=self.eos_token or "", **kwargs)
        except SecurityError:  # the template itself misbehaves: the server's fault, not the conversation's
            raise
        except TemplateError as e:  # raise_exception() in the template, a field the conversation lacks
            raise ValueError(f"the chat template refused the conversation: {e}") from None
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str) or final.strip() not in text:
                raise ValueError("continue_final_message: the final message's content is not a string the "
                                 "template renders")
            # cut after the final message's text: its end-of-turn tokens go, the model continues it
            tail = final if final in text else final.strip()
            text = text[: text.rindex(tail) + len(tail)]
        return text

    @staticmethod
    def _pick_template(t: Any) -> Optional[str]:
        # A list of named templates is allowed by HF; "default" is the one used for chat.
        if t is None or isinstance(t, str):
            return t
        if isinstance(t, list):
            named = {d.get("name"): d.get("template") for d in t if isinstance(d, dict)}
            return named.get("default") or next(iter(named.values()), None)
        raise ValueError(f"chat_template must be a string or a list of named templates, got {type(t).__name__}")

    def _id_of(self, token: Optional[str]) -> Optional[int]:
        return None if token is None else self._tok.token_to_id(token)
