"""Structured outputs: constrain sampling to a JSON Schema, a regex, a list of choices or a grammar.

Lifecycle:

* ``StructuredOutputsParams`` (vLLM's names: ``json``, ``regex``, ``choice``, ``grammar``,
  ``json_object``) is built by the caller with exactly one constraint set, shape-checked in
  ``__post_init__`` (``ValueError`` naming ``structured_outputs.<field>``) and read-only afterwards; it
  rides in ``SamplingParams.structured_outputs`` and crosses process boundaries as plain fields.
* ``check_structured_outputs(params, tokenizer)`` is the router's compile check, run once per request
  before any worker works: it compiles the constraint against the model's vocabulary under
  ``LIMITS`` (llguidance's fuel/size limits bound the time and memory a pathological schema or regex
  can take) and raises ``ValueError`` naming the field for an invalid schema, an unsupported schema
  keyword, a regex that does not compile, a grammar that does not parse or a constraint nothing in
  the vocabulary can start.
* ``GrammarCompiler`` (one per engine, and one per tokenizer for the router's checks, made by
  ``GrammarCompiler.for_tokenizer``) owns the llguidance tokenizer built from our ``tokenizers``
  tokenizer, an LRU cache of compiled grammars keyed by the constraint, and ``new_matcher``.
* ``Matcher`` (one per sequence, so one per choice of an n > 1 request) wraps an ``llguidance.LLMatcher``
  and is advanced by each token the sequence accepts. It is rebuilt from the constraint plus the
  tokens generated so far wherever a sequence (re)starts: on a decode worker after the prefill
  worker sampled the first token, after a migration (``resume_token_ids``); a recompute preemption or
  a prefix-cache hit keeps the sequence, hence its matcher. Nothing is shipped between workers but the
  constraint and token ids.
* ``MaskBatch`` computes one step's bitmasks (one row per sampling row, drafts of a speculative
  verification included), on a worker thread while the model runs where the forward releases the GIL
  (CUDA) and inline before sampling on CPU (pdserve's CPU kernels hold the GIL through the forward), and
  ``apply_bitmask`` turns the rows into -inf logits before the sampler looks at them.

Library: llguidance (vLLM's ``guidance`` backend): lazy (no per-grammar precompile over the
vocabulary), JSON Schema / regex / Lark grammars, no dependencies; xgrammar was not taken because its
wheel pulls triton and transformers into the serving process (docs/interfaces.md has the costs).
"""
from __future__ import annotations

import json as _json
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Optional, Sequence, Union

MAX_CONSTRAINT_CHARS = 64 * 1024
"""A schema (as JSON text), regex or grammar longer than this is refused before compiling."""
MAX_CHOICES = 1024
"""At most this many choices."""
MAX_CHOICE_CHARS = 4096
"""Each choice at most this long."""
GRAMMAR_CACHE_SIZE = 64
"""Compiled grammars kept per engine and by the router's checker (LRU, keyed by the constraint); each holds the
lexer states its matchers built (bounded by ``parser_limits``)."""

_FIELDS = ("json", "regex", "choice", "grammar", "json_object")


