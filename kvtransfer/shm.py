"""Same-host KV payload through shared memory: a gloo pair whose payload bytes skip the socket.

Why: two workers on one host moved KV through gloo over loopback, every byte copied into the kernel's socket
buffers and out again (2-4 GB/s here, docs/benchmarks.md). Here the payload goes through a ring of slots in a
``/dev/shm`` file both processes map: the sender copies a chunk into a free slot and tells the receiver which
(a 16-byte control message over the pair's gloo group), the receiver copies it out and hands the slot back.
Head messages and acks, and everything about breaking a pair, stay gloo's (``TorchPair``).

Lifecycle: the sender's endpoint offers shared memory only to a receiver that published the capability
(``Rendezvous``: ``cap/<name>``; an older receiver never sees it) and only on a gloo backend; the offer is
marked in the pair's key. ``negotiate`` then runs once on the freshly built gloo pair, both ranks: rank 0
creates ``/dev/shm/pdserve-kv-<pid>-<random>`` (``SLOTS`` x ``slot_bytes`` plus a header holding a random
nonce) and sends its name; rank 1 maps it and checks the nonce, which tells whether both processes see the
same ``/dev/shm`` (two containers on one node may not), and answers yes or no; rank 0 unlinks the file either
way (the mappings live on; a process killed inside that window leaves one file, which ``sweep_orphans``
removes at the next endpoint start once its creator is dead). On yes both use a ``ShmPair``, on no the plain gloo
pair: nothing else differs. ``close`` closes the gloo pair (waking every wait, as before) and drops the mapping.

Ordering: control messages share gloo's per-tag FIFO order. A sender's payload ops are carried out in the order
they were posted, whatever order they are waited in (a chunk is announced only after every earlier one); a
receiver posts its control receive at ``irecv`` time, so chunks match receives in order as gloo's would. Slot
reuse waits for the receiver's release of that slot; the sender keeps one release receive posted per slot, so
a receiver's release never blocks on the sender.
"""
from __future__ import annotations

import functools
import json
import logging
import os
import re
import secrets
import struct
import threading
from collections import deque
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

import torch

from kvtransfer.layout import CacheLayout, TokenRows, _rows, block_rows
from kvtransfer.transport import PairBroken, PairOp, TorchPair
from kvtransfer.wire import TAG_PAYLOAD, FramingError
from transport.shared_memory import SegmentHandle, SharedSegment, map_segment, segment_of

log = logging.getLogger(__name__)

SHM_DIR = Path("/dev/shm")
SLOTS = 8
"""Ring slots per pair: twice the channels' window of payload messages in flight."""
TAG_SHM_HELLO, TAG_SHM_CTL, TAG_SHM_FREE = 0x7F10, 0x7F11, 0x7F12
_HELLO_BYTES = 512
_HEADER = 64
"""Bytes before the first slot: the nonce rank 1 checks."""
_NAME = re.compile(r"^pdserve-kv-(\d+)-[0-9a-f]{16}$")
_RING, _PULL_OK = 1, 2
"""Bits of rank 1's answer: the ring file is shared; it can also map rank 0's memory (pull frames)."""
_PULL = struct.Struct("<IIQQIIII")
"""Pull descriptor head: pid, fd, inode, segment bytes, source blocks, source block size, first_token, ids; then
two u64 offsets (K, V) per layer of the frame, then the block ids as u32."""
_MAPPED_MAX = 8
_GPU_STRETCHES = 16
"""A GPU pull with more stretches than this gathers and scatters (``_gathered``)."""
_CUDA_MAGIC = 0x55434450
"""b"PDCU": a pull descriptor naming a CUDA IPC segment (a pid, the first field of the other form, is < 2**22)."""
_PULL_CUDA = struct.Struct("<IIQIIII")
"""CUDA pull descriptor head: magic, packed handle bytes, segment bytes, source blocks, source block size,
first_token, ids; then the packed ``transport.cuda_ipc.CudaHandle``, the offsets and the block ids as above."""


def _stamp(t: torch.Tensor) -> str:
    """Write a random 16-byte nonce at the start of ``t``; its hex, for the peer to check."""
    nonce = secrets.token_bytes(16)
    t[:16] = torch.frombuffer(bytearray(nonce), dtype=torch.uint8)
    return nonce.hex()


def _stamped(t: torch.Tensor, nonce_hex: str) -> bool:
    """Whether ``t`` starts with the nonce ``_stamp`` wrote (the peer's memory, not another's)."""
    return bytes(t[:16].tolist()) == bytes.fromhex(nonce_hex)


