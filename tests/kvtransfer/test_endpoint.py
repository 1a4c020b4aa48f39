"""KVEndpoint behaviour over the in-process backend (and gloo threads on a real Redis rendezvous).

Each test builds its own store, so nothing is shared between tests; the inproc
backend runs the full channel protocol (headers, acks, rejections, deadlines)
without sockets.
"""
import threading
import time

import pytest
import torch

from kvtransfer import InprocStore, KVEndpoint, StoreConfig, TransferState
from tests.kvtransfer.agent import CacheSpec, make_cache, token_checksum, untouched_except
from tests.waiting import wait_until

torch.set_num_threads(1)
DONE, FAILED, PENDING = TransferState.DONE, TransferState.FAILED, TransferState.PENDING


SRC = CacheSpec(num_layers=3, num_blocks=32, block_size=4, seed=7)
DST = CacheSpec(num_layers=3, num_blocks=40, block_size=6)


def test_interleaved_requests_per_layer_land_in_their_blocks(pair):
    p, d = pair
    src, dst = make_cache(SRC), make_cache(DST)
    reqs = {  # request -> (src blocks, dst blocks, tokens)
        "a": ([3, 9, 1, 30, 4], [10, 2, 33], 17),
        "b": ([0, 5], [7], 5),
        "c": ([8, 7, 6, 2, 11, 12, 13], [0, 1, 39, 20, 21], 25),
    }
    # the receiver posts in one order, the sender submits in another, and layers interleave
    rh = {r: d.recv("p0", r, dst, v[1], v[2]) for r, v in sorted(reqs.items(), reverse=True)}
    sh = {r: p.send("d0", r, src, v[0], v[2]) for r, v in reqs.items()}
    assert all(d.poll(h) == PENDING for h in rh.values())
    for layer in range(3):
        for r in ("b", "c", "a"):
            p.layer_ready(sh[r], layer)
    for r in reqs:
        assert p.wait(sh[r], 5) == DONE, p.failure(sh[r])
        assert d.wait(rh[r], 5) == DONE, d.failure(rh[r])
        assert token_checksum(src, reqs[r][0], reqs[r][2]) == token_checksum(dst, reqs[r][1], reqs[r][2])
    assert untouched_except(dst, [(v[1], v[2]) for v in reqs.values()])
    sent = {s.request_id: s for s in p.take_completed()}
    row = 2 * 16 * 4  # heads * head_dim * float32
    assert sent["c"].num_bytes == 3 * 2 * 25 * row and sent["c"].state == DONE and sent["c"].layers_done == 3
    assert p.take_completed() == []


def test_layers_ready_shortcut_and_partial_last_block(pair):
    p, d = pair
    src, dst = make_cache(SRC), make_cache(DST)
    hr = d.recv("p0", "r", dst, [4, 5], 7)
    hs = p.send("d0", "r", src, [1, 2], 7, layers_ready=True)
    assert p.wait(hs, 5) == DONE and d.wait(hr, 5) == DONE
    assert token_checksum(src, [1, 2], 7) == token_checksum(dst, [4, 5], 7)
    assert d.stats(hr).num_bytes == p.stats(hs).num_bytes > 0


def test_a_frame_carried_whole_in_its_head_still_spends_time_on_the_wire(pair):
    """A one-frame transfer small enough to ride inline in the head message (no payload chunks) is timed on the
    wire from posting (send) or arrival (recv) to its bytes gone or placed; its phases add up to its total."""
    p, d = pair
    src, dst = make_cache(SRC), make_cache(DST)
    hr = d.recv("p0", "tiny", dst, [4], 3)
    hs = p.send("d0", "tiny", src, [1], 3, layers_ready=True)
    assert p.wait(hs, 5) == DONE and d.wait(hr, 5) == DONE
    for st in (p.stats(hs), d.stats(hr)):
        assert st.num_bytes == 3 * 2 * 3 * 2 * 16 * 4  # layers * (k, v) * tokens * heads * head_dim * float32
        assert st.wire_seconds > 0, st
        assert sum(st.phases().values()) == pytest.approx(st.seconds, abs=1e-6), st