@dataclass
class StructuredOutputsParams:
    """One output constraint (exactly one field set), vLLM's ``StructuredOutputsParams`` names."""

    json: Optional[Union[str, dict]] = None
    """A JSON Schema, as a dict or as JSON text: the output is one JSON value that validates against it."""
    regex: Optional[str] = None
    """A regular expression (Rust ``regex`` syntax, as llguidance takes it) the whole output matches."""
    choice: Optional[list[str]] = None
    """The output is exactly one of these strings."""
    grammar: Optional[str] = None
    """A Lark grammar (llguidance's dialect; GBNF is converted), the output is a sentence of it."""
    json_object: bool = False
    """The output is some JSON object (OpenAI's ``response_format: json_object``)."""

    @classmethod
    def of_field(cls, name: Optional[str], value: Any) -> "StructuredOutputsParams":
        """The constraint a message's one set field names (a proto ``oneof``: ``name`` None when none is set);
        ValueError naming ``structured_outputs.<field>`` (none set, a false json_object, ...). The one conversion
        both wire sides (router, workers) use."""
        if name is None:
            raise ValueError("structured_outputs is set but empty: set one of structured_outputs.json, .regex, "
                             ".choice, .grammar or .json_object")
        if name not in _FIELDS:
            raise ValueError(f"structured_outputs.{name} is not a constraint (one of {', '.join(_FIELDS)})")
        if name == "json_object":
            if value is not True:
                raise ValueError("structured_outputs.json_object must be true when given")
            return cls(json_object=True)
        return cls(**{name: list(value) if name == "choice" else value})

    def __post_init__(self) -> None:
        given = [f for f in _FIELDS if (getattr(self, f) is not False if f == "json_object"
                                        else getattr(self, f) is not None)]
        if not given:
            raise ValueError("structured_outputs: set exactly one of structured_outputs.json, .regex, .choice, "
                             ".grammar or .json_object")
        if len(given) > 1:
            raise ValueError(f"structured_outputs.{given[1]}: only one constraint may be set, but "
                             + " and ".join(f"structured_outputs.{f}" for f in given) + " are set")
        if self.json is not None:
            self._check_json()
        if self.regex is not None:
            self._check_text("regex")
        if self.grammar is not None:
            self._check_text("grammar")
        if self.choice is not None:
            self._check_choice()
        if not isinstance(self.json_object, bool):
            raise ValueError(f"structured_outputs.json_object must be a boolean, got {self.json_object!r}")

    def _check_json(self) -> None:
        v = self.json
        if isinstance(v, str):
            if len(v) > MAX_CONSTRAINT_CHARS:
                raise ValueError(f"structured_outputs.json is {len(v)} characters; at most {MAX_CONSTRAINT_CHARS}")
            try:
                v = _json.loads(v)
            except ValueError as e:
                raise ValueError(f"structured_outputs.json is not valid JSON: {e}") from None
        if isinstance(v, bool):
            raise ValueError("structured_outputs.json must be a JSON Schema object, got a boolean")
        if not isinstance(v, dict):
            raise ValueError(f"structured_outputs.json must be a JSON Schema object, got {type(v).__name__}")
        try:
            text = _json.dumps(v, separators=(",", ":"), allow_nan=False)
        except (TypeError, ValueError) as e:
            raise ValueError(f"structured_outputs.json is not JSON-serialisable: {e}") from None
        if len(text) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"structured_outputs.json is {len(text)} characters as JSON; at most "
                             f"{MAX_CONSTRAINT_CHARS}")

    def _check_text(self, name: str) -> None:
        v = getattr(self, name)
        if not isinstance(v, str):
            raise ValueError(f"structured_outputs.{name} must be a string, got {type(v).__name__}")
        if not v:
            raise ValueError(f"structured_outputs.{name} must not be empty")
        if len(v) > MAX_CONSTRAINT_CHARS:
            raise ValueError(f"structured_outputs.{name} is {len(v)} characters; at most {MAX_CONSTRAINT_CHARS}")

    def _check_choice(self) -> None:
        v = self.choice
        if isinstance(v, (str, bytes)) or not isinstance(v, (list, tuple)):
            raise ValueError(f"structured_outputs.choice must be a list of strings, got {type(v).__name__}")
        if not v:
            raise ValueError("structured_outputs.choice must not be empty")
        if len(v) > MAX_CHOICES:
            raise ValueError(f"structured_outputs.choice has {len(v)} entries; at most {MAX_CHOICES}")
        for i, c in enumerate(v):
            if not isinstance(c, str):
                raise ValueError(f"structured_outputs.choice[{i}] must be a string, got {type(c).__name__}")
            if not c:
                raise ValueError(f"structured_outputs.choice[{i}] must not be empty")
            if len(c) > MAX_CHOICE_CHARS:
                raise ValueError(f"structured_outputs.choice[{i}] is {len(c)} characters; at most "
                                 f"{MAX_CHOICE_CHARS}")
        self.choice = list(v)

    # -- reading ----------------------------------------------------------------------------------

    @property
    def kind(self) -> str:
        """The field that is set: 'json', 'regex', 'choice', 'grammar' or 'json_object'."""
        for f in _FIELDS[:4]:
            if getattr(self, f) is not None:
                return f
        return "json_object"

    def schema_text(self) -> Optional[str]:
        """The JSON Schema as compact JSON text, or None when ``json`` is not set. Key order is kept: it is
        the order the output's properties come in."""
        if self.json is None:
            return None
        v = _json.loads(self.json) if isinstance(self.json, str) else self.json
        return _json.dumps(v, separators=(",", ":"))

    def key(self) -> tuple[str, str]:
        """What the grammar cache is keyed by: the kind and its canonical text."""
        k = self.kind
        if k == "json":
            return k, self.schema_text() or ""
        if k == "choice":
            return k, _json.dumps(self.choice)
        if k == "json_object":
            return k, ""
        return k, getattr(self, k)


