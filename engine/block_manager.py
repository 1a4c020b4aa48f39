"""Ownership of the paged KV cache's blocks.

Lifecycle: one ``BlockManager`` per engine, sized once from the KV cache. The
scheduler grows a sequence's block table with ``ensure`` before each step that
writes K/V past its last block (``False`` = not enough free blocks: the caller
waits or preempts), the decode role takes a whole table up front with
``allocate`` (``reserve``), and every path that ends a sequence (finish, abort,
preemption, release of a held prefill) hands its table back with ``free``.
Blocks carry reference counts so a table can be shared (``fork``); a block goes
back to the free list only when its last holder frees it.
"""
from __future__ import annotations

from collections import deque


class BlockManager:
    """Free list + reference counts over block ids 0..num_blocks-1."""

    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self._free: deque[int] = deque(range(num_blocks))
        self._refs = [0] * num_blocks

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def blocks_for(self, num_tokens: int) -> int:
        """Blocks needed to hold num_tokens tokens."""
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        """Take num_blocks fresh blocks (refcount 1); ValueError if not enough are free."""
        if num_blocks < 0:
            raise ValueError(f"num_blocks must be >= 0, got {num_blocks}")
        if num_blocks > len(self._free):
            raise ValueError(f"cannot allocate {num_blocks} blocks: only {len(self._free)} free")
        out = [self._free.popleft() for _ in range(num_blocks)]
        for b in out:
            self._refs[b] = 1
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
        """Drop one reference to each block; blocks with none left return to the free list."""
        for b in reversed(block_table):
            if self._refs[b] <= 0:
                raise ValueError(f"double free of block {b}")
            self._refs[b] -= 1
            if self._refs[b] == 0:
                self._free.append(b)
        block_table.clear()

    def ref_count(self, block: int) -> int:
        return self._refs[block]
