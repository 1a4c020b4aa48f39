"""Paged KV cache layout: validation, and the token-level gather/scatter of frames.

Lifecycle: ``CacheLayout.of`` validates an engine's ``kv_caches`` when a send or
receive is submitted; ``TokenRows`` maps token positions ``0..num_tokens-1`` to
rows of a layer's flattened ``[num_blocks * block_size, heads, head_dim]`` cache
through the transfer's block ids; ``FramePlan`` cuts one frame's payload (layers
``lo..hi-1``, K then V, token-major) into chunks that the channel threads gather
into (sender) or scatter out of (receiver). Because the payload is addressed by
token, not by block, the two sides may use different block sizes.

Chunks whose rows are contiguous in the cache are sent from (or received into)
the cache itself, skipping the staging copy. A cache may also be a slice of the KV heads of a contiguous cache
(``cache[:, :, h0:h1]``, what tensor-parallel resharding moves): its rows then always go through staging.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Optional, Sequence

import torch


@dataclass(frozen=True)
class CacheLayout:
    """Shape facts of one side's paged KV cache."""

    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    device: torch.device
    layer_step: Optional[int] = field(default=None, compare=False)
    """Bytes from each tensor to the next in the order K0, V0, K1, V1, ... where all are contiguous views of one
    storage at that equal distance (one allocation, as ``engine.kv_cache.allocate_kv_caches`` makes a cache), else
    None: a copy may then take every layer at once through one strided view (kvtransfer/shm.py's pull)."""

    @property
    def row_bytes(self) -> int:
        """Bytes of one token's K (or V) in one layer."""
        return self.num_kv_heads * self.head_dim * torch.empty((), dtype=self.dtype).element_size()

    @classmethod
    def of(cls, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> "CacheLayout":
        """Validate the engine's per-layer (k, v) caches; ValueError naming kv_caches otherwise."""
        if not isinstance(kv_caches, (list, tuple)) or len(kv_caches) == 0:
            raise ValueError("kv_caches must be a non-empty list of (k, v) tensor pairs per layer")
        first = None
        for i, pair in enumerate(kv_caches):
            if not isinstance(pair, (list, tuple)) or len(pair) != 2:
                raise ValueError(f"kv_caches[{i}] must be a (k, v) pair")
            for name, t in zip("kv", pair):
                if not isinstance(t, torch.Tensor):
                    raise ValueError(f"kv_caches[{i}].{name} must be a torch.Tensor")
                if t.dim() != 4:
                    raise ValueError(f"kv_caches[{i}].{name} must be [num_blocks, block_size, "
                                     f"num_kv_heads, head_dim], got shape {tuple(t.shape)}")
                if not (t.is_contiguous() or _head_slice(t)):
                    raise ValueError(f"kv_caches[{i}].{name} must be contiguous, or a slice of the KV heads of a "
                                     "contiguous cache")
                if first is None:
                    first = t
                elif t.shape != first.shape or t.dtype != first.dtype or t.device != first.device:
                    raise ValueError(f"kv_caches[{i}].{name} is {tuple(t.shape)} {t.dtype} on {t.device}, "
                                     f"but kv_caches[0].k is {tuple(first.shape)} {first.dtype} on {first.device}")
        assert first is not None
        nb, bs, nh, hd = first.shape
        if min(nb, bs, nh, hd) <= 0:
            raise ValueError(f"kv_caches tensors must have no empty dimension, got {tuple(first.shape)}")
        return cls(len(kv_caches), nb, bs, nh, hd, first.dtype, first.device, _equal_step(kv_caches))


def _equal_step(kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> Optional[int]:
    """``CacheLayout.layer_step`` of caches ``of`` has checked (one shape, dtype and device)."""
    first = kv_caches[0][0]
    step = kv_caches[0][1].data_ptr() - first.data_ptr()
    if step < first.numel() * first.element_size():
        return None
    p0, k, base = first.data_ptr(), 0, first.untyped_storage().data_ptr()
    for pair in kv_caches:
        for t in pair:  # (separate allocations may happen to lie at equal distances: one storage is asked for)
            if t.data_ptr() != p0 + k * step or not t.is_contiguous() or t.untyped_storage().data_ptr() != base:
                return None
            k += 1
    return step


def _head_slice(t: torch.Tensor) -> bool:
    """Whether ``t`` is ``cache[:, :, h0:h1]`` of a contiguous [blocks, block_size, heads, head_dim] cache: each
    token's row of its heads is one contiguous run, so rows gather and scatter in place (a tensor-parallel rank's
    share of a peer's heads, kvtransfer/sharding.py)."""
    return (t.dim() == 4 and t.stride(3) == 1 and t.stride(2) == t.shape[3]
            and t.stride(0) == t.shape[1] * t.stride(1) and t.stride(1) >= t.shape[2] * t.shape[3])


def block_rows(block_ids: Sequence[int], block_size: int, lo: int, hi: int) -> torch.Tensor:
    """[hi - lo] int64 (CPU): the flat cache rows of positions lo..hi-1 of a sequence whose blocks are ``block_ids``
    (two tensor ops, whatever the length)."""
    return (torch.tensor(block_ids, dtype=torch.int64)[:, None] * block_size
            + torch.arange(block_size, dtype=torch.int64)).reshape(-1)[lo:hi]


class TokenRows:
    """Flat cache row of every token position of one transfer, on one side: token positions
    ``first_token .. num_tokens - 1`` of the sequence whose blocks are ``block_ids`` (a delta transfer skips the
    ``first_token`` positions the receiver already holds; ``self.num_tokens`` counts the positions moved)."""

    def __init__(self, layout: CacheLayout, block_ids: Sequence[int], num_tokens: int, field: str,
                 first_token: int = 0):
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) or num_tokens <= 0:
            raise ValueError(f"num_tokens must be a positive int, got {num_tokens!r}")
        if isinstance(first_token, bool) or not isinstance(first_token, int) or not 0 <= first_token < num_tokens:
            raise ValueError(f"first_token must be an int in [0, num_tokens={num_tokens}), got {first_token!r}")
        bs = layout.block_size
        needed = -(-num_tokens // bs)
        try:
            ids = [int(i) for i in list(block_ids)[:needed]]
        except (TypeError, ValueError):
            raise ValueError(f"{field} must be a sequence of ints") from None
        if len(ids) < needed:
            raise ValueError(f"{field} has {len(ids)} blocks of {bs} tokens, too few for num_tokens={num_tokens}")
        if min(ids) < 0 or max(ids) >= layout.num_blocks:
            raise ValueError(f"{field} must be in [0, {layout.num_blocks}), got {ids}")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{field} must not repeat a block, got {ids}")
        self._device = layout.device
        self.block_size = bs
        self.block_ids = ids
        """The blocks holding positions 0 .. num_tokens - 1 (a pull names them to the peer)."""
        self.first_token = first_token
        self.num_tokens = num_tokens - first_token

    @functools.cached_property
    def rows(self) -> torch.Tensor:
        """[num_tokens] int64 on the cache's device: the flat cache row of each moved position. Built on first use
        (a pull between caches in one allocation each never needs it; the checks above run at send/recv time)."""
        return block_rows(self.block_ids, self.block_size, self.first_token,
                          self.first_token + self.num_tokens).to(self._device)

    @functools.cached_property
    def _run(self) -> list[int]:
        """Run id per block: tokens [a, b) are one contiguous stretch iff their blocks share a run."""
        ids = self.block_ids
        run = [0] * len(ids)
        for j in range(1, len(ids)):
            run[j] = run[j - 1] + (ids[j] != ids[j - 1] + 1)
        return run

    def contiguous(self, a: int, b: int) -> bool:
        """True when rows a..b-1 of this transfer (positions first_token + a ..) are one contiguous stretch."""
        a, b = a + self.first_token, b + self.first_token
        return self._run[a // self.block_size] == self._run[(b - 1) // self.block_size]


@dataclass(frozen=True)
class Segment:
    """A run of one frame chunk that lies in one layer's K or V."""

    layer: int
    kv: int
    """0 for K, 1 for V."""
    tok_lo: int
    tok_hi: int


SEGMENT_ALONE_BYTES = 256 << 10
"""Segments at least this big get messages of their own (zero-copy when their rows are contiguous);
smaller ones are packed, since a message costs about as much as moving this many bytes on loopback."""


class FramePlan:
    """How one frame's payload (layers lo..hi-1, each K rows then V rows) is cut into messages.

    A payload of at most ``inline_bytes`` rides whole in the head message. Otherwise each
    (layer, K|V) *segment* of ``num_tokens`` rows is cut into chunks of at most
    ``chunk_bytes`` that never straddle two segments (so a chunk over contiguous cache rows
    is sent from, or received into, the cache itself), and segments under
    ``SEGMENT_ALONE_BYTES`` are packed several to a message. Both sides derive the same
    plan from header fields.
    """

    def __init__(self, row_bytes: int, num_tokens: int, layer_lo: int, layer_hi: int, chunk_bytes: int,
                 inline_bytes: int = 0):
        self.row_bytes = row_bytes
        self.num_tokens = num_tokens
        self.layer_lo, self.layer_hi = layer_lo, layer_hi
        nseg = (layer_hi - layer_lo) * 2
        self.total_rows = nseg * num_tokens
        self.payload_nbytes = self.total_rows * row_bytes
        self.inline_rows = self.total_rows if self.payload_nbytes <= inline_bytes else 0
        self.inline_nbytes = self.inline_rows * row_bytes
        self.ranges: list[tuple[int, int]] = []
        per = max(1, chunk_bytes // row_bytes)
        self.chunk_bytes = per * row_bytes
        if self.inline_rows:
            return
        if num_tokens >= per or num_tokens * row_bytes >= SEGMENT_ALONE_BYTES:
            for seg in range(nseg):
                base = seg * num_tokens
                self.ranges += [(base + a, base + min(a + per, num_tokens)) for a in range(0, num_tokens, per)]
        else:
            k = max(1, per // num_tokens)
            self.ranges = [(s * num_tokens, min(s + k, nseg) * num_tokens) for s in range(0, nseg, k)]

    @property
    def sizes(self) -> list[int]:
        """Byte size of each payload message after the head message."""
        return [(b - a) * self.row_bytes for a, b in self.ranges]

    @property
    def num_chunks(self) -> int:
        return len(self.ranges)

    def segments(self, r: int, end: int) -> list[Segment]:
        """The (layer, K|V, token range) pieces of payload rows r..end-1, in payload order."""
        out = []
        while r < end:
            seg, tok = divmod(r, self.num_tokens)
            take = min(end - r, self.num_tokens - tok)
            out.append(Segment(self.layer_lo + seg // 2, seg % 2, tok, tok + take))
            r += take
        return out

    def inline_segments(self) -> list[Segment]:
        return self.segments(0, self.inline_rows)

    def chunk_segments(self, i: int) -> list[Segment]:
        return self.segments(*self.ranges[i])


def flat(t: torch.Tensor) -> torch.Tensor:
    """A layer's cache as [num_blocks * block_size, heads, head_dim] (a view)."""
    return t.view(t.shape[0] * t.shape[1], t.shape[2], t.shape[3])


def direct_view(kv_caches, tokens: TokenRows, segs: list[Segment]) -> torch.Tensor | None:
    """The cache bytes of a single-segment contiguous chunk, as a uint8 view; else None."""
    if len(segs) != 1:
        return None
    s = segs[0]
    if not kv_caches[s.layer][s.kv].is_contiguous():  # a head slice: its rows are not one run of bytes
        return None
    if not tokens.contiguous(s.tok_lo, s.tok_hi):
        return None
    start = int(tokens.rows[s.tok_lo])
    return flat(kv_caches[s.layer][s.kv])[start:start + s.tok_hi - s.tok_lo].reshape(-1).view(torch.uint8)


def _rows(t: torch.Tensor) -> torch.Tensor:
    """A layer's cache as 2-D [rows, words] of the widest integer type dividing a row.

    Row copies are the same bytes whatever the dtype, and index_select/index_copy_ run
    about twice as fast on 8-byte words as on fp16 [heads, head_dim] rows (measured here).
    """
    row = t.shape[2] * t.shape[3] * t.element_size()
    for dt, w in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if row % w == 0:
            return t.view(t.shape[0] * t.shape[1], -1).view(torch.uint8).view(dt)
    return t.view(t.shape[0] * t.shape[1], -1).view(torch.uint8)


def gather(kv_caches, tokens: TokenRows, segs: list[Segment], out: torch.Tensor) -> torch.Tensor:
    """Copy a chunk's rows from the cache into the uint8 staging buffer ``out``; returns the filled part."""
    words = _rows(kv_caches[0][0])
    rows = out.view(words.dtype).view(-1, words.shape[1])
    n = 0
    for s in segs:
        k = s.tok_hi - s.tok_lo
        torch.index_select(_rows(kv_caches[s.layer][s.kv]), 0, tokens.rows[s.tok_lo:s.tok_hi], out=rows[n:n + k])
        n += k
    return out[: n * words.shape[1] * words.element_size()]


def scatter(kv_caches, tokens: TokenRows, segs: list[Segment], buf: torch.Tensor) -> None:
    """Copy a received chunk (uint8 ``buf``) into the cache rows of its tokens."""
    words = _rows(kv_caches[0][0])
    rows = buf.view(words.dtype).view(-1, words.shape[1])
    n = 0
    for s in segs:
        k = s.tok_hi - s.tok_lo
        # index_put_ measured ~1.4x faster than index_copy_ for these row sizes; rows never repeat
        _rows(kv_caches[s.layer][s.kv]).index_put_((tokens.rows[s.tok_lo:s.tok_hi],), rows[n:n + k])
        n += k