# -- llguidance ---------------------------------------------------------------------------------------

def _llg() -> Any:
    import llguidance

    return llguidance


def parser_limits() -> Any:
    """llguidance's resource limits for every grammar pdserve compiles (docs/interfaces.md lists them).

    The one that matters most is ``initial_lexer_fuel``: llguidance's default (1M) lets a regex such as
    ``(a{1000}){1000}`` precompute its lexer over the whole vocabulary at the first mask (3-4 s and
    ~450 MB here); at 100K the same regex costs ~55 ms and ~65 MB and is lexed lazily instead. Per mask:
    at most 100K lexer fuel (~7 ms) and 20K Earley items (~1 ms); lexer states (~1-2 kB each) and grammar
    size are capped too. A constraint that hits a limit puts its matcher in an error state: the check
    refuses it (``structured_outputs.<field>: ...``), a running request ends."""
    return _llg().LLParserLimits(
        max_items_in_row=2000,
        initial_lexer_fuel=100_000,
        step_lexer_fuel=100_000,
        step_max_items=20_000,
        max_lexer_states=50_000,
        max_grammar_size=200_000,
        verbose_errors=False,
    )


JSON_COMPILE_OPTIONS = {"whitespace_flexible": False}
"""Schemas compile to compact JSON (no free whitespace between tokens, vLLM's ``disable_any_whitespace``):
a model cannot stall in an endless run of spaces, and the output is what ``json.dumps`` with compact
separators writes."""


def grammar_text(params: StructuredOutputsParams) -> str:
    """The llguidance grammar of a constraint; ValueError naming the field when it cannot be built."""
    llg = _llg()
    k = params.kind
    try:
        if k == "json":
            return llg.LLMatcher.grammar_from_json_schema(params.schema_text(), defaults=JSON_COMPILE_OPTIONS)
        if k == "json_object":
            return llg.LLMatcher.grammar_from_json_schema('{"type":"object"}', defaults=JSON_COMPILE_OPTIONS)
        if k == "regex":
            return llg.LLMatcher.grammar_from_regex(params.regex)
        if k == "choice":
            return llg.LLMatcher.grammar_from_lark("start: " + " | ".join(_json.dumps(c) for c in params.choice))
        from llguidance.gbnf_to_lark import any_to_lark

        return llg.LLMatcher.grammar_from_lark(any_to_lark(params.grammar))
    except Exception as e:  # the library's own parse errors (JSON, GBNF conversion)
        raise ValueError(f"structured_outputs.{k}: {_first_line(e)}") from None


def _first_line(e: Any) -> str:
    s = " ".join(str(e).split())  # llguidance's messages draw carets over several lines: one line here
    return s if len(s) <= 600 else s[:600] + "..."


class Matcher:
    """One sequence's grammar state: llguidance's matcher, advanced by each accepted token."""

    __slots__ = ("_m", "num_consumed")

    def __init__(self, m: Any) -> None:
        self._m = m
        self.num_consumed = 0
        """Tokens accepted so far (the sequence's output tokens)."""

    @property
    def raw(self) -> Any:
        return self._m

    def consume(self, tokens: Sequence[int]) -> bool:
        """Advance by ``tokens``; False (the matcher then stays in its error state) if one is not allowed."""
        if not tokens:
            return True
        ok = self._m.consume_tokens(list(tokens))
        if ok:
            self.num_consumed += len(tokens)
        return bool(ok)

    def valid_prefix(self, tokens: Sequence[int]) -> int:
        """How many of ``tokens`` (say, speculative drafts) the grammar accepts in a row from here."""
        return int(self._m.validate_tokens(list(tokens))) if tokens else 0

    def rollback(self, n: int) -> None:
        if n:
            self._m.rollback(n)
            self.num_consumed -= n

    def is_stopped(self) -> bool:
        """The grammar is complete and admits nothing more (the request finishes with 'stop')."""
        return bool(self._m.is_stopped())

    def is_accepting(self) -> bool:
        return bool(self._m.is_accepting())

    def is_error(self) -> bool:
        return bool(self._m.is_error())

    def error(self) -> str:
        return str(self._m.get_error())


