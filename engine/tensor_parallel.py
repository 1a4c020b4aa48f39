"""Tensor parallelism inside one engine: N ranks share one model, Megatron-style, and run every step together.

Lifecycle: ``LLMEngine`` with ``tensor_parallel_size`` N > 1 checks the split first (``check_tensor_parallel``:
heads, KV heads, MLP width, cores, quantization groups; a ``ValueError`` naming the flag and the numbers, before
anything loads), then ``TPGroup.start`` spawns ranks 1..N-1 as child processes, opens one gloo group of N ranks
over a loopback ``TCPStore`` (its port chosen by the OS) and loads rank 0's shard in this process while the
others load theirs. Rank 0 is the engine: it schedules, owns the block manager, the sampler and every request;
the other ranks (followers) hold only their shard of the weights and of the paged KV cache (the same block ids,
their KV heads); rank 0 allocates the followers' caches in shared memory and maps them too, so a worker's KV
transfers (kvtransfer/sharding.py) read and write every rank's heads from rank 0's process. Each step, rank 0's ``TPModelRunner`` prepares the flat batch as a one-rank engine does, sends
the step's inputs (token ids, positions, attention metadata, the row ranges that become logits) down one pipe
per follower, and every rank runs the same forward: two all-reduces per layer, the vocabulary gathered on
rank 0 for logits. Only rank 0 samples. ``TPGroup.close`` (``LLMEngine.close``) ends the followers; a follower also ends on
its own when rank 0's pipe closes (rank 0 died) or a collective fails, so no rank outlives its engine.

The split (``TPLayout``), as in Megatron-LM and vLLM:

- attention: each rank owns H/N query heads and their KV heads: Hkv/N of them, or, where N exceeds Hkv, one KV
  head replicated on N/Hkv ranks; q/k/v are column-parallel (the fused ``qkv_proj`` holds the rank's heads),
  ``o_proj`` row-parallel, then one all-reduce;
- MLP: gate/up column-parallel (I/N columns each), ``down_proj`` row-parallel, then one all-reduce;
- vocabulary: the embedding and the LM head hold ceil(V/N) rows each (the last rank's tail zero-padded); the
  embedding is masked and all-reduced, the logits gathered on rank 0;
- norms, RoPE tables and the sampler are whole on every rank (the sampler runs on rank 0 only).

Every linear of a shard takes the format the engine asks for (fp32 packs, int8/int4/w8a8/w4a8) from the shard's
own float weight; the fused C++ decode layer is not built (it runs a whole block in one call, with no place for
the all-reduces), so decode layers run the Python path on the same kernels. The KV cache may be int8 per shard.
Speculative decoding, structured outputs, beam search and prefix caching live on rank 0 and need nothing from
the followers. Gloo on CPU only: NCCL ranks on GPUs are not built yet (issue 44).

``kv_cache_memory_bytes`` is each rank's budget, so N ranks hold N times the blocks where the KV heads split.
"""
from __future__ import annotations

import dataclasses
import logging
import math
import multiprocessing as mp
import os
import pickle
import re
import time
import traceback
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from engine.config import EngineConfig, ModelConfig
from engine.model_runner import ModelRunner
from transport.gloo import open_gloo, timedelta_s

if TYPE_CHECKING:  # pragma: no cover
    from engine.model import CausalLM

log = logging.getLogger(__name__)

COLLECTIVE_TIMEOUT_S = 120.0
"""Longest one collective of a step may wait for the other ranks (a 2048-token prefill of a large model on a
busy CPU takes seconds; a rank that never arrives fails the step after this)."""
START_TIMEOUT_S = 600.0
"""Longest the followers may take to load their shards."""


class TensorParallelError(RuntimeError):
    """A rank of the tensor-parallel group died, hung past the collective timeout, or failed to start."""


