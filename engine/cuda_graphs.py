"""Decode steps replayed from CUDA graphs, one graph per batch-size bucket.

Lifecycle: ``LLMEngine`` builds one ``DecodeGraphs`` per engine when it runs on CUDA with ``enforce_eager`` off and
one rank (or, on any device, when ``static_decode_buffers`` asks for the same path without capture), after the KV
cache exists and before the first request; ``capture`` then records, for every bucket of ``cuda_graph_sizes``
(largest first, all in one memory pool), the model's forward and LM head over static input buffers: token ids,
positions, slot mapping, block tables and context lengths. Each pure decode step (single-token decodes and
speculative verification rows, every row sampling, no prefill chunk) whose row count fits a bucket is then
``run``: the step's rows are copied into the buffers, the rest of the bucket padded, and the bucket's graph
replayed; the logits of the real rows come back (a view of the graph's output, valid until the next step) and are
sampled eagerly as before. Every other step runs eagerly. Nothing is captured again: buffers and graphs live as
long as the engine.

Padding rows are single-token decodes of position 0 whose K/V go to a scratch block that no sequence owns (the
engine allocates its cache one block larger than the block manager's pool, ``scratch_block``), with a context of
that one row: they read and write nothing of any request. Block-table columns past a step's widest row keep
earlier steps' block ids (always valid indices); every kernel masks keys at or past a row's context length, so they
are never read. A graph's decode attention therefore has to read K/V through the block tables with the lengths
read on the device: pdserve's Triton kernel on CUDA (engine/triton_kernels.py). Where it cannot run (``eager_reason``:
no Triton, an int8 cache, a head_dim it does not take) the engine captures nothing and says why once: the gather +
SDPA fallback would be correct, but would gather the whole table width, ``max_model_len`` keys a row, every step.
Captured graphs hold memory: ``graph_memory_estimate`` of it is taken out of ``kv_cache_memory_bytes`` before the
cache is sized, and the capture logs what it really took.

Without capture (``capture=False``: ``static_decode_buffers`` on any device, what the CPU tests use) ``run``
calls the same forward on the same buffers each step, so bucketing, padding and buffer bookkeeping are checked
where no GPU is; a captured graph replays exactly those ops.
"""
from __future__ import annotations

import gc
import logging
import time
from typing import Any, Callable, Optional, Sequence

import torch
from torch import Tensor

from engine.attention import AttentionMetadata
from engine.config import ModelConfig
from engine.model import CausalLM

log = logging.getLogger(__name__)


GRAPH_POOL_SLACK = 2 * 20 * 2**20
"""Bytes added once to the graphs' estimate for the CUDA caching allocator's granularity: a graph pool reserves
whole segments (2 MiB for small blocks, 20 MiB for blocks of 1-10 MiB) whatever its blocks need, and the
warm-up's temporaries may take fresh segments of the general pool. On a small model this is most of what the graphs
take; on a 1B one it is little beside the KV budget."""


def graph_memory_estimate(mc: ModelConfig, max_bucket: int, dtype: torch.dtype, max_blocks: int) -> int:
    """Bytes the decode graphs are expected to hold (taken out of ``kv_cache_memory_bytes`` before the cache is
    sized): the graph pool keeps the largest bucket's peak activations (the logits in the model dtype and in
    float32, one layer's projections, attention output, MLP and residual rows), doubled for the caching
    allocator's rounding, plus the static input buffers. The capture logs what it really took beside it."""
    elem = torch.empty((), dtype=dtype).element_size()
    per_row = (mc.vocab_size * (4 + elem)
               + (3 * mc.intermediate_size + (2 * mc.num_attention_heads + 2 * mc.num_key_value_heads) * mc.head_dim
                  + 4 * mc.hidden_size) * elem)
    buffers = max_bucket * (4 + max_blocks) * 8  # ids, positions, slots, lengths and the block tables, int64
    return 2 * max_bucket * per_row + buffers


def eager_reason(device: torch.device, dtype: torch.dtype, cache_dtype: torch.dtype, head_dim: int) -> Optional[str]:
    """Why a CUDA engine should not capture decode graphs, or None. Captured decode attention must read K/V through
    the block tables (pdserve's Triton kernel); the gather + SDPA fallback would gather every row's whole table
    width, ``max_model_len`` keys, each step: slower than eager, so the engine stays eager there (logged once)."""
    if cache_dtype not in (dtype, torch.float8_e4m3fn):
        return f"the {str(cache_dtype).removeprefix('torch.')} KV cache has no Triton decode kernel"
    if head_dim & (head_dim - 1) or not 16 <= head_dim <= 256:
        return f"head_dim {head_dim} is not a power of 2 in 16..256 (the Triton decode kernel's)"
    from engine import triton_kernels

    if not triton_kernels.available(device):
        return "Triton is not available (not installed, or PDSERVE_TRITON_KERNELS=0)"
    return None


