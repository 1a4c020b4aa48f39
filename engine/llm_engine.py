"""LLMEngine: the model runtime core that the offline LLM and both worker roles wrap.

Lifecycle: ``LLMEngine(EngineConfig)`` loads the model and tokenizer, sizes and
allocates the paged KV cache, and builds the scheduler and the model runner.
Callers then ``add_request`` (or, on a decode worker, ``reserve`` +
``add_prefilled_request``) and call ``step()`` in a loop while
``has_unfinished_requests()``; each step is schedule -> run -> postprocess and
returns one ``CoreOutput`` per request that produced a token or finished.
With ``speculative_config`` set, each step first proposes draft tokens for the
decoding sequences (``engine.speculative``), the runner verifies them in the
same forward, and a sequence may advance by several tokens per step (a
``CoreOutput`` then carries them all); blocks only rejected drafts used are
freed at once.
Each step that runs a batch leaves its ``IterationStats`` in ``last_step_stats``;
``make_stats()`` returns a ``SchedulerStats`` (state now, running totals) for
metrics (``engine.stats``).
A request with ``SamplingParams.structured_outputs`` gets a grammar matcher on
its sequence (``engine.structured_outputs``), built from the constraint plus
the tokens it already has (a decode worker's first token, a migration's
``resume_token_ids``); the runner masks its sampling rows, drafts the grammar
rejects are cut before verification, each accepted token advances the matcher
and the request finishes with "stop" once the grammar is complete. A request whose answer opens with a
reasoning block (``SamplingParams.reasoning_end_token_ids``, ``engine.reasoning``) gets its matcher only when
the block closes: the grammar constrains the answer after the thinking.
A thread may change the engine beside a running step: an owner that serializes calls into the engine with a
lock (``worker_common.engine_loop``) sets it as ``owner_lock``; ``step()`` releases it while the model runs
(and takes it back before touching requests or blocks again), so a decode worker's ``reserve_prompt`` is
answered during the forward instead of after it.
With ``async_scheduling`` (engine/config.py) each step is launched and left running: the next ``step()`` schedules
and launches the step after it (each sequence's unread token a placeholder, its id read on the device), then reads
the first one back and returns its outputs, so outputs come one call later and a sequence that stopped has one
wasted token computed (its blocks freed when that step is done); a step that cannot run ahead (``_can_run_ahead``)
waits for the one in flight first.
Finished requests free their blocks at once; prefill-only requests keep theirs
(finish_reason "prefill_done") until ``release``; ``abort_request`` frees
everything a request holds, wherever it is. Token ids only: text, stop strings
and detokenization live in ``engine.detokenizer``.
"""
from __future__ import annotations

import dataclasses
import logging
import numbers
import threading
import time
from dataclasses import dataclass, field, replace
from typing import Callable, Iterable, Optional, TypeVar

import torch
from torch import Tensor

from engine.block_manager import BlockManager, block_keys, salted_root
from engine.client import EngineLoad, StepResult
from engine.config import EngineConfig, ModelConfig, default_graph_sizes, default_token_sizes
from engine.kernels import cpu_kernels
from engine.cuda_graphs import GRAPH_POOL_SLACK, DecodeGraphs, eager_reason, graph_memory_estimate
from engine.piecewise_graphs import PiecewiseGraphs, piecewise_memory_estimate
from engine.kv_cache import allocate_kv_caches, num_blocks_for_budget
from engine.loader import (default_eos, load_model, load_model_config, load_pooling_config, load_prequantized,
                           load_tokenizer)
from engine.lora import (LoRASet, attach_adapter, check_lora_name, detach_adapter, load_adapter, load_adapters,
                         shard_adapter)
from engine.model_runner import ModelRunner, PendingStep, RunnerOutput
from engine.outputs import CoreOutput, TokenLogprob
from engine.pooling import PoolingConfig
from engine.sampler import Sampler
from engine.reasoning import drafts_before_end, ends_with, find_end
from engine.sampling_params import SamplingParams, bad_words_token_ids
from engine.scheduler import Scheduler, SchedulerOutput, SeqStatus, Sequence, check_stop
from engine.speculative import NgramProposer, SpecDecodeStats, accept
from engine.structured_outputs import GrammarCompiler
from engine.stats import IterationStats, SchedulerStats

logger = logging.getLogger(__name__)
T = TypeVar("T")


PLACEHOLDER = -1
"""A run-ahead step's stand-in for a token still on the device (never a model input: the runner reads the real id
there; an embedding of -1 would fail loudly)."""


