"""Beam search over the engine's paged KV cache: vLLM's ``LLM.beam_search`` with transformers' semantics.

Lifecycle: ``LLM.beam_search`` (or ``run_beam_search``) takes an ``LLMEngine`` with no unfinished
requests and owns it until the call returns; the scheduler is bypassed, the search drives the model
and the block manager itself. Prompts wait in input order and are admitted while the worst case of
their beams' blocks fits the blocks free at the start (so an allocation never fails mid-search) and
the live beams stay within ``max_num_seqs``. Each step is one model forward: every newly admitted
prompt is prefilled whole (once), and every live beam of the other prompts decodes its last token;
the rows' float32 log-softmax over the vocabulary then goes to each prompt's ``PromptBeamSearch``,
which does exactly one iteration of transformers' ``_beam_search`` (5.x): top 2W continuations of
the accumulated log-probs, the W best that did not stop run on, the W best finished hypotheses are
kept by length-penalised score, and transformers' early-stop heuristic decides when to quit.
``PromptBeamSearch`` needs no torch: its state is Python floats holding float32 values, and each step's
arithmetic is rounded to float32 as torch's was. Its two ways in rank the candidates differently:
``step`` (the engine) takes full log-prob rows and ranks them with ``torch.topk``, as transformers does;
``step_top`` (the router, which must not load torch) takes each row's top 2W (token, log-prob) pairs and
ranks them in Python, ties to the lower (row, token); both then run the same update.

KV sharing: a prompt's table is prefilled once; every beam descends from it through ``fork``
(reference counts), so the prompt's blocks and a parent's history are shared, never recomputed.
When a beam is about to write its next token into a block someone else still holds (the partial
last block of a parent with several children), that block is first copied, K and V of every layer,
to a fresh block (copy-on-write); the last holder writes in place. Full blocks are never written.
A prompt's blocks go back as soon as it is done, and every table the search took is freed when it
returns or raises, so the engine's free block count is back where it started.
"""
from __future__ import annotations

import heapq
import math
import struct
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence, Union

if TYPE_CHECKING:  # pragma: no cover
    from torch import Tensor

    from engine.attention import AttentionMetadata
    from engine.llm_engine import LLMEngine

NEG = -1.0e9
"""transformers' score offset for continuations that may not run on (and for unused beams); a float32 value."""

_F32 = struct.Struct("f")


def _f32(x: float) -> float:
    """``x`` rounded to float32. One +, -, * or / of two float32 values done in float64 and rounded here equals the
    float32 operation (53 >= 2 * 24 + 2 bits: the double rounding is harmless), so the search's sums match torch's."""
    return _F32.unpack(_F32.pack(x))[0]


