"""Same-node KV over CUDA IPC (transport/cuda_ipc.py, kvtransfer/shm.py's ``negotiate_cuda`` and CUDA pull frames).

On CPU the protocol around the CUDA calls is checked with the calls stood in by shared-memory segments: the
negotiation over a real gloo pair (both ends agree only when the receiver maps the probe and reads its stamp back),
the handle's encoding (plain JSON, refused when malformed), and a CUDA-form pull descriptor copied into a cache
through the same checks as the shared-memory one. Where a GPU is, two processes on it move KV through a real CUDA
IPC pair, bit-exact, without NCCL (benchmarks/device_session.sh runs it).
"""
from __future__ import annotations

import secrets
import struct
import threading

import pytest
import torch
import torch.distributed as dist

from kvtransfer.shm import _CUDA_MAGIC, _PULL_CUDA, IpcPair, negotiate_cuda, pull_descriptor, pull_rows
from kvtransfer.transport import _open_gloo
from kvtransfer.wire import FramingError
from transport.cuda_ipc import CudaHandle
from transport.shared_memory import SharedSegment, map_segment


def _handle(nbytes: int = 64) -> CudaHandle:
    return CudaHandle(0, secrets.token_bytes(64), nbytes, 0, b"/torch_123_456_0", 0, secrets.token_bytes(64), True)


def test_a_handle_round_trips_through_plain_json_and_garbage_is_refused():
    h = _handle()
    assert CudaHandle.unpack(h.pack()) == h
    assert CudaHandle.unpack(CudaHandle(1, b"h", 8, 4, b"r", 2, None, False).pack()).event is None
    for bad in (b"", b"[1,2]", b"not json", b'[0,"!!",64,0,"cg==",0,null,false]', b'[0,"aA==",0,0,"cg==",0,null,0]',
                b'[-1,"aA==",8,0,"cg==",0,null,0]'):
        with pytest.raises(ValueError, match="not a CUDA IPC handle"):
            CudaHandle.unpack(bad)


class _StandIn:
    """The CUDA calls as shared memory: ``export`` makes a probe segment with a stamp (its handle packed as a
    CudaHandle whose ``handle`` bytes carry the segment's /proc path), ``opener`` maps it."""

    def __init__(self, stamp_ok: bool = True, open_fails: bool = False, export_fails: bool = False):
        self.stamp_ok, self.open_fails, self.export_fails = stamp_ok, open_fails, export_fails
        self.segments: dict[bytes, SharedSegment] = {}
        self.opened = 0

    def export(self):
        if self.export_fails:
            raise RuntimeError("no CUDA device (test)")
        seg = SharedSegment(64, "probe-test")
        stamp = secrets.token_bytes(16)
        seg.tensor[:16] = torch.frombuffer(bytearray(stamp), dtype=torch.uint8)
        raw = CudaHandle(0, repr(seg.handle).encode(), 64, 0, b"r", 0, None, False).pack()
        self.segments[raw] = seg
        return raw, (stamp.hex() if self.stamp_ok else secrets.token_hex(16)), lambda: self.segments.pop(raw)

    def opener(self, raw: bytes) -> torch.Tensor:
        self.opened += 1
        if self.open_fails:
            raise RuntimeError("cudaIpcOpenMemHandle: invalid device context (test)")
        CudaHandle.unpack(raw)
        return map_segment(self.segments[raw].handle)


