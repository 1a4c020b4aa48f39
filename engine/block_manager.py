"""Ownership of the paged KV cache's blocks, with automatic prefix caching.

Lifecycle: one ``BlockManager`` per engine, sized once from the KV cache. The
scheduler grows a sequence's block table with ``ensure`` before each step that
writes K/V past its last block (``False`` = not enough free blocks: the caller
waits or preempts), the decode role takes a whole table up front with
``allocate`` (``reserve``), and every path that ends a sequence (finish, abort,
preemption, release of a held prefill) hands its table back with ``free``.
Blocks carry reference counts so a table can be shared (``fork``); a block goes
back to the free list only when its last holder frees it.

Prefix caching (``enable_caching``, vLLM v1's design): once a block is full its
content is named by a chained key, (key of the previous block, its tokens), and
``register`` records key -> block. A freed block keeps its content and its key
while it sits in the free list, which is kept in LRU order; ``allocate`` takes
the least recently freed block and only then forgets its key (eviction). A new
sequence asks ``lookup`` for the longest run of its leading full blocks that is
cached and takes them with ``acquire`` (refcount + 1, out of the free list), so
their K/V is not computed again. Full blocks are never written again, so sharing
them between running sequences is safe. Keys compare the tokens themselves, so a
hit is exact up to a collision of the 64-bit hash of the parent key.

Block hashes are process-independent (``block_hash``: blake2b-64 over the parent's hash and the block's
tokens as little-endian uint64s; the first block's parent is ``ROOT_HASH``), so a router computing
``prefix_block_hashes`` from a prompt names the same blocks the engines name in their KV events. With
``enable_events()`` the manager also records what its prefix cache gains and loses, for a worker to
publish (``take_events``, drained by the owner's thread after each step): ``(STORED, key)`` when a block is
registered, ``(REMOVED, hash)`` when a cached block is evicted, ``(CLEARED,)`` on ``reset_prefix_cache``.
"""
from __future__ import annotations

from array import array
from collections import OrderedDict
from hashlib import blake2b
from typing import Optional, Sequence

BlockKey = tuple
"""(parent block's hash, tuple of the block's token ids, this block's hash = block_hash(parent, tokens))."""
ROOT_HASH = 0
"""The parent hash of a prompt's first block."""
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
"""Kinds of the prefix-cache events ``BlockManager.take_events`` returns."""


def block_hash(parent: int, token_ids: Sequence[int]) -> int:
    """The process-independent 64-bit hash of a block: blake2b (8-byte digest) of the little-endian uint64s
    (parent hash, *token ids), read as an unsigned little-endian integer. About 1.3 us per 16-token block."""
    return int.from_bytes(blake2b(array("Q", (parent, *token_ids)).tobytes(), digest_size=8).digest(), "little")


def salted_root(root: int, cache_salt: Optional[str]) -> int:
    """The prefix-cache root of a request with vLLM's ``cache_salt`` (None or "": ``root`` itself): blake2b-64 of
    the root and the salt, so prompts under different salts share no cached block (one tenant cannot learn another's
    prompts from cache hits), and every engine and router computes the same root from the same salt."""
    if not cache_salt:
        return root
    h = blake2b(b"pdserve-salt\0" + root.to_bytes(8, "little") + cache_salt.encode("utf-8", "surrogatepass"),
                digest_size=8)
    return int.from_bytes(h.digest(), "little") or 1


def block_keys(token_ids: Sequence[int], block_size: int, num_blocks: int,
               parent: Optional[BlockKey] = None, root: int = ROOT_HASH) -> list[BlockKey]:
    """Chained keys of the first ``num_blocks`` full blocks of token_ids (after ``parent``; the first block's
    parent hash is ``root``: ``ROOT_HASH``, or a LoRA adapter's, engine/lora.py)."""
    out: list[BlockKey] = []
    h = root if parent is None else parent[2]
    for i in range(num_blocks):
        toks = tuple(token_ids[i * block_size:(i + 1) * block_size])
        nh = block_hash(h, toks)
        out.append((h, toks, nh))
        h = nh
    return out