def test_dtype_mismatch_rejected_on_both_sides_then_channel_works(pair):
    p, d = pair
    dst = make_cache(DST)
    half = make_cache(CacheSpec(num_layers=3, num_blocks=32, block_size=4, seed=1, dtype="float16"))
    hr = d.recv("p0", "bad", dst, [0, 1], 8)
    hs = p.send("d0", "bad", half, [0, 1], 8, layers_ready=True)
    assert d.wait(hr, 5) == FAILED and "dtype mismatch" in d.failure(hr)
    assert p.wait(hs, 5) == FAILED and "dtype mismatch" in p.failure(hs)
    assert "float16" in p.failure(hs) and "float32" in p.failure(hs)
    assert untouched_except(dst, [])  # a rejected payload is drained, never written
    src = make_cache(SRC)
    hr = d.recv("p0", "good", dst, [2, 3], 8)
    hs = p.send("d0", "good", src, [5, 6], 8, layers_ready=True)
    assert p.wait(hs, 5) == DONE and d.wait(hr, 5) == DONE
    assert token_checksum(src, [5, 6], 8) == token_checksum(dst, [2, 3], 8)


@pytest.mark.parametrize("spec,tokens,match", [
    (CacheSpec(num_layers=3, num_blocks=32, block_size=4, head_dim=8, seed=1), 8, "shape mismatch"),
    (CacheSpec(num_layers=2, num_blocks=32, block_size=4, seed=1), 8, "num_layers mismatch"),
    (SRC, 9, "num_tokens mismatch"),
])
def test_header_mismatch_rejected(pair, spec, tokens, match):
    p, d = pair
    dst = make_cache(DST)
    hr = d.recv("p0", "x", dst, [0, 1], 8)
    hs = p.send("d0", "x", make_cache(spec), [0, 1, 2], tokens, layers_ready=True)
    assert p.wait(hs, 5) == FAILED and match in p.failure(hs)
    assert d.wait(hr, 5) == FAILED and match in d.failure(hr)


def test_unposted_request_is_drained_and_reported(pair):
    p, d = pair
    d.recv("p0", "other", make_cache(DST), [0], 3)  # the channel exists, but not for "ghost"
    hs = p.send("d0", "ghost", make_cache(SRC), [0], 3, layers_ready=True)
    assert p.wait(hs, 5) == FAILED and "no receive posted for request 'ghost'" in p.failure(hs)


def test_deadline_fails_both_sides_when_producer_stalls(pair):
    p, d = pair
    src, dst = make_cache(SRC), make_cache(DST)
    hr = d.recv("p0", "slow", dst, [0, 1], 8, deadline_s=0.5)
    hs = p.send("d0", "slow", src, [0, 1], 8, deadline_s=0.4)
    p.layer_ready(hs, 0)  # layer 0 leaves, layers 1 and 2 never become ready
    t0 = time.monotonic()
    assert p.wait(hs, 3) == FAILED and "deadline exceeded" in p.failure(hs)
    assert d.wait(hr, 3) == FAILED
    assert time.monotonic() - t0 < 1.0
    # the sender's abort frame reached the receiver before its own deadline, or its deadline did
    assert "aborted by sender" in d.failure(hr) or "deadline exceeded" in d.failure(hr)
    assert d.stats(hr).layers_done == 1


def test_cancel_on_receiver_reaches_sender(pair):
    p, d = pair
    src, dst = make_cache(SRC), make_cache(DST)
    hr = d.recv("p0", "c", dst, [0, 1], 8)
    hs = p.send("d0", "c", src, [0, 1], 8)
    p.layer_ready(hs, 0)
    wait_until(lambda: d.stats(hr).layers_done == 1, timeout=3.0, interval=0.002, message="layer 0 received")
    d.cancel(hr)
    d.cancel(hr)  # idempotent
    assert d.poll(hr) == FAILED and d.failure(hr) == "cancelled"
    assert p.wait(hs, 3) == FAILED and "cancelled" in p.failure(hs)


def test_close_fails_in_flight_and_channel_reopens(pair):
    p, d = pair
    src, dst = make_cache(SRC), make_cache(DST)
    hr = d.recv("p0", "k", dst, [0, 1], 8)
    hs = p.send("d0", "k", src, [0, 1], 8)
    p.layer_ready(hs, 0)
    wait_until(lambda: d.stats(hr).layers_done == 1, timeout=3.0, interval=0.002, message="layer 0 received")
    t0 = time.monotonic()
    p.close("d0")
    assert p.poll(hs) == FAILED and "closed" in p.failure(hs)
    assert d.wait(hr, 3) == FAILED and "broken" in d.failure(hr)  # the pair broke under it
    assert time.monotonic() - t0 < 1.0
    hr = d.recv("p0", "k2", dst, [2, 3], 8)
    hs = p.send("d0", "k2", src, [2, 3], 8, layers_ready=True)
    assert p.wait(hs, 5) == DONE and d.wait(hr, 5) == DONE


