"""The paged KV cache tensors.

Lifecycle: allocated once at engine start (``allocate_kv_caches``), sized either
by an explicit block count or by a memory budget (``num_blocks_for_budget``),
and never reallocated: every layer owns a (K, V) pair of shape
[num_blocks, block_size, num_kv_heads, head_dim] that the attention writes into
through slot indices and reads back through block tables. The same tensors are
what the KV transfer layer sends and receives (by block id), which is why the
layout is part of the engine's public interface.
"""
from __future__ import annotations

import logging
from typing import Callable

import torch
from torch import Tensor

from engine.config import ModelConfig

log = logging.getLogger(__name__)


def row_width(mc: ModelConfig, dtype: torch.dtype) -> int:
    """Elements per cached (token, KV head) row: head_dim, plus 4 bytes of float32 scale for int8
    (engine/quant.py's ``quantize_kv``; an fp8 row has no scale of its own: vLLM's default of 1)."""
    return mc.head_dim + 4 if dtype == torch.int8 else mc.head_dim


def bytes_per_block(mc: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """K and V of all layers for one block."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * mc.num_hidden_layers * block_size * mc.num_key_value_heads * row_width(mc, dtype) * elem


def num_blocks_for_budget(mc: ModelConfig, block_size: int, dtype: torch.dtype, budget_bytes: int) -> int:
    """How many blocks fit in budget_bytes; ValueError if not even one."""
    n = budget_bytes // bytes_per_block(mc, block_size, dtype)
    if n < 1:
        raise ValueError(f"kv_cache_memory_bytes={budget_bytes} is smaller than one KV block "
                         f"({bytes_per_block(mc, block_size, dtype)} bytes)")
    return int(n)


def allocate_kv_caches(mc: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device, shared: bool = False) -> list[tuple[Tensor, Tensor]]:
    """Zeroed (K, V) per layer, each [num_blocks, block_size, num_kv_heads, row_width] (row_width is
    head_dim, or head_dim + 4 for an int8 cache: each row carries its scale), all views of one allocation at equal
    distances (aligned to 512 bytes or more), so one copy can take every layer. ``shared``: every tensor is a
    view of one ``transport.shared_memory.SharedSegment`` (CPU; zeroed by the kernel) or one
    ``transport.cuda_ipc.CudaSegment`` (CUDA), which a KV transfer peer on this host reads in place (kvtransfer/shm.py's
    pull)."""
    shape = (num_blocks, block_size, mc.num_key_value_heads, row_width(mc, dtype))
    layers = mc.num_hidden_layers
    if shared and device.type == "cuda":  # one allocation, so one CUDA IPC handle names every layer
        from transport.cuda_ipc import CudaSegment

        each = _stride_bytes(shape, dtype, 512)
        seg = CudaSegment(2 * layers * each, device)
        return _layer_views(lambda off: seg.view(off, shape, dtype), layers, each)
    if shared and device.type == "cpu":
        from transport.shared_memory import shared_memory_unavailable

        why = shared_memory_unavailable()
        if why is None:
            try:
                return _in_segment(layers, shape, dtype)
            except OSError as e:
                why = str(e)
        log.warning("KV cache in private memory, not shared (%s): same-host peers receive its KV by copy", why)
    # private memory, still one allocation with the layers at equal distances: a same-host pull into it copies every
    # layer of a stretch at once (kvtransfer/shm.py's _layer_stack)
    each = _stride_bytes(shape, dtype, 512)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    flat = torch.zeros(2 * layers * each, dtype=torch.uint8, device=device)
    return _layer_views(lambda off: flat[off:off + nbytes].view(dtype).view(shape), layers, each)


def _stride_bytes(shape: tuple, dtype: torch.dtype, align: int) -> int:
    """Bytes from one of a cache's K or V tensors to the next: one tensor's bytes, rounded up to ``align``."""
    return -(-torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size() // align) * align


def _layer_views(view: Callable[[int], Tensor], layers: int, each: int) -> list[tuple[Tensor, Tensor]]:
    """(K, V) per layer, ``view(byte offset)`` at 0, ``each``, 2 x ``each``, ... in the order K0, V0, K1, V1: the
    layout whose layers kvtransfer copies at once (``CacheLayout.layer_step``)."""
    return [(view(2 * i * each), view((2 * i + 1) * each)) for i in range(layers)]


def _in_segment(layers: int, shape: tuple, dtype: torch.dtype) -> list[tuple[Tensor, Tensor]]:
    """Zeroed (K, V) per layer as page-aligned views of one new ``SharedSegment``."""
    from transport.shared_memory import SharedSegment

    each = _stride_bytes(shape, dtype, 4096)  # every tensor page-aligned, as an allocator's would be
    seg = SharedSegment(2 * layers * each)
    return _layer_views(lambda off: seg.view(off, shape, dtype), layers, each)


def share_kv_caches(kv_caches: list[tuple[Tensor, Tensor]]) -> list[tuple[Tensor, Tensor]]:
    """A copy of CPU ``kv_caches`` laid out as ``allocate_kv_caches(shared=True)`` lays a cache out (benchmarks and
    tests that stand in for a prefill worker's cache)."""
    k0 = kv_caches[0][0]
    out = _in_segment(len(kv_caches), tuple(k0.shape), k0.dtype)
    for (k, v), (sk, sv) in zip(kv_caches, out):
        sk.copy_(k)
        sv.copy_(v)
    return out
