"""KV cache events: what an engine's prefix cache gained and lost, in vLLM's schema and encoding.

Lifecycle: an engine's ``BlockManager`` (with ``enable_events()``) records raw events as its prefix cache
changes; the worker drains them after each step and hands them to its publisher
(``worker_common.kv_events``), which turns them into one ``KVEventBatch`` (``kv_batch_from_raw``), encodes it
(``encode_kv_batch``) and appends it, with a sequence number and its generation, to the worker's Redis stream
(``kv_stream_key``). Every router decodes the entries (``decode_kv_batch``) into its global index
(``router.kv.index``). A consumer that missed entries reads the worker's latest ``KVSnapshot``
(``kv_snapshot_key``) and replays the stream after it.

The structs are vLLM's (``vllm/distributed/kv_events.py``: msgspec ``array_like`` structs, events tagged
by class name, msgpack-encoded), so a consumer built for vLLM (llm-d's kv-cache manager, Dynamo's router)
decodes pdserve's payload bytes unchanged. Block hashes are the engine's ``block_hash`` values (unsigned
64-bit ints, chained: ``engine.block_manager``); ``medium`` is "GPU" or "CPU" (where the cache lives).
Nothing here touches torch, Redis or a thread: it is the wire contract both sides import.
"""
from __future__ import annotations

import time
from typing import Any, Optional, Sequence, Union

import msgspec

from engine.block_manager import CLEARED, REMOVED, ROOT_HASH, STORED

KV_ENTRY_SEQ = b"seq"
"""Stream entry field: the batch's sequence number (decimal), 0 for a publisher's first batch, +1 per batch."""
KV_ENTRY_GEN = b"gen"
"""Stream entry field: the publisher's generation (a fresh random id per publisher start)."""
KV_ENTRY_BATCH = b"batch"
"""Stream entry field: the vLLM-encoded ``KVEventBatch`` bytes."""
KV_ENTRY_LOAD = b"load"
"""Optional stream entry field: the worker's load when the batch was made, "running,waiting,queued_prompt_tokens"
(a batch with no events carries only this: routers learn a worker's load within a step, not a heartbeat)."""


class EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """vLLM's batch header: when it was made and its events."""

    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class KVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    """Base of every KV cache event (tagged with its class name on the wire)."""


class BlockStored(KVCacheEvent):
    """Full blocks named in the prefix cache: ``block_hashes`` chained from ``parent_block_hash`` (None: the
    prompt's first block), with their ``token_ids`` (``block_size`` per block)."""

    block_hashes: list[int]
    parent_block_hash: Optional[int]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class BlockRemoved(KVCacheEvent):
    """Blocks evicted from the prefix cache."""

    block_hashes: list[int]
    medium: Optional[str]


class AllBlocksCleared(KVCacheEvent):
    """The prefix cache forgot everything (a reset, or a publisher's first batch: start from empty)."""


class KVEventBatch(EventBatch):
    """One step's events (vLLM's ``KVEventBatch``)."""

    events: list[Union[BlockStored, BlockRemoved, AllBlocksCleared]]


class KVSnapshot(msgspec.Struct, array_like=True, gc=False):
    """pdserve's resync record (not a vLLM type): a publisher's whole cache after batch ``seq``, and the
    stream entry id a consumer replays after (every batch with a larger seq follows that id)."""

    generation: str
    seq: int
    stream_id: str
    block_size: int
    block_hashes: list[int]


_ENCODER = msgspec.msgpack.Encoder()
_BATCH_DECODER = msgspec.msgpack.Decoder(KVEventBatch)
_SNAPSHOT_DECODER = msgspec.msgpack.Decoder(KVSnapshot)


def kv_stream_key(namespace: str, worker_id: str) -> str:
    """The Redis stream a worker appends its batches to (its replay buffer, trimmed to a length)."""
    return f"{namespace}:kvev:{worker_id}"


def kv_snapshot_key(namespace: str, worker_id: str) -> str:
    """The Redis key holding a worker's latest ``KVSnapshot``."""
    return f"{namespace}:kvsnap:{worker_id}"


def encode_kv_batch(batch: KVEventBatch) -> bytes:
    return _ENCODER.encode(batch)


def decode_kv_batch(data: bytes) -> KVEventBatch:
    """A batch from its bytes; ValueError (naming what is wrong) for anything that is not one."""
    try:
        return _BATCH_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as e:
        raise ValueError(f"batch: not a vLLM KVEventBatch: {e}") from None


def encode_kv_snapshot(snap: KVSnapshot) -> bytes:
    return _ENCODER.encode(snap)


def decode_kv_snapshot(data: bytes) -> KVSnapshot:
    try:
        return _SNAPSHOT_DECODER.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError, TypeError) as e:
        raise ValueError(f"snapshot: not a pdserve KV snapshot: {e}") from None


def kv_batch_from_raw(raw: Sequence[tuple], block_size: int, medium: Optional[str] = None,
                   ts: Optional[float] = None, lora_roots: Optional[dict[int, int]] = None) -> KVEventBatch:
    """vLLM events from ``BlockManager.take_events()`` tuples, in order: consecutive stores of one chain
    become one ``BlockStored``, consecutive removals one ``BlockRemoved``. ``lora_roots`` (a LoRA adapter's
    first-block parent hash -> its id, engine/lora.py): a chain starting at one is reported as a prompt's first
    blocks (no parent) with that ``lora_id``, as vLLM reports an adapter's blocks."""
    roots = lora_roots or {}
    events: list[Any] = []
    for ev in raw:
        kind = ev[0]
        last = events[-1] if events else None
        if kind == STORED:
            parent, toks, h = ev[1]
            if isinstance(last, BlockStored) and last.block_hashes[-1] == parent:
                last.block_hashes.append(h)
                last.token_ids.extend(toks)
            else:
                first = parent == ROOT_HASH or parent in roots
                events.append(BlockStored([h], None if first else parent, list(toks), block_size, roots.get(parent),
                                          medium))
        elif kind == REMOVED:
            if isinstance(last, BlockRemoved):
                last.block_hashes.append(ev[1])
            else:
                events.append(BlockRemoved([ev[1]], medium))
        elif kind == CLEARED:
            events.append(AllBlocksCleared())
        else:
            raise ValueError(f"raw event kind must be one of {(STORED, REMOVED, CLEARED)}, got {kind!r}")
    return KVEventBatch(ts=time.time() if ts is None else ts, events=events)
