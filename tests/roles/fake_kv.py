"""A same-process stand-in for kvtransfer.KVEndpoint (unit tests of the worker layer only).

Endpoints that share one ``FakeKVHub`` copy blocks directly between the two
engines' caches as layers become ready; ``poll`` follows the real API's states.
"""
from __future__ import annotations

import itertools
import threading
from dataclasses import dataclass, field
from typing import Any, Optional


@dataclass
class _Xfer:
    id: int
    request_id: str
    direction: str
    state: str = "PENDING"
    failure: Optional[str] = None
    peer_xfer: Optional["_Xfer"] = None
    kv: Any = None
    blocks: list = field(default_factory=list)
    num_tokens: int = 0
    layers_ready: set = field(default_factory=set)


class FakeKVHub:
    """Shared state of the fake endpoints of one test."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        self.recvs: dict[tuple[str, str, str], _Xfer] = {}  # (sender, receiver, rid)
        self.ids = itertools.count()


class FakeKVEndpoint:
    def __init__(self, name: str, hub: FakeKVHub) -> None:
        self.name, self.hub = name, hub
        self.sends: dict[int, tuple[str, _Xfer]] = {}

    def recv(self, peer, request_id, kv_caches, dst_block_ids, num_tokens, *, deadline_s=None):
        x = _Xfer(next(self.hub.ids), request_id, "recv", kv=kv_caches, blocks=list(dst_block_ids),
                  num_tokens=num_tokens)
        with self.hub.lock:
            self.hub.recvs[(peer, self.name, request_id)] = x
        return x

    def send(self, peer, request_id, kv_caches, src_block_ids, num_tokens, *, deadline_s=None, layers_ready=False):
        x = _Xfer(next(self.hub.ids), request_id, "send", kv=kv_caches, blocks=list(src_block_ids),
                  num_tokens=num_tokens)
        x.peer = peer
        if layers_ready:
            for i in range(len(kv_caches)):
                self.layer_ready(x, i)
        return x

    def layer_ready(self, h, layer_idx):
        with self.hub.lock:
            r = self.hub.recvs.get((self.name, h.peer, h.request_id))
            if r is None or r.state == "FAILED":
                h.state, h.failure = "FAILED", "no matching receive"
                return
            bs_s, bs_d = h.kv[0][0].shape[1], r.kv[0][0].shape[1]
            for pos in range(h.num_tokens):
                for t in (0, 1):
                    r.kv[layer_idx][t][r.blocks[pos // bs_d], pos % bs_d] = h.kv[layer_idx][t][h.blocks[pos // bs_s], pos % bs_s]
            h.layers_ready.add(layer_idx)
            if len(h.layers_ready) == len(h.kv):
                h.state = r.state = "DONE"
                del self.hub.recvs[(self.name, h.peer, h.request_id)]
            else:
                h.state = r.state = "TRANSFERRING"

    def all_layers_ready(self, h):
        for i in range(len(h.kv)):
            self.layer_ready(h, i)

    def poll(self, h):
        return h.state

    def failure(self, h):
        return h.failure

    def cancel(self, h):
        with self.hub.lock:
            if h.state not in ("DONE", "FAILED"):
                h.state, h.failure = "FAILED", "cancelled"

    def take_completed(self):
        return []

    def shutdown(self):
        pass
