"""Memory another process on this host can map: what a same-host KV hand-off reads the peer's cache from.

Lifecycle: ``SharedSegment(nbytes)`` creates an anonymous memory file (``memfd_create``: no name in
``/dev/shm``, not bounded by its size, freed when the last mapping and descriptor go) and maps it here; the
engine allocates its KV cache tensors as views of one (``engine.kv_cache.allocate_kv_caches(shared=True)``).
The segment registers itself while it lives, so ``segment_of(tensor)`` finds the segment a tensor lies in
(kvtransfer asks it of a transfer's cache). ``handle`` says how a peer maps it: ``/proc/<pid>/fd/<fd>``, which
the peer opens only while this process lives and only where it shares this process's pid namespace and user
(another container's peer cannot: kvtransfer then moves bytes instead); the inode guards against a descriptor
number reused by a later segment. ``map_segment(handle)`` is the peer's side; ``SharedSegment.attach(handle)`` maps
it and registers it here under the owner's handle (a worker mapping its engine process's cache). ``close`` (or garbage collection
of the segment) unregisters it and closes the descriptor; live tensors keep the mapping until they go.
"""
from __future__ import annotations

import os
import threading
import weakref
from dataclasses import dataclass
from typing import Optional

import torch

__all__ = ["SegmentHandle", "SharedSegment", "map_segment", "segment_of", "segment_view", "shared_memory_unavailable"]


@dataclass(frozen=True)
class SegmentHandle:
    """How a process on this host maps a ``SharedSegment``."""

    pid: int
    fd: int
    inode: int
    nbytes: int

    @property
    def path(self) -> str:
        return f"/proc/{self.pid}/fd/{self.fd}"


_live: "weakref.WeakValueDictionary[int, SharedSegment]" = weakref.WeakValueDictionary()
"""This process's live segments by base address (a fact of the process's memory, like its mappings). Weak: a
segment lives as long as the tensors viewing it (``views`` ties them) or its owner."""
_live_lock = threading.Lock()


def shared_memory_unavailable() -> Optional[str]:
    """Why segments cannot be made here, or None."""
    if not hasattr(os, "memfd_create"):
        return "this platform has no memfd_create"
    if not os.path.isdir("/proc/self/fd"):
        return "this platform has no /proc/self/fd"
    return None


class SharedSegment:
    """One anonymous shared memory file of ``nbytes``, mapped here as ``tensor`` (uint8)."""

    def __init__(self, nbytes: int, name: str = "pdserve-kv-cache"):
        if not isinstance(nbytes, int) or nbytes <= 0:
            raise ValueError(f"nbytes must be a positive int, got {nbytes!r}")
        why = shared_memory_unavailable()
        if why:
            raise OSError(why)
        self.fd = os.memfd_create(name)
        try:
            os.ftruncate(self.fd, nbytes)
            os.posix_fallocate(self.fd, 0, nbytes)  # its memory taken now (as zeroed tensors would), not at a write
            self.tensor = torch.from_file(f"/proc/self/fd/{self.fd}", shared=True, size=nbytes, dtype=torch.uint8)
        except BaseException:
            os.close(self.fd)
            raise
        self.handle = SegmentHandle(os.getpid(), self.fd, os.fstat(self.fd).st_ino, nbytes)
        self.base = self.tensor.data_ptr()
        with _live_lock:
            _live[self.base] = self

    @classmethod
    def attach(cls, handle: SegmentHandle) -> "SharedSegment":
        """A peer's segment mapped here (``map_segment``) and registered under the peer's ``handle``: tensors made
        with ``view`` are found by ``segment_of``, so a third process is told to map the segment where it lives (an
        engine process's KV cache, which its worker's KV transfers read and write). Owns no descriptor: the
        segment lives while the peer or a mapping does. OSError if it cannot be mapped here."""
        self = cls.__new__(cls)
        self.tensor = map_segment(handle)
        self.fd = -1
        self.handle = handle
        self.base = self.tensor.data_ptr()
        with _live_lock:
            _live[self.base] = self
        return self

    def contains(self, t: torch.Tensor) -> bool:
        """Whether all of ``t``'s bytes (it must be contiguous) lie in this segment."""
        lo = t.data_ptr()
        return t.device.type == "cpu" and self.base <= lo and lo + t.numel() * t.element_size() <= self.base + \
            self.handle.nbytes

    def offset(self, t: torch.Tensor) -> int:
        return t.data_ptr() - self.base

    def view(self, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
        """A tensor of ``shape`` and ``dtype`` over this segment from byte ``offset``; it keeps the segment alive."""
        return segment_view(self, self.tensor, offset, shape, dtype)

    def close(self) -> None:
        with _live_lock:
            if _live.get(self.base) is self:
                del _live[self.base]
        fd, self.fd = self.fd, -1
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


def segment_view(owner: object, memory: torch.Tensor, offset: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """A tensor of ``shape`` and ``dtype`` over the uint8 ``memory`` from byte ``offset`` that keeps ``owner`` (the
    segment, which registries hold weakly) alive; ValueError if it would overrun ``memory``."""
    n = 1
    for d in shape:
        n *= d
    nbytes = n * torch.empty((), dtype=dtype).element_size()
    if offset < 0 or offset + nbytes > memory.numel():
        raise ValueError(f"view of {nbytes} bytes at {offset} overruns the {memory.numel()}-byte segment")
    out = memory[offset:offset + nbytes].view(dtype).view(shape)
    out._pdserve_segment = owner
    return out


def segment_of(t: torch.Tensor) -> Optional[SharedSegment]:
    """The live segment ``t`` lies in, or None."""
    if t.device.type != "cpu":
        return None
    with _live_lock:
        segs = list(_live.values())
    return next((s for s in segs if s.contains(t)), None)


def map_segment(handle: SegmentHandle) -> torch.Tensor:
    """Map a peer's segment (uint8); OSError if it cannot be opened here or is not the segment named."""
    st = os.stat(handle.path)
    if st.st_ino != handle.inode or st.st_size != handle.nbytes:
        raise OSError(f"{handle.path} is not the segment named (inode/size differ)")
    return torch.from_file(handle.path, shared=True, size=handle.nbytes, dtype=torch.uint8)
