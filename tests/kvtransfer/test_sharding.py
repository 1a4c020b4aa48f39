"""KV between tensor-parallel layouts (kvtransfer/sharding.py) over the in-process backend.

The reference is the unsplit cache: the source ranks' caches are cut from one whole cache by the engine's head
convention, and after a transfer every destination rank must hold exactly the heads the convention gives it, of
exactly the transferred tokens, per token (checked by plain indexing, not kvtransfer's gather/scatter).
"""
from __future__ import annotations

import pytest
import torch

from kvtransfer import KVShards, TransferState, head_pieces, rank_heads
from tests.kvtransfer.agent import CacheSpec, make_cache

DONE, FAILED = TransferState.DONE, TransferState.FAILED


def split(whole, tp: int) -> KVShards:
    """The engine's per-rank caches of ``whole`` (each its own contiguous tensor, as a rank allocates it)."""
    heads = rank_heads(whole[0][0].shape[2], tp)
    return KVShards(tuple([(k[:, :, lo:hi].clone(), v[:, :, lo:hi].clone()) for k, v in whole] for lo, hi in heads),
                    tuple(heads))


def empty_like(shards: KVShards) -> KVShards:
    return KVShards(tuple([(torch.zeros_like(k), torch.zeros_like(v)) for k, v in c] for c in shards.caches),
                    shards.heads)