def test_bad_arguments_raise_value_error_naming_field(pair):
    p, d = pair
    src = make_cache(SRC)
    with pytest.raises(ValueError, match="src_block_ids"):
        p.send("d0", "r", src, [0], 8)
    with pytest.raises(ValueError, match="dst_block_ids"):
        d.recv("p0", "r", src, [99, 100], 8)
    with pytest.raises(ValueError, match="num_tokens"):
        p.send("d0", "r", src, [0], -1)
    with pytest.raises(ValueError, match="deadline_s"):
        p.send("d0", "r", src, [0], 1, deadline_s=0)
    with pytest.raises(ValueError, match="request_id"):
        p.send("d0", "", src, [0], 1)
    with pytest.raises(ValueError, match="peer"):
        p.send("p0", "r", src, [0], 1)
    with pytest.raises(ValueError, match="kv_caches"):
        p.send("d0", "r", [], [0], 1)
    h = p.send("d0", "r", src, [0], 1)
    with pytest.raises(ValueError, match="layer_idx"):
        p.layer_ready(h, 3)
    d.recv("p0", "dup", src, [0], 1)
    with pytest.raises(ValueError, match="request_id 'dup' already has a receive"):
        d.recv("p0", "dup", src, [1], 1)
    with pytest.raises(ValueError, match="backend"):
        KVEndpoint("x", InprocStore(), backend="tcp")
    with pytest.raises(ValueError, match="store"):
        KVEndpoint("x", "http://nowhere:1")
    with pytest.raises(ValueError, match="timeout_s"):
        KVEndpoint("x", InprocStore(), backend="inproc", timeout_s=-1)
    if not torch.cuda.is_available():  # this project's machine: the nccl path is implemented but cannot run
        with pytest.raises(ValueError, match="backend 'nccl' cannot run here"):
            KVEndpoint("x", InprocStore(), backend="nccl")


def test_a_cache_list_changed_since_its_last_transfer_is_checked_again(pair):
    """The endpoint remembers a cache list's layout (a worker hands over the same list every time); once one of the
    list's layers holds other tensors it is validated again: a bad one is refused naming kv_caches, a good one
    moves its own bytes."""
    p, d = pair
    src, dst = make_cache(SRC), make_cache(DST)
    assert p._layout_of(src) is p._layout_of(src)  # remembered, not worked out again
    hr = d.recv("p0", "a", dst, [4, 5], 7)
    hs = p.send("d0", "a", src, [1, 2], 7, layers_ready=True)
    assert p.wait(hs, 5) == DONE and d.wait(hr, 5) == DONE
    good = src[1]
    src[1] = (good[0][:, :, :1], good[1][:, :, :1])  # a layer swapped for a slice of fewer heads
    with pytest.raises(ValueError, match=r"kv_caches\[1\]"):
        p.send("d0", "b", src, [1, 2], 7)
    dst[2] = (dst[2][0].to(torch.float16), dst[2][1].to(torch.float16))
    with pytest.raises(ValueError, match=r"kv_caches\[2\]"):
        d.recv("p0", "b", dst, [6, 7], 7)
    src[1] = (good[0].clone() + 1, good[1].clone() + 1)  # a good layer, other bytes: those arrive
    dst = make_cache(DST)
    hr = d.recv("p0", "c", dst, [4, 5], 7)
    hs = p.send("d0", "c", src, [1, 2], 7, layers_ready=True)
    assert p.wait(hs, 5) == DONE and d.wait(hr, 5) == DONE
    assert token_checksum(src, [1, 2], 7) == token_checksum(dst, [4, 5], 7)


def test_the_remembered_layout_keeps_no_cache_alive(pair):
    """An engine that drops its cache frees it, even though the endpoint remembers that cache's layout."""
    import gc
    import weakref

    p, _ = pair
    cache = make_cache(SRC)
    lay = p._layout_of(cache)
    assert p._layout_of(cache) is lay and p._layout_of(list(cache)) == lay  # (another list: worked out again)
    ref = weakref.ref(cache[0][0])
    del cache
    gc.collect()
    assert ref() is None


