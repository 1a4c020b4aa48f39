"""KVEndpoint: a worker's one handle on KV transfer, to and from any peer.

Lifecycle: a prefill or decode worker creates one endpoint at start with its
unique name; the endpoint publishes its incarnation in the store and starts a
reaper thread that enforces deadlines. ``send``/``recv`` validate their
arguments, create the peer's channel on first use (channels build their pair
groups lazily and do all I/O on their own threads; each is handed the
endpoint's ``ChannelHost`` and reports every transfer that ends through its
``finished``) and return a handle at once; the worker loop then calls ``poll``. ``close(peer)`` drops one peer's
channels, failing what is in flight; ``shutdown`` drops all and stops the
threads.

Concurrency: one re-entrant lock guards every transfer and channel table; no
I/O is ever done while holding it, so ``poll`` never waits on the network.
"""
from __future__ import annotations

import dataclasses
import itertools
import logging
import operator
import random
import threading
import time
import weakref
from collections import deque
from typing import Optional, Sequence

import torch
import torch.distributed as dist

from kvtransfer.channel import ChannelHost
from kvtransfer.channel_recv import RecvChannel
from kvtransfer.channel_send import SendChannel
from kvtransfer.layout import CacheLayout, TokenRows
from kvtransfer.sharding import KVShards, head_pieces, piece_request_id
from kvtransfer.shm import sweep_orphans
from kvtransfer.rendezvous import Rendezvous
from kvtransfer.store import StoreConfig, open_store
from kvtransfer.transfer import Transfer, TransferGroup, TransferHandle, TransferState, TransferStats, id_source
from kvtransfer.transport import BACKENDS, nccl_unavailable
from kvtransfer.wire import MAX_REQUEST_ID_BYTES, dtype_code

log = logging.getLogger(__name__)

REAP_INTERVAL_S = 0.01
COMPLETED_MEMORY = 10000
LAYOUT_MEMORY = 4
"""kv_caches lists whose layouts an endpoint remembers (``_layout_of``)."""


_SIBLING = "another piece of the request,"
"""How a group's pieces that another piece's failure cancelled say why (``failure`` reports the cause)."""