def rows(cache, blocks: list[int], n: int, lo: int = 0, hi: int | None = None) -> list[torch.Tensor]:
    bs = cache[0][0].shape[1]
    return [torch.stack([t[blocks[p // bs], p % bs, lo:hi] for p in range(n)]) for kv in cache for t in kv]


def test_rank_heads_follow_the_engine_convention():
    from engine.config import ModelConfig
    from engine.tensor_parallel import TPLayout

    for hkv, tp in ((4, 1), (4, 2), (4, 4), (2, 4), (1, 2), (2, 8)):
        mc = ModelConfig(num_attention_heads=8, num_key_value_heads=hkv, head_dim=8, hidden_size=64)
        lays = [TPLayout(mc, tp, r) for r in range(tp)]
        assert rank_heads(hkv, tp) == [(la.kv_head_lo, la.kv_head_lo + la.kv_heads) for la in lays]
    with pytest.raises(ValueError, match="tensor_parallel_size=3 and num_kv_heads=2 must divide one another"):
        rank_heads(2, 3)


def test_pieces_cover_every_destination_rank_head_once():
    for hkv, p, d in ((4, 1, 2), (4, 2, 1), (4, 2, 4), (4, 4, 2), (2, 4, 1), (1, 1, 2), (2, 2, 8)):
        pieces = head_pieces(hkv, p, d)
        src, dst = rank_heads(hkv, p), rank_heads(hkv, d)
        for j, (lo, hi) in enumerate(dst):
            got = sorted(h for a, b, i, jj in pieces if jj == j for h in range(a, b))
            assert got == list(range(lo, hi)), (hkv, p, d, j)
        assert all(src[i][0] <= a < b <= src[i][1] for a, b, i, _ in pieces)
    assert head_pieces(4, 1, 1) == [(0, 4, 0, 0)]


@pytest.mark.parametrize("hkv,p,d", [(2, 1, 2), (2, 2, 1), (4, 2, 4), (4, 4, 2), (1, 1, 2), (2, 2, 2)])
@pytest.mark.parametrize("dtype", ["float32", "int8"])
def test_a_transfer_between_layouts_lands_every_head_where_the_destination_rank_holds_it(pair, hkv, p, d, dtype):
    ep_p, ep_d = pair
    width = 16 + 4 if dtype == "int8" else 16  # an int8 row carries its scale (engine/kv_cache.py)
    whole = make_cache(CacheSpec(num_layers=3, num_blocks=32, block_size=4, num_kv_heads=hkv, head_dim=width,
                                 seed=5, dtype="float32"))
    if dtype == "int8":
        whole = [(k.mul(40).to(torch.int8), v.mul(40).to(torch.int8)) for k, v in whole]
    src = split(whole, p)
    dst = empty_like(split([(torch.zeros(40, 6, hkv, width, dtype=whole[0][0].dtype),) * 2] * 3, d))
    sb, db, n = [9, 3, 30, 1, 7], [12, 4, 39, 0], 19
    hr = ep_d.recv_shards("p0", "r", dst, p, db, n)
    hs = ep_p.send_shards("d0", "r", src, d, sb, n)
    for layer in range(3):
        ep_p.layer_ready(hs, layer)
    assert ep_p.wait(hs, 5) == DONE, ep_p.failure(hs)
    assert ep_d.wait(hr, 5) == DONE, ep_d.failure(hr)
    for j, (lo, hi) in enumerate(dst.heads):
        want = rows(whole, sb, n, lo, hi)
        got = rows(dst.caches[j], db, n)
        assert all(torch.equal(a, b) for a, b in zip(want, got)), (j, lo, hi)
        # nothing outside the transferred blocks was written
        untouched = [b for b in range(40) if b not in db[:4]]
        assert all(not t[untouched].any() for kv in dst.caches[j] for t in kv)
    st = ep_d.stats(hr)
    elem = whole[0][0].element_size()
    assert st.num_bytes == 3 * 2 * n * sum(hi - lo for lo, hi in dst.heads) * width * elem
    assert len(hs.handles) == len(head_pieces(hkv, p, d))


def test_one_piece_is_the_plain_transfer_under_the_request_id(pair):
    """1 -> 1: a TP worker's peer at TP=1 sees exactly today's transfer (same request id, whole cache)."""
    ep_p, ep_d = pair
    whole = make_cache(CacheSpec(num_layers=2, num_blocks=8, block_size=4, seed=3))
    dst = [(torch.zeros_like(k), torch.zeros_like(v)) for k, v in whole]
    hr = ep_d.recv("p0", "plain", dst, [1, 2], 6)  # an unsplit receiver's plain receive
    hs = ep_p.send_shards("d0", "plain", KVShards.whole(whole), 1, [3, 4], 6, layers_ready=True)
    assert ep_p.wait(hs, 5) == DONE and ep_d.wait(hr, 5) == DONE
    assert [h.request_id for h in hs.handles] == ["plain"]


def test_a_failed_piece_fails_the_group_and_cancels_the_rest(pair):
    ep_p, ep_d = pair
    whole = make_cache(CacheSpec(num_layers=2, num_blocks=8, block_size=4, num_kv_heads=2, seed=3))
    dst = empty_like(split(whole, 2))
    hr = ep_d.recv_shards("p0", "f", dst, 1, [1, 2], 6, deadline_s=5.0)
    ep_d.cancel(hr.handles[1])  # the second piece gives up: the group fails, the first piece is cancelled
    assert ep_d.poll(hr) == FAILED
    assert "cancelled" in ep_d.failure(hr) and "f|kv1" in ep_d.failure(hr)
    assert all(ep_d.poll(h) == FAILED for h in hr.handles)
    hs = ep_p.send_shards("d0", "f", KVShards.whole(whole), 2, [3, 4], 6, layers_ready=True)
    assert ep_p.wait(hs, 5) == FAILED  # the receiver's cancels reach the sender's pieces


def test_a_head_slice_of_a_cache_is_accepted_and_other_strides_are_not(pair):
    ep_p, _ = pair
    whole = make_cache(CacheSpec(num_layers=1, num_blocks=8, block_size=4, num_kv_heads=4, seed=1))
    k, v = whole[0]
    h = ep_p.send("d0", "ok", [(k[:, :, 1:3], v[:, :, 1:3])], [0], 2)
    ep_p.cancel(h)
    with pytest.raises(ValueError, match="must be contiguous, or a slice of the KV heads"):
        ep_p.send("d0", "bad", [(k[:, :, :, :8], v[:, :, :, :8])], [0], 2)
