"""Turn a SchedulerOutput into one model forward and sampled tokens.

Lifecycle: one ``ModelRunner`` per engine, owning the model, the KV caches and
the sampler. Each step ``execute`` flattens the scheduled work into one token
batch (decodes and every position of a speculative verification first, each a
one-token decode row, then prefill chunks), builds the step's
``AttentionMetadata`` (K/V slots, decode block tables, prefill spans), runs the
model once under ``torch.inference_mode``, computes logits only for rows that
sample (decodes, last prefill chunks, and every position of a speculative
verification: the last token and each draft) and samples them. Sequences
under a structured-outputs constraint have their masks computed while the
model runs (``engine.structured_outputs.MaskBatch``, on the engine's grammar
compiler, ``grammar``, set by the engine on first use). It returns a
plain ``RunnerOutput``; the engine does all sequence bookkeeping, including
which drafts are accepted.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
from torch import Tensor

from engine.attention import AttentionMetadata, PrefillSpan
from engine.model import CausalLM
from engine.outputs import TokenLogprob
from engine.sampler import Sampler, SamplingRequest
from engine.scheduler import SchedulerOutput, Sequence
from engine.structured_outputs import GrammarCompiler, MaskBatch


@dataclass
class RunnerOutput:
    """Sampled tokens for the sequences that sampled this step, one row each, in the same order; a
    verifying sequence has 1 + len(spec_token_ids) consecutive rows (one per position)."""

    seqs: list[Sequence] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[Optional[TokenLogprob]] = field(default_factory=list)


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

    def execute(self, sched: SchedulerOutput,
                layer_hook: Optional[Callable[[int], None]] = None) -> RunnerOutput:
        input_ids, positions, meta, sample_rows, sample_seqs, histories = self._prepare(sched)
        masks = None
        if self.grammar is not None and any(s.matcher is not None for s in sample_seqs):
            masks = MaskBatch(self.grammar, sample_seqs).start(self.grammar.overlap_masks)
        with torch.inference_mode():
            hidden = self.model(input_ids, positions, meta, self.kv_caches, layer_hook)
            if not sample_seqs:
                return RunnerOutput()
            logits = self.model.compute_logits(hidden)  # hidden holds only the sampling rows
        reqs = [SamplingRequest(s.params, s.prompt_token_ids, h, s.eos_token_id, generator=self.generator)
                for s, h in zip(sample_seqs, histories)]
        tokens, logprobs = self.sampler.sample(logits, reqs, masks.result() if masks is not None else None)
        return RunnerOutput(sample_seqs, tokens, logprobs)

    def _prepare(self, sched: SchedulerOutput):
        bs = self.block_size
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        sample_rows: list[int] = []
        sample_seqs: list[Sequence] = []
        sample_ctx: list[int] = []
        histories: list[list[int]] = []  # each sampling row's output history
        B = len(sched.decodes)
        ctx_lens: list[int] = []
        tables: list[list[int]] = []
        for row, seq in enumerate(sched.decodes):
            p = seq.num_computed
            ids.append(seq.token_ids[p])
            pos.append(p)
            slots.append(seq.block_table[p // bs] * bs + p % bs)
            ctx_lens.append(p + 1)
            tables.append(seq.block_table)
            if p + 1 == seq.num_tokens:
                sample_rows.append(row)
                sample_seqs.append(seq)
                sample_ctx.append(seq.num_tokens)
                histories.append(seq.output_token_ids)
        # verifications: the last token and the drafts of a decoding sequence, every position sampling. Each
        # position is a decode row of its own (its context ends at its position; the step writes every row's
        # K/V before any row reads), so a verified position is computed exactly as a one-token decode of it
        # would be: the same kernels on the same row, bit for bit wherever the linears give a row the same
        # bits in any batch (pdserve's CPU kernels; engine/speculative.py says what that buys)
        for seq in sched.verifies:
            p0 = seq.num_computed
            for j, tok in enumerate([seq.token_ids[p0], *seq.spec_token_ids]):
                p = p0 + j
                ids.append(tok)
                pos.append(p)
                slots.append(seq.block_table[p // bs] * bs + p % bs)
                ctx_lens.append(p + 1)
                tables.append(seq.block_table)
                sample_rows.append(B)
                sample_seqs.append(seq)
                sample_ctx.append(p + 1)
                histories.append(seq.output_token_ids + seq.spec_token_ids[:j])
                B += 1
        meta = AttentionMetadata(slot_mapping=None, num_decode=B, block_size=bs)  # type: ignore[arg-type]
        dev = self.device
        if B:
            width = max(len(t) for t in tables)
            # pad with block 0: those positions are masked out, the values never matter
            padded = [t + [0] * (width - len(t)) for t in tables]
            meta.decode_block_tables = torch.tensor(padded, dtype=torch.long, device=dev)
            meta.decode_ctx_lens = torch.tensor(ctx_lens, dtype=torch.long, device=dev)
        row = B
        prefill_slots: list[Tensor] = []
        for seq, n in sched.prefills:
            chunk_ids = seq.token_ids[seq.num_computed:seq.num_computed + n]
            p0 = seq.num_computed
            ids.extend(chunk_ids)
            pos.extend(range(p0, p0 + n))
            bt = torch.tensor(seq.block_table, dtype=torch.long, device=dev)
            pr = torch.arange(p0, p0 + n, device=dev)
            prefill_slots.append(bt[pr // bs] * bs + pr % bs)
            meta.prefills.append(PrefillSpan(row, row + n, p0, bt))
            row += n
            if p0 + n == seq.num_tokens:
                sample_rows.append(row - 1)
                sample_seqs.append(seq)
                sample_ctx.append(seq.num_tokens)
                histories.append(seq.output_token_ids)
        if len(sample_rows) != row:
            meta.keep = self._keep_view(sample_rows, sample_seqs, sample_ctx, bs)
        slot_t = torch.tensor(slots, dtype=torch.long, device=dev)
        meta.slot_mapping = torch.cat([slot_t, *prefill_slots]) if prefill_slots else slot_t
        input_ids = torch.tensor(ids, dtype=torch.long, device=dev)
        positions = torch.tensor(pos, dtype=torch.long, device=dev)
        if meta.keep is not None:
            meta.keep.slot_mapping = meta.slot_mapping
        return input_ids, positions, meta, sample_rows, sample_seqs, histories

    def _keep_view(self, rows: list[int], seqs: list[Sequence], ctx: list[int], bs: int) -> AttentionMetadata:
        """The sampling rows as single-query decodes over their context (``ctx``: keys up to and including
        the row's own position) for the last layer."""
        dev = self.device
        keep = AttentionMetadata(slot_mapping=None, num_decode=len(rows), block_size=bs,  # type: ignore[arg-type]
                                 rows=torch.tensor(rows, dtype=torch.long, device=dev))
        if rows:
            tables = [s.block_table for s in seqs]
            width = max(len(t) for t in tables)
            keep.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables],
                                                    dtype=torch.long, device=dev)
            keep.decode_ctx_lens = torch.tensor(ctx, dtype=torch.long, device=dev)
        return keep