def _send_13_tokens(p: KVEndpoint, d: KVEndpoint, rid: str = "r1", wait_s: float = 10) -> None:
    """p0 -> d0: request ``rid``'s 13 tokens, every layer, landing intact in d0's blocks 3, 4, 5."""
    src, dst = make_cache(SRC), make_cache(DST)
    hr = d.recv("p0", rid, dst, [3, 4, 5], 13)
    hs = p.send("d0", rid, src, [9, 1, 2, 7], 13)
    for i in range(3):
        p.layer_ready(hs, i)
    assert p.wait(hs, wait_s) == DONE, p.failure(hs)
    assert d.wait(hr, wait_s) == DONE, d.failure(hr)
    assert token_checksum(src, [9, 1, 2, 7], 13) == token_checksum(dst, [3, 4, 5], 13)


def test_gloo_pairs_rendezvous_through_redis(redis_url, redis_namespace):
    """Two endpoints in one process, gloo groups in threads, rendezvous on a real Redis server."""
    cfg = StoreConfig(redis_url, namespace=f"{redis_namespace}:kvt")
    p = KVEndpoint("p0", cfg, backend="gloo", timeout_s=5.0)
    d = KVEndpoint("d0", cfg, backend="gloo", timeout_s=5.0)
    try:
        _send_13_tokens(p, d)
        import redis
        keys = redis.Redis.from_url(redis_url).keys(f"{redis_namespace}:kvt/*")
        assert any(b"/inc/p0" in k for k in keys) and any(b"/offer/p0>d0" in k for k in keys)
    finally:
        p.shutdown()
        d.shutdown()
    assert not [t for t in threading.enumerate() if t.name.startswith("kv-") and t.is_alive()
                and ("-p0" in t.name or "-d0" in t.name)]


def test_gloo_pairs_listen_and_connect_on_the_given_host_only(redis_url, redis_namespace):
    """``host`` pins gloo to one interface: 127.0.0.2 (loopback, but not what the hostname resolves to), so
    every TCP socket the pair opens listens on or connects to 127.0.0.2, none on a wildcard."""
    import psutil

    me = psutil.Process()
    before = {(c.laddr, c.raddr) for c in me.net_connections("tcp")}
    cfg = StoreConfig(redis_url, namespace=f"{redis_namespace}:kvt", host="127.0.0.2")
    # a generous pair timeout: under a loaded suite a 5 s one could break the pair and leave it being rebuilt
    # (listening, not yet connected) when the sockets are read
    p = KVEndpoint("p0", cfg, backend="gloo", timeout_s=30.0)
    d = KVEndpoint("d0", StoreConfig(redis_url, namespace=f"{redis_namespace}:kvt"), backend="gloo",
                   timeout_s=30.0, host="127.0.0.2")
    try:
        _send_13_tokens(p, d, wait_s=60)
        redis_port = int(redis_url.rsplit(":", 1)[1].split("/")[0])

        def new_sockets() -> list:
            return [c for c in me.net_connections("tcp") if (c.laddr, c.raddr) not in before
                    and redis_port not in (c.laddr.port, c.raddr.port if c.raddr else None)]

        # Listeners bind 127.0.0.2; connections go to 127.0.0.2 (the kernel picks the connecting side's
        # source address, 127.0.0.1 on loopback). The pair's connection(s), waited for: a pair is rebuilt after a
        # failure, connecting again
        new = wait_until(lambda: (lambda n: n if any(c.raddr for c in n) else None)(new_sockets()), 30,
                         message=lambda: f"no connected socket of the pair: {new_sockets()}")
        assert all(c.laddr.ip == "127.0.0.2" for c in new if c.status == psutil.CONN_LISTEN), new
        assert all("127.0.0.2" in (c.laddr.ip, c.raddr.ip) for c in new if c.raddr), new
    finally:
        p.shutdown()
        d.shutdown()


def test_store_config_repr_and_errors_hide_the_redis_password():
    cfg = StoreConfig("redis://:s3cret-pass@127.0.0.1:1/0", namespace="x")
    assert "s3cret" not in repr(cfg) and "redis://:***@127.0.0.1:1/0" in repr(cfg)
    with pytest.raises(ValueError) as e:
        KVEndpoint("p0", StoreConfig("http://:s3cret-pass@127.0.0.1:1/0"), backend="gloo")
    assert "s3cret" not in str(e.value) and "***" in str(e.value)