class GraphBuckets:
    """What the decode graphs and the piecewise graphs (engine/piecewise_graphs.py) share: the sorted buckets, the
    smallest one holding a count, and capture with its bookkeeping."""

    def __init__(self, sizes: Sequence[int], capture: bool, device: torch.device) -> None:
        self.sizes = sorted(sizes)
        self.capture_graphs = capture
        self.device = device
        self.capture_seconds = 0.0
        self.memory_bytes = 0
        """Device memory the graphs took (the CUDA caching allocator's reserved bytes before and after capture)."""
        self.replays = 0
        """Steps run through a bucket (captured or static)."""

    @property
    def max_size(self) -> int:
        return self.sizes[-1]

    def bucket_for(self, count: int) -> Optional[int]:
        """The smallest bucket holding ``count`` rows or tokens; None past the largest (the step runs eagerly)."""
        for s in self.sizes:
            if s >= count:
                return s
        return None

    def _capture(self, run: Callable[[int], None], record: Callable[[int, Any], None]) -> None:
        """Every bucket, largest first (the smaller ones reuse the pool's memory): ``run(size)`` once each as a
        warm-up off the default stream (Triton compiles per shape; torch's graph docs ask for a side stream), then
        ``record(size, pool)`` captures it into one shared pool. Without ``capture_graphs`` only ``run`` (checking
        the buffers, warming the kernels)."""
        t0 = time.perf_counter()
        if not self.capture_graphs:
            for s in reversed(self.sizes):
                run(s)
            self.capture_seconds = time.perf_counter() - t0
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            for s in reversed(self.sizes):
                run(s)
        torch.cuda.current_stream(self.device).wait_stream(stream)
        # what the pool takes: reserved memory from here on (the warm-ups' freed temporaries released first, as
        # ``torch.cuda.graph`` itself releases them when a capture starts; measured before the warm-ups, an H200
        # run saw a negative size)
        torch.cuda.synchronize(self.device)
        gc.collect()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved(self.device)
        for s in reversed(self.sizes):
            record(s, pool)
        torch.cuda.synchronize(self.device)
        self.memory_bytes = torch.cuda.memory_reserved(self.device) - before
        self.capture_seconds = time.perf_counter() - t0


