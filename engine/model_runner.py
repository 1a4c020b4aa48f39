"""Turn a SchedulerOutput into one model forward and sampled tokens.

Lifecycle: one ``ModelRunner`` per engine, owning the model, the KV caches and
the sampler. Each step ``execute`` flattens the scheduled work into one token
batch (decodes and every position of a speculative verification first, each a
one-token decode row, then prefill chunks), builds the step's
``AttentionMetadata`` (K/V slots, decode block tables, prefill spans), runs the
model once under ``torch.inference_mode``, computes logits only for rows that
sample (decodes, last prefill chunks, and every position of a speculative
verification: the last token and each draft) and samples them; a prefill chunk
of a request asking ``prompt_logprobs`` also keeps its prompt positions' rows
and gets their raw log-probabilities (no other request pays for it). Sequences
under a structured-outputs constraint have their masks computed while the
model runs (``engine.structured_outputs.MaskBatch``, on the engine's grammar
compiler, ``grammar``, set by the engine on first use). It returns a
plain ``RunnerOutput``; the engine does all sequence bookkeeping, including
which drafts are accepted. Where the engine gave the runner decode graphs
(``graphs``: engine/cuda_graphs.py), a pure decode step (single-token rows that all
sample, no prefill chunk, at most the largest bucket) is run by
replaying its bucket's graph over static buffers instead, then sampled the same way; where it also gave
piecewise graphs (``piecewise``: engine/piecewise_graphs.py), any other step of up to their largest bucket's tokens
runs the model through them (attention eagerly between the pieces). A per-layer hook (a worker's
``layer_done_callback``) is called on either path as on the eager one: after layer i's K/V are written.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from engine.attention import AttentionMetadata, PrefillSpan
from engine.cuda_graphs import DecodeGraphs
from engine.lora import StepLoRA
from engine.piecewise_graphs import PiecewiseGraphs
from engine.model import CausalLM
from engine.outputs import TokenLogprob
from engine.sampler import SampleHandle, Sampler, SamplingRequest, to_device
from engine.scheduler import SchedulerOutput, SeqStatus, Sequence
from engine.structured_outputs import GrammarCompiler, MaskBatch


@dataclass
class RunnerOutput:
    """Sampled tokens for the sequences that sampled this step, one row each, in the same order; a
    verifying sequence has 1 + len(spec_token_ids) consecutive rows (one per position)."""

    seqs: list[Sequence] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Optional[TokenLogprob]] = field(default_factory=list)
    prompt_logprobs: list[tuple[Sequence, int, list[TokenLogprob]]] = field(default_factory=list)
    """(sequence, first position, logprobs): the prompt tokens at positions first + 1, first + 2, ... as predicted
    by this step's rows of a chunk of a request asking ``prompt_logprobs``."""


class PendingStep:
    """A step launched on the device and not yet read back (``ModelRunner.launch``): its sampling sequences in row
    order, the sampler's handle (None: no row sampled, or the draw waits for ``sample``) and the prompt logprobs
    already read; ``output()`` waits and gives the ``RunnerOutput``."""

    def __init__(self, seqs: list[Sequence], handle: Optional[SampleHandle], prompt_logprobs: Optional[list] = None,
                 later: Optional[tuple["ModelRunner", Tensor, list[list[int]]]] = None) -> None:
        self.seqs = seqs
        self.handle = handle
        self.prompt_logprobs = prompt_logprobs or []
        self._later = later
        """(runner, logits, histories) of a draw left to ``sample``."""

    def row_of(self) -> dict[int, int]:
        """id(sequence) -> its row (a sampling sequence of a step that verifies nothing has one row)."""
        return {id(s): i for i, s in enumerate(self.seqs)}

    def sample(self) -> None:
        """The draw of a step launched with ``sample=False``, now that what it depends on is on the host (an async
        engine read the step before back: its tokens, the grammars' states, the histories penalties count). Rows of
        sequences that finished meanwhile are left out (their tokens would be thrown away)."""
        if self._later is None:
            return
        runner, logits, histories = self._later
        self._later = None
        keep = [i for i, s in enumerate(self.seqs) if s.status is not SeqStatus.FINISHED]
        if len(keep) < len(self.seqs):
            self.seqs = [self.seqs[i] for i in keep]
            histories = [histories[i] for i in keep]
            logits = logits.index_select(0, to_device(keep, torch.long, logits.device))
        if self.seqs:
            self.handle = runner.draw(self.seqs, histories, logits)

    def output(self) -> RunnerOutput:
        self.sample()
        if self.handle is None:
            return RunnerOutput(prompt_logprobs=self.prompt_logprobs)
        tokens, logprobs = self.handle.result()
        return RunnerOutput(self.seqs, tokens, logprobs, self.prompt_logprobs)