def test_corrupt_frame_breaks_pair_which_is_rebuilt(pair, monkeypatch):
    """A header whose framing is garbage cannot be skipped: the pair is dropped and rebuilt."""
    import kvtransfer.channel_send as cs

    p, d = pair
    src, dst = make_cache(SRC), make_cache(DST)
    real_pack = cs.FrameHeader.pack
    calls = []

    def corrupt_first(self, out=None):
        buf = real_pack(self, out)
        if not calls:
            buf[0] ^= 0xFF  # breaks the magic
        calls.append(1)
        return buf

    monkeypatch.setattr(cs.FrameHeader, "pack", corrupt_first)
    hr = d.recv("p0", "garbled", dst, [0, 1], 8, deadline_s=1.0)
    hs = p.send("d0", "garbled", src, [0, 1], 8, layers_ready=True)
    assert p.wait(hs, 3) == FAILED and "bad frame" in p.failure(hs) or "broken" in p.failure(hs)
    assert d.wait(hr, 3) == FAILED  # its header never parsed: it fails by its deadline
    assert untouched_except(dst, [])
    hr = d.recv("p0", "next", dst, [2, 3], 8)
    hs = p.send("d0", "next", src, [4, 5], 8, layers_ready=True)
    assert p.wait(hs, 5) == DONE and d.wait(hr, 5) == DONE
    assert token_checksum(src, [4, 5], 8) == token_checksum(dst, [2, 3], 8)


def test_frames_larger_than_inline_go_in_chunks_and_arrive_intact(pair):
    """1 KiB token rows: each layer is 200 KiB, so most of it travels in 4 KiB payload chunks."""
    p, d = pair
    src = make_cache(CacheSpec(num_layers=3, num_blocks=64, block_size=4, num_kv_heads=4, head_dim=64, seed=9))
    dst = make_cache(CacheSpec(num_layers=3, num_blocks=40, block_size=6, num_kv_heads=4, head_dim=64))
    sb = list(range(63, 38, -1))      # 25 blocks of 4, descending: contiguous only within a block
    db = [3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 0, 1]  # 17 blocks of 6, mostly contiguous
    hr = d.recv("p0", "big", dst, db, 100)
    hs = p.send("d0", "big", src, sb, 100)
    for layer in (0, 1, 2):
        p.layer_ready(hs, layer)
    assert p.wait(hs, 10) == DONE, p.failure(hs)
    assert d.wait(hr, 10) == DONE, d.failure(hr)
    assert token_checksum(src, sb, 100) == token_checksum(dst, db, 100)
    assert untouched_except(dst, [(db, 100)])
    assert d.stats(hr).num_bytes == 3 * 2 * 100 * 1024


def test_caches_made_under_inference_mode(pair):
    """Engines allocate caches and call send/recv under torch.inference_mode; channel threads must cope."""
    p, d = pair
    with torch.inference_mode():
        src = make_cache(CacheSpec(num_layers=2, num_blocks=8, num_kv_heads=8, head_dim=64, seed=3))
        dst = make_cache(CacheSpec(num_layers=2, num_blocks=8, num_kv_heads=8, head_dim=64))
        hr = d.recv("p0", "im", dst, [1, 2, 3], 40)
        hs = p.send("d0", "im", src, [4, 5, 6], 40)
        p.layer_ready(hs, 0)
    p.all_layers_ready(hs)
    assert p.wait(hs, 5) == DONE, p.failure(hs)
    assert d.wait(hr, 5) == DONE, d.failure(hr)
    assert token_checksum(src, [4, 5, 6], 40) == token_checksum(dst, [1, 2, 3], 40)


def test_unknown_peer_fails_at_deadline_saying_why():
    st = InprocStore()
    with KVEndpoint("p0", st, backend="inproc", timeout_s=3.0) as p:
        t0 = time.monotonic()
        h = p.send("nobody", "r", make_cache(SRC), [0], 3, deadline_s=0.3, layers_ready=True)
        assert p.wait(h, 3) == FAILED
        assert time.monotonic() - t0 < 1.0
        assert "deadline exceeded" in p.failure(h) and "pair not connected" in p.failure(h)
        assert "'nobody'" in p.failure(h)