class KVEndpoint:
    """One process's KV transfer endpoint (see docs/interfaces.md, section kvtransfer)."""

    def __init__(self, name: str, store: "str | StoreConfig | dist.Store", *, backend: str = "gloo",
                 timeout_s: float = 10.0, chunk_bytes: int = 4 << 20, host: Optional[str] = None, shm: bool = True):
        """``host``: the interface this endpoint's pair groups listen on and advertise (None: the store
        config's ``host``, else torch's default, the hostname's address). ``shm``: with backend gloo, a pair whose
        both endpoints allow it and share ``/dev/shm`` (one host) moves its payload through shared memory
        (kvtransfer/shm.py); with backend nccl, a pair whose receiver can map the sender's device memory (one node)
        pulls the rows over CUDA IPC; False: always the socket (NCCL)."""
        if not isinstance(name, str) or not name or any(c in name for c in "/> \t\n"):
            raise ValueError(f"name must be a non-empty string without '/', '>' or spaces, got {name!r}")
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if backend == "nccl" and nccl_unavailable():
            raise ValueError(f"backend 'nccl' cannot run here: {nccl_unavailable()}")
        if not isinstance(timeout_s, (int, float)) or not timeout_s > 0:
            raise ValueError(f"timeout_s must be a positive number of seconds, got {timeout_s!r}")
        if not isinstance(shm, bool):
            raise ValueError(f"shm must be a bool, got {shm!r}")
        if not isinstance(chunk_bytes, int) or chunk_bytes < 4096:
            raise ValueError(f"chunk_bytes must be an int >= 4096, got {chunk_bytes!r}")
        self.name = name
        self.backend = backend
        self.timeout_s = float(timeout_s)
        self.chunk_bytes = chunk_bytes
        if host is None and isinstance(store, StoreConfig):
            host = store.host
        if host is not None and (not isinstance(host, str) or not host):
            raise ValueError(f"host must be a non-empty interface address, got {host!r}")
        self.host = host
        self._store, namespace = open_store(store)
        self._lock = threading.RLock()
        self.shm = shm and backend in ("gloo", "nccl")
        if self.shm and backend == "gloo":
            sweep_orphans()
        self._host = ChannelHost(name, backend, self.timeout_s, chunk_bytes, self._lock,
                                 Rendezvous(self._store, namespace, name, shm=self.shm), self._finished, host)
        self._send: dict[str, SendChannel] = {}
        self._recv: dict[str, RecvChannel] = {}
        self._live: dict[int, Transfer] = {}
        self._completed: deque[TransferStats] = deque(maxlen=COMPLETED_MEMORY)
        self._layouts: dict[int, tuple[tuple, CacheLayout]] = {}
        """``_layout_of``'s memory: id of a kv_caches list -> (weak references to its tensors then, its layout)."""
        self._ids = id_source(random.getrandbits(32))
        self._stopped = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name=f"kv-reaper-{name}", daemon=True)
        self._reaper.start()
        log.info("kv endpoint %s up (backend %s%s, incarnation %s)", name, backend,
                 (", shared memory with same-host peers" if backend == "gloo" else ", CUDA IPC with same-node peers")
                 if self.shm else "", self._host.rendezvous.incarnation)

    # -- submission ------------------------------------------------------------------------------
    def _new(self, direction: str, peer: str, request_id: str, kv_caches, block_ids, num_tokens: int,
             deadline_s: float | None, field: str, first_token: int = 0) -> Transfer:
        if self._stopped.is_set():
            raise RuntimeError(f"kv endpoint {self.name!r} is shut down")
        if not isinstance(peer, str) or not peer or any(c in peer for c in "/> \t\n"):
            raise ValueError(f"peer must be a kv endpoint name, got {peer!r}")
        if peer == self.name:
            raise ValueError(f"peer must differ from this endpoint's own name {self.name!r}")
        if not isinstance(request_id, str) or not request_id or len(request_id.encode()) > MAX_REQUEST_ID_BYTES:
            raise ValueError(f"request_id must be a non-empty string of at most {MAX_REQUEST_ID_BYTES} bytes")
        if deadline_s is None:
            deadline_s = self.timeout_s
        if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not deadline_s > 0:
            raise ValueError(f"deadline_s must be a positive number of seconds, got {deadline_s!r}")
        layout = self._layout_of(kv_caches)
        dtype_code(layout.dtype)
        cuda = layout.device.type == "cuda"
        if self.backend == "nccl" and not cuda:
            raise ValueError("kv_caches must be CUDA tensors for backend 'nccl'")
        if self.backend != "nccl" and cuda:
            raise ValueError(f"kv_caches must be CPU tensors for backend {self.backend!r} (use 'nccl' for CUDA)")
        tokens = TokenRows(layout, block_ids, num_tokens, field, first_token)
        return Transfer(next(self._ids), direction, peer, request_id, kv_caches, layout, tokens,
                        time.monotonic() + float(deadline_s), self._lock)

    def _layout_of(self, kv_caches) -> CacheLayout:
        """``CacheLayout.of(kv_caches)``, remembered for the last ``LAYOUT_MEMORY`` lists: a worker hands over its one
        cache on every send and receive, and working the layout out costs tens of microseconds a transfer. What is
        remembered, by the list's id, is weak references to its tensors: a hit is a list of that id holding exactly
        those tensors, in that order (so a reused id or a changed list is worked out again), and the memory never
        keeps a cache alive."""
        with self._lock:
            hit = self._layouts.get(id(kv_caches))
        if hit is not None:
            try:  # (C-level loops but one: a few microseconds for a 32-layer cache)
                if (len(kv_caches) * 2 == len(hit[0]) and all(map((2).__eq__, map(len, kv_caches)))
                        and all(map(operator.is_, itertools.chain.from_iterable(kv_caches), [r() for r in hit[0]]))):
                    return hit[1]
            except TypeError:
                pass  # a pair that is no sequence: CacheLayout.of says which
        layout = CacheLayout.of(kv_caches)  # ValueError on a bad cache: nothing remembered
        with self._lock:
            while len(self._layouts) >= LAYOUT_MEMORY:
                del self._layouts[next(iter(self._layouts))]
            self._layouts[id(kv_caches)] = (tuple(weakref.ref(x) for p in kv_caches for x in p), layout)
        return layout

    def send(self, peer: str, request_id: str, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
             src_block_ids: Sequence[int], num_tokens: int, *, deadline_s: float | None = None,
             layers_ready: bool = False, first_token: int = 0) -> TransferHandle:
        """Start sending a request's KV to ``peer``; layers go out as they are marked ready. ``first_token``: the
        positions before it are not sent (the receiver holds them: a delta transfer); both sides must agree."""
        t = self._new("send", peer, request_id, kv_caches, src_block_ids, num_tokens, deadline_s, "src_block_ids",
                      first_token)
        with self._lock:
            ch = self._send.get(peer)
            if ch is None or ch.closed is not None:
                ch = self._send[peer] = SendChannel(self._host, peer)
            self._live[t.transfer_id] = t
            ch.add(t)
            h = TransferHandle(t, ch)
            if layers_ready:
                self.all_layers_ready(h)
        log.debug("kv send %s -> %s request_id=%s id=%d", self.name, peer, request_id, t.transfer_id)
        return h

    def recv(self, peer: str, request_id: str, kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]],
             dst_block_ids: Sequence[int], num_tokens: int, *, deadline_s: float | None = None,
             first_token: int = 0) -> TransferHandle:
        """Post a receive of a request's KV from ``peer`` into ``dst_block_ids`` (positions ``first_token`` ..
        ``num_tokens - 1``: the earlier ones are already in those blocks)."""
        t = self._new("recv", peer, request_id, kv_caches, dst_block_ids, num_tokens, deadline_s, "dst_block_ids",
                      first_token)
        with self._lock:
            ch = self._recv.get(peer)
            if ch is None or ch.closed is not None:
                ch = self._recv[peer] = RecvChannel(self._host, peer)
            ch.post(t)
            self._live[t.transfer_id] = t
        log.debug("kv recv %s <- %s request_id=%s id=%d", self.name, peer, request_id, t.transfer_id)
        return TransferHandle(t, ch)

    # -- tensor-parallel layouts (kvtransfer/sharding.py) ------------------------------------------------
    def send_shards(self, peer: str, request_id: str, shards: KVShards, peer_tp: int,
                    src_block_ids: Sequence[int], num_tokens: int, *, deadline_s: float | None = None,
                    layers_ready: bool = False, first_token: int = 0) -> TransferGroup:
        """``send`` from a cache held by ``shards.tp`` ranks to a peer whose cache is split over ``peer_tp``: one
        transfer per piece (``head_pieces``), from head slices of the source ranks' caches, as one handle."""
        pieces = head_pieces(shards.num_kv_heads, shards.tp, peer_tp)
        handles: list[TransferHandle] = []
        try:
            for n, (lo, hi, i, _) in enumerate(pieces):
                handles.append(self.send(peer, piece_request_id(request_id, n, len(pieces)), shards.view(i, lo, hi),
                                         src_block_ids, num_tokens, deadline_s=deadline_s, layers_ready=layers_ready,
                                         first_token=first_token))
        except Exception:
            for h in handles:
                self.cancel(h)
            raise
        return TransferGroup(handles, request_id, peer, "send")

    def recv_shards(self, peer: str, request_id: str, shards: KVShards, peer_tp: int,
                    dst_block_ids: Sequence[int], num_tokens: int, *,
                    deadline_s: float | None = None, first_token: int = 0) -> TransferGroup:
        """``recv`` into a cache held by ``shards.tp`` ranks from a peer whose cache is split over ``peer_tp``:
        one receive per piece, into head slices of the destination ranks' caches, as one handle."""
        pieces = head_pieces(shards.num_kv_heads, peer_tp, shards.tp)
        handles: list[TransferHandle] = []
        try:
            for n, (lo, hi, _, j) in enumerate(pieces):
                handles.append(self.recv(peer, piece_request_id(request_id, n, len(pieces)), shards.view(j, lo, hi),
                                         dst_block_ids, num_tokens, deadline_s=deadline_s, first_token=first_token))
        except Exception:
            for h in handles:
                self.cancel(h)
            raise
        return TransferGroup(handles, request_id, peer, "recv")

    def _sender(self, h: TransferHandle) -> tuple[Transfer, SendChannel]:
        if not isinstance(h, TransferHandle) or h._t.direction != "send":
            raise ValueError("h must be a TransferHandle returned by send()")
        return h._t, h._owner

    def layer_ready(self, h: TransferHandle | TransferGroup, layer_idx: int) -> None:
        """Layer ``layer_idx`` of the source blocks is complete: put it on the wire."""
        if isinstance(h, TransferGroup):
            for p in h.handles:
                self.layer_ready(p, layer_idx)
            return
        t, ch = self._sender(h)
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < t.layout.num_layers:
            raise ValueError(f"layer_idx must be in [0, {t.layout.num_layers}), got {layer_idx!r}")
        with self._lock:
            if t.final or layer_idx in t.layers_queued:
                return
            t.layers_queued.add(layer_idx)
            ch.enqueue(t, layer_idx, layer_idx + 1, len(t.layers_queued) == t.layout.num_layers)

    def all_layers_ready(self, h: TransferHandle) -> None:
        """Every layer is complete: send all not yet queued (contiguous runs as single frames)."""
        if isinstance(h, TransferGroup):
            for p in h.handles:
                self.all_layers_ready(p)
            return
        t, ch = self._sender(h)
        with self._lock:
            if t.final:
                return
            runs: list[list[int]] = [[0, t.layout.num_layers]]  # the common case: every layer at once, one frame
            if t.layers_queued:
                runs = []
                for i in range(t.layout.num_layers):
                    if i in t.layers_queued:
                        continue
                    if runs and runs[-1][1] == i:
                        runs[-1][1] = i + 1
                    else:
                        runs.append([i, i + 1])
            for k, (lo, hi) in enumerate(runs):
                t.layers_queued.update(range(lo, hi))
                ch.enqueue(t, lo, hi, k == len(runs) - 1)

    # -- progress --------------------------------------------------------------------------------
    def poll(self, h: TransferHandle) -> TransferState:
        """The transfer's state now; never blocks on I/O. A group: FAILED once a piece failed (the rest are
        cancelled then), DONE once every piece is, else PENDING."""
        if isinstance(h, TransferGroup):
            states = [self.poll(p) for p in h.handles]
            if TransferState.FAILED in states:
                first = h.handles[states.index(TransferState.FAILED)]
                for p in h.handles:
                    self._expire(p, f"{_SIBLING} {first.request_id} failed: {first._t.failure}")
                return TransferState.FAILED
            return TransferState.DONE if all(x == TransferState.DONE for x in states) else TransferState.PENDING
        t = h._t
        if not t.final and time.monotonic() >= t.deadline:
            self._expire(h, None)
        return t.state

    def failure(self, h: TransferHandle) -> str | None:
        """Why the transfer FAILED, else None (a group: its first failed piece's reason, naming the piece)."""
        if isinstance(h, TransferGroup):
            self.poll(h)
            failed = [(p, p._t.failure) for p in h.handles if p._t.failure is not None]
            own = [(p, why) for p, why in failed if not why.startswith(_SIBLING)]
            if not failed:
                return None
            p, why = (own or failed)[0]
            return why if len(h.handles) == 1 else f"{why} (piece {p.request_id})"
        self.poll(h)
        return h._t.failure

    def stats(self, h: TransferHandle) -> TransferStats:
        """Bytes, seconds and layers of this transfer so far (a group: its pieces' bytes summed, the longest
        piece's times, the fewest layers done)."""
        if isinstance(h, TransferGroup):
            parts = [p._t.stats() for p in h.handles]
            first = max(parts, key=lambda st: st.seconds)
            state = self.poll(h)
            return dataclasses.replace(first, request_id=h.request_id, state=state,
                                       num_bytes=sum(st.num_bytes for st in parts),
                                       layers_done=min(st.layers_done for st in parts), failure=self.failure(h))
        return h._t.stats()

    def wait(self, h: TransferHandle, timeout_s: float | None = None) -> TransferState:
        """Block until DONE/FAILED or ``timeout_s``; returns the state then."""
        if isinstance(h, TransferGroup):
            end = None if timeout_s is None else time.monotonic() + timeout_s
            for p in h.handles:
                if self.wait(p, None if end is None else max(0.0, end - time.monotonic())) == TransferState.FAILED:
                    break
            return self.poll(h)
        h._t.done_event.wait(timeout_s if timeout_s is not None else max(h._t.deadline - time.monotonic(), 0) + 1)
        return self.poll(h)

    def cancel(self, h: TransferHandle) -> None:
        """Fail the transfer with reason 'cancelled'; the peer's side fails too. Idempotent."""
        if isinstance(h, TransferGroup):
            for p in h.handles:
                self._expire(p, "cancelled")
            return
        self._expire(h, "cancelled")

    def _expire(self, h: TransferHandle, reason: str | None) -> None:
        t, ch = h._t, h._owner
        with self._lock:
            if t.final:
                return
            if reason is None:
                side = "sent" if t.direction == "send" else "received"
                reason = (f"deadline exceeded after {t.timeout_s:.3f} s ({len(t.layers_done)}/"
                          f"{t.layout.num_layers} layers {side}, peer {t.peer!r})")
            why = ch.expire(t, reason)
            gen = ch.gen
        self._finished(t)
        if why:
            ch.break_pair(gen, why)

    def take_completed(self) -> list[TransferStats]:
        """Stats of transfers that ended (DONE or FAILED) since the last call."""
        with self._lock:
            out = list(self._completed)
            self._completed.clear()
            return out

    def _finished(self, t: Transfer) -> None:
        """The channels' ``ChannelHost.finished``: move ``t`` from in flight to completed, and log it."""
        with self._lock:
            if self._live.pop(t.transfer_id, None) is None:
                return
            st = t.stats()
            self._completed.append(st)
        if st.state == TransferState.FAILED:
            log.warning("kv %s request_id=%s peer=%s failed: %s", st.direction, st.request_id, st.peer, st.failure)
        else:
            log.debug("kv %s request_id=%s peer=%s done: %d bytes in %.4f s", st.direction, st.request_id,
                      st.peer, st.num_bytes, st.seconds)

    def _reap_loop(self) -> None:
        while not self._stopped.wait(REAP_INTERVAL_S):
            with self._lock:
                chans = list(self._send.values()) + list(self._recv.values())
            now = time.monotonic()
            for ch in chans:
                ch.reap(now)

    # -- teardown --------------------------------------------------------------------------------
    def close(self, peer: str) -> None:
        """Drop the channels to and from ``peer``; its in-flight transfers fail ('channel closed')."""
        with self._lock:
            chans = [c for c in (self._send.pop(peer, None), self._recv.pop(peer, None)) if c is not None]
        for c in chans:
            c.close(f"channel to {peer!r} closed")
        for c in chans:
            c.join(2.0)

    def shutdown(self) -> None:
        """Close every channel and stop the endpoint's threads; idempotent."""
        if self._stopped.is_set():
            return
        self._stopped.set()
        with self._lock:
            peers = set(self._send) | set(self._recv)
            self._layouts.clear()
        for p in peers:
            self.close(p)
        self._reaper.join(2.0)

    def __enter__(self) -> "KVEndpoint":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
