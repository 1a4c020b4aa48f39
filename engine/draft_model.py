"""Draft-model proposer for speculative decoding: a small model with its own paged KV cache.

Lifecycle: built once by ``LLMEngine`` when ``speculative_config.method ==
"draft_model"``: it loads the draft (a built-in name such as ``tiny-draft`` or a
HF directory) on the target's device and dtype, checks that it shares the
target's vocabulary, and allocates its own paged KV cache and block manager
(the draft's blocks are small: its K/V per token is a fraction of the
target's). Each engine step, before scheduling, ``propose`` gets the decoding
sequences and the room each has (``propose_many``), and proposes in a tight loop of its own, with
no scheduler round trip per draft token:

1. catch-up: one forward over every sequence's tokens the draft has not seen
   yet (for a new sequence its whole prompt, the decode worker's "prefill the
   draft itself"; after a verified step the accepted drafts it did not keep
   plus the target's own token), which yields the first draft token;
2. k - 1 batched single-token decode forwards, each giving the next draft.

Drafts are the draft model's argmax (a deterministic proposal, like an
n-gram's), so the engine's acceptance rule stays exactly lossless for greedy
and sampled requests (``engine.speculative``). Rollback is bookkeeping: the
draft remembers which drafts it wrote into its cache; at the next step the ones
the target accepted are kept, and everything past them is overwritten. A
sequence's draft blocks are freed when it is no longer among the decoding
sequences (finished, aborted, preempted; a preempted one catches up again).
When the draft's own blocks run out, the sequences that do not fit get no
drafts that step (plain decoding), never an error.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Sequence as Seq

import torch

from engine.attention import AttentionMetadata, PrefillSpan
from engine.block_manager import BlockManager
from engine.config import EngineConfig
from engine.kv_cache import allocate_kv_caches

logger = logging.getLogger(__name__)


@dataclass
class _DraftSeq:
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Leading tokens of the sequence whose draft K/V are in the draft cache."""
    written: list[int] = field(default_factory=list)
    """Drafts whose K/V were written after position num_computed (kept if the target accepts them)."""


