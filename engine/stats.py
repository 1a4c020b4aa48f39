"""The engine's stats records: plain data its consumers (worker metrics, the simulator, benchmarks) read.

Lifecycle (vLLM v1's shape, ``vllm/v1/metrics/stats.py``): every ``LLMEngine.step()`` that runs a batch
emits one ``IterationStats``, what that step did (tokens by phase, preemptions, prefix-cache lookups,
speculative drafts), kept as ``engine.last_step_stats`` until the next step replaces it. At any moment,
``engine.make_stats()`` returns a ``SchedulerStats``: the engine's state now (running and waiting requests,
KV blocks) and its running totals since it was built, the last step's record included. A consumer that
reads it once per loop pass (a worker's metrics) turns the totals into counter increments by their
difference since its last read, so a missed read loses nothing.

Both records are frozen: a consumer may keep one while the engine goes on. Nothing here imports the model
stack; an engine without a model (``LLMEngine.with_runner``, the simulator) emits the same records.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:  # annotations only: the records stay importable without the engine
    from engine.llm_engine import LLMEngine
    from engine.scheduler import SchedulerOutput
    from engine.speculative import SpecDecodeStats


@dataclass(frozen=True, slots=True)
class IterationStats:
    """What one engine step computed (a step that ran a batch; an empty schedule is no step)."""

    num_prefill_tokens: int = 0
    """Positions of a prompt (or of a preempted sequence's recompute) computed this step."""
    num_decode_tokens: int = 0
    """Positions past the prompt: one per decoding sequence, plus each verified draft token."""
    num_running: int = 0
    """Sequences in this step's batch."""
    num_preemptions: int = 0
    """Sequences this step's schedule preempted (recompute)."""
    prefix_cache_queries: int = 0
    """Tokens of the sequences admitted this step with nothing computed, looked up in the prefix cache."""
    prefix_cache_hits: int = 0
    """Of those, the tokens whose K/V was reused."""
    spec_num_drafts: int = 0
    """Sequences that verified drafts this step."""
    spec_num_draft_tokens: int = 0
    """Draft tokens verified this step."""
    spec_num_accepted_tokens: int = 0
    """Of those, the tokens accepted."""

    @property
    def num_scheduled_tokens(self) -> int:
        """Every position computed this step (vLLM's ``iteration_tokens_total`` observation)."""
        return self.num_prefill_tokens + self.num_decode_tokens

    @classmethod
    def of(cls, sched: "SchedulerOutput", num_tokens: int, num_prefill_tokens: int,
           spec_before: tuple[int, int, int], spec_after: tuple[int, int, int]) -> "IterationStats":
        """The record of the step that ran ``sched``: its token counts as read before the step advanced its
        sequences (and dropped rejected drafts), and the speculative counts (drafts, draft tokens, accepted
        tokens: ``SpecDecodeStats.counts()``) before and after postprocessing."""
        (d0, t0, a0), (d1, t1, a1) = spec_before, spec_after
        return cls(num_prefill_tokens=num_prefill_tokens, num_decode_tokens=num_tokens - num_prefill_tokens,
                   num_running=len(sched.decodes) + len(sched.prefills) + len(sched.verifies),
                   num_preemptions=len(sched.preempted), prefix_cache_queries=sched.prefix_cache_queries,
                   prefix_cache_hits=sched.prefix_cache_hits,
                   spec_num_drafts=d1 - d0, spec_num_draft_tokens=t1 - t0, spec_num_accepted_tokens=a1 - a0)


@dataclass(frozen=True, slots=True)
class SpecDecodeTotals:
    """Speculative-decoding running totals, frozen (``engine.speculative.SpecDecodeStats`` is the live one)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: tuple[int, ...] = ()
    """accepted_per_pos[i]: times the draft at position i was accepted."""

    @classmethod
    def of(cls, live: "SpecDecodeStats") -> "SpecDecodeTotals":
        return cls(live.num_drafts, live.num_draft_tokens, live.num_accepted_tokens, tuple(live.accepted_per_pos))


@dataclass(frozen=True, slots=True)
class SchedulerStats:
    """The engine's state now and its running totals since it was built (``LLMEngine.make_stats``)."""

    num_running: int
    """Requests in the running batch."""
    num_waiting: int
    """Requests queued for admission (preempted ones included)."""
    num_free_blocks: int
    num_total_blocks: int
    num_steps: int
    """Steps that ran a batch."""
    num_scheduled_tokens: int
    """Positions computed over those steps."""
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec_decode: SpecDecodeTotals = SpecDecodeTotals()
    graph_steps: int = 0
    """Of ``num_steps``, those whose model ran through a decode CUDA graph bucket."""
    piecewise_steps: int = 0
    """Of ``num_steps``, those whose model ran through the piecewise graphs (the rest ran eagerly)."""
    ahead_steps: int = 0
    """Of ``num_steps``, those launched before the step in flight was read back (async scheduling)."""
    last_step: Optional[IterationStats] = None
    """The latest step's record (None before the first step)."""
    running_lora_adapters: tuple[str, ...] = ()
    """The LoRA adapters of the running requests (sorted, each once): vLLM's ``lora_requests_info`` labels."""
    waiting_lora_adapters: tuple[str, ...] = ()
    """The LoRA adapters of the waiting requests."""
    num_lora_adapters: int = 0
    """Adapters the engine holds (serving or draining)."""

    @classmethod
    def of(cls, engine: "LLMEngine") -> "SchedulerStats":
        """``engine``'s record now (``LLMEngine.make_stats``)."""
        return cls(num_running=engine.num_running, num_waiting=engine.num_waiting,
                   num_free_blocks=engine.num_free_blocks, num_total_blocks=engine.num_total_blocks,
                   num_steps=engine.num_steps, num_scheduled_tokens=engine.num_scheduled_tokens,
                   num_preemptions=engine.num_preemptions, prefix_cache_queries=engine.prefix_cache_queries,
                   prefix_cache_hits=engine.prefix_cache_hits, spec_decode=SpecDecodeTotals.of(engine.spec_stats),
                   graph_steps=engine.graph_steps, piecewise_steps=engine.piecewise_steps,
                   ahead_steps=engine.ahead_steps,
                   last_step=engine.last_step_stats, **engine.lora_requests())

    @property
    def kv_cache_usage(self) -> float:
        """Fraction of KV blocks in use, 0..1 (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - self.num_free_blocks / max(1, self.num_total_blocks)