def _segment(path: Path, nbytes: int) -> torch.Tensor:
    """Map the ring file at ``path`` (``nbytes``)."""
    return torch.from_file(str(path), shared=True, size=nbytes, dtype=torch.uint8)


def _create(path: Path, nbytes: int) -> torch.Tensor:
    """Create the ring file (this user only) with its pages reserved, then map it. A ``/dev/shm`` too small for it (a
    container's default is 64 MiB) fails here with ENOSPC, not later with SIGBUS on a write to a sparse file."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return _segment(path, nbytes)


def sweep_orphans(shm_dir: Optional[Path] = None) -> int:
    """Remove ring files whose creating process is gone (it died between creating and unlinking one)."""
    shm_dir = shm_dir or SHM_DIR
    removed = 0
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return 0
    for name in names:
        m = _NAME.match(name)
        if m is None or Path(f"/proc/{m.group(1)}").exists():
            continue
        try:
            os.unlink(shm_dir / name)
            removed += 1
        except OSError:
            pass
    return removed


def negotiate(pair: TorchPair, rank: int, slot_bytes: int, timeout_s: float,
              shm_dir: Optional[Path] = None, accept: bool = True) -> "TorchPair | ShmPair":
    """Run on a gloo pair just built with a shared-memory offer: the ``ShmPair`` both agreed on, or ``pair``.
    ``accept`` (rank 1): False answers no whatever is offered (this endpoint has shared memory off; a capability key
    it published in an earlier life may still be in the store)."""
    shm_dir = shm_dir or SHM_DIR
    msg = torch.zeros(_HELLO_BYTES, dtype=torch.uint8)
    answer = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        path: Optional[Path] = None
        seg = None
        hello: dict[str, Any] = {"path": ""}
        probe = None
        try:  # can the receiver map this process's memory (the same pid namespace and user)? then it may pull
            probe = SharedSegment(64, "pdserve-kv-probe")
            h = probe.handle
            hello["pull"] = [h.pid, h.fd, h.inode, h.nbytes, _stamp(probe.tensor)]
        except (OSError, RuntimeError) as e:  # no memfd, or torch cannot map it: the ring only
            log.info("kv pull unavailable here (%s)", e)
        try:
            path = shm_dir / f"pdserve-kv-{os.getpid()}-{secrets.token_hex(8)}"
            seg = _create(path, _HEADER + SLOTS * slot_bytes)
            hello.update(path=str(path), nonce=_stamp(seg), slot_bytes=slot_bytes, slots=SLOTS)
        except (OSError, RuntimeError) as e:  # no /dev/shm, or full: plain gloo
            log.info("kv shared memory unavailable here (%s); the pair stays on gloo", e)
            seg = None
        try:
            raw = json.dumps(hello).encode()
            msg[:len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
            pair.isend(msg, TAG_SHM_HELLO).wait(timeout_s)
            pair.irecv(answer, TAG_SHM_HELLO).wait(timeout_s)
        finally:
            if path is not None:
                try:
                    os.unlink(path)
                except OSError:
                    pass
            if probe is not None:
                probe.close()
        said = int(answer.item())
        if seg is not None and said & _RING:
            return ShmPair(pair, seg, slot_bytes, SLOTS, rank, pull=bool(said & _PULL_OK))
        return pair
    pair.irecv(msg, TAG_SHM_HELLO).wait(timeout_s)
    seg = None
    try:
        if not accept:
            raise ValueError("shared memory is off here")
        hello = json.loads(bytes(msg.tolist()).rstrip(b"\0").decode())
        path = Path(hello.get("path", ""))
        if path.parent == shm_dir and _NAME.match(path.name):
            size = _HEADER + int(hello["slots"]) * int(hello["slot_bytes"])
            if path.stat().st_size == size:
                cand = _segment(path, size)
                if _stamped(cand, hello["nonce"]):
                    seg = cand
    except (OSError, RuntimeError, ValueError, KeyError, TypeError):
        seg = None  # another /dev/shm (another container), or a file already gone: gloo
    pull = False
    if seg is not None and "pull" in hello:
        try:
            pid, fd, inode, nbytes, nonce = hello["pull"]
            pull = _stamped(map_segment(SegmentHandle(int(pid), int(fd), int(inode), int(nbytes))), nonce)
        except (OSError, RuntimeError, ValueError, TypeError):
            pull = False  # another pid namespace or user: the ring only
    answer.fill_((_RING if seg is not None else 0) | (_PULL_OK if pull else 0))
    pair.isend(answer, TAG_SHM_HELLO).wait(timeout_s)
    if seg is None:
        return pair
    return ShmPair(pair, seg, int(hello["slot_bytes"]), int(hello["slots"]), rank, pull=pull)


_CUDA_HELLO_BYTES = 1024


def negotiate_cuda(pair: TorchPair, rank: int, timeout_s: float, accept: bool = True,
                   export: Optional[Callable[[], tuple[bytes, str, Callable[[], None]]]] = None,
                   opener: Optional[Callable[[bytes], torch.Tensor]] = None) -> "TorchPair | IpcPair":
    """Run on an nccl pair (its gloo control group) just built with a same-node offer: an ``IpcPair`` where rank 1
    can map rank 0's device memory (CUDA IPC: the same node, a device it can reach), else ``pair`` (payload over
    NCCL, as before). Rank 0 exports a small probe segment holding a random stamp; rank 1 maps it, reads the stamp
    back and answers. ``export`` / ``opener`` stand in for the CUDA calls (tests on CPU); the defaults use
    ``transport.cuda_ipc``."""
    export = export or _export_cuda_probe
    probe_opener = opener or _open_cuda_probe
    opener = opener or _open_cuda
    msg = torch.zeros(_CUDA_HELLO_BYTES, dtype=torch.uint8)
    answer = torch.zeros(1, dtype=torch.int64)
    if rank == 0:
        hello: dict[str, Any] = {}
        release: Callable[[], None] = lambda: None  # noqa: E731
        try:
            raw, nonce, release = export()
            hello = {"handle": raw.decode(), "nonce": nonce}
        except (OSError, RuntimeError, ValueError) as e:
            log.info("kv CUDA IPC unavailable here (%s); the pair stays on NCCL", e)
        try:
            body = json.dumps(hello).encode()
            if len(body) > _CUDA_HELLO_BYTES:
                body = b"{}"
            msg[:len(body)] = torch.frombuffer(bytearray(body), dtype=torch.uint8)
            pair.isend(msg, TAG_SHM_HELLO).wait(timeout_s)
            pair.irecv(answer, TAG_SHM_HELLO).wait(timeout_s)
        finally:
            release()
        return IpcPair(pair, opener) if int(answer.item()) & _PULL_OK else pair
    pair.irecv(msg, TAG_SHM_HELLO).wait(timeout_s)
    ok = False
    if accept:
        try:
            hello = json.loads(bytes(msg.tolist()).rstrip(b"\0").decode())
            if "handle" in hello:
                raw = hello["handle"].encode()
                probe = probe_opener(raw)
                ok = bytes(probe[:16].cpu().tolist()).hex() == hello["nonce"]
                del probe
        except (OSError, RuntimeError, ValueError, KeyError, TypeError, AttributeError):
            ok = False  # another node, a device out of reach, no CUDA: NCCL
    answer.fill_(_PULL_OK if ok else 0)
    pair.isend(answer, TAG_SHM_HELLO).wait(timeout_s)
    return IpcPair(pair, opener) if ok else pair


def _export_cuda_probe() -> tuple[bytes, str, Callable[[], None]]:
    """A 64-byte CUDA segment with a random stamp in its first 16 bytes: its packed handle, the stamp (hex), and
    how to drop it."""
    from transport.cuda_ipc import CudaSegment

    if not torch.cuda.is_available():
        raise RuntimeError("no CUDA device")
    seg = CudaSegment(64, torch.device("cuda", torch.cuda.current_device()))
    stamp = secrets.token_bytes(16)
    seg.tensor[:16].copy_(torch.frombuffer(bytearray(stamp), dtype=torch.uint8))
    torch.cuda.current_stream(seg.tensor.device).synchronize()
    holder = [seg]

    def release() -> None:
        holder.clear()  # the allocation goes back to torch's cache (torch's IPC counter keeps it while mapped)

    return seg.handle.pack(), stamp.hex(), release


def _open_cuda(raw: bytes) -> torch.Tensor:
    from transport.cuda_ipc import CudaHandle, open_handle

    return open_handle(CudaHandle.unpack(raw))


def _open_cuda_probe(raw: bytes) -> torch.Tensor:
    """The probe's mapping, not kept: it would pin the allocator block the probe came from."""
    from transport.cuda_ipc import CudaHandle, open_handle

    return open_handle(CudaHandle.unpack(raw), cache=False)