def encoder_engine_config(config: EngineConfig, mc: ModelConfig) -> EngineConfig:
    """The config an encoder (engine/encoder.py) runs with: every prompt whole in one step (the step budget raised
    to the context where it is smaller), no prefix cache, eager steps, a KV block pool that only meters the tokens
    in flight (unless ``num_kv_blocks`` says otherwise); ValueError naming what an encoder cannot do."""
    refused = [name for name, on in (("tensor_parallel_size > 1", config.tensor_parallel_size > 1),
                                     ("quantization", config.quantization is not None),
                                     ("kv_cache_dtype", config.kv_cache_dtype != "auto"),
                                     ("lora_modules", bool(config.lora_modules)),
                                     ("speculative_config", config.speculative_config is not None)) if on]
    if refused:
        raise ValueError(f"{refused[0]}: not available for an encoder ({mc.architecture}), which serves embeddings "
                         "and scores on one device, unquantized")
    max_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
    budget = max(config.max_num_batched_tokens, max_len)
    if budget != config.max_num_batched_tokens:
        logger.info("encoder: max_num_batched_tokens raised to %d, one whole prompt of the context (attention is "
                    "bidirectional: prompts are not chunked)", budget)
    blocks = config.num_kv_blocks or -(-budget // config.block_size) + config.max_num_seqs
    return replace(config, enable_prefix_caching=False, enforce_eager=True, static_decode_buffers=False,
                   async_scheduling=False, max_num_batched_tokens=budget, num_kv_blocks=blocks,
                   cuda_graph_token_sizes=None)


@dataclass
class _InFlight:
    """A step launched and not read back (async scheduling)."""

    pending: PendingStep
    seq_ids: set[int]
    """id() of every sequence it computes (it holds them, so the ids stay theirs): their blocks are in use."""
    sampled: set[int]
    """id() of those that sample in it: each has a token the host has not read."""
    deferred: list[list[int]] = field(default_factory=list)
    """Block tables of its sequences that ended while it ran: freed once it is done (the device still writes them)."""
    ahead: bool = False
    """The next step was scheduled before this one was read: each of its live sequences has a placeholder."""


class LLMEngine:
    """Continuous-batching engine over a paged KV cache (see docs/interfaces.md)."""

    def __init__(self, config: EngineConfig) -> None:
        if not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        self.config = config
        if config.num_threads is not None:
            torch.set_num_threads(config.num_threads)
        self.model_config: ModelConfig = load_model_config(config)
        mc = self.model_config
        if mc.is_encoder:  # (engine/encoder.py: whole prompts, no prefix cache, no graphs, its few blocks)
            config = self.config = encoder_engine_config(config, mc)
        self.prequantized = load_prequantized(config)
        """The checkpoint's own quantization (engine/prequantized.py: GPTQ or compressed-tensors int4), or None."""
        if self.prequantized is not None and mc.is_encoder:
            raise ValueError(f"model: a {self.prequantized.describe()} encoder checkpoint is not loaded (encoders are "
                             "served unquantized)")
        if self.prequantized is not None:
            refused = [name for name, on in (("quantization", config.quantization is not None),
                                             ("device 'cuda'", torch.device(config.device).type == "cuda")) if on]
            if refused:
                raise ValueError(f"{refused[0]}: not available with a {self.prequantized.describe()} checkpoint "
                                 "(it loads as it is, on CPU: leave quantization unset, or serve the float "
                                 "checkpoint)")
            if config.tensor_parallel_size > 1 and self.prequantized.group_size:  # (groups may not straddle ranks)
                from engine.tensor_parallel import check_tensor_parallel

                check_tensor_parallel(mc, config.tensor_parallel_size, device=config.device, quantization="int4",
                                      group_size=self.prequantized.group_size)
        self.block_size = config.block_size
        device = torch.device(config.device)
        cache_dtype = config.cache_dtype
        self.kv_cache_dtype = str(cache_dtype).removeprefix("torch.")
        """The KV cache tensors' dtype by name ('float32', 'int8', ...): what a KV transfer peer must match."""
        fp8 = [name for name in ("kv_cache_dtype", "quantization") if getattr(config, name) == "fp8"]
        if fp8 and device.type == "cuda" and (cap := torch.cuda.get_device_capability(device)) < (8, 9):
            raise ValueError(f"{fp8[0]}='fp8' needs a GPU with FP8 (compute capability 8.9+: Ada, Hopper); "
                             f"{torch.cuda.get_device_name(device)} is {cap[0]}.{cap[1]}")
        if config.batch_invariant and device.type == "cuda":
            from engine import triton_kernels

            if not triton_kernels.available(device):
                raise ValueError("batch_invariant on CUDA needs pdserve's Triton kernels: triton is not installed, or "
                                 "PDSERVE_TRITON_KERNELS=0")
        tp = config.tensor_parallel_size
        if tp > 1:  # cheap checks first: a split that cannot work fails before anything loads
            from engine.tensor_parallel import TPLayout, check_tensor_parallel

            check_tensor_parallel(mc, tp, device=config.device, quantization=config.quantization,
                                  group_size=config.quantization_group_size)
            if config.num_threads is None:
                from engine.tensor_parallel import rank_threads

                torch.set_num_threads(rank_threads(config))
        # the KV heads this process holds (one rank's share where the model is split) size the cache
        local_mc = TPLayout(mc, tp, 0).local_config() if tp > 1 else mc
        # decode graphs (engine/cuda_graphs.py) pad a batch with rows whose K/V go to one scratch block past the
        # block manager's pool; captured ones hold memory the KV budget gives up
        graphs = tp == 1 and not config.enforce_eager and (device.type == "cuda" or config.static_decode_buffers)
        if graphs and mc.num_experts:  # (its experts are chosen on the host each step: nothing to capture)
            logger.info("decode graphs off for a mixture-of-experts model: every step eager")
            graphs = False
        capture = graphs and device.type == "cuda" and not config.static_decode_buffers
        if capture:
            why = eager_reason(device, config.torch_dtype, cache_dtype, local_mc.head_dim)
            if why is not None:
                logger.warning("decode graphs off, every step eager: %s", why)
                graphs = capture = False
        graph_sizes = config.cuda_graph_sizes or default_graph_sizes(config.max_num_seqs)
        token_sizes = (config.cuda_graph_token_sizes if config.cuda_graph_token_sizes is not None
                       else default_token_sizes(config.max_num_batched_tokens)) if graphs else []
        budget = config.kv_cache_memory_bytes
        self.graph_memory_estimate = 0
        """Bytes of ``kv_cache_memory_bytes`` left to the decode graphs (0: none captured, or a fixed block count)."""
        if capture and config.num_kv_blocks is None:
            max_len = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
            self.graph_memory_estimate = graph_memory_estimate(local_mc, graph_sizes[-1], config.torch_dtype,
                                                               -(-max_len // self.block_size))
            if token_sizes:
                self.graph_memory_estimate += piecewise_memory_estimate(local_mc, token_sizes[-1], config.torch_dtype)
            self.graph_memory_estimate += GRAPH_POOL_SLACK
            budget -= self.graph_memory_estimate
            if budget <= 0:
                raise ValueError(f"kv_cache_memory_bytes={config.kv_cache_memory_bytes} leaves nothing for the KV "
                                 f"cache after the decode graphs' {self.graph_memory_estimate} bytes (raise it, or "
                                 "enforce_eager)")
        n_blocks = config.num_kv_blocks or num_blocks_for_budget(local_mc, self.block_size, cache_dtype, budget)
        self.num_total_blocks = n_blocks
        # one sequence alone must always fit, so a sequence never waits forever for blocks: the model's context is
        # cut to the cache; a context asked for explicitly that the cache cannot hold is refused (vLLM does too),
        # since the router checks requests against it (WorkerInfo.max_model_len)
        asked = min(config.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        if config.max_model_len is not None and asked > n_blocks * self.block_size:
            raise ValueError(f"max_model_len={asked} does not fit this engine's KV cache: {n_blocks} blocks of "
                             f"{self.block_size} tokens hold {n_blocks * self.block_size} (one sequence of "
                             "max_model_len must fit: raise num_kv_blocks or kv_cache_memory_bytes, or lower "
                             "max_model_len)")
        self.max_model_len = min(asked, n_blocks * self.block_size)
        self.tokenizer = load_tokenizer(config)
        self.pooling = load_pooling_config(config)
        """How this model's embeddings are made (engine/pooling.py)."""
        if mc.is_encoder and self.pooling.unsupported is not None:
            raise ValueError(f"model: this encoder cannot be served: {self.pooling.unsupported}")
        self.eos_token_id = default_eos(mc, self.tokenizer)
        if device.type == "cpu":
            cpu_kernels()  # build (first start on this machine) or load them now, never mid-request
        self.lora: LoRASet = load_adapters(config.lora_modules, mc) if config.lora_modules else LoRASet()
        """The LoRA adapters this engine serves (engine/lora.py): those of ``lora_modules``, checked before the model
        loads, and those ``add_lora`` loaded since."""
        self.tp_group = None
        """The tensor-parallel ranks (engine.tensor_parallel.TPGroup) where tensor_parallel_size > 1."""
        if tp > 1:
            from engine.tensor_parallel import TPGroup

            self.tp_group, model = TPGroup.start(config, mc, n_blocks, self.max_model_len)
        else:
            model = load_model(config, mc, self.max_model_len)
            self.lora.attach(model, device, config.torch_dtype)
            if mc.is_encoder:
                model.pooling_mode = self.pooling.mode
                if self.tokenizer is not None:
                    model.sep_token_id = self.tokenizer.convert_tokens_to_ids("[SEP]")
        self.kv_caches: list[tuple[Tensor, Tensor]] = allocate_kv_caches(
            local_mc, n_blocks + graphs, self.block_size, cache_dtype, device,
            shared=config.kv_cache_shared and tp == 1)
        generator = torch.Generator().manual_seed(config.seed)
        sampler = Sampler(mc.vocab_size, config.seed)
        if self.tp_group is not None:
            from engine.tensor_parallel import TPModelRunner

            runner: ModelRunner = TPModelRunner(self.tp_group, model, self.kv_caches, self.block_size, sampler,
                                                generator)
        else:
            runner = ModelRunner(model, self.kv_caches, self.block_size, sampler, generator)
        runner.serves_lora = bool(self.lora.by_slot)
        if device.type == "cuda" and not mc.is_encoder:
            self._warm_up_kernels(config, local_mc, cache_dtype)
        if graphs:
            runner.graphs = DecodeGraphs(model, self.kv_caches, self.block_size, graph_sizes, self.max_model_len,
                                         scratch_block=n_blocks, capture=capture)
            runner.graphs.capture()
            if token_sizes:
                runner.piecewise = PiecewiseGraphs(model, self.kv_caches, token_sizes, self.block_size,
                                                   scratch_block=n_blocks, capture=capture)
                runner.piecewise.capture()
            logger.info("decode graphs: %s%s%s", runner.graphs.describe(),
                        f"; {runner.piecewise.describe()}" if runner.piecewise is not None else "",
                        f" (estimated {self.graph_memory_estimate / 2**20:.0f} MiB, taken out of the KV budget)"
                        if self.graph_memory_estimate else "")
        self._init_core(n_blocks, runner)
        self._async = config.async_scheduling
        self.spec_config = config.speculative_config
        self._proposer = None
        if self.spec_config is not None and self.spec_config.method == "draft_model":
            from engine.draft_model import DraftModelProposer

            # as many draft blocks as target blocks, plus room for every sequence's k drafts past its end. The
            # draft's cache is memory on top of kv_cache_memory_bytes (a quarter of it for tiny-draft on tiny)
            k = self.spec_config.num_speculative_tokens
            extra = config.max_num_seqs * (self.block_manager.blocks_for(k) + 1)
            self._proposer = DraftModelProposer(config, self.spec_config.model, mc.vocab_size, n_blocks + extra,
                                                self.block_size, self.max_model_len)
        elif self.spec_config is not None:
            self._proposer = NgramProposer(self.spec_config)
        self.spec_stats = SpecDecodeStats()
        """Speculative decoding counters (drafts, draft tokens, accepted tokens, per position)."""
        logger.info("engine ready: model=%s dtype=%s quantization=%s kv_cache_dtype=%s device=%s kv_blocks=%d x %d "
                    "tokens, max_model_len=%d%s%s", config.model, config.dtype,
                    config.quantization or (self.prequantized.describe() if self.prequantized else None),
                    config.kv_cache_dtype, config.device, n_blocks, self.block_size, self.max_model_len,
                    ", async scheduling" if self._async else "",
                    f", LoRA adapters {self.lora.names} ({self.lora.weight_bytes() / 2**20:.1f} MiB)"
                    if self.lora.by_slot else "")

    @property
    def rank_kv_caches(self) -> list[list[tuple[Tensor, Tensor]]]:
        """Every tensor-parallel rank's KV cache, rank 0's first (``[kv_caches]`` for one rank): the others live
        in shared memory this process maps, so KV transfers reach every rank from here."""
        group = getattr(self, "tp_group", None)
        return [self.kv_caches] + (list(group.rank_caches) if group is not None else [])

    @property
    def kv_head_ranges(self) -> list[tuple[int, int]]:
        """The model's KV heads [lo, hi) each rank's cache holds, in rank order ([(0, Hkv)] for one rank)."""
        tp = self.config.tensor_parallel_size if getattr(self, "tp_group", None) is not None else 1
        hkv = self.model_config.num_key_value_heads
        if tp == 1:
            return [(0, hkv)]
        from engine.tensor_parallel import TPLayout

        return [(la.kv_head_lo, la.kv_head_lo + la.kv_heads) for la in (TPLayout(self.model_config, tp, r)
                                                                       for r in range(tp))]

    def ranks_up(self) -> list[bool]:
        """Whether each tensor-parallel rank's process is alive, rank 0 (this process) first; [True] for an
        engine of one rank."""
        group = getattr(self, "tp_group", None)
        if group is None:
            return [True]
        dead = set(group.dead_ranks())
        return [True] + [r not in dead for r in range(1, self.config.tensor_parallel_size)]

    def close(self) -> None:
        """End what the engine started outside this process (its tensor-parallel ranks); idempotent. An engine
        of one rank holds nothing to end."""
        group = getattr(self, "tp_group", None)
        if group is not None:
            group.close()

    def _warm_up_kernels(self, config: EngineConfig, mc: ModelConfig, cache_dtype: torch.dtype) -> None:
        """Compile pdserve's Triton attention kernels (or load them from Triton's cache) now, once per variant this
        engine can launch, so no request's step waits for a compile (triton_kernels.warm_up); where they cannot
        run here (``eager_reason``: no Triton, a head_dim or KV cache they do not take) the engine uses torch's
        paths and this does nothing."""
        from engine import triton_kernels

        device = torch.device(config.device)
        if eager_reason(device, config.torch_dtype, cache_dtype, mc.head_dim) is not None:
            return
        t0 = time.perf_counter()
        n = triton_kernels.warm_up(device, config.torch_dtype, cache_dtype, mc.num_attention_heads,
                                   mc.num_key_value_heads, mc.head_dim, self.block_size,
                                   config.max_num_batched_tokens, invariant=config.batch_invariant)
        logger.info("attention kernels warmed up: %d launches in %.2f s", n, time.perf_counter() - t0)

    def _init_core(self, n_blocks: int, runner: ModelRunner) -> None:
        """The bookkeeping every engine has, whatever runs its steps: blocks, scheduler, runner, request maps."""
        config = self.config
        self.block_manager = BlockManager(n_blocks, self.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(self.block_manager, config.max_num_seqs, config.max_num_batched_tokens)
        self.scheduler.whole_prompts = self.model_config.is_encoder
        self.runner = runner
        self.layer_done_callback: Optional[Callable[[int, list[str]], None]] = None
        self.owner_lock: Optional[threading.Lock] = None
        """Held by the owner's thread while it calls into the engine; ``step()`` lets go of it while the model
        runs, so another thread holding it can reserve blocks then (see the module docstring)."""
        self._seqs: dict[str, Sequence] = {}
        self._pending: list[CoreOutput] = []  # outputs decided outside step(), emitted by the next step
        self._num_steps = 0
        self._num_scheduled_tokens = 0
        self._grammar: Optional[GrammarCompiler] = None
        self._last_step: Optional[tuple] = None  # what ``last_step_stats`` is built from, on demand
        """What the latest step that ran a batch did (``engine.stats``); None before the first."""
        self._async = False
        """Async scheduling is on (``config.async_scheduling``; an engine built ``with_runner`` never)."""
        self._inflight: Optional[_InFlight] = None
        self._ahead_steps = 0

    @classmethod
    def with_runner(cls, config: EngineConfig, model_config: ModelConfig, runner: "ModelRunner",
                    num_blocks: int, eos_token_id: Optional[int] = None) -> "LLMEngine":
        """An engine whose steps ``runner.execute(sched, hook)`` runs instead of a model: the same scheduler,
        block manager, request API and step bookkeeping, no weights, tokenizer or KV tensors. The simulator
        (``simulator.engine_sim``) drives pdserve's own policy code this way on a virtual clock. Speculative
        decoding is not available here."""
        if not isinstance(config, EngineConfig):
            raise ValueError(f"config must be an EngineConfig, got {type(config).__name__}")
        if config.speculative_config is not None:
            raise ValueError("with_runner: speculative decoding needs a model (speculative_config must be None)")
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks must be an integer >= 1, got {num_blocks!r}")
        self = cls.__new__(cls)
        self.config = config
        self.model_config = model_config
        self.block_size = config.block_size
        self.kv_cache_dtype = str(config.cache_dtype).removeprefix("torch.")
        self.num_total_blocks = num_blocks
        self.max_model_len = min(config.max_model_len or model_config.max_position_embeddings,
                                 model_config.max_position_embeddings, num_blocks * self.block_size)
        self.tokenizer = None
        self.pooling = PoolingConfig()
        self.eos_token_id = eos_token_id
        self.kv_caches = []
        self.lora = LoRASet()  # (no model: no adapters)
        self.tp_group = None
        self._init_core(num_blocks, runner)
        self.spec_config = None
        self._proposer = None
        self.spec_stats = SpecDecodeStats()
        return self

    # -- state ----------------------------------------------------------------------------------

    @property
    def num_free_blocks(self) -> int:
        return self.block_manager.num_free_blocks

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting)

    @property
    def num_preemptions(self) -> int:
        return self.scheduler.num_preemptions

    @property
    def num_steps(self) -> int:
        """Steps that ran a batch so far (a metric: with ``num_scheduled_tokens``, tokens per step)."""
        return self._num_steps

    @property
    def graph_steps(self) -> int:
        """Steps whose model ran through a decode graph bucket (engine/cuda_graphs.py; static buffers where not
        captured) so far."""
        graphs = getattr(self.runner, "graphs", None)
        return graphs.replays if graphs is not None else 0

    @property
    def piecewise_steps(self) -> int:
        """Steps whose model ran through the piecewise graphs (engine/piecewise_graphs.py) so far; the rest of
        ``num_steps`` ran eagerly."""
        pw = getattr(self.runner, "piecewise", None)
        return pw.replays if pw is not None else 0

    @property
    def ahead_steps(self) -> int:
        """Steps scheduled and launched before the step in flight was read back (async scheduling), since start."""
        return self._ahead_steps

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens computed over all steps so far: prompt chunks plus one per decoding sequence."""
        return self._num_scheduled_tokens

    @property
    def prefix_cache_queries(self) -> int:
        """Prompt tokens looked up in the prefix cache so far (counted at admission)."""
        return self.scheduler.prefix_cache_queries

    @property
    def prefix_cache_hits(self) -> int:
        """Of prefix_cache_queries, the tokens whose K/V was reused instead of computed."""
        return self.scheduler.prefix_cache_hits

    @property
    def model(self):
        return self.runner.model

    def lora_requests(self) -> dict:
        """The adapters of the running and waiting requests and how many adapters the engine holds
        (``SchedulerStats``'s LoRA fields); nothing to count, and no pass over the requests, without adapters."""
        if not self.lora.by_slot:
            return {}
        names = {slot: a.name for slot, a in self.lora.by_slot.items()}

        def of(seqs: Iterable) -> tuple[str, ...]:
            return tuple(sorted({names[s.lora_slot] for s in seqs if s.lora_slot in names}))

        return {"running_lora_adapters": of(self.scheduler.running),
                "waiting_lora_adapters": of(self.scheduler.waiting), "num_lora_adapters": len(names)}

    def make_stats(self) -> SchedulerStats:
        """The engine's state now and its running totals, as one frozen record (``engine.stats``)."""
        return SchedulerStats.of(self)

    def load(self) -> EngineLoad:
        """The load a worker reports, read at once (``engine.client.EngineLoad``)."""
        return EngineLoad(self.num_free_blocks, self.num_total_blocks, self.num_running, self.num_waiting,
                          self.make_stats())

    def step_result(self) -> StepResult:
        """One step as a worker's loop runs it (``engine.client.StepResult``): outputs, load, prefix-cache events."""
        outs = self.step()
        return StepResult(outs, self.load(), self.block_manager.take_events())

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_work() or bool(self._pending) or self._inflight is not None

    def get_block_table(self, request_id: str) -> list[int]:
        seq = self._seqs.get(request_id)
        if seq is None:
            raise ValueError(f"request_id {request_id!r} is not known to this engine")
        return list(seq.block_table)

    # -- requests -------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    prefill_only: bool = False, resume_token_ids: Optional[list[int]] = None,
                    pooling: bool = False) -> None:
        """Queue a prompt; ValueError for a duplicate id, bad tokens or a prompt that cannot fit.

        ``resume_token_ids`` (migration): outputs this request already produced elsewhere. They are
        prefilled with the prompt and sampling goes on at output index len(resume_token_ids), exactly
        as after a recompute preemption, so seeded draws and penalties continue where they left off.
        ``pooling``: an embedding request (engine/pooling.py): the prompt is computed and the request ends with one
        output carrying its last token's final hidden state (``CoreOutput.embedding``); of ``params`` only
        ``lora_name``, ``truncate_prompt_tokens``, ``cache_salt`` and ``priority`` apply."""
        if pooling:
            if self.pooling.unsupported is not None:
                raise ValueError(f"embeddings: this model cannot serve them: {self.pooling.unsupported}")
            if prefill_only or resume_token_ids:
                raise ValueError("pooling cannot be combined with prefill_only or resume_token_ids")
            params = SamplingParams(max_tokens=1, temperature=0.0, lora_name=params.lora_name,
                                    truncate_prompt_tokens=params.truncate_prompt_tokens,
                                    cache_salt=params.cache_salt, priority=params.priority)
        elif self.model_config.is_encoder:
            n = self.model_config.num_labels
            raise ValueError(f"this model is an encoder ({self.model_config.architecture}): it serves "
                             + ("pair scores (score, rerank)" if n == 1 else "classifications" if n else "embeddings")
                             + ", not generation")
        elif not getattr(getattr(self.runner, "model", None), "has_lm_head", True):  # (a simulator's runner has none)
            raise ValueError("this model's checkpoint has no LM head (lm_head.weight): it serves embeddings only")
        seq = self._new_seq(request_id, prompt_token_ids, params, prefill_only, pooling=pooling)
        seq.pooling = pooling
        if resume_token_ids:
            if prefill_only:
                raise ValueError("resume_token_ids cannot be combined with prefill_only")
            outs = self._check_ids("resume_token_ids", resume_token_ids)
            if len(outs) >= params.max_tokens:
                raise ValueError(f"resume_token_ids has {len(outs)} tokens, not fewer than max_tokens "
                                 f"({params.max_tokens}): nothing is left to generate")
            if len(seq.prompt_token_ids) + len(outs) >= self.max_model_len:
                raise ValueError(f"prompt ({len(seq.prompt_token_ids)}) plus resume_token_ids ({len(outs)}) "
                                 f"leave no room under max_model_len ({self.max_model_len})")
            self._grammar_over(seq, outs, "resume_token_ids do")
            for t in outs:
                seq.append(t)
            seq.num_prefill = seq.num_tokens
        elif params.prompt_logprobs is not None:
            seq.prompt_logprobs = []  # (a migration's resume: the client has them already)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        logger.debug("request %s added: %d prompt tokens, prefill_only=%s", request_id,
                     len(seq.prompt_token_ids), prefill_only)

    def check_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                      prefill_only: bool = False) -> None:
        """The checks ``add_request`` makes (ValueError naming the field), adding nothing: for a caller that must
        refuse a bad request before work that comes ahead of adding it (a prefill worker's prefix fetch)."""
        self._new_seq(request_id, prompt_token_ids, params, prefill_only)

    def has_request(self, request_id: str) -> bool:
        """Whether ``request_id`` is held here (waiting, running, held or reserved)."""
        return request_id in self._seqs

    def abort_request(self, request_id: str) -> None:
        """Drop a request wherever it is (waiting, running, held, reserved) and free its blocks."""
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return
        self._defer_free(seq)
        if seq.lora_slot in self.lora.retired:
            self._reap_loras()
        self.scheduler.finish(seq)
        if self._proposer is not None:
            self._proposer.release(request_id)
        self._pending = [o for o in self._pending if o.request_id != request_id]
        logger.debug("request %s aborted", request_id)

    def release(self, request_id: str) -> None:
        """Free a prefill-only request's held blocks (after its KV was sent); unknown ids are ignored."""
        self.abort_request(request_id)

    def reserve(self, request_id: str, num_tokens: int) -> Optional[list[int]]:
        """Take blocks for num_tokens of KV about to arrive; None if there are not enough free blocks."""
        got = self.reserve_prompt(request_id, num_tokens)
        return None if got is None else got[0]

    def reserve_prompt(self, request_id: str, num_tokens: int, prompt_token_ids: Optional[list[int]] = None, *,
                       prefix: bool = False, lora_name: Optional[str] = None,
                       cache_salt: Optional[str] = None) -> Optional[tuple[list[int], int]]:
        """Take blocks for ``num_tokens`` of KV about to arrive: ``(block ids, cached tokens)``, None if there are
        not enough free blocks. With ``prompt_token_ids`` (the whole prompt) and prefix caching on, the leading
        full blocks this cache already holds for it (at most all but the last token's, as a local prefill would
        reuse) are taken by reference and pinned until the request ends: only positions ``cached tokens ..`` need
        to arrive (a delta transfer), the rest of the list is fresh blocks. ``prefix``: ``prompt_token_ids`` is a
        prompt's leading whole blocks, fetched to be cached here (``commit_reserved``): every cached one is taken.
        ``lora_name``: the request's LoRA adapter (its K/V is cached under that adapter's keys); ``cache_salt``: its
        salt (``SamplingParams.cache_salt``)."""
        self._check_reservation(request_id, num_tokens)
        root = salted_root(self._lora_root(lora_name), cache_salt)
        cached: list[int] = []
        keys: list = []
        bs = self.block_size
        if prefix and (prompt_token_ids is None or num_tokens % bs):
            raise ValueError(f"a prefix reservation needs its tokens, whole blocks of {bs}, got {num_tokens}")
        if prompt_token_ids is not None:
            if len(prompt_token_ids) != num_tokens:
                raise ValueError(f"prompt_token_ids has {len(prompt_token_ids)} tokens, num_tokens is {num_tokens}")
            if self.block_manager.enable_caching:
                keys = block_keys(prompt_token_ids, bs, num_tokens // bs if prefix else (num_tokens - 1) // bs,
                                  root=root)
                cached = self.block_manager.acquire(self.block_manager.lookup(keys))
                keys = keys[:len(cached)]
        fresh = self.block_manager.blocks_for(num_tokens) - len(cached)
        if not self.block_manager.can_allocate(fresh):
            self.block_manager.free(cached)
            return None
        seq = Sequence(request_id, [], SamplingParams(), eos_token_id=self.eos_token_id)
        seq.block_table = cached + self.block_manager.allocate(fresh)
        seq.status = SeqStatus.RESERVED
        seq.num_prefill = num_tokens
        seq.num_cached_tokens = len(cached) * bs
        seq.block_keys = keys  # (not counted in prefix_cache_queries/hits: those count prompts this engine prefills)
        seq.key_root = root
        self.scheduler.reserved[request_id] = seq
        self._seqs[request_id] = seq
        return list(seq.block_table), seq.num_cached_tokens

    def reset_prefix_cache(self) -> tuple[bool, int]:
        """vLLM's ``reset_prefix_cache``: forget every cached prompt block (a CLEARED KV event tells the routers).
        Only while no block is held (a running, held or reserved request's, a step in flight's): then
        ``(False, blocks held)`` and nothing changes; ``(True, 0)`` otherwise."""
        bm = self.block_manager
        if self._inflight is not None or not bm.reset_prefix_cache():
            return False, bm.num_blocks_in_use
        return True, 0

    def cached_prefix_tokens(self, prompt_token_ids: list[int], lora_name: Optional[str] = None,
                             cache_salt: Optional[str] = None) -> int:
        """How many leading tokens of ``prompt_token_ids`` (whole blocks of it) this prefix cache holds now (under
        LoRA adapter ``lora_name`` and ``cache_salt``); takes nothing and evicts nothing (a caller deciding whether
        to fetch the rest)."""
        if not self.block_manager.enable_caching:
            return 0
        bs = self.block_size
        keys = block_keys(prompt_token_ids, bs, len(prompt_token_ids) // bs,
                          root=salted_root(self._lora_root(lora_name), cache_salt))
        return len(self.block_manager.lookup(keys)) * bs

    def commit_reserved(self, request_id: str, prompt_token_ids: list[int]) -> int:
        """The KV of a prefix reservation (``reserve_prompt(prefix=True)``) arrived: name its blocks in the prefix
        cache, so a prompt added next that starts with ``prompt_token_ids`` reuses them (while the reservation
        holds them, and after it as any cached block). Returns the tokens now cached (0 with caching off)."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status != SeqStatus.RESERVED:
            raise ValueError(f"request_id {request_id!r} has no reservation")
        bs = self.block_size
        if len(prompt_token_ids) != seq.num_prefill or len(prompt_token_ids) % bs:
            raise ValueError(f"prompt_token_ids has {len(prompt_token_ids)} tokens; the reservation of "
                             f"{request_id!r} is {seq.num_prefill} tokens of whole blocks")
        if not self.block_manager.enable_caching:
            return 0
        keys = block_keys(prompt_token_ids, bs, len(prompt_token_ids) // bs, root=seq.key_root)
        if keys[:len(seq.block_keys)] != seq.block_keys:
            raise ValueError(f"prompt_token_ids differ from the prefix reserved for {request_id!r}")
        for i in range(len(seq.block_keys), len(keys)):
            self.block_manager.register(seq.block_table[i], keys[i])
        seq.block_keys = keys
        return len(keys) * bs

    def _check_reservation(self, request_id: str, num_tokens: int) -> None:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(num_tokens, int) or isinstance(num_tokens, bool) or num_tokens < 1:
            raise ValueError(f"num_tokens must be a positive integer, got {num_tokens!r}")
        if num_tokens >= self.max_model_len:
            raise ValueError(f"num_tokens ({num_tokens}) must be < max_model_len ({self.max_model_len})")

    def add_prefilled_request(self, request_id: str, prompt_token_ids: list[int], first_token_id: int,
                              params: SamplingParams, first_logprob: Optional[TokenLogprob] = None) -> None:
        """A reserved request whose prompt KV now sits in its blocks joins the batch with its first token.

        With prefix caching on, the prompt's full blocks are registered in the cache at once, so requests
        added right after (sibling choices of the same prompt) share them.

        The first token is not emitted again; if it already ends the request (EOS, stop token,
        max_tokens=1) the next step() returns CoreOutput(request_id, [], finish_reason) and frees it.
        """
        seq = self._seqs.get(request_id)
        if seq is None or seq.status != SeqStatus.RESERVED:
            raise ValueError(f"request_id {request_id!r} has no reservation (call reserve first)")
        fresh = self._new_seq(request_id, prompt_token_ids, params, False, check_id=False)
        if len(fresh.prompt_token_ids) > seq.num_prefill:
            raise ValueError(f"prompt_token_ids has {len(fresh.prompt_token_ids)} tokens, more than the "
                             f"{seq.num_prefill} reserved for {request_id!r}")
        if not isinstance(first_token_id, int) or not 0 <= first_token_id < self.model_config.vocab_size:
            raise ValueError(f"first_token_id must be a token id in [0, {self.model_config.vocab_size}), "
                             f"got {first_token_id!r}")
        self._grammar_over(fresh, [first_token_id], f"first_token_id {first_token_id} does")
        if seq.block_keys and fresh.key_root != seq.key_root:
            raise ValueError(f"params.lora_name ({params.lora_name!r}) or params.cache_salt is not what {request_id!r} "
                             "reserved its cached blocks under")
        if seq.block_keys and block_keys(fresh.prompt_token_ids, self.block_size, len(seq.block_keys),
                                         root=fresh.key_root) != seq.block_keys:
            raise ValueError(f"prompt_token_ids differ from the prompt reserved for {request_id!r} within its "
                             f"{seq.num_cached_tokens} cached tokens")
        del self.scheduler.reserved[request_id]
        fresh.block_table = seq.block_table
        fresh.block_keys = seq.block_keys
        fresh.num_computed = len(fresh.prompt_token_ids)
        fresh.num_cached_tokens = seq.num_cached_tokens
        fresh.append(first_token_id)
        self._seqs[request_id] = fresh
        self.scheduler.add_prefilled(fresh)
        if self.block_manager.enable_caching:
            # the arrived KV is as good as computed here: name its full blocks in the prefix cache now, so
            # a request added next (a sibling choice of the same prompt) reuses them instead of recomputing
            self.scheduler.commit_seq(fresh, self.block_size)
        reason = check_stop(fresh, self.max_model_len)
        if reason is None and fresh.matcher is not None and fresh.matcher.is_stopped():
            reason = "stop"
        if reason is not None:
            self._finish(fresh)
            self._pending.append(CoreOutput(request_id, [], None, reason, len(fresh.prompt_token_ids)))

    # -- the step -------------------------------------------------------------------------------

    def step(self) -> list[CoreOutput]:
        """One scheduling step: schedule -> run -> postprocess. With async scheduling: complete the step in flight
        unless this one can run ahead of it, schedule, launch, then (running ahead) read the one before back."""
        if self.lora.retired:
            self._reap_loras()  # (unloaded adapters whose last request has left)
        outputs, self._pending = self._pending, []
        prev, self._inflight = self._inflight, None
        late = False
        if prev is not None:
            ahead, late = self._can_run_ahead(prev)
            if ahead:
                prev.ahead = True
                self._ahead_steps += 1
                for seq in prev.pending.seqs:
                    if seq.status is SeqStatus.RUNNING:
                        seq.append(PLACEHOLDER)
            else:
                outputs += self._complete(prev)
                prev = None
        if self._proposer is not None:
            self._propose()
        sched = self.scheduler.schedule()
        if sched.is_empty:
            if prev is not None:  # (never: a step ahead schedules the first running sequence at least)
                outputs += self._complete(prev)
            return outputs
        pending = self._launch(sched, prev, not late) if self._async else None
        if pending is None:
            result = self._execute(sched)
        num_tokens, num_prefill = sched.num_tokens, sched.num_prefill_tokens  # before _advance moves them
        self._num_steps += 1
        self._num_scheduled_tokens += num_tokens
        self._advance(sched)
        spec_before = self.spec_stats.counts()
        if pending is not None:
            computed = [*sched.decodes, *(s for s, _ in sched.prefills), *sched.verifies]
            self._inflight = _InFlight(pending, {id(s) for s in computed}, {id(s) for s in pending.seqs})
            if prev is not None:  # its tokens replace the placeholders before this step's blocks are named
                outputs += self._complete(prev)
            if late:  # a grammar's state or a penalty's history needed prev's tokens: the draw comes now
                pending.sample()
            self.scheduler.commit(sched)
        else:
            self.scheduler.commit(sched)
            outputs += self._postprocess(result)
        # the record is built when asked for (metrics read it once a scrape, the simulator never): a step only
        # keeps its inputs, which it must freeze now (the speculative counts move on)
        self._last_step = (sched, num_tokens, num_prefill, spec_before,
                           spec_before if self._proposer is None else self.spec_stats.counts())
        return outputs

    def _can_run_ahead(self, prev: _InFlight) -> tuple[bool, bool]:
        """(whether the next step can be scheduled and launched before ``prev`` is read back, whether its draw must
        then wait until ``prev`` is read). Each running sequence that sampled in ``prev`` gets a placeholder for its
        unread token (so it must decode, and that token must not be its last by length); one under a grammar or
        with a penalty or a bad word over its history (``SamplingParams.needs_history``) makes the draw wait (the
        forward still runs ahead); every other running sequence has known tokens to compute; nothing is prefill-only; and the running sequences the step's
        budget reaches get their blocks without a preemption (the step in flight still writes a victim's blocks,
        and it would re-prefill its placeholder). Waiting requests may be admitted: they take only free blocks."""
        sch = self.scheduler
        if not sch.running:
            return False, False
        # (once per step over every running sequence: written for speed, the host's work being what this overlaps)
        sampled, bs, max_len = prev.sampled, self.block_size, self.max_model_len
        budget, need, late = sch.max_num_batched_tokens, 0, False
        for seq in sch.running:
            if budget <= 0:
                break  # the scheduler stops here too: the rest wait a step (a placeholder is only read back)
            if seq.prefill_only:
                return False, False
            n, t = seq.num_computed, len(seq.token_ids)
            if id(seq) in sampled:
                p = seq.params
                if t != n or len(seq.output_token_ids) + 1 >= p.max_tokens or t + 1 >= max_len:
                    return False, False
                if seq.matcher is not None or p.needs_history:
                    late = True
                k = 1
            elif t > n:
                k = min(t - n, budget)
            else:
                return False, False
            blocks, have = -(-(n + k) // bs), len(seq.block_table)
            if blocks > have:
                need += blocks - have
            budget -= k
        if need > self.block_manager.num_free_blocks:
            return False, False
        return True, late

    def _launch(self, sched: SchedulerOutput, prev: Optional[_InFlight], sample: bool = True) -> PendingStep:
        """``runner.launch``, owner_lock let go meanwhile."""
        return self._unlocked(self.runner.launch, sched, prev.pending if prev is not None else None,
                              self._layer_hook(sched), sample)

    def _complete(self, prev: _InFlight) -> list[CoreOutput]:
        """Read a launched step back (owner_lock let go while waiting), free what ended while it ran, put its
        tokens in place of the placeholders and postprocess its live sequences (a sequence that ended meanwhile
        loses its wasted token)."""
        result = self._unlocked(prev.pending.output)
        for table in prev.deferred:
            self.block_manager.free(table)
        live = [i for i, seq in enumerate(result.seqs) if seq.status is not SeqStatus.FINISHED]
        if prev.ahead:
            for i in live:
                seq = result.seqs[i]
                seq.token_ids.pop()
                seq.output_token_ids.pop()
        if len(live) < len(result.seqs):
            result = RunnerOutput([result.seqs[i] for i in live], [result.token_ids[i] for i in live],
                                  [result.logprobs[i] for i in live], result.prompt_logprobs)
        return self._postprocess(result)

    def _defer_free(self, seq: Sequence) -> None:
        """A sequence ending while a launched step still computes it: its blocks go back once that step is done."""
        fl = self._inflight
        if fl is not None and id(seq) in fl.seq_ids and seq.block_table:
            fl.deferred.append(seq.block_table)
            seq.block_table = []

    def _execute(self, sched: SchedulerOutput) -> RunnerOutput:
        """The model's forward for ``sched``, read back."""
        return self._unlocked(self.runner.execute, sched, self._layer_hook(sched))

    def _unlocked(self, fn: Callable[..., T], *args: object) -> T:
        """``fn(*args)`` with ``owner_lock`` let go meanwhile (a forward, a launch, a wait on the device): what runs
        beside it may take free blocks and post requests, never touch the scheduled sequences (whose blocks the
        step holds)."""
        lock = self.owner_lock
        if lock is None:
            return fn(*args)
        lock.release()
        try:
            return fn(*args)
        finally:
            lock.acquire()

    @property
    def last_step_stats(self) -> Optional[IterationStats]:
        """The ``IterationStats`` of the last step that ran a batch (None before the first)."""
        if self._last_step is None:
            return None
        if not isinstance(self._last_step, IterationStats):
            self._last_step = IterationStats.of(*self._last_step)
        return self._last_step

    def _propose(self) -> None:
        """Draft tokens for every running sequence that decodes this step (one token left to compute)."""
        k = self.spec_config.num_speculative_tokens
        todo: list[Sequence] = []
        items = []
        for seq in self.scheduler.running:
            seq.spec_token_ids = []
            if seq.prefill_only or seq.num_tokens - seq.num_computed != 1:
                continue
            # never draft past what the request may still emit (the verified step emits drafts + 1)
            room = min(k, seq.params.max_tokens - len(seq.output_token_ids) - 1,
                       self.max_model_len - seq.num_tokens - 1)
            if room > 0:
                todo.append(seq)
                items.append((seq.request_id, seq.token_ids, room))
        for seq, drafts in zip(todo, self._proposer.propose_many(items)):
            if seq.matcher is not None and drafts:
                drafts = list(drafts)[:seq.matcher.valid_prefix(drafts)]  # what the grammar rejects is no draft
            elif seq.grammar_waits and drafts:  # the grammar's first token is drawn with its mask, never drafted
                drafts = drafts_before_end(seq.output_token_ids, drafts, seq.params.reasoning_end_token_ids)
            seq.spec_token_ids = drafts

    def _layer_hook(self, sched: SchedulerOutput) -> Optional[Callable[[int], None]]:
        cb = self.layer_done_callback
        if cb is None:
            return None
        done = [s.request_id for s, n in sched.prefills if s.num_computed + n == s.num_prefill]
        done += [s.request_id for s in [*sched.decodes, *sched.verifies] if s.num_computed + 1 == s.num_prefill]
        if not done:
            return None
        return lambda layer: cb(layer, done)

    @staticmethod
    def _advance(sched: SchedulerOutput) -> None:
        for seq in sched.decodes:
            seq.num_computed += 1
        for seq, n in sched.prefills:
            seq.num_computed += n
        for seq in sched.verifies:
            seq.num_computed += 1  # its last token; accepted drafts are counted once known

    def _postprocess(self, result: RunnerOutput) -> list[CoreOutput]:
        outputs = []
        for seq, first, lps in result.prompt_logprobs:
            if seq.prompt_logprobs is not None:
                seq.prompt_logprobs[first:] = lps  # (a chunk recomputed after a preemption replaces its own)
        i = 0
        while i < len(result.seqs):
            seq = result.seqs[i]
            n = 1 + len(seq.spec_token_ids)
            toks, lps = result.token_ids[i:i + n], result.logprobs[i:i + n]
            i += n
            if seq.pooling:  # its prompt is computed: the pooled state is its answer (the sampled token is not)
                outputs.append(CoreOutput(seq.request_id, [], None, "stop", len(seq.prompt_token_ids),
                                          seq.num_cached_tokens, embedding=seq.pooled))
                seq.pooled = None
                self._finish(seq)
                continue
            if n > 1:
                toks = accept(seq.spec_token_ids, toks)
                self.spec_stats.record(n - 1, len(toks) - 1)
            out: list[int] = []
            reason = None
            for tok in toks:
                seq.append(tok)
                out.append(tok)
                reason = check_stop(seq, self.max_model_len)
                if seq.matcher is not None:
                    reason = self._advance_matcher(seq, tok, reason)
                elif seq.grammar_waits and ends_with(seq.output_token_ids, seq.params.reasoning_end_token_ids):
                    seq.matcher, seq.grammar_waits = self.grammar.new_matcher(seq.params.structured_outputs), False
                if reason is not None:
                    break
            if n > 1:
                seq.num_computed += len(out) - 1  # the accepted drafts' K/V are right; the last token is new
                seq.spec_token_ids = []
            want_lp = seq.params.logprobs is not None and all(lp is not None for lp in lps[:len(out)])
            if seq.prefill_only:
                self.scheduler.hold(seq)
                reason = "prefill_done"
            elif reason is not None:
                self._finish(seq)
            elif n > 1:
                self._trim_blocks(seq)
            outputs.append(CoreOutput(seq.request_id, out, list(lps[:len(out)]) if want_lp else None, reason,
                                      len(seq.prompt_token_ids), seq.num_cached_tokens))
            if seq.prompt_logprobs is not None and out:  # the first output carries the prompt's
                outputs[-1].prompt_logprobs = [None, *seq.prompt_logprobs]
                seq.prompt_logprobs = None
        return outputs

    @staticmethod
    def _advance_matcher(seq: Sequence, tok: int, reason: Optional[str]) -> Optional[str]:
        """Feed an accepted token to the sequence's grammar; "stop" once the grammar is complete."""
        if not seq.matcher.consume([tok]):
            # the mask allowed it, so the grammar ran out of a parser limit (engine.structured_outputs.parser_limits:
            # a pathological regex or schema) or this is a bug: end the request ("abort") rather than go on unconstrained
            logger.error("request %s: structured_outputs matcher failed at token %d (%s)", seq.request_id, tok,
                         seq.matcher.error())
            return "abort"
        if reason is None and seq.matcher.is_stopped():
            return "stop"
        return reason

    @property
    def grammar(self) -> GrammarCompiler:
        """This engine's grammar compiler (llguidance tokenizer + compiled-grammar cache), built on first use."""
        if self._grammar is None:
            if self.tokenizer is None:
                raise ValueError("structured_outputs needs the model's tokenizer, and this engine has none")
            self._grammar = GrammarCompiler(self.tokenizer, self.model_config.vocab_size, self.eos_token_id)
            # a mask thread needs the GIL between llguidance calls, and pdserve's CPU kernels hold it for the whole
            # forward: on CPU the thread could only run after the forward (it made a tiny step of 8 rows 3-4x
            # slower than computing the masks inline); where the forward releases the GIL (CUDA) it overlaps
            self._grammar.overlap_masks = torch.device(self.config.device).type != "cpu"
            self.runner.grammar = self._grammar
        return self._grammar

    def _trim_blocks(self, seq: Sequence) -> None:
        """Free the blocks a verification took that only rejected drafts used (positions >= num_tokens)."""
        keep = self.block_manager.blocks_for(seq.num_tokens)
        if len(seq.block_table) > keep:
            tail = seq.block_table[keep:]
            del seq.block_table[keep:]
            self.block_manager.free(tail)

    def _finish(self, seq: Sequence) -> None:
        self._defer_free(seq)
        self.scheduler.finish(seq)
        if self._proposer is not None:
            self._proposer.release(seq.request_id)
        self._seqs.pop(seq.request_id, None)
        if seq.lora_slot in self.lora.retired:
            self._reap_loras()  # (its last request gone: an unloaded adapter's weights go now)

    # -- validation -----------------------------------------------------------------------------

    def _check_ids(self, field: str, token_ids) -> list[int]:
        """A list of plain-int token ids in the vocabulary; ValueError naming ``field`` otherwise."""
        if isinstance(token_ids, (str, bytes)) or not hasattr(token_ids, "__iter__"):
            raise ValueError(f"{field} must be a list of token ids")
        ids = list(token_ids)
        V = self.model_config.vocab_size
        if all(type(t) is int for t in ids) and (not ids or (min(ids) >= 0 and max(ids) < V)):
            return ids  # the common case, checked at C speed: plain ints (not bools) within the vocabulary
        for j, t in enumerate(ids):
            if isinstance(t, bool) or not isinstance(t, numbers.Integral) or not 0 <= t < V:
                raise ValueError(f"{field}: {t!r} is not a token id in [0, {V})")
            ids[j] = int(t)  # numpy / tensor-item ints become plain ints
        return ids

    def _lora_slot(self, name: Optional[str]) -> int:
        """The slot of LoRA adapter ``name`` here (None: 0, the base model); ValueError naming ``lora_name``."""
        if name is None:
            return 0
        if not self.lora.slot_of:
            raise ValueError(f"lora_name: this engine serves no LoRA adapters (asked for {name!r})")
        return self.lora.resolve(name)

    def _lora_root(self, name: Optional[str]) -> int:
        """The prefix-cache root of adapter ``name``'s chains here (0 for the base model); ValueError naming
        ``lora_name``."""
        slot = self._lora_slot(name)
        return self.lora.by_slot[slot].key_root if slot else 0

    # -- LoRA adapters at run time ---------------------------------------------------------------

    def lora_adapters(self) -> dict[str, int]:
        """The adapters requests may name here, each with its prefix-cache root (``LoRAAdapter.key_root``: a router
        hashes an adapter's prompts with it, and checks that every worker holds the same weights under a name)."""
        return self.lora.roots()

    def lora_event_ids(self) -> dict[int, int]:
        """Every adapter's prefix-cache root -> its slot (the ``lora_id`` of its blocks' KV events), those unloaded
        since too (their blocks may still be cached)."""
        return dict(self.lora.event_ids)

    def add_lora(self, name: str, path: str) -> int:
        """Load the PEFT LoRA adapter in directory ``path`` and serve it as ``name`` from the next step (vLLM's
        ``/v1/load_lora_adapter``); returns its prefix-cache root. ValueError naming ``lora_name`` or the adapter's
        problem (engine/lora.py's checks), with nothing changed. Running requests are unaffected; the adapter
        runs eagerly as those given at start do."""
        check_lora_name(name, "lora_name")
        if not isinstance(path, str) or not path:
            raise ValueError(f"lora_path must be a non-empty path, got {path!r}")
        device = torch.device(self.config.device)
        if device.type != "cpu":
            raise ValueError(f"lora_name: LoRA adapters run on CPU engines only (this one is on {device.type})")
        if name in self.lora.slot_of:
            raise ValueError(f"lora_name: adapter {name!r} is already loaded")
        adapter = load_adapter(name, path, self.model_config)
        slot = self.lora.add(adapter)
        try:
            if self.tp_group is not None:
                self.tp_group.lora_add(slot, adapter)  # every follower its shard; rank 0's below
                from engine.tensor_parallel import TPLayout

                adapter = shard_adapter(adapter, TPLayout(self.model_config, self.config.tensor_parallel_size, 0))
            attach_adapter(self.runner.model, slot, adapter, device, self.config.torch_dtype)
        except BaseException:
            self.lora.retire(name)
            self._drop_lora(slot)
            raise
        self.runner.serves_lora = True
        logger.info("LoRA adapter %r loaded from %s (slot %d, rank %d, %.1f MiB)", name, path, slot, adapter.rank,
                    sum(a.numel() + b.numel() for a, b in adapter.weights.values()) * 4 / 2**20)
        return adapter.key_root

    def remove_lora(self, name: str) -> int:
        """Stop serving adapter ``name`` (vLLM's ``/v1/unload_lora_adapter``): requests naming it are refused from
        now on (ValueError naming ``lora_name``); those already admitted under it finish under it, and its weights
        are freed once the last has left. Returns how many requests still run under it. ValueError naming
        ``lora_name`` if it is not served."""
        slot = self.lora.retire(name)
        left = self._lora_users(slot)
        if not left and self._inflight is None:
            self._drop_lora(slot)
        logger.info("LoRA adapter %r unloaded (%d request(s) still running under it)", name, left)
        return left

    def _lora_users(self, slot: int) -> int:
        return sum(1 for s in self._seqs.values() if s.lora_slot == slot)

    def _drop_lora(self, slot: int) -> None:
        """Free an unloaded adapter's weights on every rank."""
        detach_adapter(self.runner.model, slot)
        if self.tp_group is not None and self.lora.by_slot.get(slot) is not None:
            self.tp_group.lora_drop(slot)
        self.lora.drop(slot)
        self.runner.serves_lora = bool(self.lora.by_slot)

    def _reap_loras(self) -> None:
        """Drop unloaded adapters no request (nor the step in flight) uses any more."""
        if self._inflight is not None:
            return
        for slot in sorted(self.lora.retired):
            if not self._lora_users(slot):
                self._drop_lora(slot)

    def _new_seq(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                 prefill_only: bool, check_id: bool = True, pooling: bool = False) -> Sequence:
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        if check_id and request_id in self._seqs:
            raise ValueError(f"request_id {request_id!r} is already in use")
        if not isinstance(params, SamplingParams):
            raise ValueError(f"params must be SamplingParams, got {type(params).__name__}")
        ids = self._check_ids("prompt_token_ids", prompt_token_ids)
        if not ids:
            raise ValueError("prompt_token_ids must not be empty")
        ids = params.truncate_prompt(ids, self.max_model_len)
        if params.logit_bias:
            self._check_ids("logit_bias", params.logit_bias.keys())
        if params.allowed_token_ids is not None:
            self._check_ids("allowed_token_ids", params.allowed_token_ids)
        for name in ("reasoning_end_token_ids", "reasoning_start_token_ids"):
            if getattr(params, name) is not None:
                self._check_ids(name, getattr(params, name))
        if params.bad_words_token_ids:
            for i, seq in enumerate(params.bad_words_token_ids):
                self._check_ids(f"bad_words_token_ids[{i}]", seq)
        elif params.bad_words:
            if self.tokenizer is None:
                raise ValueError("bad_words needs the model's tokenizer, and this engine has none (give "
                                 "bad_words_token_ids)")
            # a copy: the caller's params (shared by its other requests) stay as given
            params = dataclasses.replace(params, bad_words_token_ids=bad_words_token_ids(
                params.bad_words, self.tokenizer, self.model_config.vocab_size))
        if len(ids) > self.max_model_len or (len(ids) == self.max_model_len and not pooling):
            raise ValueError(f"prompt_token_ids has {len(ids)} tokens; max_model_len is {self.max_model_len} "
                             + ("(an embedding's prompt fills it at most)" if pooling else
                                "(prompt plus at least one new token)"))
        seq = Sequence(request_id, ids, params, prefill_only=prefill_only, eos_token_id=self.eos_token_id)
        if params.lora_name is not None:
            seq.lora_slot = self._lora_slot(params.lora_name)
            seq.key_root = self.lora.by_slot[seq.lora_slot].key_root
        seq.key_root = salted_root(seq.key_root, params.cache_salt)
        if params.structured_outputs is not None:
            if params.reasoning_end_token_ids is None:
                seq.matcher = self.grammar.new_matcher(params.structured_outputs)  # ValueError names the field
            else:  # (compiled now all the same: a bad constraint is refused before any work)
                self.grammar.compile(params.structured_outputs)
                seq.grammar_waits = True
        return seq

    def _grammar_over(self, seq: Sequence, outs: list[int], what: str) -> None:
        """Set a fresh sequence's grammar state as after ``outs`` (tokens produced elsewhere: a migration's resume,
        the prefill worker's first token), before they are appended: consumed by its matcher, or, where a
        reasoning block was open, the matcher made from what follows the block's end; ValueError naming ``what``
        (with its verb) when they break the constraint."""
        if seq.grammar_waits:
            end = seq.params.reasoning_end_token_ids
            at = find_end(outs, end)
            if at is None:
                return
            seq.matcher, seq.grammar_waits = self.grammar.new_matcher(seq.params.structured_outputs), False
            outs = outs[at:]
        if seq.matcher is not None and not seq.matcher.consume(outs):
            raise ValueError(f"{what} not follow the request's structured_outputs constraint "
                             f"({seq.matcher.error()})")
