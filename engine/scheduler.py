"""Sequences and the continuous-batching scheduler.

Lifecycle of a sequence: ``add`` puts it at the back of the waiting queue;
``schedule`` admits it into the running batch when the step's token budget, the
seq limit and the free KV blocks allow, prefilling it in chunks of at most the
remaining budget; once its whole prompt is in the cache every step gives it one
decode token; the engine removes it with ``finish`` (stop/length/abort) or, for a
prefill-only request, ``hold``s it (out of the batch, blocks kept until
released). Decode-role requests skip the queue: ``reserve`` takes blocks for a
prompt prefilled elsewhere and ``add_prefilled`` puts it straight into the
running batch.

Priority (vLLM's priority policy; ``SamplingParams.priority``, lower first, default 0): both the waiting queue and
the running batch are kept in (priority, arrival) order, so with every priority equal everything below is plain
first-come-first-served, and otherwise "arrival order" reads "priority, then arrival order".

Policy, each step (vLLM v1 style, decode-first, mixed batches):
1. Running sequences in arrival order get their tokens first: one per decoding
   sequence, the next chunk for one still prefilling. A sequence that needs a new
   block when none is free preempts the last running sequence (the most recently
   admitted of the worst priority; recompute: its blocks are freed and it goes to
   the FRONT of the waiting queue's part of its priority with prompt + generated
   tokens to re-prefill), possibly itself. Then
   decoding sequences with speculative drafts (``spec_token_ids``) get as many
   extra positions as the leftover budget and free blocks allow (never by
   preempting; none if anyone was preempted); they run as ``verifies``.
2. If nothing was preempted, waiting sequences are admitted in FIFO order with
   the leftover budget; the first one that cannot get blocks for its chunk stops
   admission (new work waits, no overtaking). With prefix caching a sequence
   admitted with nothing computed first takes the cached blocks of its longest
   cached prefix (leaving at least its last token to compute, whose logits it
   needs) and prefills only the rest; one asking for prompt logprobs computes
   its whole prompt (vLLM does the same).
3. After the step, ``commit`` names every block that became full in the block
   manager's prefix cache.
"""
from __future__ import annotations

import enum
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Optional

from engine.block_manager import BlockKey, BlockManager, block_keys
from engine.sampling_params import SamplingParams
from engine.structured_outputs import Matcher


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    HELD = "held"          # prefill-only, done, blocks kept for hand-off
    RESERVED = "reserved"  # decode role: blocks taken, KV arriving
    FINISHED = "finished"