def check_tensor_parallel(mc: ModelConfig, size: Any, *, device: str = "cpu", quantization: Optional[str] = None,
                          group_size: int = 128, flag: str = "tensor_parallel_size",
                          cpus: Optional[int] = None) -> None:
    """ValueError, naming ``flag`` and the numbers, unless ``mc`` splits over ``size`` ranks on this machine."""
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise ValueError(f"{flag} must be an integer >= 1, got {size!r}")
    if size == 1:
        return
    if mc.num_experts:
        raise ValueError(f"{flag}={size}: tensor parallelism does not split mixture-of-experts models "
                         f"({mc.architecture}) yet; run them on one rank")
    H, Hkv, I = mc.num_attention_heads, mc.num_key_value_heads, mc.intermediate_size
    if H % size:
        raise ValueError(f"{flag}={size} must divide the model's num_attention_heads ({H})")
    if Hkv % size and size % Hkv:
        raise ValueError(f"{flag}={size} and the model's num_key_value_heads ({Hkv}) must divide one another "
                         "(KV heads are split, or replicated where the ranks outnumber them)")
    if I % size:
        raise ValueError(f"{flag}={size} must divide the model's intermediate_size ({I})")
    if device != "cpu":
        raise ValueError(f"{flag}={size} on device {device!r}: tensor-parallel ranks run on CPU over gloo; "
                         "NCCL ranks on GPUs are not built yet")
    n_cpu = cpus if cpus is not None else node_cpus()
    if size > n_cpu:
        raise ValueError(f"{flag}={size} is more ranks than this node's {n_cpu} CPU cores")
    if quantization in ("int4", "w4a8"):
        for name, width in (("o_proj", H // size * mc.head_dim), ("down_proj", I // size)):
            if width % group_size:
                raise ValueError(f"{flag}={size} with quantization {quantization!r}: each rank's {name} has "
                                 f"{width} inputs, not a multiple of quantization_group_size ({group_size})")


@dataclass(frozen=True)
class TPLayout:
    """What rank ``rank`` of ``size`` holds of a model (``full``): its heads, MLP columns and vocabulary rows."""

    full: ModelConfig
    size: int
    rank: int

    @property
    def heads(self) -> int:
        return self.full.num_attention_heads // self.size

    @property
    def kv_heads(self) -> int:
        return max(1, self.full.num_key_value_heads // self.size)

    @property
    def kv_head_lo(self) -> int:
        """The first KV head this rank holds (the one it shares with N/Hkv - 1 others where they are fewer)."""
        Hkv, N = self.full.num_key_value_heads, self.size
        return self.rank * Hkv // N if Hkv >= N else self.rank // (N // Hkv)

    @property
    def intermediate(self) -> int:
        return self.full.intermediate_size // self.size

    @property
    def vocab_shard(self) -> int:
        return math.ceil(self.full.vocab_size / self.size)

    @property
    def vocab_lo(self) -> int:
        return min(self.full.vocab_size, self.rank * self.vocab_shard)

    @property
    def vocab_hi(self) -> int:
        return min(self.full.vocab_size, self.vocab_lo + self.vocab_shard)

    def local_config(self) -> ModelConfig:
        """The shard's shapes as a model config: the layers, the KV cache and the vocabulary rows size from it."""
        return dataclasses.replace(self.full, num_attention_heads=self.heads, num_key_value_heads=self.kv_heads,
                                   intermediate_size=self.intermediate, vocab_size=self.vocab_shard)

    _PROJ = re.compile(r"^model\.layers\.\d+\.(?:self_attn|mlp)\.(\w+)\.(weight|bias)$")

    def shard(self, hf_name: str, t: Tensor) -> Tensor:
        """This rank's part of the whole checkpoint tensor ``hf_name`` ([out, in] as Hugging Face stores it);
        tensors it does not split (norms) come back unchanged. ValueError if the whole tensor has the wrong size
        along the split dimension (so a wrong checkpoint is not silently cut to fit)."""
        D, mc = self.full.head_dim, self.full
        if hf_name in ("model.embed_tokens.weight", "lm_head.weight"):
            self._expect(hf_name, t, 0, mc.vocab_size)
            part = t[self.vocab_lo:self.vocab_hi]
            if part.shape[0] < self.vocab_shard:  # the last rank's tail: zero rows (their logits are cut)
                part = torch.cat([part, part.new_zeros(self.vocab_shard - part.shape[0], *part.shape[1:])])
            return part
        m = self._PROJ.match(hf_name)
        if m is None:
            return t
        proj = m.group(1)
        if proj in ("qkv_proj", "gate_up_proj"):  # (Phi-3's fused tensors: each part's share, in the same order)
            names = ("q_proj", "k_proj", "v_proj") if proj == "qkv_proj" else ("gate_proj", "up_proj")
            H, Hkv, inter = mc.num_attention_heads * D, mc.num_key_value_heads * D, mc.intermediate_size
            sizes = [H, Hkv, Hkv] if proj == "qkv_proj" else [inter, inter]
            self._expect(hf_name, t, 0, sum(sizes))
            prefix = hf_name[:m.start(1)]
            return torch.cat([self.shard(f"{prefix}{n}.{m.group(2)}", part)
                              for n, part in zip(names, t.split(sizes, dim=0))], dim=0)
        if proj == "q_proj":
            self._expect(hf_name, t, 0, mc.num_attention_heads * D)
            return t[self.rank * self.heads * D:(self.rank + 1) * self.heads * D]
        if proj in ("k_proj", "v_proj"):
            self._expect(hf_name, t, 0, mc.num_key_value_heads * D)
            return t[self.kv_head_lo * D:(self.kv_head_lo + self.kv_heads) * D]
        if proj == "o_proj":
            self._expect(hf_name, t, 1, mc.num_attention_heads * D)
            return t[:, self.rank * self.heads * D:(self.rank + 1) * self.heads * D]
        if proj in ("gate_proj", "up_proj"):
            self._expect(hf_name, t, 0, mc.intermediate_size)
            return t[self.rank * self.intermediate:(self.rank + 1) * self.intermediate]
        if proj == "down_proj":
            self._expect(hf_name, t, 1, mc.intermediate_size)
            return t[:, self.rank * self.intermediate:(self.rank + 1) * self.intermediate]
        return t

    def shard_scale(self, hf_name: str, s: Tensor) -> Tensor:
        """This rank's part of a prequantized layer's group scales ``s`` [out, in / group] (engine/prequantized.py):
        the rows of an output-split layer (as ``shard``), the whole groups of an input-split one's columns
        (o_proj, down_proj: a group may not straddle two ranks; per channel (one group): all of it, each rank's
        columns then one group). ValueError where a group would be cut."""
        m = self._PROJ.match(hf_name)
        proj = m.group(1) if m is not None else None
        if proj not in ("o_proj", "down_proj"):
            return self.shard(hf_name, s)
        mc = self.full
        width, lo = ((mc.num_attention_heads * mc.head_dim, self.rank * self.heads * mc.head_dim)
                     if proj == "o_proj" else (mc.intermediate_size, self.rank * self.intermediate))
        n = self.intermediate if proj == "down_proj" else self.heads * mc.head_dim
        if s.shape[1] == 1:
            return s
        group = width // s.shape[1]
        if lo % group or n % group:
            raise ValueError(f"tensor parallelism: {hf_name} splits its {width} inputs {n} a rank, across its "
                             f"quantization groups of {group}")
        return s[:, lo // group:(lo + n) // group]

    @staticmethod
    def _expect(name: str, t: Tensor, dim: int, n: int) -> None:
        if t.dim() <= dim or t.shape[dim] != n:
            raise ValueError(f"weights: {name!r} has shape {tuple(t.shape)}, expected {n} along dimension {dim}")


class TPComm:
    """One rank's handle on the group's collectives, as point-to-point exchanges over one gloo group: the sum of
    the ranks' partial results (each rank sends its part to every other and adds all parts in rank order, so every
    rank holds the same bits), and the logits' vocabulary gathered on rank 0. Measured on the 2-core box, a
    2-rank exchange of a decode row takes ~0.29 ms in a tight loop where gloo's own ``allreduce`` takes ~1.3 ms
    (docs/benchmarks.md, "Tensor parallelism"). A failed collective (a rank died, or never came within ``COLLECTIVE_TIMEOUT_S``) raises
    ``TensorParallelError``."""

    REDUCE_TAG, GATHER_TAG = 1, 2

    def __init__(self, pg: Any, rank: int, size: int, vocab_size: int) -> None:
        self.pg, self.rank, self.size, self.vocab_size = pg, rank, size, vocab_size
        self.reduce_seconds = 0.0
        """Time spent in collectives, waiting for the other ranks included (the benchmark's share)."""

    def _fail(self, what: str, e: BaseException) -> TensorParallelError:
        return TensorParallelError(f"tensor-parallel {what} failed on rank {self.rank}: {e}")

    def all_reduce(self, t: Tensor) -> Tensor:
        """The sum of every rank's ``t``, added in rank order (the same bits on every rank)."""
        t = t.contiguous()
        t0 = time.perf_counter()
        parts: list[Optional[Tensor]] = [None] * self.size
        parts[self.rank] = t
        try:
            recvs = []
            for r in range(self.size):
                if r != self.rank:
                    parts[r] = torch.empty_like(t)
                    recvs.append(self.pg.recv([parts[r]], r, self.REDUCE_TAG))
            sends = [self.pg.send([t], r, self.REDUCE_TAG) for r in range(self.size) if r != self.rank]
            for w in recvs + sends:
                w.wait()
        except RuntimeError as e:
            raise self._fail("all-reduce", e) from e
        out = parts[0]
        for p in parts[1:]:
            out = out + p
        self.reduce_seconds += time.perf_counter() - t0
        return out

    def gather_vocab(self, local: Tensor) -> Tensor:
        """[rows, V/N] logits of every rank -> [rows, V] on rank 0 (a follower sends its part and gets it back)."""
        local = local.contiguous()
        t0 = time.perf_counter()
        try:
            if self.rank != 0:
                self.pg.send([local], 0, self.GATHER_TAG).wait()
                return local
            outs = [local] + [torch.empty_like(local) for _ in range(1, self.size)]
            works = [self.pg.recv([outs[r]], r, self.GATHER_TAG) for r in range(1, self.size)]
            for w in works:
                w.wait()
        except RuntimeError as e:
            raise self._fail("logits gather", e) from e
        finally:
            self.reduce_seconds += time.perf_counter() - t0
        return torch.cat(outs, dim=-1)[:, :self.vocab_size]


def open_comm(host: str, port: int, rank: int, size: int, master: Optional[dist.TCPStore] = None) -> TPComm:
    """Rank ``rank``'s ``TPComm`` of a ``size``-rank group meeting at the TCPStore ``host:port`` (``master``: the
    store itself, in the process that created it)."""
    store = master if master is not None else dist.TCPStore(host, port, size, False,
                                                             timeout=timedelta_s(START_TIMEOUT_S))
    pg = open_gloo(dist.PrefixStore("tp", store), rank, size, COLLECTIVE_TIMEOUT_S, host)
    return TPComm(pg, rank, size, 0)


def load_shard(config: EngineConfig, mc: ModelConfig, layout: TPLayout, max_positions: int,
               comm: TPComm) -> "CausalLM":
    """Rank ``layout.rank``'s shard of the engine's model, its weights streamed from the whole checkpoint."""
    from engine.builtin import BUILTIN_NAMES
    from engine.loader import fill_weights, iter_checkpoint
    from engine.model import CausalLM

    device = torch.device(config.device)
    with torch.device("meta"):
        model = CausalLM(layout.local_config(), max_positions=max_positions, tp=layout)
    model = model.to_empty(device=device).to(config.torch_dtype)
    group = None
    if config.model in BUILTIN_NAMES:
        model.load_weights(iter_checkpoint(config))
    else:  # (a prequantized checkpoint's scales are sharded with their weights: ``TPLayout.shard_scale``)
        group = fill_weights(model, config)
    comm.vocab_size = mc.vocab_size
    model.attach_comm(comm)
    model = model.finalize(config.cpu_gemm, config.quantization, config.quantization_group_size,
                           config.batch_invariant, prequantized_group=group)
    if config.lora_modules:  # every rank its shard of every adapter (each step's rows' adapters come with its meta)
        from engine.lora import load_adapters

        load_adapters(config.lora_modules, mc).sharded(layout).attach(model, device, config.torch_dtype)
    return model


def rank_threads(config: EngineConfig) -> int:
    """Threads each rank computes with: ``num_threads``, else this node's cores shared out among the ranks."""
    if config.num_threads is not None:
        return config.num_threads
    return max(1, node_cpus() // config.tensor_parallel_size)


def node_cpus() -> int:
    """The cores this process may run on."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def _follower_main(config: EngineConfig, mc: ModelConfig, rank: int, port: int, kv: list,
                   max_positions: int, conn: Any) -> None:
    """A follower rank: load the shard, say ready, then run every step rank 0 sends until its pipe closes. ``kv``
    is this rank's KV cache, in memory rank 0 maps too (it moves KV in and out of every rank's cache)."""
    from engine.kernels import cpu_kernels

    try:
        torch.set_num_threads(rank_threads(config))
        size = config.tensor_parallel_size
        layout = TPLayout(mc, size, rank)
        if config.device == "cpu":
            cpu_kernels()  # rank 0 built them before starting us: this loads them
        conn.send(("joining", rank))
        comm = open_comm("127.0.0.1", port, rank, size)
        model = load_shard(config, mc, layout, max_positions, comm)
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, which raises it at start
        conn.send(("error", f"rank {rank}: {type(e).__name__}: {e}", traceback.format_exc()))
        return
    conn.send(("ready", rank))
    while True:
        try:
            msg = conn.recv_bytes()
        except (EOFError, OSError):
            return  # rank 0 closed the group or died
        step = pickle.loads(msg)
        if step is None:
            return
        if isinstance(step, dict):  # a LoRA adapter loaded or unloaded at run time (LLMEngine.add_lora)
            conn.send(_follower_lora(step, model, mc, layout, config))
            continue
        input_ids, positions, meta, ranges = step
        try:
            with torch.inference_mode():
                hidden = model(input_ids, positions, meta, kv)
                for lo, hi in ranges:
                    model.compute_logits(hidden[lo:hi])
        except TensorParallelError:
            return  # another rank is gone: rank 0 fails its step and replaces the group


def _follower_lora(cmd: dict, model: "CausalLM", mc: ModelConfig, layout: TPLayout, config: EngineConfig) -> tuple:
    """Run one LoRA command on a follower: ``add`` loads the adapter from its directory (the same files rank 0 read:
    their digest must match), takes this rank's shard and attaches it in rank 0's slot; ``drop`` detaches a slot.
    Answers ("ok",) or ("error", message)."""
    from engine.lora import attach_adapter, detach_adapter, load_adapter, shard_adapter

    try:
        if cmd["op"] == "add":
            ad = load_adapter(cmd["name"], cmd["path"], mc)
            if ad.digest != cmd["digest"]:
                raise ValueError(f"adapter {cmd['name']!r} at {cmd['path']} changed while it was being loaded")
            attach_adapter(model, cmd["slot"], shard_adapter(ad, layout), torch.device(config.device),
                           config.torch_dtype)
        else:
            detach_adapter(model, cmd["slot"])
        return ("ok",)
    except Exception as e:  # noqa: BLE001 - rank 0 raises it for the caller
        return ("error", f"rank {layout.rank}: {e}")


class TPGroup:
    """Rank 0's side of the group: the follower processes, their pipes and rank 0's ``TPComm``."""

    def __init__(self, comm: TPComm, procs: list, conns: list, store: Any, rank_caches: Optional[list] = None
                 ) -> None:
        self.comm, self._procs, self._conns, self._store = comm, procs, conns, store
        self.rank_caches = rank_caches or []
        """Ranks 1..N-1's KV caches (shared memory the followers compute in), for the worker's KV transfers."""
        self.closed = False

    @classmethod
    def start(cls, config: EngineConfig, mc: ModelConfig, num_blocks: int, max_positions: int
              ) -> tuple["TPGroup", "CausalLM"]:
        """Spawn ranks 1..N-1, open the group, load rank 0's shard; returns once every rank is ready.
        Raises ``TensorParallelError`` (a rank's load failed, or it died) with the rank's own error."""
        from engine.kv_cache import allocate_kv_caches

        size = config.tensor_parallel_size
        if mp.current_process().daemon:
            raise TensorParallelError("tensor_parallel_size > 1 cannot start its ranks from a daemonic process "
                                      "(run the engine in the worker's own process)")
        store = dist.TCPStore("127.0.0.1", 0, size, True, timeout=timedelta_s(START_TIMEOUT_S), wait_for_workers=False)
        ctx = mp.get_context("spawn")
        procs, conns, rank_caches = [], [], []
        for rank in range(1, size):
            # the follower computes in this cache; rank 0 maps it too, so a worker's KV transfers reach every rank
            kv = allocate_kv_caches(TPLayout(mc, size, rank).local_config(), num_blocks, config.block_size,
                                    config.cache_dtype, torch.device(config.device))
            for k, v in kv:
                k.share_memory_()
                v.share_memory_()
            rank_caches.append(kv)
            parent, child = ctx.Pipe()
            p = ctx.Process(target=_follower_main, args=(config, mc, rank, store.port, kv, max_positions,
                                                         child), name=f"pdserve-tp-rank{rank}", daemon=True)
            p.start()
            child.close()
            procs.append(p)
            conns.append(parent)
        group = None
        try:
            deadline = time.monotonic() + START_TIMEOUT_S
            cls._expect(procs, conns, "joining", deadline)  # every rank is up before rank 0 blocks on the group
            comm = open_comm("127.0.0.1", store.port, 0, size, master=store)
            group = cls(comm, procs, conns, store, rank_caches)
            model = load_shard(config, mc, TPLayout(mc, size, 0), max_positions, comm)
            cls._expect(procs, conns, "ready", deadline)
        except BaseException:
            if group is not None:
                group.close()
            else:
                cls(None, procs, conns, store).close()  # type: ignore[arg-type]
            raise
        log.info("tensor parallel: %d ranks ready (%s)", size, ", ".join(f"rank {r} pid {p.pid}"
                                                                       for r, p in enumerate(procs, start=1)))
        return group, model

    @staticmethod
    def _expect(procs: list, conns: list, what: str, deadline: float) -> None:
        """Wait for message ``what`` from every follower; a rank's reported error, exit or lateness raises."""
        for rank, conn in enumerate(conns, start=1):
            while not conn.poll(0.2):
                if not procs[rank - 1].is_alive():
                    raise TensorParallelError(f"tensor-parallel rank {rank} exited while starting "
                                              f"(exit code {procs[rank - 1].exitcode})")
                if time.monotonic() > deadline:
                    raise TensorParallelError(f"tensor-parallel rank {rank} did not start within "
                                              f"{START_TIMEOUT_S:.0f} s")
            try:
                msg = conn.recv()
            except (EOFError, OSError):
                procs[rank - 1].join(5.0)
                raise TensorParallelError(f"tensor-parallel rank {rank} exited while starting "
                                          f"(exit code {procs[rank - 1].exitcode})") from None
            if msg[0] == "error":
                raise TensorParallelError(f"tensor-parallel {msg[1]}")
            if msg[0] != what:
                raise TensorParallelError(f"tensor-parallel rank {rank} said {msg[0]!r}, expected {what!r}")

    def dead_ranks(self) -> list[int]:
        """Follower ranks whose process has exited."""
        return [i for i, p in enumerate(self._procs, start=1) if not p.is_alive()]

    def send_step(self, input_ids: Tensor, positions: Tensor, meta: Any, ranges: list[tuple[int, int]]) -> None:
        """Every follower gets the step's inputs (one pickled message down each pipe)."""
        msg = pickle.dumps((input_ids, positions, meta, ranges), protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for c in self._conns:
                c.send_bytes(msg)
        except (OSError, ValueError) as e:
            raise TensorParallelError(f"tensor-parallel ranks {self.dead_ranks() or '?'} gone: {e}") from e

    def lora_add(self, slot: int, adapter: Any) -> None:
        """Every follower loads ``adapter`` (engine.lora.LoRAAdapter, as rank 0 read it) from its directory and
        attaches its shard in ``slot``; the first follower's refusal is raised as ValueError (those that attached
        it detach it again)."""
        self._lora({"op": "add", "slot": slot, "name": adapter.name, "path": adapter.path,
                    "digest": adapter.digest}, undo={"op": "drop", "slot": slot})

    def lora_drop(self, slot: int) -> None:
        """Every follower detaches the adapter in ``slot``."""
        self._lora({"op": "drop", "slot": slot})

    def _lora(self, cmd: dict, undo: Optional[dict] = None, timeout_s: float = 120.0) -> None:
        msg = pickle.dumps(cmd, protocol=pickle.HIGHEST_PROTOCOL)
        try:
            for c in self._conns:
                c.send_bytes(msg)
            replies = []
            for rank, c in enumerate(self._conns, start=1):
                if not c.poll(timeout_s):
                    raise TensorParallelError(f"tensor-parallel rank {rank} did not answer a LoRA {cmd['op']} in "
                                              f"{timeout_s:g} s")
                replies.append(c.recv())
        except (OSError, EOFError, ValueError) as e:
            raise TensorParallelError(f"tensor-parallel ranks {self.dead_ranks() or '?'} gone: {e}") from e
        errors = [r[1] for r in replies if r[0] != "ok"]
        if errors:
            if undo is not None:
                self._lora(undo)
            raise ValueError(errors[0])

    def close(self, timeout_s: float = 5.0) -> None:
        """End every follower (a closed pipe ends its loop; past ``timeout_s`` it is killed). Idempotent."""
        if self.closed:
            return
        self.closed = True
        for c in self._conns:
            try:
                c.send_bytes(pickle.dumps(None))
            except (OSError, ValueError):
                pass
            c.close()
        deadline = time.monotonic() + timeout_s
        for p in self._procs:
            p.join(max(0.0, deadline - time.monotonic()))
            if p.is_alive():
                p.kill()
                p.join(1.0)
        if self.comm is not None:
            self.comm.pg = None


class TPModelRunner(ModelRunner):
    """Rank 0's runner: each step's inputs go to every follower before rank 0 runs the same forward."""

    def __init__(self, group: TPGroup, *args: Any, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.group = group

    def _before_forward(self, input_ids: Tensor, positions: Tensor, meta: Any, num_sample_rows: int,
                        samples: bool) -> None:
        if self.group.closed:
            raise TensorParallelError("the tensor-parallel group is closed")
        dead = self.group.dead_ranks()
        if dead:
            raise TensorParallelError(f"tensor-parallel rank(s) {dead} died")
        ranges = self.logit_ranges(num_sample_rows, samples)
        self.group.send_step(input_ids, positions, meta, ranges)

    def logit_ranges(self, num_sample_rows: int, samples: bool) -> list[tuple[int, int]]:
        """The hidden rows this step turns into logits, in the order ``execute`` does: each prompt-logprobs chunk,
        then the sampling rows (each a collective every rank must join)."""
        offsets = self.prompt_row_offsets()
        out = [(num_sample_rows + offsets[i] + a, num_sample_rows + offsets[i] + b) for i, a, b in self.prompt_chunks()]
        if samples:
            out.append((0, num_sample_rows))
        return out

