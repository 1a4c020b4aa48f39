"""Token-level addressing of paged caches: validation, chunk plans, gather/scatter across block sizes."""
import pytest
import torch

from kvtransfer.layout import CacheLayout, FramePlan, TokenRows, direct_view, gather, scatter

torch.set_num_threads(1)


def _cache(layers=2, blocks=10, bs=4, heads=2, dim=3, fill=True, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = (lambda: torch.randn(blocks, bs, heads, dim, generator=g).to(dtype)) if fill else (
        lambda: torch.zeros(blocks, bs, heads, dim, dtype=dtype))
    return [(mk(), mk()) for _ in range(layers)]


def _tokens_of(cache, layer, kv, blocks, n):
    bs = cache[0][0].shape[1]
    return torch.stack([cache[layer][kv][blocks[p // bs], p % bs] for p in range(n)])


def test_layout_validation_names_the_field():
    with pytest.raises(ValueError, match="kv_caches"):
        CacheLayout.of([])
    with pytest.raises(ValueError, match=r"kv_caches\[1\]"):
        CacheLayout.of([(torch.zeros(2, 4, 1, 2), torch.zeros(2, 4, 1, 2)),
                        (torch.zeros(2, 4, 1, 2), torch.zeros(2, 4, 1, 3))])
    with pytest.raises(ValueError, match="contiguous"):
        t = torch.zeros(4, 2, 1, 2).transpose(0, 1)
        CacheLayout.of([(t, t)])
    lay = CacheLayout.of(_cache())
    assert (lay.num_layers, lay.num_blocks, lay.block_size, lay.row_bytes) == (2, 10, 4, 2 * 3 * 4)


@pytest.mark.parametrize("blocks,n,match", [
    ([0, 1], 9, "too few"),             # 9 tokens need 3 blocks of 4
    ([0, 10], 5, r"\[0, 10\)"),          # block 10 does not exist
    ([3, 3], 5, "repeat"),
    ([0], 0, "num_tokens"),
    (["a"], 1, "src_block_ids"),
])
def test_token_rows_validation(blocks, n, match):
    lay = CacheLayout.of(_cache())
    with pytest.raises(ValueError, match=match):
        TokenRows(lay, blocks, n, "src_block_ids")


def test_frame_plan_segments_cover_payload_in_order():
    lay = CacheLayout.of(_cache(layers=4))
    plan = FramePlan(lay.row_bytes, num_tokens=7, layer_lo=1, layer_hi=3, chunk_bytes=lay.row_bytes * 5)
    assert plan.payload_nbytes == 2 * 2 * 7 * lay.row_bytes and plan.inline_rows == 0
    # 7-token segments with 5-row chunks: every segment is cut 5 + 2, never across segments
    assert plan.sizes == [5 * lay.row_bytes, 2 * lay.row_bytes] * 4
    seen = []
    for i in range(plan.num_chunks):
        segs = plan.chunk_segments(i)
        assert len(segs) == 1
        for s in segs:
            seen += [(s.layer, s.kv, p) for p in range(s.tok_lo, s.tok_hi)]
    # payload order: layer 1 K rows 0..6, layer 1 V rows, layer 2 K, layer 2 V
    assert seen == [(l, kv, p) for l in (1, 2) for kv in (0, 1) for p in range(7)]


def test_frame_plan_packs_small_segments_and_inlines_small_payloads():
    row = 100
    plan = FramePlan(row, num_tokens=3, layer_lo=0, layer_hi=4, chunk_bytes=1000)  # 8 segments of 300 B
    assert plan.sizes == [900, 900, 600]  # three segments a message, then the last two
    assert [len(plan.chunk_segments(i)) for i in range(3)] == [3, 3, 2]
    tiny = FramePlan(row, num_tokens=3, layer_lo=0, layer_hi=4, chunk_bytes=1000, inline_bytes=2400)
    assert tiny.inline_rows == 24 and tiny.sizes == []
    assert FramePlan(row, 3, 0, 4, 1000, inline_bytes=2399).inline_rows == 0
    # 1 MiB segments are never packed, even under a 4 MiB chunk size: each can go zero-copy
    big = FramePlan(2048, 512, 0, 8, 4 << 20)
    assert big.sizes == [1 << 20] * 16 and all(len(big.chunk_segments(i)) == 1 for i in range(16))


@pytest.mark.parametrize("src_bs,dst_bs", [(4, 4), (4, 3), (5, 8), (16, 1)])
def test_gather_scatter_moves_tokens_between_block_sizes(src_bs, dst_bs):
    n = 11
    src = _cache(layers=3, blocks=12, bs=src_bs, seed=1)
    dst = _cache(layers=3, blocks=20, bs=dst_bs, fill=False)
    src_blocks = [7, 2, 9, 0, 5, 11, 3, 1, 4, 6, 8][: -(-n // src_bs)]
    dst_blocks = [19, 4, 5, 6, 0, 13, 2, 8, 9, 10, 11, 12][: -(-n // dst_bs)]
    s_lay, d_lay = CacheLayout.of(src), CacheLayout.of(dst)
    s_tok = TokenRows(s_lay, src_blocks, n, "src")
    d_tok = TokenRows(d_lay, dst_blocks, n, "dst")
    plan = FramePlan(s_lay.row_bytes, n, 0, 3, chunk_bytes=s_lay.row_bytes * 4)
    staging = torch.empty(max(plan.sizes), dtype=torch.uint8)
    for i in range(plan.num_chunks):
        segs = plan.chunk_segments(i)
        data = gather(src, s_tok, segs, staging).clone()
        scatter(dst, d_tok, segs, data)
    for layer in range(3):
        for kv in range(2):
            assert torch.equal(_tokens_of(src, layer, kv, src_blocks, n), _tokens_of(dst, layer, kv, dst_blocks, n))
    # nothing outside the destination tokens was written
    written = sum(int((t != 0).sum()) for pair in dst for t in pair)
    assert written == 3 * 2 * n * 2 * 3


def test_direct_view_only_for_contiguous_rows():
    cache = _cache(layers=1, blocks=6, bs=4)
    lay = CacheLayout.of(cache)
    tok = TokenRows(lay, [2, 3, 0], 10, "src")  # rows 8..15 contiguous, then 0..1
    plan = FramePlan(lay.row_bytes, 10, 0, 1, chunk_bytes=lay.row_bytes * 8)
    v = direct_view(cache, tok, plan.chunk_segments(0))
    assert v is not None and torch.equal(v.view(torch.float32), cache[0][0][2:4].reshape(-1))
    v = direct_view(cache, tok, plan.chunk_segments(1))  # tokens 8, 9 of K: block 0 rows 0..1
    assert v is not None and torch.equal(v.view(torch.float32), cache[0][0][0, :2].reshape(-1))
    tok = TokenRows(lay, [3, 2, 0], 10, "src")  # rows 12..15 then 8..11: not one stretch
    assert direct_view(cache, tok, plan.chunk_segments(0)) is None
    packed = FramePlan(lay.row_bytes, 10, 0, 1, chunk_bytes=lay.row_bytes * 20)  # small: K and V in one message
    assert direct_view(cache, TokenRows(lay, [2, 3, 0], 10, "src"), packed.chunk_segments(0)) is None
