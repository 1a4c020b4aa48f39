"""Prefix-aware routing's parts: the router's prefix index and the ranking rule, on hand-made records."""
from __future__ import annotations

import pytest

from engine.block_manager import block_keys
from proto.worker_pb2 import WorkerInfo
from engine import prefix_block_hashes as prompt_block_hashes
from router.kv.prefix_index import PrefixIndex
from router.selection import WorkerSelector


def test_block_hashes_are_the_engine_keys_hashed():
    ids = list(range(100, 141))  # 41 tokens, block 16: 2 full blocks looked up (the last token is computed)
    assert prompt_block_hashes(ids, 16) == [k[2] for k in block_keys(ids, 16, 2)]
    assert prompt_block_hashes(ids[:16], 16) == []  # a one-block prompt recomputes its only block
    # a different first token changes every later hash (chained keys)
    assert set(prompt_block_hashes([7] + ids[1:], 16)).isdisjoint(prompt_block_hashes(ids, 16))


def test_index_matches_leading_blocks_and_forgets_least_recent():
    idx = PrefixIndex(capacity_blocks=3)
    idx.record("p0", [1, 2, 3])
    assert idx.match("p0", [1, 2, 9]) == 2
    assert idx.match("p0", [9, 1, 2]) == 0  # a prefix, not a set
    assert idx.match("p1", [1]) == 0
    idx.record("p0", [4])  # over capacity: 1 (least recently recorded) goes
    assert idx.match("p0", [1, 2]) == 0 and idx.match("p0", [4]) == 1
    idx.forget("p0")
    assert idx.match("p0", [4]) == 0
    with pytest.raises(ValueError, match="capacity_blocks"):
        PrefixIndex(0)


def _w(wid: str, queued: int) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role="prefill", ready=True, queued_prompt_tokens=queued, block_size=16)


def test_prefer_cached_moves_the_best_match_first_within_the_slack():
    sel = WorkerSelector()
    ranked = [_w("a", 0), _w("b", 100), _w("c", 5000)]
    assert [w.worker_id for w in sel.prefer_cached(ranked, {"b": 2}, 2048)] == ["b", "a", "c"]
    assert [w.worker_id for w in sel.prefer_cached(ranked, {"b": 2, "c": 3}, 2048)] == ["a", "b", "c"]  # c too busy
    assert [w.worker_id for w in sel.prefer_cached(ranked, {"c": 3}, 10_000)] == ["c", "a", "b"]
    assert [w.worker_id for w in sel.prefer_cached(ranked, {}, 2048)] == ["a", "b", "c"]
    # this router's own not-yet-prefilled tokens count as queue too
    sel.acquire("b", 4000)
    assert [w.worker_id for w in sel.prefer_cached(ranked, {"b": 2}, 2048)] == ["a", "b", "c"]


@pytest.mark.parametrize("field,value", [("prefix_aware_routing", "yes"), ("prefix_balance_tokens", -1),
                                         ("prefix_balance_tokens", 2.5)])
def test_router_config_rejects_bad_prefix_settings(field, value):
    from router.config import RouterConfig

    with pytest.raises(ValueError, match=field):
        RouterConfig(**{field: value})