class DecodeGraphs(GraphBuckets):
    """Static decode buffers, one bucket per batch size, and (``capture``) one CUDA graph per bucket."""

    def __init__(self, model: CausalLM, kv_caches: list[tuple[Tensor, Tensor]], block_size: int,
                 sizes: Sequence[int], max_model_len: int, scratch_block: int, capture: bool) -> None:
        super().__init__(sizes, capture, model.embed_tokens.weight.device)
        self.model = model
        self.kv_caches = kv_caches
        self.block_size = block_size
        self.scratch_block = scratch_block
        n, dev = self.sizes[-1], self.device
        self.max_blocks = -(-max_model_len // block_size)
        self.input_ids = torch.zeros(n, dtype=torch.long, device=dev)
        self.positions = torch.zeros(n, dtype=torch.long, device=dev)
        self.slot_mapping = torch.full((n,), scratch_block * block_size, dtype=torch.long, device=dev)
        self.block_tables = torch.full((n, self.max_blocks), scratch_block, dtype=torch.long, device=dev)
        self.ctx_lens = torch.ones(n, dtype=torch.long, device=dev)
        # the block tables' host mirror, rewritten row by row only where a row's table changed (a row's table is
        # re-sent whole only when its sequence or its blocks changed; a new block appends one entry): converting
        # every row's list each step cost ~2 ms at 256 rows of 2K-token contexts. Pinned on CUDA; the device copy
        # goes from ``_stage``, which the next step refills only once that copy is done (``_staged``).
        self._host_tables = torch.full((n, self.max_blocks), scratch_block, dtype=torch.long)
        self._stage: Optional[Tensor] = None
        """CUDA: a pinned buffer the step's [size, width] tables are packed into for one asynchronous copy."""
        self._staged: Optional["torch.cuda.Event"] = None
        """CUDA: recorded after the staging buffer's copy; the next step waits for it before refilling the buffer."""
        if dev.type == "cuda":
            self._host_tables = self._host_tables.pin_memory()
            self._stage = torch.empty(n * self.max_blocks, dtype=torch.long).pin_memory()
        self._host_rows: list[Optional[list[int]]] = [None] * n
        """Per row: a copy of the table the mirror holds (None: the row holds padding)."""
        self.graphs: dict[int, "torch.cuda.CUDAGraph"] = {}
        self.outputs: dict[int, Tensor] = {}
        """Each bucket's logits [bucket, vocab] float32: the graph's output buffer (capture) or the last run's."""

    def capture(self) -> None:
        """Record every bucket's graph (``GraphBuckets._capture``); uncaptured, run each bucket once."""
        self._capture(self._forward, self._record)

    def _record(self, size: int, pool: Any) -> None:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=pool):
            self.outputs[size] = self._forward(size)
        self.graphs[size] = g

    def _forward(self, size: int) -> Tensor:
        """The model over the first ``size`` rows of the buffers, to float32 logits. A fresh metadata each call:
        its lazily built masks are then computed from the buffers inside the recorded ops, not cached from a
        warm-up."""
        meta = AttentionMetadata(slot_mapping=self.slot_mapping[:size], num_decode=size, block_size=self.block_size,
                                 decode_block_tables=self.block_tables[:size], decode_ctx_lens=self.ctx_lens[:size])
        with torch.inference_mode():
            hidden = self.model(self.input_ids[:size], self.positions[:size], meta, self.kv_caches)
            return self.model.compute_logits(hidden)

    def run(self, input_ids: list[int], positions: list[int], slots: list[int], tables: list[list[int]],
            ctx_lens: list[int], carry: Optional[tuple[list[int], Tensor, list[int]]] = None) -> Tensor:
        """Logits [rows, vocab] of one decode step of these rows (at most ``max_size``): copied into the buffers,
        padded to their bucket, replayed (or, uncaptured, run on the buffers).

        ``carry`` (an async engine: engine/llm_engine.py): ``(rows, tokens, indices)``: the input ids of these rows
        are ``tokens[indices]``, a tensor on the device that the previous step's sampler is still filling; their
        entries in ``input_ids`` are placeholders. The copy is enqueued after that step's draw and before this
        replay, so the host never reads them."""
        rows = len(input_ids)
        size = self.bucket_for(rows)
        if size is None or rows == 0:
            raise ValueError(f"a graph step holds 1..{self.max_size} rows, got {rows}")
        pad = size - rows
        width = max(len(t) for t in tables)
        scratch_slot = self.scratch_block * self.block_size
        n_carry = len(carry[0]) if carry else 0
        host = torch.tensor(input_ids + [0] * pad + positions + [0] * pad + slots + [scratch_slot] * pad
                            + ctx_lens + [1] * pad + (carry[0] + carry[2] if carry else []), dtype=torch.long)
        nb = self.device.type == "cuda"
        if self._staged is not None:
            # the previous step's tables may still be on their way up from the staging buffer (an async engine
            # launches this step before it waited for that one): that copy is the first thing that step did
            self._staged.synchronize()
        self._update_tables(tables, size)
        if nb:
            host = host.pin_memory()
        if n_carry:
            moved = host[4 * size:].to(self.device, non_blocking=nb)
            host = host[:4 * size]
        host = host.view(4, size)
        self.input_ids[:size].copy_(host[0], non_blocking=nb)
        if n_carry:
            self.input_ids.index_copy_(0, moved[:n_carry], carry[1].index_select(0, moved[n_carry:]))
        self.positions[:size].copy_(host[1], non_blocking=nb)
        self.slot_mapping[:size].copy_(host[2], non_blocking=nb)
        self.ctx_lens[:size].copy_(host[3], non_blocking=nb)
        if self._stage is not None:  # packed contiguous and pinned: the copy to the device is one async transfer
            stage = self._stage[:size * width].view(size, width)
            stage.copy_(self._host_tables[:size, :width])
            self.block_tables[:size, :width].copy_(stage, non_blocking=True)
            if self._staged is None:
                self._staged = torch.cuda.Event()
            self._staged.record(torch.cuda.current_stream(self.device))
        else:
            self.block_tables[:size, :width].copy_(self._host_tables[:size, :width])
        self.replays += 1
        if self.capture_graphs:
            self.graphs[size].replay()
            return self.outputs[size][:rows]
        self.outputs[size] = self._forward(size)
        return self.outputs[size][:rows]

    def _update_tables(self, tables: list[list[int]], size: int) -> None:
        """Bring the host mirror's first ``size`` rows to ``tables`` (then padding rows of the scratch block),
        converting only what changed: a row whose table still starts with what the mirror holds gets its new
        entries; any other change (another sequence in the row, a table trimmed or refilled) rewrites the row.
        Compared by content (an unchanged entry is the same int object in the copy, so the compare is cheap)."""
        host, held = self._host_tables, self._host_rows
        for i, t in enumerate(tables):
            old = held[i]
            n, k = len(t), 0 if old is None else len(old)
            if old is not None and n >= k and (t == old if n == k else t[:k] == old):
                if n == k:
                    continue
                host[i, k:n] = torch.tensor(t[k:], dtype=torch.long)
            else:
                host[i, :n] = torch.tensor(t, dtype=torch.long)
            held[i] = t[:]
        for i in range(len(tables), size):
            if held[i] is not None:
                host[i].fill_(self.scratch_block)
                held[i] = None

    def describe(self) -> str:
        return (f"{len(self.sizes)} decode buckets ({self.sizes[0]}..{self.max_size} rows) "
                f"{'captured' if self.capture_graphs else 'static, not captured'} in {self.capture_seconds:.2f} s"
                + (f", {self.memory_bytes / 2**20:.0f} MiB" if self.capture_graphs else ""))