class IpcPair:
    """A ``PairGroup`` over an nccl ``TorchPair`` whose receiver maps the sender's device memory (CUDA IPC): data
    frames over a shared cache go as pull frames (the receiver copies the rows device to device); everything else
    (head messages, acks, payload of frames that cannot pull) is the plain pair's."""

    pull = True
    shared = True
    cuda_ipc = True
    link = "socket"
    """Frames that do not pull go as they would on the plain pair (NCCL payload)."""

    def __init__(self, pair: TorchPair, opener: Callable[[bytes], torch.Tensor]):
        self._pair = pair
        self._opener = opener
        self.counts = {"ring_chunks": 0, "pull_frames": 0}
        self.data_device = pair.data_device

    def isend(self, t: torch.Tensor, tag: int) -> PairOp:
        return self._pair.isend(t, tag)

    def irecv(self, t: torch.Tensor, tag: int) -> PairOp:
        return self._pair.irecv(t, tag)

    def peer_segment(self, handle: bytes) -> torch.Tensor:
        """Receiver: the sender's segment (a packed CUDA handle), mapped once per process (RuntimeError/ValueError
        if it cannot be)."""
        return self._opener(handle)

    def close(self) -> None:
        self._pair.close()


class _Op:
    def __init__(self, fn):
        self._fn, self._done = fn, False

    def wait(self, timeout_s: float) -> None:
        if not self._done:
            self._fn(timeout_s)
            self._done = True


