"""KV between tensor-parallel layouts: which heads of which rank go to which rank of the peer.

Lifecycle: stateless helpers and one value type. A worker whose engine is split over N ranks holds its paged KV
cache as N per-rank caches, each with a contiguous range of the model's KV heads (``KVShards``; rank 0 maps
every rank's cache, engine/tensor_parallel.py). A transfer between a worker at TP=p and one at TP=d is cut into
*pieces* (``head_pieces``): for each destination rank j and each run of its heads that one source rank holds,
one piece ``(lo, hi, i, j)`` moves heads [lo, hi) from source rank i's cache to destination rank j's. Both sides
compute the same list from the model's KV heads and the two TP sizes, so the pieces need no negotiation; each is
an ordinary kvtransfer transfer over the pair's one channel, from and into head slices of the caches
(``KVShards.view``), and ``KVEndpoint.send_shards``/``recv_shards`` bundle them in one ``TransferGroup``. A 1 -> 1
transfer is one piece under the request's own id, exactly the transfer of an unsplit worker.

The head convention is the engine's (``engine.tensor_parallel.TPLayout``): with N <= Hkv, rank r holds heads
[r Hkv/N, (r+1) Hkv/N); with N > Hkv, rank r holds head r // (N/Hkv) (replicated on N/Hkv ranks; the source sends
from the first rank that holds a head, and every destination replica receives its own copy).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

Caches = Sequence[tuple[torch.Tensor, torch.Tensor]]


def rank_heads(num_kv_heads: int, tp: int) -> list[tuple[int, int]]:
    """The global KV heads [lo, hi) each of ``tp`` ranks holds; ValueError where they do not split."""
    if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
        raise ValueError(f"tensor_parallel_size must be an integer >= 1, got {tp!r}")
    if num_kv_heads % tp and tp % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={tp} and num_kv_heads={num_kv_heads} must divide one another")
    if tp <= num_kv_heads:
        per = num_kv_heads // tp
        return [(r * per, (r + 1) * per) for r in range(tp)]
    rep = tp // num_kv_heads
    return [(r // rep, r // rep + 1) for r in range(tp)]


def head_pieces(num_kv_heads: int, src_tp: int, dst_tp: int) -> list[tuple[int, int, int, int]]:
    """(lo, hi, source rank, destination rank) per piece, in destination-rank then head order."""
    src, dst = rank_heads(num_kv_heads, src_tp), rank_heads(num_kv_heads, dst_tp)
    holder = {}  # head -> the first source rank holding it
    for i, (lo, hi) in enumerate(src):
        for h in range(lo, hi):
            holder.setdefault(h, i)
    out: list[tuple[int, int, int, int]] = []
    for j, (lo, hi) in enumerate(dst):
        h = lo
        while h < hi:
            i = holder[h]
            end = min(hi, src[i][1])
            out.append((h, end, i, j))
            h = end
    return out


def piece_request_id(request_id: str, piece: int, num_pieces: int) -> str:
    """The kvtransfer request id of piece ``piece``: the request's own id when it is the only one."""
    return request_id if num_pieces == 1 else f"{request_id}|kv{piece}"


@dataclass(frozen=True)
class KVShards:
    """One worker's KV cache as its ranks hold it: ``caches[r]`` is rank r's per-layer (k, v) list, holding the
    global KV heads ``heads[r]``."""

    caches: tuple
    heads: tuple

    @classmethod
    def whole(cls, kv_caches: Caches) -> "KVShards":
        """An unsplit cache: one rank with every head."""
        return cls((list(kv_caches),), ((0, int(kv_caches[0][0].shape[2])),))

    @property
    def tp(self) -> int:
        return len(self.caches)

    @property
    def num_kv_heads(self) -> int:
        return max(hi for _, hi in self.heads)

    def view(self, rank: int, lo: int, hi: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Rank ``rank``'s cache restricted to global heads [lo, hi) (views, no copy; the whole cache if all)."""
        r_lo, r_hi = self.heads[rank]
        if not r_lo <= lo < hi <= r_hi:
            raise ValueError(f"rank {rank} holds KV heads [{r_lo}, {r_hi}), not [{lo}, {hi})")
        caches = self.caches[rank]
        if (lo, hi) == (r_lo, r_hi):
            return list(caches)
        a, b = lo - r_lo, hi - r_lo
        return [(k[:, :, a:b], v[:, :, a:b]) for k, v in caches]