class GrammarCompiler:
    """The llguidance tokenizer of one model plus a cache of compiled grammars (see the module docstring)."""

    def __init__(self, tokenizer: Any, vocab_size: Optional[int] = None, eos_token_id: Optional[int] = None,
                 cache_size: int = GRAMMAR_CACHE_SIZE) -> None:
        llg = _llg()
        backend = getattr(tokenizer, "_tok", tokenizer)  # engine.tokenizer.Tokenizer or a tokenizers.Tokenizer
        if not hasattr(backend, "to_str"):
            raise ValueError(f"structured outputs need a `tokenizers` tokenizer, got {type(tokenizer).__name__}")
        eos = eos_token_id if eos_token_id is not None else getattr(tokenizer, "eos_token_id", None)
        n_tok = backend.get_vocab_size(with_added_tokens=True)
        self.vocab_size = max(int(vocab_size or n_tok), n_tok)
        """Mask width in tokens: the model's vocabulary (padded model vocabularies have more ids than the
        tokenizer; those ids are never allowed)."""
        t0 = time.perf_counter()
        self.ll_tokenizer = llg.LLTokenizer(backend.to_str(), n_vocab=self.vocab_size, eos_token=eos)
        self.tokenizer_build_s = time.perf_counter() - t0
        self.eos_token_id = eos
        self.limits = parser_limits()
        self._cache: OrderedDict[tuple[str, str], tuple[str, Any]] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.cache_hits = 0
        self.cache_misses = 0
        self.compile_s = 0.0
        """Seconds spent compiling grammars (cache misses)."""
        self.mask_compute_s = 0.0
        """Seconds spent computing masks, all steps (on the mask thread when overlapped)."""
        self.mask_wait_s = 0.0
        """Seconds the step waited for masks after the logits were ready (the cost not hidden by the forward)."""
        self.mask_steps = 0
        self.overlap_masks = True
        """Compute a step's masks on a worker thread while the model runs (False: inline, before sampling). The
        engine turns it off on CPU, where pdserve's kernels hold the GIL through the forward."""
        self._pool: Any = None

    def mask_thread(self) -> Any:
        """The one worker thread that computes a step's masks during the forward (made on first use; idle
        between steps, joined by the interpreter at exit)."""
        if self._pool is None:
            from concurrent.futures import ThreadPoolExecutor

            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        return self._pool

    def close(self) -> None:
        """Stop the mask thread (tools that make many engines in one process; an engine never needs to)."""
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None

    _by_tokenizer: "weakref.WeakKeyDictionary[Any, GrammarCompiler]" = weakref.WeakKeyDictionary()
    """A cache of derived data (one compiler per live tokenizer object), so the router's checks build the
    llguidance tokenizer once; it holds nothing a request could change."""

    @classmethod
    def for_tokenizer(cls, tokenizer: Any, vocab_size: Optional[int] = None) -> "GrammarCompiler":
        """The compiler of this tokenizer object, built on first use (the router's checks share it)."""
        cache = GrammarCompiler._by_tokenizer
        comp = cache.get(tokenizer)
        if comp is None or (vocab_size is not None and comp.vocab_size < vocab_size):
            comp = cls(tokenizer, vocab_size)
            cache[tokenizer] = comp
        return comp

    @property
    def mask_words(self) -> int:
        """int32 words per bitmask row."""
        return (self.vocab_size + 31) // 32

    def compile(self, params: StructuredOutputsParams) -> str:
        """The checked grammar of a constraint (cached); ValueError naming the field if it is invalid."""
        return self._compiled(params)[0]

    def _compiled(self, params: StructuredOutputsParams) -> tuple[str, Any]:
        """(grammar, a fresh matcher of it to copy) of a constraint, from the LRU cache or compiled now."""
        key = params.key()
        with self._lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
                self.cache_hits += 1
                return hit
        t0 = time.perf_counter()
        g = grammar_text(params)
        llg = _llg()
        is_err, msgs = llg.LLMatcher.validate_grammar_with_warnings(g, self.ll_tokenizer, limits=self.limits)
        if is_err:
            raise ValueError(f"structured_outputs.{params.kind}: {_first_line(msgs[0] if msgs else 'invalid')}")
        template = llg.LLMatcher(self.ll_tokenizer, g, log_level=0, limits=self.limits)
        if template.is_error():
            raise ValueError(f"structured_outputs.{params.kind}: {_first_line(template.get_error())}")
        with self._lock:
            self.compile_s += time.perf_counter() - t0
            self.cache_misses += 1
            self._cache[key] = (g, template)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return g, template

    def new_matcher(self, params: StructuredOutputsParams, tokens: Sequence[int] = ()) -> Matcher:
        """A matcher for ``params`` advanced past ``tokens`` (what the sequence has generated so far): a copy
        of the cached, never advanced matcher of the constraint (~1 us, where building one costs ~0.3-5 ms)."""
        _, template = self._compiled(params)
        with self._lock:
            m = template.deep_copy()
        matcher = Matcher(m)
        if tokens and not matcher.consume(tokens):
            raise ValueError(f"structured_outputs: the tokens generated so far do not follow the constraint "
                             f"({_first_line(matcher.error())})")
        return matcher

    def check(self, params: StructuredOutputsParams) -> None:
        """Compile ``params``, compute its first mask and take one allowed token: ValueError naming the field
        if the constraint is invalid, hits a limit, or no token of the vocabulary can start it. A refused
        constraint leaves nothing in the cache."""
        m = self.new_matcher(params)
        try:
            mask = bytearray(self.mask_words * 4)
            m.raw.unsafe_compute_mask_ptr(_addr(mask), len(mask))
            if m.is_error() or not any(mask):
                raise ValueError(f"structured_outputs.{params.kind}: no token of the model's vocabulary can start "
                                 "an output that satisfies the constraint")
            # one step further: a lexer too big for the limits (say ``(a{1000}){1000}``) fails at its first token
            first = next(i for i, b in enumerate(mask) if b)
            tok = first * 8 + (mask[first] & -mask[first]).bit_length() - 1
            if tok != self.eos_token_id and not m.consume([tok]):
                raise ValueError(f"structured_outputs.{params.kind}: too complex for the parser's limits "
                                 f"({_first_line(m.error())})")
        except ValueError:
            with self._lock:
                self._cache.pop(params.key(), None)
            raise