class _Send:
    """One payload send: its pieces, how many are in slots and announced, the announcements' gloo ops; or a chunk
    the channel gathered straight into a slot (``staged``: slot, bytes), announced without a copy."""

    def __init__(self, pieces: list[torch.Tensor], staged: Optional[tuple[int, int]] = None):
        self.pieces, self.posted, self.ctl, self.staged = pieces, 0, [], staged


class _Recv:
    def __init__(self, fn):
        self._fn, self._view = fn, None

    def wait(self, timeout_s: float) -> torch.Tensor:
        if self._view is None:
            self._view = self._fn(timeout_s)
        return self._view


def _pieces(t: torch.Tensor, slot_bytes: int) -> list[torch.Tensor]:
    flat = t.reshape(-1).view(torch.uint8) if t.is_contiguous() else None
    if flat is None:
        raise PairBroken("shared-memory pair: payload tensors must be contiguous")
    return [flat[i:i + slot_bytes] for i in range(0, flat.numel(), slot_bytes)]


class ShmPair:
    """A ``PairGroup`` over a gloo ``TorchPair`` whose ``TAG_PAYLOAD`` bytes move through shared slots."""

    def __init__(self, pair: TorchPair, segment: torch.Tensor, slot_bytes: int, slots: int, rank: int,
                 pull: bool = False):
        self.pull = pull
        """Rank 1 can map rank 0's memory: data frames over a shared cache go as pull frames."""
        self.counts = {"ring_chunks": 0, "pull_frames": 0}
        """Receiver: payload chunks that came through the slots, and pull frames copied (for tests and logs)."""
        self._mapped: dict[tuple[int, int, int], torch.Tensor] = {}
        self._pair = pair
        self._seg = segment
        self._slot_bytes, self._nslots = slot_bytes, slots
        self.data_device = torch.device("cpu")
        self._lock = threading.Lock()
        self._sends: deque = deque()  # sender: payload ops posted, not yet carried out, in order
        self._free: deque[int] = deque(range(slots))
        self._releases: deque = deque()  # sender: (op, buffer) release receives posted, oldest first
        if rank == 0:
            for _ in range(slots):
                self._post_release()

    shared = True
    link = "ring"
    """What ``TransferStats.link`` calls a frame whose chunks take this pair's slots (a plain pair: "socket")."""

    @property
    def slot_bytes(self) -> int:
        return self._slot_bytes

    def _slot_of(self, view: torch.Tensor) -> Optional[int]:
        """The slot ``view`` lies in (it starts at that slot's first byte), or None: not this ring's memory."""
        base = self._seg.data_ptr() + _HEADER
        off = view.data_ptr() - base
        if view.device.type != "cpu" or off < 0 or off % self._slot_bytes or off // self._slot_bytes >= self._nslots:
            return None
        return off // self._slot_bytes

    def _slot(self, i: int, n: int) -> torch.Tensor:
        if not 0 <= i < self._nslots or not 0 <= n <= self._slot_bytes:
            raise PairBroken(f"shared-memory pair: bad slot message ({i}, {n})")
        lo = _HEADER + i * self._slot_bytes
        return self._seg[lo:lo + n]

    def _post_release(self) -> None:
        buf = torch.zeros(1, dtype=torch.int64)
        self._releases.append((self._pair.irecv(buf, TAG_SHM_FREE), buf))

    def _take_slot(self, timeout_s: Optional[float]) -> Optional[int]:
        """A free slot: at once if one is free or released already; None if not and ``timeout_s`` is None; else
        wait for the oldest release (PairBroken after ``timeout_s``)."""
        while not self._free:
            op, buf = self._releases[0]
            if timeout_s is None and not op.completed():
                return None
            op.wait(timeout_s if timeout_s is not None else 1.0)  # None: already completed
            self._releases.popleft()
            self._free.append(int(buf.item()))
            self._post_release()
        return self._free.popleft()

    def _pump(self, timeout_s: Optional[float], upto: Optional[_Send] = None) -> None:
        """Copy posted payload sends into slots and announce them, in order: while slots are free (``timeout_s``
        None), or waiting for releases until ``upto`` is all announced. Holds the lock."""
        while self._sends:
            s = self._sends[0]
            if s.staged is not None and not s.posted:
                ctl = torch.tensor(list(s.staged), dtype=torch.int64)
                s.ctl.append(self._pair.isend(ctl, TAG_SHM_CTL))
                s.posted = len(s.pieces)
            while s.posted < len(s.pieces):
                i = self._take_slot(timeout_s)
                if i is None:
                    return
                piece = s.pieces[s.posted]
                self._slot(i, piece.numel()).copy_(piece)
                ctl = torch.tensor([i, piece.numel()], dtype=torch.int64)
                s.ctl.append(self._pair.isend(ctl, TAG_SHM_CTL))  # gloo keeps the tensor alive
                s.posted += 1
            self._sends.popleft()
            if s is upto:
                return

    # -- the channels' zero-copy side ------------------------------------------------------------
    def stage(self, nbytes: int, timeout_s: float) -> torch.Tensor:
        """Sender: a slot to gather a chunk of ``nbytes`` (at most ``slot_bytes``) straight into; ``isend`` of it
        (or of its first bytes) then only announces it. Earlier payload sends go out first."""
        if not 0 < nbytes <= self._slot_bytes:
            raise ValueError(f"stage: {nbytes} bytes do not fit a {self._slot_bytes}-byte slot")
        with self._lock:
            self._pump(timeout_s, self._sends[-1] if self._sends else None)
            i = self._take_slot(timeout_s)
        return self._slot(i, nbytes)

    def recv_staged(self, nbytes: int) -> "_Recv":
        """Receiver: the next payload chunk of ``nbytes``, left in its slot: ``wait`` returns the slot's bytes
        (read them, then ``release``). Posted in order with ``irecv``."""
        ctl = torch.zeros(2, dtype=torch.int64)
        op = self._pair.irecv(ctl, TAG_SHM_CTL)

        def wait(timeout_s: float) -> torch.Tensor:
            op.wait(timeout_s)
            i, n = int(ctl[0]), int(ctl[1])
            if n != nbytes:
                raise PairBroken(f"shared-memory pair: a chunk of {n} bytes where {nbytes} were expected")
            self.counts["ring_chunks"] += 1
            return self._slot(i, n)
        return _Recv(wait)

    def release(self, view: torch.Tensor, timeout_s: float) -> None:
        """Receiver: hand the slot of a ``recv_staged`` chunk back to the sender."""
        i = self._slot_of(view)
        if i is None:
            raise ValueError("release: not a slot of this pair")
        self._pair.isend(torch.tensor([i], dtype=torch.int64), TAG_SHM_FREE).wait(timeout_s)

    # -- PairGroup ----------------------------------------------------------------------------------
    def isend(self, t: torch.Tensor, tag: int) -> PairOp:
        """Payload: a staged slot is announced; other bytes are copied into free slots and announced now as far
        as slots allow, the rest by ``wait``."""
        if tag != TAG_PAYLOAD or t.is_cuda:
            return self._pair.isend(t, tag)
        i = self._slot_of(t)
        s = _Send([t], (i, t.numel())) if i is not None else _Send(_pieces(t, self._slot_bytes))
        with self._lock:
            self._sends.append(s)
            self._pump(None)

        def wait(timeout_s: float) -> None:
            with self._lock:
                if s.posted < len(s.pieces) or s in self._sends:
                    self._pump(timeout_s, s)
            for op in s.ctl:
                op.wait(timeout_s)
        return _Op(wait)

    def irecv(self, t: torch.Tensor, tag: int) -> PairOp:
        if tag != TAG_PAYLOAD or t.is_cuda:
            return self._pair.irecv(t, tag)
        pieces = _pieces(t, self._slot_bytes)
        posted = []
        for piece in pieces:
            ctl = torch.zeros(2, dtype=torch.int64)
            posted.append((self._pair.irecv(ctl, TAG_SHM_CTL), ctl, piece))

        def wait(timeout_s: float) -> None:
            for op, ctl, piece in posted:
                op.wait(timeout_s)
                i, n = int(ctl[0]), int(ctl[1])
                if n != piece.numel():
                    raise PairBroken(f"shared-memory pair: a chunk of {n} bytes into a buffer of {piece.numel()}")
                piece.copy_(self._slot(i, n))
                self.counts["ring_chunks"] += 1
                self._pair.isend(torch.tensor([i], dtype=torch.int64), TAG_SHM_FREE).wait(timeout_s)
        return _Op(wait)

    def peer_segment(self, handle: SegmentHandle) -> torch.Tensor:
        """Receiver: the sender's segment, mapped once per pair (OSError if it cannot be)."""
        key = (handle.pid, handle.fd, handle.inode)
        seg = self._mapped.get(key)
        if seg is None or seg.numel() != handle.nbytes:
            if len(self._mapped) >= _MAPPED_MAX:
                self._mapped.clear()
            seg = self._mapped[key] = map_segment(handle)
        return seg

    def close(self) -> None:
        self._mapped.clear()
        self._pair.close()


