"""GPU memory another process on this node can map: the CUDA counterpart of transport/shared_memory.py.

Lifecycle: ``CudaSegment(nbytes, device)`` makes one device allocation and registers itself while it lives, so
``cuda_segment_of(tensor)`` finds the segment a tensor lies in; a prefill worker's engine allocates its whole KV
cache as views of one (``engine.kv_cache.allocate_kv_caches(shared=True)`` on CUDA), so one IPC handle names every
layer. ``handle`` exports it once (torch's own CUDA IPC, as ``torch.multiprocessing`` shares CUDA tensors:
``cudaIpcGetMemHandle`` on the allocation, plus torch's producer-side reference counter) and every peer gets that
same handle. ``open_handle(handle)`` is the peer's side: it maps the allocation into this process (``cudaIpcOpenMemHandle``)
once and keeps it in a small per-process cache, so many pairs to one producer share one mapping; a mapping goes
with the cache entry (or the process). A peer on another node, or one that cannot reach the device, fails to
open: kvtransfer then moves the bytes over NCCL instead.

Written against torch 2.11-2.13's private ``UntypedStorage._share_cuda_`` / ``_new_shared_cuda`` (what
``torch.multiprocessing.reductions`` calls). The encoding of a handle (``pack`` / ``unpack``) is tested on CPU; the
CUDA calls run only where a GPU is (tests/kvtransfer/test_cuda_ipc.py, benchmarks/device_session.sh).
"""
from __future__ import annotations

import base64
import json
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass
from typing import Optional

import torch

from transport.shared_memory import segment_view

__all__ = ["CudaHandle", "CudaSegment", "cuda_segment_of", "open_handle"]


@dataclass(frozen=True)
class CudaHandle:
    """What a process on this node needs to map a ``CudaSegment`` (the fields of torch's ``_share_cuda_``)."""

    device: int
    handle: bytes
    size: int
    offset: int
    ref_counter: bytes
    ref_offset: int
    event: Optional[bytes]
    event_sync: bool

    def pack(self) -> bytes:
        """Plain JSON (never pickle: the bytes come from a peer)."""
        def b64(b: Optional[bytes]) -> Optional[str]:
            return None if b is None else base64.b64encode(b).decode()

        return json.dumps([self.device, b64(self.handle), self.size, self.offset, b64(self.ref_counter),
                           self.ref_offset, b64(self.event), self.event_sync], separators=(",", ":")).encode()

    @classmethod
    def unpack(cls, raw: bytes) -> "CudaHandle":
        """ValueError if ``raw`` is not a packed handle."""
        try:
            dev, h, size, off, ref, ref_off, ev, sync = json.loads(raw.decode())
            out = cls(int(dev), base64.b64decode(h, validate=True), int(size), int(off),
                      base64.b64decode(ref, validate=True), int(ref_off),
                      None if ev is None else base64.b64decode(ev, validate=True), bool(sync))
        except (ValueError, TypeError, UnicodeDecodeError) as e:
            raise ValueError(f"not a CUDA IPC handle: {e}") from None
        if out.device < 0 or out.size <= 0 or out.offset < 0 or not out.handle:
            raise ValueError("not a CUDA IPC handle: bad device, size or offset")
        return out


_live: "weakref.WeakValueDictionary[int, CudaSegment]" = weakref.WeakValueDictionary()
_live_lock = threading.Lock()


class CudaSegment:
    """One device allocation of ``nbytes`` (zeroed), as ``tensor`` (uint8), that peers on this node can map."""

    def __init__(self, nbytes: int, device: "torch.device | str") -> None:
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        device = torch.device(device)
        if device.type != "cuda":
            raise ValueError(f"a CUDA segment needs a CUDA device, got {device}")
        self.tensor = torch.zeros(nbytes, dtype=torch.uint8, device=device)
        self.nbytes = nbytes
        self.base = self.tensor.data_ptr()
        self._handle: Optional[CudaHandle] = None
        self._lock = threading.Lock()
        with _live_lock:
            _live[self.base] = self

    @property
    def handle(self) -> CudaHandle:
        """This allocation's IPC handle, exported once (each export is a reference torch's producer counts)."""
        with self._lock:
            if self._handle is None:
                dev, h, size, off, ref, ref_off, ev, sync = self.tensor.untyped_storage()._share_cuda_()
                self._handle = CudaHandle(int(dev), bytes(h), int(size), int(off), bytes(ref), int(ref_off),
                                          None if ev is None else bytes(ev), bool(sync))
            return self._handle

    def contains(self, t: torch.Tensor) -> bool:
        """Whether all of ``t``'s bytes (it must be contiguous) lie in this segment."""
        lo = t.data_ptr()
        return (t.device == self.tensor.device and self.base <= lo
                and lo + t.numel() * t.element_size() <= self.base + self.nbytes)

    def offset(self, t: torch.Tensor) -> int:
        return t.data_ptr() - self.base

    def view(self, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` over this segment from byte ``offset``; it keeps the segment alive."""
        return segment_view(self, self.tensor, offset, shape, dtype)


def cuda_segment_of(t: torch.Tensor) -> Optional[CudaSegment]:
    """The live CUDA segment ``t`` lies in, or None."""
    if t.device.type != "cuda":
        return None
    with _live_lock:
        segs = list(_live.values())
    return next((s for s in segs if s.contains(t)), None)


_OPENED_MAX = 8
_opened: "OrderedDict[tuple, torch.Tensor]" = OrderedDict()
_opened_lock = threading.Lock()


def open_handle(h: CudaHandle, cache: bool = True) -> torch.Tensor:
    """A peer's segment mapped into this process (uint8 on ``cuda:<h.device>``); RuntimeError if CUDA cannot map it
    here (another node, a device this process cannot reach). ``cache`` False: a one-off mapping (a probe), closed
    when the tensor goes, so it pins none of the peer's memory."""
    key = (h.handle, h.offset, h.size)
    with _opened_lock:
        t = _opened.get(key) if cache else None
        if t is not None:
            _opened.move_to_end(key)
            return t
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(h.device, h.handle, h.size, h.offset, h.ref_counter,
                                                    h.ref_offset, h.event, h.event_sync)
    t = torch.empty(0, dtype=torch.uint8, device=torch.device("cuda", h.device)).set_(
        storage, 0, (h.size,), (1,))
    if cache:
        with _opened_lock:
            _opened[key] = t
            while len(_opened) > _OPENED_MAX:
                _opened.popitem(last=False)
    return t
