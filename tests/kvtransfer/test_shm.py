"""Same-host KV through shared memory (kvtransfer/shm.py): chosen when both ends allow it and see one /dev/shm,
bit-exact, no file left behind, and the socket when either end cannot.

Real processes (``tests.kvtransfer.agent``: one KVEndpoint each, a TCPStore rendezvous) for the choice and the
bytes; one process with two threads over a real gloo pair for the ordering of payload ops.
"""
from __future__ import annotations

import datetime
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from kvtransfer.shm import SHM_DIR, ShmPair, sweep_orphans
from kvtransfer.transport import open_pair
from kvtransfer.wire import TAG_PAYLOAD
from tests.kvtransfer.agent import Agent, CacheSpec, wait_state

pytestmark = pytest.mark.skipif(not SHM_DIR.is_dir(), reason="this host has no /dev/shm")


def _ring_files(*pids: int) -> list[str]:
    return sorted(n for n in os.listdir(SHM_DIR) if any(n.startswith(f"pdserve-kv-{p}-") for p in pids))


def _move(a: Agent, b: Agent, rid: str, src: list[int], dst: list[int], n: int) -> None:
    b.call("recv", rid, "A", rid, dst, n, 20.0)
    a.call("send", rid, "B", rid, src, n, "all", 20.0)
    assert wait_state(a, rid, 30)[:2] == ("done", None)
    assert wait_state(b, rid, 30)[:2] == ("done", None)
    assert a.call("checksum", src, n) == b.call("checksum", dst, n), rid


def _pair_of(receiver_kw: dict, store_url: str, shared: bool = False,
             sender_kw: dict | None = None, receiver_cache: dict | None = None) -> tuple[dict, dict, list[str]]:
    """A (seeded cache) sends three requests to B (zeros) in 6 KiB chunks (rows of 1 KiB: many more chunks than
    ring slots, so every slot is reused; chunks over shuffled blocks are gathered into and scattered out of the
    slots in place, contiguous ones copied in and out); the kinds of both ends' pairs and the ring files left."""
    spec = dict(num_layers=3, num_blocks=64, block_size=16, num_kv_heads=4, head_dim=64)
    # 6-row chunks straddle the 16-token blocks: shuffled blocks make most chunks gathered or scattered ones
    a = Agent("A", store_url, CacheSpec(seed=7, shared=shared, **spec), chunk_bytes=6144, **(sender_kw or {}))
    b = Agent("B", store_url, CacheSpec(**{"shared": shared, **spec, **(receiver_cache or {})}), chunk_bytes=6144,
              **receiver_kw)
    try:
        a.ready()
        b.ready()
        _move(a, b, "r1", [5, 9, 2, 40], [13, 11, 10, 12], 57)
        _move(a, b, "r2", list(range(20, 28)), list(range(30, 38)), 128)
        _move(a, b, "r3", [63], [0], 3)
        assert b.call("untouched", [([13, 11, 10, 12], 57), (list(range(30, 38)), 128), ([0], 3)])
        links = {x[4] for x in a.call("stats") + b.call("stats")}  # what TransferStats.link says, both sides
        assert len(links) == 1
        pairs = a.call("pairs"), b.call("pairs")
        kind = pairs[1]["recv:A"]
        c = pairs[1].get("recv:A:counts", {"ring_chunks": 0, "pull_frames": 0})
        assert links == {"socket" if kind == "gloo" else "pull" if c["pull_frames"] else "ring"}
        return (*pairs, _ring_files(a.pid, b.pid))
    finally:
        a.stop()
        b.stop()


def _counts(receiver: dict) -> tuple[bool, bool]:
    c = receiver.pop("recv:A:counts")
    return c["ring_chunks"] > 0, c["pull_frames"] > 0


def test_same_host_workers_move_kv_through_shared_memory_bit_exact_and_leave_no_file(store_url):
    """Plain (private) caches: the pair can pull, but there is nothing to pull from; every chunk takes the ring."""
    sender, receiver, left = _pair_of({}, store_url)
    assert _counts(receiver) == (True, False)
    assert sender == {"send:B": "shm+pull"} and receiver == {"recv:A": "shm+pull"}
    assert left == []  # unlinked once both ends mapped it


def test_a_sender_whose_cache_is_shared_memory_is_read_in_place_by_the_receiver(store_url):
    """Both caches in shared segments (an engine's with kv_cache_shared): every frame is a pull (the receiver
    copies the rows from the sender's cache, no payload messages), bit-exact into scattered and contiguous blocks."""
    sender, receiver, left = _pair_of({}, store_url, shared=True)
    assert _counts(receiver) == (False, True)
    assert sender == {"send:B": "shm+pull"} and receiver == {"recv:A": "shm+pull"}
    assert left == []