def _addr(buf: bytearray) -> int:
    import ctypes

    return ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))


def check_structured_outputs(params: Optional[StructuredOutputsParams], tokenizer: Any,
                             vocab_size: Optional[int] = None) -> None:
    """The router's compile check (see the module docstring); ``None`` passes. ``tokenizer`` is an
    ``engine.Tokenizer`` (or a ``GrammarCompiler``). Raises ValueError naming ``structured_outputs.<field>``."""
    if params is None:
        return
    if not isinstance(params, StructuredOutputsParams):
        raise ValueError(f"structured_outputs must be StructuredOutputsParams, got {type(params).__name__}")
    if tokenizer is None:
        raise ValueError("structured_outputs needs the model's tokenizer, and this server has none")
    comp = tokenizer if isinstance(tokenizer, GrammarCompiler) else GrammarCompiler.for_tokenizer(tokenizer,
                                                                                               vocab_size)
    comp.check(params)


# -- one step's masks -----------------------------------------------------------------------------------

class MaskBatch:
    """The bitmasks of one step's constrained sampling rows, computed on a worker thread while the model
    runs (llguidance drops the GIL while it computes): ``start`` before the forward, ``result`` after the
    logits. Each constrained sequence gets one row per sampling position: one for a decode or a prompt's
    last chunk, 1 + len(drafts) for a speculative verification (row j is the mask after drafts 0..j-1;
    llguidance advances the matcher through the drafts and rolls it back)."""

    def __init__(self, compiler: "GrammarCompiler", sample_seqs: Sequence[Any]) -> None:
        import numpy as np

        self.rows: list[int] = []
        """Sampling rows (indices into the step's sampling batch) that have a mask, in bitmask order."""
        items: list[tuple[Any, int, list[int]]] = []
        i = 0
        while i < len(sample_seqs):
            seq = sample_seqs[i]
            n = 1 + len(seq.spec_token_ids)
            m = getattr(seq, "matcher", None)
            if m is not None:
                items.append((m.raw, len(self.rows), list(seq.spec_token_ids)))
                self.rows.extend(range(i, i + n))
            i += n
        self.bitmask = np.full((len(self.rows), compiler.mask_words), -1, dtype=np.int32)
        self._items = items
        self._compiler = compiler
        self._future: Optional[Future] = None
        self.compute_s = 0.0
        """Seconds the masks took to compute (on whichever thread computed them)."""

    def __bool__(self) -> bool:
        return bool(self.rows)

    def _compute(self) -> None:
        # one matcher after another on this thread (llguidance drops the GIL in each call): a mask costs
        # ~10-100 us on an 8K vocabulary. llguidance's LLExecutor would spread them over its own threads,
        # but on a small CPU box those threads fight torch's OpenMP threads (a step of 8 rows took ~7 ms)
        t0 = time.perf_counter()
        width = self._compiler.mask_words * 4
        base = self.bitmask.ctypes.data
        for m, k, drafts in self._items:
            m.unsafe_compute_mask_ptr(base + k * width, width)
            if not drafts:
                continue
            # verification rows: the mask after each valid draft; the matcher goes back where it was. Rows
            # after a draft the grammar rejects stay all-allowed: that draft's own row forbids it, so the
            # target never agrees with it and what is sampled past it is discarded
            n = m.validate_tokens(drafts)
            done = 0
            for j in range(min(n, len(drafts))):
                if not m.consume_token(drafts[j]):
                    break
                done += 1
                m.unsafe_compute_mask_ptr(base + (k + j + 1) * width, width)
            if done:
                m.rollback(done)
        for m, k, drafts in self._items:
            if m.is_error():  # a parser limit hit mid-answer: offer only EOS; the engine ends the request
                self._only_eos(k)
        self.compute_s = time.perf_counter() - t0

    def _only_eos(self, row: int) -> None:
        eos = self._compiler.eos_token_id
        self.bitmask[row] = 0 if eos is not None else -1
        if eos is not None:
            w = 1 << (eos % 32)
            self.bitmask[row, eos // 32] = w - (1 << 32) if w >= 1 << 31 else w

    def start(self, overlap: bool) -> "MaskBatch":
        """Compute now (overlap False) or on the compiler's mask thread (overlap True)."""
        if overlap and self._items:
            self._future = self._compiler.mask_thread().submit(self._compute)
        else:
            self._compute()
        return self

    def result(self) -> "MaskBatch":
        """Wait for the masks (the time waited here is the cost the forward did not hide)."""
        if self._future is not None:
            t0 = time.perf_counter()
            self._future.result()
            self._future = None
            self._compiler.mask_wait_s += time.perf_counter() - t0
        self._compiler.mask_compute_s += self.compute_s
        self._compiler.mask_steps += 1
        return self


def _penalty_table() -> Any:
    import numpy as np

    return np.array([-np.inf, 0.0], dtype=np.float32)


def apply_bitmask(x: Any, bitmask: Any, rows: Sequence[int]) -> Any:
    """A copy of ``x`` ([B, V] float logits) with the tokens each masked row's bitmask ([len(rows), W] int32,
    numpy or torch) forbids set to -inf; rows not listed are unchanged. Bit t of a row (word t // 32, bit
    t % 32) allows token t. On CPU this is numpy (one thread): a handful of tiny torch ops per step cost
    milliseconds when torch's OpenMP threads share a small, busy machine."""
    import numpy as np
    import torch

    if not len(rows):
        return x
    V = x.shape[1]
    bm = bitmask.numpy() if isinstance(bitmask, torch.Tensor) else bitmask
    # little-endian int32 words: token t is bit t % 8 of byte t // 8; ids past the mask are forbidden
    bits = np.unpackbits(np.ascontiguousarray(bm).view(np.uint8), axis=1, count=V, bitorder="little")
    rows = list(rows)
    whole = rows == list(range(x.shape[0]))
    if x.device.type == "cpu" and x.dtype == torch.float32:
        # x + (0 where allowed, -inf where not): a table lookup and an add, branch-free (a boolean-mask store
        # is ~5x slower)
        penalty = _penalty_table().take(bits)
        if whole:
            return torch.from_numpy(x.numpy() + penalty)
        xn = x.numpy().copy()
        xn[rows] += penalty
        return torch.from_numpy(xn)
    forbidden = bits == 0
    f = torch.from_numpy(forbidden).to(x.device)
    if whole:
        return x.masked_fill(f, float("-inf"))
    idx = torch.tensor(rows, dtype=torch.long, device=x.device)
    x = x.clone()
    x[idx] = x.index_select(0, idx).masked_fill_(f, float("-inf"))
    return x