def prefix_block_hashes(token_ids: Sequence[int], block_size: int, root: int = ROOT_HASH) -> list[int]:
    """Hashes of the prefix-cache keys of a prompt's full blocks, as an engine with ``block_size`` names
    them (the last token always recomputes, so a prompt of exactly k blocks yields k - 1; ``root``: a LoRA
    adapter's, ``engine.lora.lora_key_root``). Routers match these against the engines' KV events (and their own
    mirror), without knowing the keys' shape."""
    if block_size < 1:
        return []
    return [k[2] for k in block_keys(token_ids, block_size, (len(token_ids) - 1) // block_size, root=root)]


class BlockManager:
    """LRU free list + reference counts over block ids 0..num_blocks-1, and the prefix cache index."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        # free blocks, least recently freed first; a cached one keeps its key until it is reused
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._refs = [0] * num_blocks
        self._key_of: list[Optional[BlockKey]] = [None] * num_blocks
        self._cached: dict[BlockKey, int] = {}
        self._events: Optional[list[tuple]] = None  # prefix-cache events since the last take_events()

    @property
    def num_free_blocks(self) -> int:
        """Blocks no sequence holds (cached ones included: they are evicted on demand)."""
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take num_blocks fresh blocks (refcount 1), evicting the least recently freed cached ones;
        ValueError if not enough are free."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {len(self._free)} free")
        out = []
        for _ in range(num_blocks):
            b, _ = self._free.popitem(last=False)
            key = self._key_of[b]
            if key is not None:
                self._key_of[b] = None
                if self._cached.get(key) == b:
                    del self._cached[key]
                    if self._events is not None:
                        self._events.append((REMOVED, key[2]))
            self._refs[b] = 1
            out.append(b)
        return out

    def ensure(self, block_table: list[int], num_tokens: int) -> bool:
        """Append blocks to block_table (in place) until it holds num_tokens; False and no change if short."""
        need = self.blocks_for(num_tokens) - len(block_table)
        if need <= 0:
            return True
        if need > len(self._free):
            return False
        block_table.extend(self.allocate(need))
        return True

    def fork(self, block_table: list[int]) -> list[int]:
        """Share every block of block_table with a new holder (refcount + 1); returns the new table."""
        for b in block_table:
            if self._refs[b] <= 0:
                raise ValueError(f"cannot fork free block {b}")
            self._refs[b] += 1
        return list(block_table)

    def free(self, block_table: list[int]) -> None:
        """Drop one reference to each block; blocks with none left return to the free list.

        The table's tail goes back first, so its last blocks are evicted before its first ones
        (a later request is likelier to share a short prefix than a long one)."""
        for b in reversed(block_table):
            if self._refs[b] <= 0:
                raise ValueError(f"double free of block {b}")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free[b] = None
        block_table.clear()

    def ref_count(self, block: int) -> int:
        return self._refs[block]

    # -- prefix cache ---------------------------------------------------------------------------

    def lookup(self, keys: Sequence[BlockKey]) -> list[int]:
        """Blocks holding the longest cached run of ``keys`` from the first one (not acquired)."""
        if not self.enable_caching:
            return []
        out = []
        for key in keys:
            b = self._cached.get(key)
            if b is None:
                break
            out.append(b)
        return out

    def acquire(self, blocks: Sequence[int]) -> list[int]:
        """Take a reference to cached blocks (out of the free list if no one held them); the new table."""
        for b in blocks:
            if self._refs[b] == 0:
                del self._free[b]
            self._refs[b] += 1
        return list(blocks)

    def register(self, block: int, key: BlockKey) -> None:
        """Record that full block ``block`` holds the tokens named by ``key`` (first holder wins)."""
        if not self.enable_caching or self._key_of[block] is not None:
            return
        if key not in self._cached:
            self._cached[key] = block
            self._key_of[block] = key
            if self._events is not None:
                self._events.append((STORED, key))

    @property
    def num_blocks_in_use(self) -> int:
        """Blocks some sequence holds now (cached free blocks not counted): what keeps ``reset_prefix_cache`` from
        running."""
        return sum(1 for r in self._refs if r)

    def reset_prefix_cache(self) -> bool:
        """Forget every cached key (vLLM's reset_prefix_cache): only while no block is held; False otherwise."""
        if any(self._refs):
            return False
        self._cached.clear()
        self._key_of = [None] * self.num_blocks
        if self._events is not None:
            self._events.append((CLEARED,))
        return True

    # -- KV events ------------------------------------------------------------------------------

    def enable_events(self) -> None:
        """Start recording prefix-cache events (the owner must drain them with ``take_events``)."""
        if self._events is None:
            self._events = []

    def take_events(self) -> list[tuple]:
        """The events recorded since the last call, oldest first (empty when events are off)."""
        ev = self._events
        if not ev:
            return []
        self._events = []
        return ev