@pytest.mark.parametrize("one_allocation", [True, False], ids=["engine-layout", "tensor-per-layer"])
def test_a_receiver_with_a_private_cache_pulls_from_a_shared_one_bit_exact(store_url, one_allocation):
    """A decode worker's cache is private: pulled into it in one copy for all layers (the engine's layout, every
    layer in one allocation) or layer by layer (a tensor per layer), bit-exact either way."""
    sender, receiver, left = _pair_of({}, store_url, shared=True,
                                      receiver_cache={"shared": False, "one_allocation": one_allocation})
    assert _counts(receiver) == (False, True)
    assert left == []


def test_a_receiver_that_cannot_map_the_senders_memory_gets_the_bytes_through_the_ring(store_url):
    sender, receiver, _ = _pair_of({"no_pull": True}, store_url, shared=True)
    assert _counts(receiver) == (True, False)
    assert sender == {"send:B": "shm"} and receiver == {"recv:A": "shm"}


def test_a_receiver_with_shared_memory_off_stays_on_the_socket(store_url):
    sender, receiver, _ = _pair_of({"shm": False}, store_url)
    assert sender == {"send:B": "gloo"} and receiver == {"recv:A": "gloo"}


def test_a_receiver_with_shared_memory_off_declines_even_an_offer_its_earlier_life_invited(store_url):
    """A worker restarted under its name with shared memory off: the capability key its earlier life published may
    still be in the store, so the sender offers; the receiver answers no and the pair keeps the socket."""
    port = int(store_url.rsplit(":", 1)[1])
    client = dist.TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
    dist.PrefixStore("kvt", client).set("cap/B", "shm")  # kvtransfer.StoreConfig's default namespace
    sender, receiver, _ = _pair_of({"shm": False}, store_url)
    assert sender == {"send:B": "gloo"} and receiver == {"recv:A": "gloo"}


def test_a_receiver_that_sees_another_dev_shm_declines_to_the_socket(store_url, tmp_path):
    """As a second container on one node: the offered file is not in its /dev/shm, so it answers no."""
    sender, receiver, left = _pair_of({"shm_dir": str(tmp_path)}, store_url)
    assert sender == {"send:B": "gloo"} and receiver == {"recv:A": "gloo"}
    assert left == []  # the sender unlinks its file after a no too


def test_a_sender_whose_dev_shm_is_full_stays_on_the_socket_without_a_file(store_url):
    """The ring file's pages are reserved when it is made: a /dev/shm without room fails there (ENOSPC, here
    simulated) and the pair keeps the socket, instead of a worker dying of SIGBUS on its first write."""
    sender, receiver, left = _pair_of({}, store_url, sender_kw={"shm_full": True})
    assert sender == {"send:B": "gloo"} and receiver == {"recv:A": "gloo"}
    assert left == []