@dataclass
class BeamSearchParams:
    """vLLM's beam search parameters, plus transformers' ``early_stopping``."""

    beam_width: int
    """Beams kept per prompt (W), and sequences returned per prompt; in [1, MAX_BEAM_WIDTH]."""
    max_tokens: int
    """Maximum number of new tokens (also capped by the engine's max_model_len)."""
    ignore_eos: bool = False
    """Never finish a hypothesis on EOS (all hypotheses then run max_tokens)."""
    temperature: float = 0.0
    """Only 0 (deterministic beam search) is supported."""
    length_penalty: float = 1.0
    """Finished score = cum_logprob / generated_len ** length_penalty (generated_len counts EOS)."""
    include_stop_str_in_output: bool = False
    """Keep the EOS token at the end of a stopped sequence's ``tokens`` (as vLLM)."""
    early_stopping: Union[bool, str] = False
    """transformers' semantics and default (vLLM's old beam search defaulted to False too): True stops a
    prompt once W hypotheses finished; False stops when the best running beam, scored at its current
    length, cannot beat the worst finished one; "never" likewise, but scores it at max_tokens when
    length_penalty > 0 (the canonical search)."""

    MAX_BEAM_WIDTH = 64

    def __post_init__(self) -> None:
        for name, lo, hi in (("beam_width", 1, self.MAX_BEAM_WIDTH), ("max_tokens", 1, None)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo or (hi is not None and v > hi):
                raise ValueError(f"{name} must be an integer in [{lo}, {hi or 'inf'}], got {v!r}")
        for name in ("ignore_eos", "include_stop_str_in_output"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be a bool, got {getattr(self, name)!r}")
        for name in ("temperature", "length_penalty"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
                raise ValueError(f"{name} must be a finite number, got {v!r}")
            setattr(self, name, float(v))
        if self.temperature != 0.0:
            raise ValueError(f"temperature must be 0 (only deterministic beam search is supported), "
                             f"got {self.temperature}")
        if not (isinstance(self.early_stopping, bool) or self.early_stopping == "never"):
            raise ValueError(f"early_stopping must be True, False or 'never', got {self.early_stopping!r}")


@dataclass
class BeamSearchSequence:
    """One finished hypothesis (vLLM's shape, plus transformers' ranking score)."""

    tokens: list[int]
    """Prompt + generated tokens (EOS only with include_stop_str_in_output)."""
    cum_logprob: float = 0.0
    """Sum of the generated tokens' log-probabilities (EOS included)."""
    score: float = 0.0
    """cum_logprob / generated_len ** length_penalty: the ranking key (transformers' sequences_scores)."""
    text: str = ""
    """Detokenized generated text ("" when the engine has no tokenizer)."""
    finish_reason: Optional[str] = None
    """"stop" (EOS) or "length"."""


@dataclass
class BeamSearchOutput:
    """The beam_width best hypotheses of one prompt, best first."""

    sequences: list[BeamSearchSequence]
    prompt: Optional[str] = None
    prompt_token_ids: list[int] = field(default_factory=list)


@dataclass
class _Beam:
    tokens: list[int]
    """Prompt + generated. A running beam's table holds K/V for all but its last token, which its next
    decode writes; a just-admitted prompt's blocks get its K/V from its prefill."""
    table: list[int]


@dataclass
class _Hyp:
    score: float
    cum: float
    tokens: list[int]
    reason: str


class PromptBeamSearch:
    """transformers' beam state for one prompt: running beams, the W best finished, the early-stop flag.

    Engine-neutral: a step takes the parents' log-probabilities and the parents themselves (anything with
    ``tokens``: prompt + generated), so the router's cluster beam search (``router.beam_search``) runs the very
    same algorithm over log-probs it gathered from workers. No torch here: ``step`` imports it for its ranking."""

    def __init__(self, prompt: list[int], max_new: int, params: BeamSearchParams, eos: Optional[int]) -> None:
        W = params.beam_width
        self.prompt, self.max_new, self.p = prompt, max_new, params
        self.eos = None if params.ignore_eos else eos
        self.running: list[_Beam] = []
        # only the first beam may expand at first, so the W beams do not all pick the same token
        self.scores: list[float] = [0.0] + [NEG] * (W - 1)
        """Running beams' cumulative log-probs (float32 values), row-aligned with the next step's parents."""
        self.finished: list[_Hyp] = []
        self.improvable = True
        self.generated = 0
        self.done = False

    def step(self, logprobs: "Tensor", parents: list) -> list[tuple[Any, int]]:
        """One iteration over the parents' log-probs [W, V] (row i belongs to ``parents[i]``; at the first step
        the prompt's one row repeated W times, with the prompt W times); the (parent, token) of the next running
        beams, W of them, or [] once ``done``. A row only has to be exact on the values that can reach the top
        2W: a row that is -inf outside its own top 2W log-probs gives the same result. Ranks with ``torch.topk``
        over the flattened rows, as transformers does (ties: torch's order)."""
        import torch

        W, V = logprobs.shape
        scores = torch.tensor(self.scores, dtype=torch.float32)
        vals, idx = torch.topk((logprobs + scores[:, None]).view(-1), 2 * W)
        return self._update(vals.tolist(), (idx // V).tolist(), (idx % V).tolist(), parents, _keep_torch)

    def step_top(self, tops: Sequence[Sequence[tuple[int, float]]], parents: list) -> list[tuple[Any, int]]:
        """``step`` on sparse rows, without torch: ``tops[i]`` is (token, log-prob) pairs of ``parents[i]``'s
        next token, distinct tokens, the rest of the row being -inf (the router's rows: each beam's top 2W from a
        worker, which gives the exact search, see ``step``). Log-probs are taken as float32, as a float32 row
        holds them. Candidates are ranked by value, ties to the lower (row, token), i.e. the lower flat index;
        with no exact ties this is ``step``'s ranking, so both give the same search, bit for bit."""
        W = len(self.scores)
        if len(tops) != W or len(parents) != W:
            raise ValueError(f"step_top needs {W} rows and parents (beam_width), got {len(tops)} and {len(parents)}")
        cands = ((_f32(_f32(lp) + s), i, tok) for i, (top, s) in enumerate(zip(tops, self.scores)) for tok, lp in top)
        best = heapq.nlargest(2 * W, cands, key=lambda c: (c[0], -c[1], -c[2]))
        if len(best) < 2 * W:
            raise ValueError(f"step_top needs at least {2 * W} candidates (2 x beam_width), got {len(best)}")
        return self._update([c[0] for c in best], [c[1] for c in best], [c[2] for c in best], parents, _keep_python)

    def _update(self, vals: list[float], src: list[int], toks: list[int], parents: list,
                keep_best: Callable[[list[float], int], list[int]]) -> list[tuple[Any, int]]:
        """The rest of one iteration, given the top 2W continuations (value, parent row, token), best first."""
        W = len(self.scores)
        pen, es = self.p.length_penalty, self.p.early_stopping
        self.generated += 1
        t = self.generated
        eos = [tok == self.eos for tok in toks]
        hit = [e or t >= self.max_new for e in eos]
        # finished hypotheses: only the top W continuations count, and only while the prompt can improve
        if self.improvable and not (es is True and len(self.finished) == W):
            div = _f32(t ** pen)
            for j in range(W):
                if hit[j]:
                    self.finished.append(_Hyp(_f32(vals[j] / div), vals[j], parents[src[j]].tokens + [toks[j]],
                                              "stop" if eos[j] else "length"))
            self.finished.sort(key=lambda h: -h.score)
            del self.finished[W:]
        # -0.0, not 0.0: what torch's ``vals + hit * NEG`` adds for a non-hit (0.0 + -0.0 keeps the 0.0)
        shifted = [_f32(v + (NEG if h else -0.0)) for v, h in zip(vals, hit)]
        keep = keep_best(shifted, W)
        self.scores = [shifted[k] for k in keep]
        nxt = [(parents[src[k]], toks[k]) for k in keep]
        if len(self.finished) == W:
            hyp_len = self.max_new if es == "never" and pen > 0.0 else t
            best = _f32(self.scores[0] / _f32(hyp_len ** pen))
            self.improvable = self.improvable and best > min(h.score for h in self.finished)
        self.done = (not self.improvable or (es is True and len(self.finished) == W) or t >= self.max_new)
        return [] if self.done else nxt

    def results(self, tokenizer: Any = None, skip_special_tokens: bool = True) -> list[BeamSearchSequence]:
        """The finished hypotheses, best first (W of them once ``done``), detokenized with ``tokenizer``."""
        out = []
        for h in self.finished:
            tokens = h.tokens
            if h.reason == "stop" and not self.p.include_stop_str_in_output:
                tokens = tokens[:-1]
            new = tokens[len(self.prompt):]
            text = tokenizer.decode(new, skip_special_tokens=skip_special_tokens) if tokenizer is not None else ""
            out.append(BeamSearchSequence(tokens, h.cum, h.score, text, h.reason))
        return out


def _keep_torch(shifted: list[float], W: int) -> list[int]:
    """The W best of ``shifted`` by ``torch.topk`` (the engine's, and transformers', choice among ties)."""
    import torch

    return torch.topk(torch.tensor(shifted, dtype=torch.float32), W).indices.tolist()


def _keep_python(shifted: list[float], W: int) -> list[int]:
    """The W best of ``shifted``, best first, ties to the earlier (better-ranked) candidate."""
    return heapq.nlargest(W, range(len(shifted)), key=shifted.__getitem__)


class BeamSearcher:
    """Runs a batch of prompts' beam searches on one engine (see the module docstring)."""

    def __init__(self, engine: "LLMEngine", params: BeamSearchParams,
                 on_step: Optional[Callable[[list[list[int]]], None]] = None, lora_name: Optional[str] = None) -> None:
        if not isinstance(params, BeamSearchParams):
            raise ValueError(f"params must be BeamSearchParams, got {type(params).__name__}")
        self.lora_slot = engine._lora_slot(lora_name)  # ValueError naming lora_name for one not served
        """Every beam's LoRA adapter slot (engine/lora.py; 0: the base model)."""
        if engine.has_unfinished_requests():
            raise ValueError("beam search needs the engine to itself: it has unfinished requests")
        self.eng, self.params, self.on_step = engine, params, on_step
        """on_step(tables): called after each forward with the block tables of the beams it decoded."""
        self.bm = engine.block_manager
        self.bs = engine.block_size
        self.device = engine.runner.device
        self._owned: list[list[int]] = []  # every table taken; freed ones are empty

    def need(self, prompt_len: int, max_new: int) -> int:
        """Most blocks one prompt's search holds at once: its full prompt blocks, shared, plus W private
        tails (the last token's K/V is never computed)."""
        shared = prompt_len // self.bs
        return shared + self.params.beam_width * (self.bm.blocks_for(prompt_len + max_new - 1) - shared)

    def run(self, prompts: list[list[int]]) -> list[list[BeamSearchSequence]]:
        eng, W = self.eng, self.params.beam_width
        budget = self.bm.num_free_blocks
        states: list[PromptBeamSearch] = []
        for i, ids in enumerate(prompts):
            if not ids:
                raise ValueError(f"prompts[{i}] must not be empty")
            V = eng.model_config.vocab_size
            for t in ids:
                if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < V:
                    raise ValueError(f"prompts[{i}]: {t!r} is not a token id in [0, {V})")
            if len(ids) >= eng.max_model_len:
                raise ValueError(f"prompts[{i}] has {len(ids)} tokens; max_model_len is {eng.max_model_len}")
            st = PromptBeamSearch(list(ids), min(self.params.max_tokens, eng.max_model_len - len(ids)),
                               self.params, eng.eos_token_id)
            if self.need(len(ids), st.max_new) > budget:
                raise ValueError(f"prompts[{i}] needs up to {self.need(len(ids), st.max_new)} KV blocks for "
                                 f"beam_width={W}; the engine has {budget} free")
            states.append(st)
        waiting, active = deque(states), []
        max_beams = max(eng.config.max_num_seqs, W)
        try:
            while waiting or active:
                used = sum(self.need(len(s.prompt), s.max_new) for s in active)
                new: list[PromptBeamSearch] = []
                while waiting and used + self.need(len(waiting[0].prompt), waiting[0].max_new) <= budget \
                        and W * (len(active) + 1) <= max_beams:
                    s = waiting.popleft()
                    used += self.need(len(s.prompt), s.max_new)
                    s.running = [_Beam(s.prompt, self._own(self.bm.allocate(self.bm.blocks_for(len(s.prompt)))))]
                    active.append(s)
                    new.append(s)
                old = [s for s in active if s not in new]
                decodes = [b for s in old for b in s.running]
                logprobs = self._forward(decodes, [s.running[0] for s in new])
                if self.on_step is not None:
                    self.on_step([b.table for b in decodes])
                row = 0
                for s in old:
                    self._advance(s, logprobs[row:row + W], s.running)
                    row += W
                for s in new:
                    self._advance(s, logprobs[row].expand(W, -1), s.running * W)
                    row += 1
                active = [s for s in active if not s.done]
                self._owned = [t for t in self._owned if t]
        finally:
            for t in self._owned:
                if t:
                    self.bm.free(t)
            self._owned = []
        return [self._results(s) for s in states]

    # -- internals --------------------------------------------------------------------------------

    def _own(self, table: list[int]) -> list[int]:
        self._owned.append(table)
        return table

    def _advance(self, s: PromptBeamSearch, logprobs: Tensor, parents: list[_Beam]) -> None:
        """One search step for s; children fork their parent's table before the parents let theirs go."""
        children = [_Beam(p.tokens + [tok], self._own(self.bm.fork(p.table))) for p, tok in s.step(logprobs, parents)]
        for p in {id(p): p for p in parents}.values():
            self.bm.free(p.table)
        s.running = children

    def _make_writable(self, beams: list[_Beam]) -> None:
        """Give each beam a private block at the position its last token is written to (copy-on-write)."""
        src: list[int] = []
        dst: list[int] = []
        for b in beams:
            i = (len(b.tokens) - 1) // self.bs
            if i == len(b.table):
                b.table.extend(self.bm.allocate(1))
            elif self.bm.ref_count(b.table[i]) > 1:
                (fresh,) = self.bm.allocate(1)
                src.append(b.table[i])
                dst.append(fresh)
                self.bm.free([b.table[i]])  # siblings still hold it, so its content stays until the copy
                b.table[i] = fresh
        if src:
            import torch

            s = torch.tensor(src, dtype=torch.long, device=self.device)
            d = torch.tensor(dst, dtype=torch.long, device=self.device)
            with torch.inference_mode():  # every tensor-parallel rank's cache: rank 0 maps them all
                for caches in self.eng.rank_kv_caches:
                    for k, v in caches:
                        k.index_copy_(0, d, k.index_select(0, s))
                        v.index_copy_(0, d, v.index_select(0, s))

    def _forward(self, decodes: list[_Beam], prefills: list[_Beam]) -> Tensor:
        """One forward: decodes' last tokens, then each prompt whole; float32 log-probs [rows, V], one row per
        decode and one (the last position) per prompt."""
        # imported here: the router runs PromptBeamSearch and must not load torch or the attention/kernel stack
        import torch

        from engine.attention import AttentionMetadata, PrefillSpan

        self._make_writable(decodes)
        bs, dev = self.bs, self.device
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        for b in decodes:
            p = len(b.tokens) - 1
            ids.append(b.tokens[p])
            pos.append(p)
            slots.append(b.table[p // bs] * bs + p % bs)
        meta = AttentionMetadata(slot_mapping=None, num_decode=len(decodes), block_size=bs)  # type: ignore[arg-type]
        rows = list(range(len(decodes)))
        for b in prefills:
            n, start = len(b.tokens), len(ids)
            ids.extend(b.tokens)
            pos.extend(range(n))
            slots.extend(b.table[p // bs] * bs + p % bs for p in range(n))
            meta.prefills.append(PrefillSpan(start, start + n, 0, torch.tensor(b.table, dtype=torch.long, device=dev)))
            rows.append(start + n - 1)
        if decodes:
            self._decode_view(meta, decodes, [len(b.tokens) for b in decodes])
        meta.slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        if len(rows) != len(ids):
            # only the sampling rows need the last layer's attention output and MLP
            meta.keep = AttentionMetadata(slot_mapping=meta.slot_mapping, num_decode=len(rows), block_size=bs,
                                          rows=torch.tensor(rows, dtype=torch.long, device=dev))
            self._decode_view(meta.keep, decodes + prefills, [len(b.tokens) for b in decodes + prefills])
        if self.lora_slot:  # every row under the search's adapter
            from engine.lora import StepLoRA

            meta.lora = StepLoRA.of([self.lora_slot] * len(ids), dev)
            if meta.keep is not None:
                meta.keep.lora = StepLoRA.of([self.lora_slot] * len(rows), dev)
        logits = self.eng.runner.logits_of(torch.tensor(ids, dtype=torch.long, device=dev),
                                           torch.tensor(pos, dtype=torch.long, device=dev), meta, len(rows))
        with torch.inference_mode():
            return torch.log_softmax(logits.float(), dim=-1).cpu()

    def _decode_view(self, meta: AttentionMetadata, beams: list[_Beam], ctx: list[int]) -> None:
        import torch

        width = max(len(b.table) for b in beams)
        # pad with block 0: positions past a row's context are masked out
        meta.decode_block_tables = torch.tensor([b.table + [0] * (width - len(b.table)) for b in beams],
                                                dtype=torch.long, device=self.device)
        meta.decode_ctx_lens = torch.tensor(ctx, dtype=torch.long, device=self.device)

    def _results(self, s: PromptBeamSearch) -> list[BeamSearchSequence]:
        return s.results(self.eng.tokenizer)


def run_beam_search(engine: "LLMEngine", prompts: list[list[int]], params: BeamSearchParams,
                    on_step: Optional[Callable[[list[list[int]]], None]] = None,
                    lora_name: Optional[str] = None) -> list[list[BeamSearchSequence]]:
    """Beam-search every prompt (token ids) on ``engine``, under LoRA adapter ``lora_name`` (None: the base model);
    per prompt its beam_width best sequences, best first."""
    return BeamSearcher(engine, params, on_step, lora_name).run(prompts)