@dataclass
class Sequence:
    """One request's tokens, KV blocks and progress."""

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    prefill_only: bool = False
    eos_token_id: Optional[int] = None
    token_ids: list[int] = field(default_factory=list)
    """Prompt + generated so far (the sampler sees output_token_ids)."""
    output_token_ids: list[int] = field(default_factory=list)
    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0
    """Tokens whose K/V are in the cache."""
    num_prefill: int = 0
    """Tokens to prefill since (re)admission: prompt, or prompt + outputs after preemption."""
    status: SeqStatus = SeqStatus.WAITING
    num_preemptions: int = 0
    block_keys: list[BlockKey] = field(default_factory=list)
    """Prefix-cache keys of the leading full blocks of block_table that are computed."""
    num_cached_tokens: int = 0
    """Prompt tokens found in the prefix cache at the last admission."""
    spec_token_ids: list[int] = field(default_factory=list)
    """Draft tokens to verify this step (speculative decoding); set before ``schedule``, trimmed by it."""
    matcher: Optional[Matcher] = None
    """The grammar state of a structured-outputs request (``engine.structured_outputs``): it has consumed
    exactly ``output_token_ids`` (after the reasoning block, where there is one); it stays with the sequence
    through preemption and prefix-cache hits."""
    grammar_waits: bool = False
    """A structured-outputs request whose reasoning block (``params.reasoning_end_token_ids``) is still open: no
    matcher yet; the engine makes it when the block's end sequence is accepted (``engine.reasoning``)."""
    lora_slot: int = 0
    """The request's LoRA adapter slot in its engine (engine/lora.py; 0: the base model)."""
    key_root: int = 0
    """The parent hash of its first prefix-cache block: ``ROOT_HASH``, or its adapter's (``lora_key_root``)."""
    pooling: bool = False
    """An embedding request (``LLMEngine.add_request(pooling=True)``): its prompt is computed, its last token's final
    hidden state kept (``pooled``) and it ends there; its one sampled token is thrown away."""
    pooled: Optional[Any] = None
    """The pooled hidden state (float32 [hidden], on the host), set by the step that computed the last prompt token."""
    prompt_logprobs: Optional[list] = None
    """With ``params.prompt_logprobs``: entry j is the ``TokenLogprob`` of prompt token j + 1 (from position j's
    logits), filled chunk by chunk until the first output emits them (then None again)."""

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)
        self.num_prefill = len(self.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    def append(self, token_id: int) -> None:
        self.token_ids.append(token_id)
        self.output_token_ids.append(token_id)


@dataclass
class SchedulerOutput:
    """What to run this step: (sequence, number of new tokens) pairs, decodes first."""

    decodes: list[Sequence] = field(default_factory=list)
    """Sequences computing exactly one token."""
    prefills: list[tuple[Sequence, int]] = field(default_factory=list)
    """(sequence, chunk length > 1)."""
    verifies: list[Sequence] = field(default_factory=list)
    """Decoding sequences that also verify their ``spec_token_ids`` (1 + len(spec) positions each)."""
    preempted: list[Sequence] = field(default_factory=list)
    prefix_cache_queries: int = 0
    """Tokens of the sequences admitted this step with nothing computed, looked up in the prefix cache."""
    prefix_cache_hits: int = 0
    """Of those, the tokens whose K/V came from the prefix cache."""

    @property
    def is_empty(self) -> bool:
        return not self.decodes and not self.prefills and not self.verifies

    @property
    def num_tokens(self) -> int:
        n = len(self.decodes)
        if self.prefills:  # (most steps of a decode worker have none: asked twice a step, keep it cheap)
            n += sum(k for _, k in self.prefills)
        if self.verifies:
            n += sum(1 + len(s.spec_token_ids) for s in self.verifies)
        return n

    @property
    def num_prefill_tokens(self) -> int:
        """Of ``num_tokens``, the positions before each sequence's ``num_prefill`` (its prompt, or what a
        preemption left to recompute); the rest are decode positions. Read before the step advances them."""
        n = sum(min(k, max(0, s.num_prefill - s.num_computed)) for s, k in self.prefills) if self.prefills else 0
        for s in self.decodes:
            if s.num_computed < s.num_prefill:
                n += 1
        for s in self.verifies:
            if s.num_computed < s.num_prefill:
                n += 1
        return n


class Scheduler:
    """Waiting queue + running batch over one BlockManager."""

    def __init__(self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int) -> None:
        self.bm = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []
        self.held: dict[str, Sequence] = {}
        self.reserved: dict[str, Sequence] = {}
        self.num_preemptions = 0
        """Total preemptions so far (a metric, and lets tests see that preemption happened)."""
        self.prefix_cache_queries = 0
        """Tokens of sequences admitted with nothing computed (looked up in the prefix cache)."""
        self.prefix_cache_hits = 0
        """Of those, tokens whose K/V came from the prefix cache."""
        self.whole_prompts = False
        """Admit a prompt only into a step with budget for all of it (an encoder's, engine/encoder.py: attention
        is bidirectional, so a prompt is never chunked); the engine keeps the budget at least one context."""

    # -- queues ---------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        seq.status = SeqStatus.WAITING
        _insert_by_priority(self.waiting, seq)

    def add_prefilled(self, seq: Sequence) -> None:
        """A reserved sequence whose prompt KV has arrived joins the running batch."""
        seq.status = SeqStatus.RUNNING
        _insert_by_priority(self.running, seq)

    def hold(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.status = SeqStatus.HELD
        self.held[seq.request_id] = seq

    def finish(self, seq: Sequence) -> None:
        """Remove seq from wherever it is and free its blocks."""
        if seq.status == SeqStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status == SeqStatus.WAITING:
            self.waiting.remove(seq)
        elif seq.status == SeqStatus.HELD:
            del self.held[seq.request_id]
        elif seq.status == SeqStatus.RESERVED:
            del self.reserved[seq.request_id]
        if seq.block_table:
            self.bm.free(seq.block_table)
        seq.status = SeqStatus.FINISHED

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # -- the policy -----------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_tokens - seq.num_computed, budget)
            while not self.bm.ensure(seq.block_table, seq.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is seq:
                    break
            if seq.status != SeqStatus.RUNNING:
                break  # seq preempted itself: it was the last running one
            self._take(out, seq, n)
            budget -= n
            i += 1
        budget = self._add_drafts(out, budget)
        while (self.waiting and budget > 0 and not out.preempted
               and len(self.running) < self.max_num_seqs):
            seq = self.waiting[0]
            hit = self._take_cached_prefix(seq)
            n = min(seq.num_tokens - seq.num_computed, budget)
            if self.whole_prompts and n < seq.num_tokens - seq.num_computed:
                break  # (it waits for a step with room for all of it)
            if not self.bm.ensure(seq.block_table, seq.num_computed + n):
                if hit:  # give the cached blocks back: it retries from scratch next step
                    self.bm.free(seq.block_table)
                    seq.num_computed = 0
                    seq.block_keys = []
                break
            if hit is not None:
                out.prefix_cache_queries += seq.num_tokens
                out.prefix_cache_hits += seq.num_computed
            self.waiting.popleft()
            seq.status = SeqStatus.RUNNING
            _insert_by_priority(self.running, seq)
            self._take(out, seq, n)
            budget -= n
        self.prefix_cache_queries += out.prefix_cache_queries
        self.prefix_cache_hits += out.prefix_cache_hits
        return out

    def _add_drafts(self, out: SchedulerOutput, budget: int) -> int:
        """Second pass over this step's decodes: a sequence with drafts verifies as many as the budget and the
        free blocks left allow, once every running sequence has its own token (so drafts never preempt
        anyone, and are dropped when either is short or someone was preempted). Returns the budget left."""
        if not any(s.spec_token_ids for s in self.running):
            return budget  # no speculation this step (or at all): nothing to do
        decoding = {id(s) for s in out.decodes}
        for seq in self.running:
            if id(seq) not in decoding:
                seq.spec_token_ids.clear()  # not decoding this step: no stale drafts
        plain = []
        for seq in out.decodes:
            spec = seq.spec_token_ids
            del spec[budget:]
            if spec and not out.preempted and self.bm.ensure(seq.block_table, seq.num_computed + 1 + len(spec)):
                out.verifies.append(seq)
                budget -= len(spec)
            else:
                spec.clear()
                plain.append(seq)
        out.decodes = plain
        return budget

    def _take_cached_prefix(self, seq: Sequence) -> Optional[int]:
        """Give a sequence with nothing computed the cached blocks of its longest cached prefix.

        Returns how many blocks it got, or None when no lookup was made (caching off, or the
        sequence already has K/V)."""
        if not self.bm.enable_caching or seq.num_computed or seq.block_table:
            return None
        if seq.prompt_logprobs is not None:
            return None  # it needs the logits of every prompt position, which a cached block does not have
        bs = self.bm.block_size
        keys = block_keys(seq.token_ids, bs, (seq.num_tokens - 1) // bs, root=seq.key_root)
        blocks = self.bm.lookup(keys)
        if not seq.output_token_ids:  # what the request reports: its first admission, not a recompute
            seq.num_cached_tokens = len(blocks) * bs
        if not blocks:
            return 0
        seq.block_table = self.bm.acquire(blocks)
        seq.block_keys = keys[:len(blocks)]
        seq.num_computed = len(blocks) * bs
        return len(blocks)

    def commit(self, sched: SchedulerOutput) -> None:
        """After a step: name the blocks its sequences filled in the prefix cache."""
        if not self.bm.enable_caching:
            return
        bs = self.bm.block_size
        for seq in [*sched.decodes, *(s for s, _ in sched.prefills), *sched.verifies]:
            self.commit_seq(seq, bs)

    def commit_seq(self, seq: Sequence, bs: int) -> None:
        full = min(seq.num_computed // bs, len(seq.block_table))
        have = len(seq.block_keys)
        if full <= have:
            return
        parent = seq.block_keys[-1] if have else None
        new = block_keys(seq.token_ids[have * bs:full * bs], bs, full - have, parent, root=seq.key_root)
        for i, key in enumerate(new, have):
            self.bm.register(seq.block_table[i], key)
        seq.block_keys.extend(new)

    @staticmethod
    def _take(out: SchedulerOutput, seq: Sequence, n: int) -> None:
        # one output token is a decode; a prompt's last token alone (a chunk cut one short of it, a prefix-cache
        # hit on all the rest, a one-token prompt) stays a prefill chunk: it runs the prefill kernels as it would
        # have inside a longer chunk, so where the scheduler cut the prompt changes none of its bits
        if n == 1 and seq.num_computed >= len(seq.prompt_token_ids):
            out.decodes.append(seq)
        else:
            out.prefills.append((seq, n))

    def _preempt(self, seq: Sequence) -> None:
        """Recompute preemption: drop the KV, re-prefill prompt + outputs later, ahead of new work."""
        self.running.remove(seq)
        seq.spec_token_ids.clear()
        self.bm.free(seq.block_table)
        seq.num_computed = 0
        seq.block_keys = []
        seq.num_prefill = seq.num_tokens
        seq.num_preemptions += 1
        self.num_preemptions += 1
        seq.status = SeqStatus.WAITING
        _insert_by_priority(self.waiting, seq, ahead=True)


def _insert_by_priority(queue: "deque[Sequence] | list[Sequence]", seq: Sequence, ahead: bool = False) -> None:
    """Put ``seq`` into a queue kept in priority order (lower ``params.priority`` first): after every sequence of
    its priority or better (arrival order within a priority), or with ``ahead`` (a preempted one) before every
    one of its priority or worse. With every priority equal (the default 0) this is append / appendleft."""
    p = seq.params.priority
    if ahead:
        i = 0
        while i < len(queue) and queue[i].params.priority < p:
            i += 1
    else:
        i = len(queue)
        while i > 0 and queue[i - 1].params.priority > p:
            i -= 1
    queue.insert(i, seq)


def check_stop(seq: Sequence, max_model_len: int) -> Optional[str]:
    """Finish reason after seq's newest token, or None to keep going (stop strings are not checked here)."""
    p = seq.params
    tok = seq.output_token_ids[-1]
    n_out = len(seq.output_token_ids)
    if n_out >= p.min_tokens:
        if not p.ignore_eos and seq.eos_token_id is not None and tok == seq.eos_token_id:
            return "stop"
        if tok in p.stop_token_ids:
            return "stop"
    if n_out >= p.max_tokens or seq.num_tokens >= max_model_len:
        return "length"
    return None