@dataclass
class _DecodeRows:
    """A step's single-token rows (decodes, then verification positions) as plain lists."""

    ids: list[int] = field(default_factory=list)
    pos: list[int] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    ctx_lens: list[int] = field(default_factory=list)
    tables: list[list[int]] = field(default_factory=list)
    sample_rows: list[int] = field(default_factory=list)
    sample_seqs: list[Sequence] = field(default_factory=list)
    sample_ctx: list[int] = field(default_factory=list)
    histories: list[list[int]] = field(default_factory=list)
    """Each sampling row's output history."""


class ModelRunner:
    """Model + KV caches + sampler on one device."""

    def __init__(self, model: CausalLM, kv_caches: list[tuple[Tensor, Tensor]], block_size: int,
                 sampler: Sampler, generator: torch.Generator) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.sampler = sampler
        self.generator = generator
        self.device = model.embed_tokens.weight.device
        self.grammar: Optional[GrammarCompiler] = None
        """The engine's grammar compiler once a constrained request arrived (None: no masks to compute)."""
        self.graphs: Optional[DecodeGraphs] = None
        """Static decode buffers and their CUDA graphs (engine/cuda_graphs.py), set by the engine where used."""
        self.piecewise: Optional[PiecewiseGraphs] = None
        """Static step buffers and their piecewise CUDA graphs (engine/piecewise_graphs.py) for the other steps of
        up to its largest bucket's tokens, set by the engine where used."""
        self.serves_lora = False
        """Set by an engine with LoRA adapters (engine/lora.py): only then are the step's rows' adapters looked at."""
        self._prompt_rows: list[tuple[Sequence, int, int]] = []
        """Set by ``_prepare``: (sequence, first position, rows) of the prompt positions whose logprobs this step
        returns; their hidden rows follow the sampling rows."""

    def execute(self, sched: SchedulerOutput,
                layer_hook: Optional[Callable[[int], None]] = None) -> RunnerOutput:
        """One step, run and read back: ``launch(sched).output()``."""
        return self.launch(sched, None, layer_hook).output()

    def launch(self, sched: SchedulerOutput, carry: Optional["PendingStep"] = None,
               layer_hook: Optional[Callable[[int], None]] = None, sample: bool = True) -> "PendingStep":
        """One step enqueued on the device and not read back: through a decode graph bucket, the piecewise graphs
        or eagerly (whichever takes it), then the sampler's draw. On CUDA nothing here waits for the device
        (inputs go up through pinned memory; the sampler's launch does not synchronise), except a step with prompt
        logprobs (their lists are read here) or a grammar mask (its bitmask goes up from pageable memory); an async
        engine (engine/llm_engine.py) launches the next step before reading this one. ``carry``: the step launched
        before this one and not read back yet: each of this step's decodes that sampled there has a placeholder as
        its last token, and its input id is read from that step's sampled ids on the device. ``sample=False``: only
        the forward is launched; the draw waits for ``PendingStep.sample`` (an async engine calls it once the step
        before is read back, when a row's grammar or penalty needs that step's token)."""
        moved = self._carry(sched, carry) if carry is not None else None
        masks = None
        if self.graphs is not None:
            r = self._graph_rows(sched)
            if r is not None:
                if sample and self.grammar is not None and any(s.matcher is not None for s in r.sample_seqs):
                    masks = MaskBatch(self.grammar, r.sample_seqs).start(self.grammar.overlap_masks)
                return self._graph_launch(r, moved, masks, layer_hook, sample)
        input_ids, positions, meta, sample_rows, sample_seqs, histories = self._prepare(sched)
        if moved is not None:
            dst, tokens, src = moved
            idx = to_device(dst + src, torch.long, input_ids.device)
            input_ids.index_copy_(0, idx[:len(dst)], tokens.index_select(0, idx[len(dst):]))
        self._before_forward(input_ids, positions, meta, len(sample_rows), bool(sample_seqs))
        if sample and self.grammar is not None and any(s.matcher is not None for s in sample_seqs):
            masks = MaskBatch(self.grammar, sample_seqs).start(self.grammar.overlap_masks)
        with torch.inference_mode():
            pw = self.piecewise
            if pw is not None and 0 < input_ids.shape[0] <= pw.max_size and meta.lora is None:
                hidden = pw.run(input_ids, positions, meta, layer_hook)
            else:
                hidden = self.model(input_ids, positions, meta, self.kv_caches, layer_hook)
            prompt_lps = self._prompt_logprobs(hidden[len(sample_rows):]) if self._prompt_rows else []
            for i, s in enumerate(sample_seqs):
                if s.pooling:  # an embedding request: its last prompt row's final hidden state (engine/pooling.py)
                    s.pooled = hidden[i].float().cpu()
            if not sample_seqs:
                return PendingStep([], None, prompt_lps)
            logits = self.model.compute_logits(hidden[:len(sample_rows)])  # hidden holds only kept rows
        if not sample:
            return PendingStep(sample_seqs, None, prompt_lps, later=(self, logits, histories))
        return PendingStep(sample_seqs, self.draw(sample_seqs, histories, logits, masks), prompt_lps)

    def draw(self, seqs: list[Sequence], histories: list[list[int]], logits: Tensor,
             masks: Optional[MaskBatch] = None) -> SampleHandle:
        """The sampler's launch over a step's sampling rows (``masks``: started beside the forward; None computes
        the grammar rows' masks now)."""
        if masks is None and self.grammar is not None and any(s.matcher is not None for s in seqs):
            masks = MaskBatch(self.grammar, seqs).start(False)
        reqs = [SamplingRequest(s.params, s.prompt_token_ids, h, s.eos_token_id, generator=self.generator)
                for s, h in zip(seqs, histories)]
        return self.sampler.launch(logits, reqs, masks.result() if masks is not None else None)

    @staticmethod
    def _carry(sched: SchedulerOutput, carry: "PendingStep") -> Optional[tuple[list[int], Tensor, list[int]]]:
        """(rows, the step before's sampled ids on the device, their rows there) for this step's decodes that
        sampled in ``carry``: a decode's row is its index in ``sched.decodes`` on every path."""
        row_of = carry.row_of()
        dst, src = [], []
        for i, seq in enumerate(sched.decodes):
            j = row_of.get(id(seq))
            if j is not None:
                dst.append(i)
                src.append(j)
        return (dst, carry.handle.tokens, src) if dst else None

    def _graph_launch(self, r: _DecodeRows, carry: Optional[tuple[list[int], Tensor, list[int]]],
                      masks: Optional[MaskBatch] = None, layer_hook: Optional[Callable[[int], None]] = None,
                      sample: bool = True) -> "PendingStep":
        """A decode step through the decode graphs (the grammar masks, where started, computed while the replay
        runs), then the sampler on the real rows' logits (a view of the graph's output, valid until its next replay:
        a draw left to ``PendingStep.sample`` is made before the next step is launched)."""
        self._prompt_rows = []
        logits = self.graphs.run(r.ids, r.pos, r.slots, r.tables, r.ctx_lens, carry)
        if layer_hook is not None:  # (a row completing a prompt: the replay wrote every layer's K/V, in order)
            for i in range(len(self.model.layers)):
                layer_hook(i)
        if not sample:
            return PendingStep(r.sample_seqs, None, later=(self, logits, r.histories))
        return PendingStep(r.sample_seqs, self.draw(r.sample_seqs, r.histories, logits, masks))

    def logits_of(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, num_rows: int) -> Tensor:
        """A forward outside the scheduler (beam search builds its own batch): the model over these inputs, every
        rank of a split engine with it, and the logits of the first ``num_rows`` kept rows."""
        self._prompt_rows = []
        self._before_forward(input_ids, positions, meta, num_rows, True)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, meta, self.kv_caches)
            return self.model.compute_logits(hidden[:num_rows])

    def _before_forward(self, input_ids: Tensor, positions: Tensor, meta: AttentionMetadata, num_sample_rows: int,
                        samples: bool) -> None:
        """Called with each step's inputs before the forward: nothing here; a tensor-parallel rank 0 sends them to
        the other ranks (engine/tensor_parallel.py)."""

    PROMPT_LOGITS_ROWS = 256
    """Prompt rows turned into logits at a time (a long chunk's [rows, vocab] float32 logits stay bounded)."""

    def prompt_chunks(self) -> list[tuple[int, int, int]]:
        """The step's prompt-logprob rows in the order they become logits: (index into the step's prompt rows,
        first, end) of each run of at most ``PROMPT_LOGITS_ROWS`` rows, counted from that prompt's first kept row.
        The one plan ``_prompt_logprobs`` and a tensor-parallel step's logits gathers (``logit_ranges``) follow."""
        return [(i, a, min(n, a + self.PROMPT_LOGITS_ROWS)) for i, (_seq, _first, n) in enumerate(self._prompt_rows)
                for a in range(0, n, self.PROMPT_LOGITS_ROWS)]

    def prompt_row_offsets(self) -> list[int]:
        """Where each prompt's kept rows start in the prompt part of the hidden states."""
        out, r = [], 0
        for _seq, _first, n in self._prompt_rows:
            out.append(r)
            r += n
        return out

    def _prompt_logprobs(self, hidden: Tensor) -> list[tuple[Sequence, int, list[TokenLogprob]]]:
        """The raw log-softmax of each kept prompt row: the actual next prompt token's logprob and the top-k."""
        per_seq: list[list[TokenLogprob]] = [[] for _ in self._prompt_rows]
        offsets = self.prompt_row_offsets()
        for i, a, b in self.prompt_chunks():
            seq, first, _n = self._prompt_rows[i]
            k = seq.params.prompt_logprobs
            actual = torch.tensor(seq.prompt_token_ids[first + 1 + a:first + 1 + b], dtype=torch.long)
            r = offsets[i]
            lp = torch.log_softmax(self.model.compute_logits(hidden[r + a:r + b]), dim=-1).cpu()
            chosen_t = lp.gather(1, actual.unsqueeze(1))
            ranks = (lp >= chosen_t).sum(dim=1).tolist()  # vLLM's rank: tokens at least as likely
            chosen = chosen_t.squeeze(1).tolist()
            if k:
                top_v, top_i = lp.topk(k, dim=-1)
                tops = [list(zip(ix, v)) for ix, v in zip(top_i.tolist(), top_v.tolist())]
            else:
                tops = [[] for _ in range(b - a)]
            per_seq[i] += [TokenLogprob(t, c, top, rk) for t, c, top, rk in zip(actual.tolist(), chosen, tops, ranks)]
        return [(seq, first, lps) for (seq, first, _n), lps in zip(self._prompt_rows, per_seq)]

    def _decode_rows(self, sched: SchedulerOutput) -> _DecodeRows:
        """The step's single-token rows as lists: every decode, then each verification's positions."""
        bs = self.block_size
        r = _DecodeRows()
        for row, seq in enumerate(sched.decodes):
            p = seq.num_computed
            r.ids.append(seq.token_ids[p])
            r.pos.append(p)
            r.slots.append(seq.block_table[p // bs] * bs + p % bs)
            r.ctx_lens.append(p + 1)
            r.tables.append(seq.block_table)
            if p + 1 == seq.num_tokens:
                r.sample_rows.append(row)
                r.sample_seqs.append(seq)
                r.sample_ctx.append(seq.num_tokens)
                r.histories.append(seq.output_token_ids)
        # verifications: the last token and the drafts of a decoding sequence, every position sampling. Each
        # position is a decode row of its own (its context ends at its position; the step writes every row's
        # K/V before any row reads), so a verified position is computed exactly as a one-token decode of it
        # would be: the same kernels on the same row, bit for bit wherever the linears give a row the same
        # bits in any batch (pdserve's CPU kernels; engine/speculative.py says what that buys)
        B = len(sched.decodes)
        for seq in sched.verifies:
            p0 = seq.num_computed
            for j, tok in enumerate([seq.token_ids[p0], *seq.spec_token_ids]):
                p = p0 + j
                r.ids.append(tok)
                r.pos.append(p)
                r.slots.append(seq.block_table[p // bs] * bs + p % bs)
                r.ctx_lens.append(p + 1)
                r.tables.append(seq.block_table)
                r.sample_rows.append(B)
                r.sample_seqs.append(seq)
                r.sample_ctx.append(p + 1)
                r.histories.append(seq.output_token_ids + seq.spec_token_ids[:j])
                B += 1
        return r

    def _graph_rows(self, sched: SchedulerOutput) -> Optional[_DecodeRows]:
        """The rows of a pure decode step the decode graphs can run (engine/cuda_graphs.py), or None where the
        step runs eagerly (a prefill chunk, a row that does not sample, more rows than the largest bucket)."""
        if sched.prefills:
            return None
        rows = len(sched.decodes) + sum(1 + len(s.spec_token_ids) for s in sched.verifies)
        if not 0 < rows <= self.graphs.max_size:
            return None
        if self.serves_lora and (any(s.lora_slot for s in sched.decodes) or any(s.lora_slot for s in sched.verifies)):
            return None  # (LoRA adapters run eagerly: engine/lora.py)
        r = self._decode_rows(sched)
        if len(r.sample_rows) != rows or max(len(t) for t in r.tables) > self.graphs.max_blocks:
            return None  # (a table past max_model_len's blocks: lookahead blocks a sequence holds near its end)
        return r

    def _prepare(self, sched: SchedulerOutput):
        bs = self.block_size
        r = self._decode_rows(sched)
        ids, pos, slots = r.ids, r.pos, r.slots
        sample_rows, sample_seqs, sample_ctx, histories = r.sample_rows, r.sample_seqs, r.sample_ctx, r.histories
        ctx_lens, tables = r.ctx_lens, r.tables
        B = len(ids)
        meta = AttentionMetadata(slot_mapping=None, num_decode=B, block_size=bs)  # type: ignore[arg-type]
        dev = self.device
        if B:
            width = max(len(t) for t in tables)
            # pad with block 0: those positions are masked out, the values never matter
            padded = [t + [0] * (width - len(t)) for t in tables]
            meta.decode_block_tables = to_device(padded, torch.long, dev)
            meta.decode_ctx_lens = to_device(ctx_lens, torch.long, dev)
        row = B
        prefill_slots: list[Tensor] = []
        self._prompt_rows = []
        prompt_rows: list[int] = []
        prompt_seqs: list[Sequence] = []
        prompt_ctx: list[int] = []
        for seq, n in sched.prefills:
            chunk_ids = seq.token_ids[seq.num_computed:seq.num_computed + n]
            p0 = seq.num_computed
            ids.extend(chunk_ids)
            pos.extend(range(p0, p0 + n))
            bt = to_device(seq.block_table, torch.long, dev)
            pr = torch.arange(p0, p0 + n, device=dev)
            prefill_slots.append(bt[pr // bs] * bs + pr % bs)
            meta.prefills.append(PrefillSpan(row, row + n, p0, bt))
            if seq.prompt_logprobs is not None:
                # positions p0 .. predict prompt tokens p0+1 ..; the prompt's last position predicts the first
                # output (a sampling row), and a recompute past the prompt has nothing to report
                hi = min(p0 + n, len(seq.prompt_token_ids) - 1)
                if hi > p0:
                    self._prompt_rows.append((seq, p0, hi - p0))
                    prompt_rows.extend(range(row, row + hi - p0))
                    prompt_seqs.extend([seq] * (hi - p0))
                    prompt_ctx.extend(range(p0 + 1, hi + 1))
            row += n
            if p0 + n == seq.num_tokens:
                sample_rows.append(row - 1)
                sample_seqs.append(seq)
                sample_ctx.append(seq.num_tokens)
                histories.append(seq.output_token_ids)
        if prompt_rows:  # a keep view, as any step with a prefill chunk (rows that do not sample) has
            meta.keep = self._keep_view(sample_rows + prompt_rows, sample_seqs + prompt_seqs,
                                        sample_ctx + prompt_ctx, bs)
        elif len(sample_rows) != row or meta.prefills:
            # with a prefill chunk, always: a prompt's sampled row then attends through the decode kernel in the
            # last layer whether its chunk was one token (every row samples) or more, so its logits do not depend
            # on where the scheduler cut the prompt (batch invariance: the H200 run of 1 Dec, and CPU float32 too)
            meta.keep = self._keep_view(sample_rows, sample_seqs, sample_ctx, bs)
        slot_t = to_device(slots, torch.long, dev)
        meta.slot_mapping = torch.cat([slot_t, *prefill_slots]) if prefill_slots else slot_t
        input_ids = to_device(ids, torch.long, dev)
        positions = to_device(pos, torch.long, dev)
        if meta.keep is not None:
            meta.keep.slot_mapping = meta.slot_mapping
        if self.serves_lora and (any(s.lora_slot for s in sched.decodes) or any(s.lora_slot for s in sched.verifies)
                                 or any(s.lora_slot for s, _ in sched.prefills)):
            # each row's adapter, in the rows' order: decodes, each verification's positions, prefill chunks
            slots = [s.lora_slot for s in sched.decodes]
            slots += [s.lora_slot for s in sched.verifies for _ in range(1 + len(s.spec_token_ids))]
            slots += [s.lora_slot for s, n in sched.prefills for _ in range(n)]
            meta.lora = StepLoRA.of(slots, dev)
        return input_ids, positions, meta, sample_rows, sample_seqs, histories

    def _keep_view(self, rows: list[int], seqs: list[Sequence], ctx: list[int], bs: int) -> AttentionMetadata:
        """The sampling rows as single-query decodes over their context (``ctx``: keys up to and including
        the row's own position) for the last layer."""
        dev = self.device
        keep = AttentionMetadata(slot_mapping=None, num_decode=len(rows), block_size=bs,  # type: ignore[arg-type]
                                 rows=to_device(rows, torch.long, dev))
        if rows:
            tables = [s.block_table for s in seqs]
            width = max(len(t) for t in tables)
            keep.decode_block_tables = to_device([t + [0] * (width - len(t)) for t in tables], torch.long, dev)
            keep.decode_ctx_lens = to_device(ctx, torch.long, dev)
            if self.serves_lora and any(s.lora_slot for s in seqs):
                keep.lora = StepLoRA.of([s.lora_slot for s in seqs], dev)
        return keep