def test_payload_ops_are_carried_out_in_posting_order_whatever_order_they_are_waited_in():
    """Five payloads of 3 slots each through an 8-slot ring (so slots are reused), the sender waiting the last
    first; the receiver's receives, posted in order, get them in order."""
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=30))
    pairs: dict[int, object] = {}

    def build(rank: int) -> None:  # a client connection each: one TCPStore client serializes gloo's waits
        own = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=datetime.timedelta(seconds=30))
        pairs[rank] = open_pair("gloo", own, "pg/order", rank, 30.0, host="127.0.0.1", shm_slot_bytes=4096)

    ths = [threading.Thread(target=build, args=(r,)) for r in (0, 1)]
    for th in ths:
        th.start()
    for th in ths:
        th.join(60)
    s, r = pairs[0], pairs[1]
    try:
        assert isinstance(s, ShmPair) and isinstance(r, ShmPair)
        sent = [torch.full((3 * 4096 // 4,), float(k), dtype=torch.float32) for k in range(5)]
        got = [torch.zeros(3 * 4096 // 4) for _ in range(5)]
        ops_r = [r.irecv(g, TAG_PAYLOAD) for g in got]
        ops_s = [s.isend(t, TAG_PAYLOAD) for t in sent]
        waiter = threading.Thread(target=lambda: [op.wait(30.0) for op in ops_r])
        waiter.start()
        for op in reversed(ops_s):
            op.wait(30.0)
        waiter.join(60)
        assert not waiter.is_alive()
        assert [float(g[0]) for g in got] == [0.0, 1.0, 2.0, 3.0, 4.0]
        assert all(torch.equal(g, t) for g, t in zip(got, sent))
        # a control message (not TAG_PAYLOAD) still goes over gloo as before
        hdr, back = torch.arange(16, dtype=torch.uint8), torch.zeros(16, dtype=torch.uint8)
        op = r.irecv(back, 0)
        s.isend(hdr, 0).wait(10.0)
        op.wait(10.0)
        assert torch.equal(hdr, back)
    finally:
        for p in pairs.values():
            p.close()
        del store


def test_sweep_removes_ring_files_of_dead_processes_only(tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True)
    dead_pid = int(dead.stdout)
    orphan = tmp_path / f"pdserve-kv-{dead_pid}-{'ab' * 8}"
    mine = tmp_path / f"pdserve-kv-{os.getpid()}-{'cd' * 8}"
    other = tmp_path / f"something-{dead_pid}"
    for f in (orphan, mine, other):
        f.write_bytes(b"x")
    assert sweep_orphans(tmp_path) == 1
    assert sorted(p.name for p in Path(tmp_path).iterdir()) == sorted([mine.name, other.name])


class _Peer:
    """The receiver side ``pull_rows`` uses of a ShmPair: mapping the sender's segment, counting."""

    def __init__(self):
        self.counts = {"ring_chunks": 0, "pull_frames": 0}

    def peer_segment(self, handle):
        from transport.shared_memory import map_segment

        return map_segment(handle)


def test_a_pull_descriptor_that_names_other_memory_is_a_framing_error_and_writes_nothing():
    """What the receiver checks before it copies a byte: offsets inside the segment and on a row word, block ids in
    range, the descriptor whole, the segment the one named. A valid one copies the rows (positions 0..20)."""
    import struct

    from engine.kv_cache import share_kv_caches
    from kvtransfer.layout import CacheLayout, TokenRows
    from kvtransfer.shm import _PULL, pull_descriptor, pull_rows
    from kvtransfer.wire import FramingError

    g = torch.Generator().manual_seed(3)
    src = share_kv_caches([(torch.randn(8, 16, 2, 16, generator=g), torch.randn(8, 16, 2, 16, generator=g))
                           for _ in range(2)])
    src_rows = TokenRows(CacheLayout.of(src), [5, 2], 21, "src_block_ids")
    desc = pull_descriptor(src, src_rows, 0, 2, 32 << 10)
    assert desc is not None

    def pull(raw: bytes, dst: list) -> list:
        rows = TokenRows(CacheLayout.of(dst), [1, 7], 21, "dst_block_ids")
        pull_rows(_Peer(), torch.frombuffer(bytearray(raw), dtype=torch.uint8), 0, 2, 21, 2 * 16 * 4, dst, rows)
        return dst

    def zeros() -> list:
        return [(torch.zeros(8, 16, 2, 16), torch.zeros(8, 16, 2, 16)) for _ in range(2)]

    got = pull(desc, zeros())
    for (sk, sv), (dk, dv) in zip(src, got):
        for s, d in ((sk, dk), (sv, dv)):
            assert torch.equal(d[1], s[5]) and torch.equal(d[7, :5], s[2, :5]) and not d[7, 5:].any()
    head = list(_PULL.unpack(desc[:_PULL.size]))
    offs = list(struct.unpack_from("<4Q", desc, _PULL.size))
    ids = desc[_PULL.size + 32:]

    def with_(head_=None, offs_=None, ids_=None) -> bytes:
        return _PULL.pack(*(head_ or head)) + struct.pack("<4Q", *(offs_ or offs)) + (ids if ids_ is None else ids_)

    bad = {
        "outside": with_(offs_=[offs[0], offs[1], offs[2], head[3]]),           # past the segment's end
        "misaligned": with_(offs_=[*offs[:3], offs[3] - 4]),                      # the last layer's V off a word
        "block id": with_(ids_=struct.pack("<2I", 5, 8)),                          # the sender has 8 blocks
        "cut short": with_()[:-4],
        "another segment": with_(head_=[*head[:2], head[2] + 1, *head[3:]]),   # inode of no such segment
    }
    for name, raw in bad.items():
        dst = zeros()
        with pytest.raises(FramingError):
            pull(raw, dst)
        assert not any(x.any() for kv in dst for x in kv), name  # refused before any row landed


@pytest.mark.parametrize("dst_bs, shuffled", [(16, False), (16, True), (4, True)],
                         ids=["one-stretch", "a-copy-a-stretch", "gather-scatter"])
def test_a_pull_takes_every_layer_at_once_where_both_caches_are_one_allocation(monkeypatch, dst_bs, shuffled):
    """pull_rows into a cache laid out as the engine lays one out (every layer in one allocation) goes through one
    view of all layers (spied), into one of a tensor per layer layer by layer; both land every row where a
    token-by-token copy puts it, and nothing else, for one stretch, a stretch per block, and stretches short
    enough to gather (blocks of 4)."""
    import random

    from engine.config import ModelConfig
    from engine.kv_cache import allocate_kv_caches, share_kv_caches
    from kvtransfer import shm
    from kvtransfer.layout import CacheLayout, TokenRows

    g = torch.Generator().manual_seed(11)
    layers, sbs, n, first = 3, 16, 45, 2
    src = share_kv_caches([(torch.randn(8, sbs, 2, 16, generator=g), torch.randn(8, sbs, 2, 16, generator=g))
                           for _ in range(layers)])
    src_ids = [5, 2, 7]
    dst_blocks = 40 * 16 // dst_bs
    dst_ids = list(range(3, 3 + -(-n // dst_bs)))
    if shuffled:
        dst_ids = random.Random(dst_bs).sample(range(dst_blocks), len(dst_ids))
    stacks: list = []
    real = shm._layer_stack
    monkeypatch.setattr(shm, "_layer_stack", lambda *a: stacks.append(real(*a)) or stacks[-1])
    desc = shm.pull_descriptor(src, TokenRows(CacheLayout.of(src), src_ids, n, "src", first), 0, layers, 32 << 10)
    assert desc is not None
    mc = ModelConfig(num_hidden_layers=layers, num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    for one in (True, False):
        dst = (allocate_kv_caches(mc, dst_blocks, dst_bs, torch.float32, torch.device("cpu")) if one else
               [(torch.zeros(dst_blocks, dst_bs, 2, 16), torch.zeros(dst_blocks, dst_bs, 2, 16)) for _ in range(layers)])
        rows = TokenRows(CacheLayout.of(dst), dst_ids, n, "dst", first)
        stacks.clear()
        shm.pull_rows(_Peer(), torch.frombuffer(bytearray(desc), dtype=torch.uint8), 0, layers, rows.num_tokens,
                      2 * 16 * 4, dst, rows)
        assert (stacks[0] is not None) == one
        for (sk, sv), (dk, dv) in zip(src, dst):
            for s, d in ((sk, dk), (sv, dv)):
                want = torch.zeros_like(d)
                for p in range(first, n):  # token by token: where the sender has it, where the receiver wants it
                    want[dst_ids[p // dst_bs], p % dst_bs] = s[src_ids[p // sbs], p % sbs]
                assert torch.equal(d, want)


def test_a_cache_layout_knows_when_its_layers_lie_at_equal_distances():
    """``CacheLayout.layer_step``: the engine's caches (private or shared) have one; a tensor per layer, a list out of
    memory order, or head slices do not."""
    from engine.config import ModelConfig
    from engine.kv_cache import allocate_kv_caches
    from kvtransfer.layout import CacheLayout

    mc = ModelConfig(num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2, head_dim=16)
    for shared in (False, True):
        kv = allocate_kv_caches(mc, 10, 16, torch.float32, torch.device("cpu"), shared=shared)
        step = kv[0][1].data_ptr() - kv[0][0].data_ptr()
        assert step >= 10 * 16 * 2 * 16 * 4 and CacheLayout.of(kv).layer_step == step
        assert CacheLayout.of(kv[::-1]).layer_step is None
        assert CacheLayout.of([(k[:, :, :1], v[:, :, :1]) for k, v in kv]).layer_step is None
    assert CacheLayout.of([(torch.zeros(4, 16, 2, 16), torch.zeros(4, 16, 2, 16)) for _ in range(3)]).layer_step is None


@pytest.mark.parametrize("sbs, dbs, first, n", [(16, 32, 0, 200), (16, 16, 5, 40), (8, 32, 3, 77), (32, 16, 31, 1)])
def test_pull_stretches_cover_every_token_once_and_only_consecutive_rows(sbs, dbs, first, n):
    """kvtransfer.shm._stretches against the rows token by token: shuffled and in-order blocks, other block sizes on
    the two sides, a delta transfer's first token."""
    import random

    from kvtransfer.shm import _stretches

    rng = random.Random(sbs * 1000 + dbs + first)
    for shuffled in (False, True):
        src_ids = list(range(3, 3 + -(-(first + n) // sbs)))
        dst_ids = list(range(1, 1 + -(-(first + n) // dbs)))
        if shuffled:
            rng.shuffle(src_ids)
            rng.shuffle(dst_ids)
        want = [(src_ids[p // sbs] * sbs + p % sbs, dst_ids[p // dbs] * dbs + p % dbs) for p in range(first, first + n)]
        runs = _stretches(tuple(src_ids), sbs, first, tuple(dst_ids), dbs, first, n)
        got = [(s + i, d + i) for s, d, c in runs for i in range(c)]
        assert got == want
        # maximal: two neighbouring stretches never continue each other on both sides
        assert all(not (a[0] + a[2] == b[0] and a[1] + a[2] == b[1]) for a, b in zip(runs, runs[1:]))
        if not shuffled and first % sbs == first % dbs:
            assert len(runs) == 1