def test_receiver_republishes_its_incarnation_when_the_store_lost_it():
    """Rendezvous keys expire (the Redis store's TTL) or vanish (a restarted Redis): a receiver that has been
    up for longer still pairs with a new sender, because it publishes its incarnation again when it waits."""
    st = InprocStore()
    d = KVEndpoint("d0", st, backend="inproc", timeout_s=3.0)
    p = KVEndpoint("p1", st, backend="inproc", timeout_s=3.0)
    try:
        assert st.delete_key("kvt/inc/d0")  # the receiver's incarnation, gone as if it had expired
        src, dst = make_cache(SRC), make_cache(DST)
        hr = d.recv("p1", "r", dst, [4, 5], 7)
        hs = p.send("d0", "r", src, [1, 2], 7, layers_ready=True)
        assert p.wait(hs, 5) == DONE, p.failure(hs)
        assert d.wait(hr, 5) == DONE and token_checksum(src, [1, 2], 7) == token_checksum(dst, [4, 5], 7)
    finally:
        p.shutdown()
        d.shutdown()


@pytest.mark.parametrize("outage", ["killed", "paused"])
def test_unreachable_store_fails_waiting_transfers_at_once_and_the_pair_builds_once_it_is_back(outage):
    """Redis away before a pair was ever built: both ends fail their waiting transfer with the store as the
    reason, long before the transfers' 60 s deadline (a request falls back instead of hanging); once Redis
    answers again the very next transfer builds the pair (one outage does not mark the pair failed)."""
    import dataclasses
    import os
    import signal

    from cluster.redis_server import EmbeddedRedis

    server = EmbeddedRedis().start()
    cfg = StoreConfig(server.url, namespace="kvt")
    p = KVEndpoint("p0", cfg, backend="gloo", timeout_s=60.0)
    d = KVEndpoint("d0", cfg, backend="gloo", timeout_s=60.0)
    try:
        src, dst = make_cache(SRC), make_cache(DST)
        port = server.port
        if outage == "killed":
            os.kill(server.pid, signal.SIGKILL)
            server.stop()
        else:
            os.kill(server.pid, signal.SIGSTOP)
        t0 = time.monotonic()
        hr = d.recv("p0", "r1", dst, [3, 4, 5], 13)
        hs = p.send("d0", "r1", src, [9, 1, 2, 7], 13)
        for i in range(3):
            p.layer_ready(hs, i)
        # bounded by the wait, not by a wall-clock limit: a 60 s deadline failure would read differently
        assert p.wait(hs, 50) == FAILED and d.wait(hr, 50) == FAILED
        assert time.monotonic() - t0 < 50
        for why in (p.failure(hs), d.failure(hr)):
            assert "rendezvous store unavailable" in why and "deadline" not in why, why
        # Redis back: the same pair builds and carries the next request
        if outage == "killed":
            server = EmbeddedRedis(dataclasses.replace(server.config, port=port)).start()
        else:
            os.kill(server.pid, signal.SIGCONT)
        _send_13_tokens(p, d, "r2", 50)
    finally:
        p.shutdown()
        d.shutdown()
        if server.pid:
            try:
                os.kill(server.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass
        server.stop()


@pytest.mark.parametrize("shape", ["inline", "chunked"])
def test_a_completed_send_reports_every_byte_even_when_the_ack_beats_the_sender_thread(pair, monkeypatch, shape):
    """The receiver can take a frame's last message and acknowledge it (which completes the send and snapshots its
    stats for ``take_completed``, the prefill worker's ``kv_transfer_bytes_total``) before the sending thread,
    descheduled just after posting, gets back: the snapshot still holds every byte (it was short by the last
    message's bytes once, on a loaded CI box)."""
    from kvtransfer.transport import InprocPair

    post = InprocPair.isend

    def slow_after_posting(self, t, tag):
        op = post(self, t, tag)
        if threading.current_thread().name.startswith("kv-send"):
            time.sleep(0.05)  # the receiver acks meanwhile
        return op

    monkeypatch.setattr(InprocPair, "isend", slow_after_posting)
    p, d = pair
    if shape == "inline":
        src, dst, sb, db, n, row = make_cache(SRC), make_cache(DST), [1], [4], 3, 2 * 16 * 4
    else:
        spec = dict(num_layers=3, num_blocks=40, block_size=4, num_kv_heads=4, head_dim=64)
        src, dst = make_cache(CacheSpec(seed=3, **spec)), make_cache(CacheSpec(**spec))
        sb, db, n, row = [5, 6, 7], [1, 2, 3], 12, 4 * 64 * 4
    hr = d.recv("p0", "r", dst, db, n)
    hs = p.send("d0", "r", src, sb, n, layers_ready=True)
    assert p.wait(hs, 5) == DONE and d.wait(hr, 5) == DONE
    done = wait_until(lambda: p.take_completed(), timeout=5.0, interval=0.01, message="the send reported done")
    assert [(st.request_id, st.state, st.num_bytes) for st in done] == [("r", DONE, 3 * 2 * n * row)]
    assert token_checksum(src, sb, n) == token_checksum(dst, db, n)


@pytest.mark.parametrize("first", [1, 6, 12, 20])
def test_a_delta_transfer_moves_only_the_positions_the_receiver_lacks(pair, first):
    """``first_token``: positions before it stay as the receiver holds them (its prefix cache's blocks); the rest
    land exactly, in chunks or inline, whatever the two block sizes (4 and 6, so the cut falls anywhere in a block)."""
    p, d = pair
    spec = dict(num_layers=3, num_blocks=40, num_kv_heads=4, head_dim=64)
    src = make_cache(CacheSpec(block_size=4, seed=5, **spec))
    dst = make_cache(CacheSpec(block_size=6, seed=6, **spec))  # the receiver's own data, to be kept
    before = [(k.clone(), v.clone()) for k, v in dst]
    sb, db, n = [9, 3, 4, 5, 30, 31], [7, 8, 0, 2], 22
    hr = d.recv("p0", "delta", dst, db, n, first_token=first)
    hs = p.send("d0", "delta", src, sb, n, first_token=first)
    for layer in (2, 0, 1):
        p.layer_ready(hs, layer)
    assert p.wait(hs, 5) == DONE, p.failure(hs)
    assert d.wait(hr, 5) == DONE, d.failure(hr)
    for (sk, sv), (dk, dv), (bk, bv) in zip(src, dst, before):
        for s, t, b in ((sk, dk, bk), (sv, dv, bv)):
            for pos in range(n):
                got = t[db[pos // 6], pos % 6]
                want = s[sb[pos // 4], pos % 4] if pos >= first else b[db[pos // 6], pos % 6]
                assert torch.equal(got, want), (first, pos)
    moved = 3 * 2 * (n - first) * 4 * 64 * 4
    assert p.stats(hs).num_bytes == d.stats(hr).num_bytes == moved


def test_a_delta_transfer_whose_sides_disagree_on_the_cut_is_refused(pair):
    p, d = pair
    src, dst = make_cache(SRC), make_cache(DST)
    hr = d.recv("p0", "cut", dst, [0, 1, 2], 10, first_token=4)
    hs = p.send("d0", "cut", src, [0, 1, 2], 10, first_token=0, layers_ready=True)
    assert p.wait(hs, 5) == FAILED and d.wait(hr, 5) == FAILED
    assert "num_tokens mismatch: sender 10, receiver 6" in d.failure(hr)
    with pytest.raises(ValueError, match="first_token"):
        p.send("d0", "bad", src, [0, 1, 2], 10, first_token=10)
    with pytest.raises(ValueError, match="first_token"):
        d.recv("p0", "bad", dst, [0, 1], 10, first_token=-1)


def test_an_fp8_cache_ships_as_it_is(pair):
    """kv_cache_dtype="fp8" caches (float8 e4m3) move byte for byte, one byte a value."""
    p, d = pair
    spec = dict(num_layers=2, num_blocks=16, block_size=4, dtype="float8_e4m3fn")
    src, dst = make_cache(CacheSpec(seed=3, **spec)), make_cache(CacheSpec(**spec))
    hr = d.recv("p0", "f8", dst, [4, 5, 6], 10)
    hs = p.send("d0", "f8", src, [9, 1, 2], 10, layers_ready=True)
    assert p.wait(hs, 5) == DONE and d.wait(hr, 5) == DONE
    assert token_checksum(src, [9, 1, 2], 10) == token_checksum(dst, [4, 5, 6], 10)
    assert p.stats(hs).num_bytes == 2 * 2 * 10 * 2 * 16  # layers x (K, V) x tokens x heads x head_dim x 1 byte