class DraftModelProposer:
    """Proposes the draft model's greedy continuation for a batch of sequences."""

    def __init__(self, target: EngineConfig, draft_model: str, target_vocab_size: int, num_blocks: int,
                 block_size: int, max_model_len: int) -> None:
        from engine.loader import load_model, load_model_config

        cfg = EngineConfig(model=draft_model, dtype=target.dtype, device=target.device, block_size=block_size,
                           cpu_gemm=target.cpu_gemm)
        try:
            mc = load_model_config(cfg)
        except ValueError as e:
            raise ValueError(f"speculative_config.model: {e}") from e
        if mc.vocab_size != target_vocab_size:
            raise ValueError(f"speculative_config.model {draft_model!r} has vocab_size {mc.vocab_size}, the "
                             f"target has {target_vocab_size}: a draft must share the target's tokenizer")
        self.config = mc
        self.block_size = block_size
        self.max_len = min(max_model_len, mc.max_position_embeddings)
        self.model = load_model(cfg, mc, self.max_len)
        self.device = torch.device(target.device)
        self.kv_caches = allocate_kv_caches(mc, num_blocks, block_size, target.torch_dtype, self.device)
        self.blocks = BlockManager(num_blocks, block_size)
        self._seqs: dict[str, _DraftSeq] = {}
        logger.info("draft model %s ready: %d KV blocks", draft_model, num_blocks)

    # -- bookkeeping ------------------------------------------------------------------------------

    def _state(self, rid: str, token_ids: Seq[int]) -> _DraftSeq:
        st = self._seqs.get(rid)
        if st is None:
            st = self._seqs[rid] = _DraftSeq()
            return st
        # keep the drafts the target accepted (same token at the same position): their K/V are right. The
        # last token is always recomputed (it yields the first draft), so at most L - 1 - n are kept; after an
        # ordinary verification that bound alone selects exactly the accepted drafts, and the token check
        # guards any other way the sequence could have changed
        n = st.num_computed
        keep = 0
        for d in st.written:
            if n + keep >= len(token_ids) - 1 or token_ids[n + keep] != d:
                break
            keep += 1
        st.num_computed = min(n + keep, len(token_ids) - 1)
        st.written = []
        return st

    def _ensure(self, st: _DraftSeq, num_tokens: int) -> bool:
        need = self.blocks.blocks_for(num_tokens) - len(st.block_table)
        if need <= 0:
            return True
        if not self.blocks.can_allocate(need):
            return False
        st.block_table.extend(self.blocks.allocate(need))
        return True

    def release(self, request_id: str) -> None:
        """A request ended: free its draft blocks (unknown ids are ignored)."""
        st = self._seqs.pop(request_id, None)
        if st is not None and st.block_table:
            self.blocks.free(st.block_table)

    def num_tracked(self) -> int:
        """Sequences holding draft KV (tests check that none leak)."""
        return len(self._seqs)

    # -- proposing --------------------------------------------------------------------------------

    def propose_many(self, items: Seq[tuple[str, Seq[int], int]]) -> list[list[int]]:
        """Drafts for each (request_id, token_ids, room) of the sequences decoding this step; request ids
        not listed are forgotten and their draft blocks freed. ``room`` caps that sequence's drafts."""
        live = {rid for rid, _, _ in items}
        for rid in [r for r in self._seqs if r not in live]:
            self.release(rid)
        out: list[list[int]] = [[] for _ in items]
        work = []  # (index, state, tokens, room)
        for i, (rid, toks, room) in enumerate(items):
            L = len(toks)
            room = min(room, self.max_len - L)
            if room < 1:
                continue
            st = self._state(rid, toks)
            if not self._ensure(st, L + room - 1):
                logger.debug("draft KV full: no drafts for %s this step", rid)
                continue
            work.append((i, st, toks, room))
        if not work:
            return out
        with torch.inference_mode():
            nxt = self._catch_up(work)
            for (i, st, toks, room), t in zip(work, nxt):
                out[i].append(t)
            for step in range(1, max(w[3] for w in work)):
                active = [(st, len(toks) + step - 1, out[i]) for i, st, toks, room in work if room > step]
                nxt = self._decode([(st, p, o[-1]) for st, p, o in active])
                for (st, _, o), t in zip(active, nxt):
                    st.written.append(o[-1])
                    o.append(t)
        return out

    def _run(self, ids: list[int], pos: list[int], meta: AttentionMetadata) -> list[int]:
        dev = self.device
        hidden = self.model(torch.tensor(ids, dtype=torch.long, device=dev),
                            torch.tensor(pos, dtype=torch.long, device=dev), meta, self.kv_caches)
        return self.model.compute_logits(hidden).argmax(dim=-1).tolist()

    def _slots(self, table: list[int], start: int, end: int) -> list[int]:
        bs = self.block_size
        return [table[p // bs] * bs + p % bs for p in range(start, end)]

    def _catch_up(self, work) -> list[int]:
        """One forward over each sequence's unseen tokens; the argmax at each sequence's last position."""
        dev = self.device
        ids: list[int] = []
        pos: list[int] = []
        slots: list[int] = []
        meta = AttentionMetadata(slot_mapping=None, num_decode=0, block_size=self.block_size)  # type: ignore[arg-type]
        rows: list[int] = []
        for _, st, toks, _ in work:
            p0, L = st.num_computed, len(toks)
            start = len(ids)
            ids.extend(toks[p0:L])
            pos.extend(range(p0, L))
            slots.extend(self._slots(st.block_table, p0, L))
            meta.prefills.append(PrefillSpan(start, len(ids), p0,
                                             torch.tensor(st.block_table, dtype=torch.long, device=dev)))
            rows.append(len(ids) - 1)
            st.num_computed = L
        meta.slot_mapping = torch.tensor(slots, dtype=torch.long, device=dev)
        if len(rows) != len(ids):
            meta.keep = self._decode_meta([(st, len(toks) - 1) for _, st, toks, _ in work], rows)
            meta.keep.slot_mapping = meta.slot_mapping
        return self._run(ids, pos, meta)

    def _decode(self, batch: list[tuple[_DraftSeq, int, int]]) -> list[int]:
        """One decode forward: each (state, position, token) writes its token's K/V and predicts the next."""
        meta = self._decode_meta([(st, p) for st, p, _ in batch], None)
        meta.slot_mapping = torch.tensor([self._slots(st.block_table, p, p + 1)[0] for st, p, _ in batch],
                                         dtype=torch.long, device=self.device)
        return self._run([t for _, _, t in batch], [p for _, p, _ in batch], meta)

    def _decode_meta(self, seqs: list[tuple[_DraftSeq, int]], rows) -> AttentionMetadata:
        dev = self.device
        tables = [st.block_table for st, _ in seqs]
        width = max(len(t) for t in tables)
        meta = AttentionMetadata(slot_mapping=None, num_decode=len(seqs), block_size=self.block_size,  # type: ignore[arg-type]
                                 rows=None if rows is None else torch.tensor(rows, dtype=torch.long, device=dev))
        meta.decode_block_tables = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.long,
                                                device=dev)
        meta.decode_ctx_lens = torch.tensor([p + 1 for _, p in seqs], dtype=torch.long, device=dev)
        return meta
