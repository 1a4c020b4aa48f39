"""KV events from the engine's prefix cache: stable block hashes, the events a real engine records, vLLM's encoding.

- block hashes are the same in every process (PYTHONHASHSEED and None's address do not enter them), so a
  router's ``prefix_block_hashes`` names the blocks the engines name in their events;
- a real ``LLMEngine`` (tiny model) records a stored event for every full block it caches, a removed event for
  every one it evicts, and a clear on reset; the stored hashes are the router's hashes of the prompt;
- the encoding is vLLM's: bytes pdserve writes decode with vLLM's struct definitions (written here from the
  schema, as ``vllm/distributed/kv_events.py`` and its example subscriber define them) and the other way round.
"""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional, Union

import msgspec
import pytest

from engine import prefix_block_hashes
from engine.block_manager import CLEARED, REMOVED, STORED, BlockManager, block_keys
from engine.config import EngineConfig
from engine.kv_events import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, decode_kv_batch,
                              encode_kv_batch, kv_batch_from_raw)
from engine.llm_engine import LLMEngine
from engine.sampling_params import SamplingParams

ROOT = Path(__file__).resolve().parents[2]


# ---- vLLM's definitions, written from its schema (not imported: vLLM is not a dependency) ----------------
class VEventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: Optional[int] = None


class VKVCacheEvent(msgspec.Struct, array_like=True, omit_defaults=True, gc=False, tag=True):
    pass


class VBlockStored(VKVCacheEvent, tag="BlockStored"):
    block_hashes: list[Union[bytes, int]]
    parent_block_hash: Optional[Union[bytes, int]]
    token_ids: list[int]
    block_size: int
    lora_id: Optional[int]
    medium: Optional[str]


class VBlockRemoved(VKVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[Union[bytes, int]]
    medium: Optional[str]


class VAllBlocksCleared(VKVCacheEvent, tag="AllBlocksCleared"):
    pass


class VKVEventBatch(VEventBatch):
    events: list[Union[VBlockStored, VBlockRemoved, VAllBlocksCleared]]


def test_block_hashes_are_the_same_in_every_process():
    prompt = list(range(3, 40))
    code = ("import json; from engine import prefix_block_hashes; "
            f"print(json.dumps(prefix_block_hashes({prompt!r}, 16)))")
    seen = set()
    for seed in ("0", "12345"):
        out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60,
                             env={"PYTHONHASHSEED": seed, "PATH": ""}, check=True)
        seen.add(tuple(json.loads(out.stdout)))
    assert seen == {tuple(prefix_block_hashes(prompt, 16))}
    hashes = prefix_block_hashes(prompt, 16)
    assert len(hashes) == 2 and all(0 <= h < 2**64 for h in hashes)


def test_block_manager_records_stored_removed_and_cleared():
    bm = BlockManager(2, 2, enable_caching=True)
    keys = block_keys([5, 6, 7, 8], 2, 2)
    t = bm.allocate(2)
    for b, k in zip(t, keys):
        bm.register(b, k)
    assert bm.take_events() == []  # off until enabled
    bm.free(t)
    bm.enable_events()
    t = bm.allocate(2)  # both cached blocks are reused: two evictions (the table's tail went back first)
    for b, k in zip(t, block_keys([1, 2, 3, 4], 2, 2)):
        bm.register(b, k)
    bm.register(t[0], keys[0])  # a block that already has a key: nothing new cached
    got = bm.take_events()
    assert [e[0] for e in got] == [REMOVED, REMOVED, STORED, STORED]
    assert sorted(e[1] for e in got[:2]) == sorted(k[2] for k in keys)
    assert bm.take_events() == []
    assert bm.reset_prefix_cache() is False  # blocks are held: nothing forgotten
    bm.free(t)
    assert bm.reset_prefix_cache() is True and bm.take_events() == [(CLEARED,)]
    assert bm.lookup(block_keys([1, 2, 3, 4], 2, 2)) == []


def test_a_real_engine_stores_the_routers_hashes_and_evicts_under_pressure():
    eng = LLMEngine(EngineConfig(model="tiny", num_kv_blocks=12, block_size=4, num_threads=1))
    eng.block_manager.enable_events()
    greedy = SamplingParams(max_tokens=2, temperature=0.0)
    prompt = list(range(10, 31))  # 21 tokens: 5 full blocks cached by the prefill
    eng.add_request("a", prompt, greedy)
    while eng.has_unfinished_requests():
        eng.step()
    batch = kv_batch_from_raw(eng.block_manager.take_events(), 4)
    stored = [h for e in batch.events if isinstance(e, BlockStored) for h in e.block_hashes]
    assert stored[:5] == prefix_block_hashes(prompt, 4)
    first = batch.events[0]
    assert first.parent_block_hash is None and first.token_ids[:4] == prompt[:4] and first.block_size == 4
    # another long prompt needs the freed blocks: the first prompt's blocks are evicted, and said so
    eng.add_request("b", list(range(500, 541)), greedy)
    while eng.has_unfinished_requests():
        eng.step()
    removed = {h for e in kv_batch_from_raw(eng.block_manager.take_events(), 4).events
               if isinstance(e, BlockRemoved) for h in e.block_hashes}
    assert removed & set(prefix_block_hashes(prompt, 4))


def test_the_encoding_is_vllms_both_ways():
    raw = [(STORED, k) for k in block_keys(list(range(8)), 4, 2)] + [(REMOVED, 77), (REMOVED, 78), (CLEARED,)]
    ours = kv_batch_from_raw(raw, 4, "CPU", ts=12.5)
    assert [type(e) for e in ours.events] == [BlockStored, BlockRemoved, AllBlocksCleared]  # runs coalesced
    data = encode_kv_batch(ours)
    assert decode_kv_batch(data) == ours
    theirs = msgspec.msgpack.Decoder(VKVEventBatch).decode(data)
    assert theirs.ts == 12.5 and theirs.data_parallel_rank is None
    st, rm, cl = theirs.events
    assert isinstance(st, VBlockStored) and st.block_hashes == ours.events[0].block_hashes
    assert (st.parent_block_hash, st.token_ids, st.block_size, st.medium) == (None, list(range(8)), 4, "CPU")
    assert isinstance(rm, VBlockRemoved) and rm.block_hashes == [77, 78] and isinstance(cl, VAllBlocksCleared)
    # what a vLLM engine writes (with a data-parallel rank) decodes here
    v = VKVEventBatch(ts=1.0, events=[VBlockStored([1, 2], 9, list(range(8)), 4, None, "GPU"), VBlockRemoved([1], None)],
                      data_parallel_rank=3)
    back = decode_kv_batch(msgspec.msgpack.encode(v))
    assert back.data_parallel_rank == 3 and back.events[0] == BlockStored([1, 2], 9, list(range(8)), 4, None, "GPU")
    with pytest.raises(ValueError, match="batch"):
        decode_kv_batch(b"\x93\x01\x02")
    with pytest.raises(ValueError, match="batch"):
        decode_kv_batch(msgspec.msgpack.encode([1.0, [["Unknown", 1]]]))