# -- pull frames -------------------------------------------------------------------------------------------
def pull_descriptor(kv_caches: Sequence, tokens: TokenRows, lo: int, hi: int, room: int,
                    segment: Any = None, layout: Optional[CacheLayout] = None) -> Optional[bytes]:
    """What a receiver needs to copy layers ``lo..hi-1`` of a transfer from this process's cache in place, or
    None: the cache is not in one shared segment (or is a head slice), or the descriptor would not fit ``room``.
    A ``transport.cuda_ipc`` segment gives the CUDA form (its packed handle), a shared-memory one the /proc form;
    ``segment`` names the cache's segment instead of looking it up (tests). ``layout``: the cache's (the
    transfer's); where its ``layer_step`` says the layers lie at equal distances, only the first and last are
    checked against the segment (the rest lie between them), else every one is."""
    seg = segment
    if seg is None and kv_caches[0][0].device.type == "cuda":
        from transport.cuda_ipc import cuda_segment_of

        seg = cuda_segment_of(kv_caches[0][0])
    elif seg is None:
        seg = segment_of(kv_caches[0][0])
    if seg is None:
        return None
    cuda = not isinstance(seg.handle, SegmentHandle)
    step = (layout or CacheLayout.of(kv_caches)).layer_step
    if step is not None:
        if not (seg.contains(kv_caches[lo][0]) and seg.contains(kv_caches[hi - 1][1])):
            return None
        off0 = seg.offset(kv_caches[lo][0])
        offs = [off0 + k * step for k in range(2 * (hi - lo))]
    else:
        for layer in range(lo, hi):
            for x in kv_caches[layer]:
                if not x.is_contiguous() or not seg.contains(x):
                    return None
        offs = [seg.offset(kv_caches[layer][j]) for layer in range(lo, hi) for j in (0, 1)]
    nb, bs = kv_caches[0][0].shape[:2]
    ids = tokens.block_ids
    tail = struct.pack(f"<{len(offs)}Q", *offs) + struct.pack(f"<{len(ids)}I", *ids)
    if cuda:
        packed = seg.handle.pack()
        packed += b" " * (-len(packed) % 8)  # (still JSON) the offsets after it stay 8-byte aligned
        raw = (_PULL_CUDA.pack(_CUDA_MAGIC, len(packed), seg.nbytes, nb, bs, tokens.first_token, len(ids)) + packed
               + tail)
    else:
        h = seg.handle
        raw = _PULL.pack(h.pid, h.fd, h.inode, h.nbytes, nb, bs, tokens.first_token, len(ids)) + tail
    return raw if len(raw) <= room else None