def _negotiated(sender: _StandIn, receiver: _StandIn, accept: bool = True):
    store = dist.HashStore()
    out: dict[int, object] = {}

    def side(rank: int, standin: _StandIn) -> None:
        pair = _open_gloo(dist.PrefixStore("p", store), rank, 10.0, "127.0.0.1")
        out[rank] = negotiate_cuda(pair, rank, 10.0, accept=accept, export=standin.export, opener=standin.opener)

    threads = [threading.Thread(target=side, args=(r, s)) for r, s in ((0, sender), (1, receiver))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert set(out) == {0, 1}
    return out[0], out[1]


def test_both_ends_agree_on_cuda_ipc_when_the_receiver_reads_the_probe():
    s, r = _StandIn(), _StandIn()
    r.segments = s.segments  # "the same node": the receiver can open what the sender exported
    a, b = _negotiated(s, r)
    try:
        assert isinstance(a, IpcPair) and isinstance(b, IpcPair) and a.pull and b.cuda_ipc
        assert r.opened == 1 and not s.segments  # the probe is dropped once answered
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("why", ["cannot open", "wrong stamp", "no export", "declined"])
def test_the_pair_stays_on_nccl_when_the_receiver_cannot_use_the_senders_memory(why):
    s = _StandIn(stamp_ok=why != "wrong stamp", export_fails=why == "no export")
    r = _StandIn(open_fails=why == "cannot open")
    r.segments = s.segments
    a, b = _negotiated(s, r, accept=why != "declined")
    try:
        assert not isinstance(a, IpcPair) and not isinstance(b, IpcPair)
        assert r.opened == (1 if why in ("cannot open", "wrong stamp") else 0)
    finally:
        a.close()
        b.close()


class _FakeCudaSegment:
    """A CPU shared segment presented as a CUDA one (the descriptor's form follows the handle's type)."""

    def __init__(self, seg: SharedSegment):
        self.seg, self.nbytes = seg, seg.handle.nbytes
        self.handle = CudaHandle(0, repr(seg.handle).encode(), self.nbytes, 0, b"r", 0, None, False)

    def contains(self, t: torch.Tensor) -> bool:
        return self.seg.contains(t)

    def offset(self, t: torch.Tensor) -> int:
        return self.seg.offset(t)


class _IpcReceiver:
    cuda_ipc = True

    def __init__(self, seg: SharedSegment, expect: CudaHandle):
        self.seg, self.expect = seg, expect
        self.counts = {"ring_chunks": 0, "pull_frames": 0}

    def peer_segment(self, raw: bytes) -> torch.Tensor:
        if CudaHandle.unpack(raw) != self.expect:
            raise RuntimeError("no such allocation (test)")
        return map_segment(self.seg.handle)


@pytest.mark.parametrize("dst_layout", ["engine", "tensor-per-layer"])
def test_a_cuda_pull_descriptor_copies_the_rows_and_is_checked_like_the_shared_memory_one(dst_layout):
    """Into a cache laid out as an engine's (one allocation: every layer in one copy) and one of a tensor per layer."""
    from engine.config import ModelConfig
    from engine.kv_cache import allocate_kv_caches, share_kv_caches
    from kvtransfer.layout import CacheLayout, TokenRows

    g = torch.Generator().manual_seed(5)
    src = share_kv_caches([(torch.randn(8, 16, 2, 16, generator=g), torch.randn(8, 16, 2, 16, generator=g))
                           for _ in range(2)])
    seg = src[0][0]._pdserve_segment
    fake = _FakeCudaSegment(seg)
    desc = pull_descriptor(src, TokenRows(CacheLayout.of(src), [5, 2], 21, "src"), 0, 2, 32 << 10, segment=fake)
    assert desc is not None and struct.unpack_from("<I", desc)[0] == _CUDA_MAGIC

    def pull(raw: bytes, group) -> list:
        mc = ModelConfig(num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, head_dim=16)
        dst = (allocate_kv_caches(mc, 8, 16, torch.float32, torch.device("cpu")) if dst_layout == "engine" else
               [(torch.zeros(8, 16, 2, 16), torch.zeros(8, 16, 2, 16)) for _ in range(2)])
        assert (CacheLayout.of(dst).layer_step is not None) == (dst_layout == "engine")
        rows = TokenRows(CacheLayout.of(dst), [1, 7], 21, "dst")
        pull_rows(group, torch.frombuffer(bytearray(raw), dtype=torch.uint8), 0, 2, 21, 2 * 16 * 4, dst, rows)
        return dst

    got = pull(desc, _IpcReceiver(seg, fake.handle))
    for (sk, sv), (dk, dv) in zip(src, got):
        for s, d in ((sk, dk), (sv, dv)):
            assert torch.equal(d[1], s[5]) and torch.equal(d[7, :5], s[2, :5]) and not d[7, 5:].any()
    head = list(_PULL_CUDA.unpack_from(desc))
    hraw = desc[_PULL_CUDA.size:_PULL_CUDA.size + head[1]]
    rest = desc[_PULL_CUDA.size + head[1]:]
    offs = list(struct.unpack_from("<4Q", rest))

    def with_(head_=None, hraw_=None, offs_=None) -> bytes:
        h = head_ or head
        hr = hraw if hraw_ is None else hraw_
        h = [*h[:1], len(hr), *h[2:]]
        return _PULL_CUDA.pack(*h) + hr + struct.pack("<4Q", *(offs_ or offs)) + rest[32:]

    bad = {
        "outside": with_(offs_=[*offs[:3], head[2]]),                     # past the segment's end
        "block id": with_(head_=[*head[:3], 2, *head[4:]]),               # the sender said it has 2 blocks
        "another allocation": with_(hraw_=_handle(head[2]).pack()),       # a handle nobody exported
        "not a handle": with_(hraw_=b"x" * 40),
        "cut short": desc[:-4],
    }
    for name, raw in bad.items():
        with pytest.raises(FramingError):
            pull(raw, _IpcReceiver(seg, fake.handle))
    with pytest.raises(FramingError, match="did not agree to CUDA IPC"):  # on a shared-memory pair
        pull(desc, type("ShmLike", (), {"counts": {"pull_frames": 0}, "peer_segment": None})())


def test_a_gpu_pull_gathers_once_where_a_copy_a_stretch_would_be_many_launches():
    """``_gathered``: on a GPU more than a few stretches (a decode worker's scattered blocks) go as one gather and one
    scatter; on CPU only stretches shorter than 8 rows on average do (a copy a stretch moves each byte once)."""
    from kvtransfer.shm import _GPU_STRETCHES, _gathered

    blocks = tuple((16 * i, 16 * (3 * i + 1), 16) for i in range(63))  # 1,008 tokens, a stretch a block
    assert _gathered(blocks, 1008, torch.device("cuda")) and not _gathered(blocks, 1008, torch.device("cpu"))
    few = blocks[:_GPU_STRETCHES]
    assert not _gathered(few, 16 * len(few), torch.device("cuda"))
    short = tuple((4 * i, 8 * i, 4) for i in range(10))  # 4-row stretches: gathered anywhere
    assert _gathered(short, 40, torch.device("cpu"))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (device_session.sh)")
def test_two_processes_on_one_gpu_move_kv_over_cuda_ipc_bit_exact(store_url):
    from tests.kvtransfer.agent import Agent, CacheSpec, wait_state

    spec = dict(num_layers=3, num_blocks=64, block_size=16, num_kv_heads=4, head_dim=64, dtype="bfloat16",
                device="cuda")
    a = Agent("A", store_url, CacheSpec(seed=7, shared=True, **spec), timeout_s=30.0)
    b = Agent("B", store_url, CacheSpec(**spec), timeout_s=30.0)
    try:
        a.ready(120)
        b.ready(120)
        # a few stretches (a copy each), one stretch, and 20 scattered blocks (on a GPU: one gather and one scatter)
        scattered = [63, 41, 17, 50, 8, 33, 26, 59, 2, 45, 12, 38, 21, 55, 5, 29, 48, 14, 36, 61]
        for rid, src, dst, n in (("r1", [5, 9, 2, 40], [13, 11, 10, 12], 57),
                                 ("r2", list(range(8)), list(range(30, 38)), 128),
                                 ("r3", list(range(40, 60)), scattered, 320)):
            b.call("recv", rid, "A", rid, dst, n, 60.0)
            a.call("send", rid, "B", rid, src, n, "all", 60.0)
            assert wait_state(a, rid, 60)[:2] == ("done", None)
            assert wait_state(b, rid, 60)[:2] == ("done", None)
            assert a.call("checksum", src, n) == b.call("checksum", dst, n)
        pairs = b.call("pairs")
        assert pairs["recv:A"] == "cuda-ipc" and pairs["recv:A:counts"]["pull_frames"] >= 2
        assert {s[4] for s in a.call("stats") + b.call("stats")} == {"pull"}
    finally:
        a.stop()
        b.stop()