@functools.lru_cache(maxsize=16)
def _stretches(src_ids: tuple, sbs: int, sfirst: int, dst_ids: tuple, dbs: int, dfirst: int,
               n: int) -> tuple[tuple[int, int, int], ...]:
    """(src row, dst row, count) of the stretches of tokens 0..n-1 whose rows are consecutive on both sides, walked
    block boundary by block boundary (plain ints: a pull's frames of one transfer, one per layer, ask the same, so
    it is remembered)."""
    out: list[tuple[int, int, int]] = []
    t = 0
    while t < n:
        sp, dp = sfirst + t, dfirst + t
        step = min(sbs - sp % sbs, dbs - dp % dbs, n - t)
        s_row = src_ids[sp // sbs] * sbs + sp % sbs
        d_row = dst_ids[dp // dbs] * dbs + dp % dbs
        if out and out[-1][0] + out[-1][2] == s_row and out[-1][1] + out[-1][2] == d_row:
            out[-1] = (out[-1][0], out[-1][1], out[-1][2] + step)
        else:
            out.append((s_row, d_row, step))
        t += step
    return tuple(out)


def _gathered(runs: tuple, num_tokens: int, dev: torch.device) -> bool:
    """Whether a pull copies by one gather and one scatter rather than a copy per stretch: stretches short on average
    (fewer than 8 rows), or on a GPU more than a few (each copy is a launch; the gather's extra pass is cheap there)."""
    return len(runs) * 8 > num_tokens or (dev.type == "cuda" and len(runs) > _GPU_STRETCHES)


def _src_stack(seg: torch.Tensor, offs: Sequence[int], rows: int, like: torch.Tensor) -> Optional[torch.Tensor]:
    """The sender's layers at byte offsets ``offs`` of ``seg`` (each ``rows`` rows of ``like``'s words) as one view
    [len(offs), rows, words], where they lie at equal distances (a cache in one allocation), else None. The
    offsets were checked against the segment's size; ``as_strided`` checks the view's bounds again."""
    n, words, w = len(offs), like.shape[1], like.element_size()  # (n >= 2: a frame's layers' K and V)
    step = offs[1] - offs[0]
    if step < rows * words * w or any(o != offs[0] + k * step for k, o in enumerate(offs)):
        return None
    try:
        first = seg[offs[0]:offs[0] + rows * words * w].view(like.dtype)
        return first.as_strided((n, rows, words), (step // w, words, 1))
    except RuntimeError:
        return None


def _layer_stack(words: torch.Tensor, n: int, step: Optional[int]) -> Optional[torch.Tensor]:
    """``n`` tensors from one of a cache's K or V tensors (``words``: it as ``_rows``), each ``step`` bytes after the
    one before (``CacheLayout.layer_step``, None: not so laid out) as one view [n, rows, words], else None. Equal
    addresses are the same memory, and ``as_strided`` checks the view stays in the first tensor's storage, so the
    view writes exactly where the per-layer tensors would."""
    w = words.element_size()
    if step is None or step % w:
        return None
    try:
        return words.as_strided((n, *words.shape), (step // w, *words.stride()))
    except RuntimeError:
        return None


def pull_rows(group: ShmPair, desc: torch.Tensor, lo: int, hi: int, num_tokens: int, row_bytes: int,
              kv_caches: Sequence, dst: TokenRows, layout: Optional[CacheLayout] = None) -> None:
    """Receiver: copy layers ``lo..hi-1`` of a pull frame from the sender's segment into ``kv_caches`` at ``dst``'s
    rows, one copy per stretch of consecutive rows (an indexed copy where stretches are short or, on a GPU, many).
    Where both caches lie in one allocation each, every layer of the frame goes in the same copy (``_src_stack``,
    ``_layer_stack``); else layer by layer. FramingError if the descriptor does not describe them. Parsed as plain
    bytes: a frame per layer pays this per layer. ``layout``: ``kv_caches``' (the transfer's; None: worked out)."""
    raw = desc.numpy() if desc.device.type == "cpu" else desc.cpu().numpy()
    cuda_handle = None
    if len(raw) >= _PULL_CUDA.size and struct.unpack_from("<I", raw)[0] == _CUDA_MAGIC:
        _magic, hlen, nbytes, nb, bs, first, n_ids = _PULL_CUDA.unpack_from(raw)
        cuda_handle = raw[_PULL_CUDA.size:_PULL_CUDA.size + hlen].tobytes()
        start = _PULL_CUDA.size + hlen
        if not getattr(group, "cuda_ipc", False):
            raise FramingError("a CUDA pull frame on a pair that did not agree to CUDA IPC")
    else:
        if len(raw) < _PULL.size:
            raise FramingError("pull descriptor is cut short")
        pid, fd, inode, nbytes, nb, bs, first, n_ids = _PULL.unpack_from(raw)
        start = _PULL.size
        if getattr(group, "cuda_ipc", False):
            raise FramingError("a shared-memory pull frame on a CUDA IPC pair")
    n_off = 2 * (hi - lo)
    if len(raw) < start + 8 * n_off + 4 * n_ids:
        raise FramingError("pull descriptor is cut short")
    offs = struct.unpack_from(f"<{n_off}Q", raw, start)
    ids = struct.unpack_from(f"<{n_ids}I", raw, start + 8 * n_off)
    needed = -(-(first + num_tokens) // bs) if bs else 0
    size = nb * bs * row_bytes
    if (not bs or n_ids < needed or (n_ids and max(ids) >= nb)
            or any(o + size > nbytes for o in offs)):
        raise FramingError("pull descriptor names memory outside the sender's segment")
    try:
        seg = (group.peer_segment(cuda_handle) if cuda_handle is not None
               else group.peer_segment(SegmentHandle(pid, fd, inode, nbytes)))
    except (OSError, RuntimeError, ValueError) as e:
        raise FramingError(f"cannot map the sender's KV cache: {e}") from None
    if seg.numel() < nbytes:
        raise FramingError("pull descriptor names memory outside the sender's segment")
    runs = _stretches(ids[:needed], bs, first, tuple(dst.block_ids), dst.block_size, dst.first_token, num_tokens)
    words = _rows(kv_caches[lo][0])
    w = words.element_size()
    if row_bytes != words.shape[1] * w or any(o % w for o in offs):
        raise FramingError(f"pull descriptor: the sender's layers are not caches of these rows ({row_bytes}-byte rows "
                           f"into {words.shape[1] * w}-byte ones, or an offset off the row words)")
    dev = words.device
    step = (layout or CacheLayout.of(kv_caches)).layer_step
    src_all, dst_all = _src_stack(seg, offs, nb * bs, words), _layer_stack(words, 2 * (hi - lo), step)
    if src_all is not None and dst_all is not None:
        # both sides in one allocation each (allocate_kv_caches): every layer in one copy a stretch (a CPU copy) or
        # one gather and one scatter (many stretches, or launch-bound on a GPU), not one copy per layer and stretch
        group.counts["pull_frames"] += 1
        if _gathered(runs, num_tokens, dev):
            src_rows, dst_rows = block_rows(ids[:needed], bs, first, first + num_tokens), dst.rows
            got = src_all.index_select(1, src_rows.to(src_all.device)).to(dev)
            dst_all.index_copy_(1, dst_rows.to(dev), got)
        else:
            for s_row, d_row, n in runs:
                dst_all[:, d_row:d_row + n].copy_(src_all[:, s_row:s_row + n])
    else:
        # every layer's source rows first, so a descriptor wrong for a later layer writes nothing
        pairs = []
        for k, (layer, j) in enumerate((layer, j) for layer in range(lo, hi) for j in (0, 1)):
            out = _rows(kv_caches[layer][j])
            try:
                pairs.append((seg[offs[k]:offs[k] + size].view(out.dtype).view(nb * bs, out.shape[1]), out))
            except RuntimeError as e:  # (checked above; kept as the backstop the stacked path has in as_strided)
                raise FramingError(f"pull descriptor: layer {layer} is not a cache of these rows: {e}") from None
        group.counts["pull_frames"] += 1
        if _gathered(runs, num_tokens, dev):
            src_rows = block_rows(ids[:needed], bs, first, first + num_tokens)
            for src, out in pairs:  # (a peer's memory may be mapped on another device index: copies cross the link)
                out.index_put_((dst.rows.to(out.device),), src.index_select(0, src_rows.to(src.device)).to(out.device))
        else:
            for src, out in pairs:
                for s_row, d_row, n in runs:
                    out[d_row:d_row + n].copy_(src[s_row:s_row + n])
    if dev.type == "cuda":
        # the ack follows, and after it the sender may reuse these blocks: the copies must be done
        torch.cuda.current_stream(dev).synchronize()
