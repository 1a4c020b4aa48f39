"""Pair rendezvous through the key-value store: who builds which group, under which prefix.

Lifecycle: each endpoint publishes its incarnation (a random id per process
start) under ``inc/<name>`` when it starts, so a worker restarted under the
same name is a new incarnation. To build a pair the sender (rank 0) reads the
receiver's current incarnation, picks a fresh group key
``<sender>.<inc>><receiver>.<inc>.<n>`` and publishes it as the pair's offer;
the receiver (rank 1) accepts the offer only if it names its own incarnation
and differs from the last key it used. Both then build the group under
``pg/<key>``, so a rebuilt pair never reads a stale rendezvous, and an offer
meant for a dead incarnation is never accepted by its successor.

A store that cannot be reached (Redis killed, paused past its socket timeout) raises
``StoreUnavailable`` at once, distinct from ``RendezvousTimeout`` (the store answers, the peer is not
there yet): the channel then fails the transfers waiting for the pair without waiting for their
deadlines, so a request learns within one store timeout that its pair cannot be built now. The one exception is
the first publish, at the endpoint's start: it is retried with backoff for up to ``publish_retry_s`` (a worker
starting while Redis is slow or restarting, e.g. on a machine whose cores are all busy, starts once it answers).
"""
from __future__ import annotations

import datetime
import itertools
import logging
import time
import uuid
from typing import Callable

import torch.distributed as dist


log = logging.getLogger(__name__)

PUBLISH_RETRY_S = 30.0
"""How long an endpoint's first publish is retried at its start before the start fails."""


SHM_MARK = ".shm"
"""Ends a pair key whose sender offers shared memory to a receiver that publishes it (``cap/<name>``)."""


class RendezvousTimeout(RuntimeError):
    """The peer did not show up in the store in time."""


class StoreUnavailable(RuntimeError):
    """The rendezvous store did not answer (connection refused, reset or timed out)."""


def _store_call(fn: Callable[[], object], what: str) -> object:
    try:
        return fn()
    except RendezvousTimeout:
        raise
    except Exception as e:  # noqa: BLE001 - redis-py and c10d errors arrive through torch's store trampoline
        raise StoreUnavailable(f"rendezvous store unavailable ({what}): {type(e).__name__}: {e}") from e


class Rendezvous:
    """One endpoint's view of the store: its incarnation, and offers to and from peers."""

    def __init__(self, store: dist.Store, namespace: str, name: str, publish_retry_s: float = PUBLISH_RETRY_S,
                 shm: bool = False):
        self.store = dist.PrefixStore(namespace, store)
        self._base = store
        self._namespace = namespace
        self.hub = getattr(store, "hub", None)  # only an InprocStore has one
        self.name = name
        self.incarnation = uuid.uuid4().hex[:12]
        self.shm = shm
        """Offer and accept same-host shared memory for pair payloads (kvtransfer/shm.py)."""
        self._seq = itertools.count(1)
        deadline, pause = time.monotonic() + publish_retry_s, 0.05
        while True:  # the first publish outlasts a slow or restarting store, within publish_retry_s
            try:
                self.publish()
                break
            except StoreUnavailable as e:
                if time.monotonic() + pause > deadline:
                    raise
                log.warning("kv endpoint %s: %s; retrying for up to %.0f s", name, e, deadline - time.monotonic())
                time.sleep(pause)
                pause = min(2 * pause, 1.0)

    def publish(self) -> None:
        """(Re)write this endpoint's incarnation. Store keys may expire (the Redis store's TTL) or vanish
        (a restarted Redis), so a receiver publishes again each time it waits for an offer."""
        _store_call(lambda: self.store.set(f"inc/{self.name}", self.incarnation), "publish")
        if self.shm:  # an endpoint without it (older, or shm off) never sets the key
            _store_call(lambda: self.store.set(f"cap/{self.name}", "shm"), "publish")

    def _poll(self, fn: Callable[[], str | None], timeout_s: float, what: str,
              stop: Callable[[], bool]) -> str:
        deadline = time.monotonic() + timeout_s
        pause = 0.0005
        while True:
            got = _store_call(fn, what)
            if got is not None:
                return got
            if stop():
                raise RendezvousTimeout(f"stopped while waiting for {what}")
            if time.monotonic() >= deadline:
                raise RendezvousTimeout(f"{what} did not appear within {timeout_s:.2f} s")
            time.sleep(pause)
            pause = min(pause * 2, 0.02)

    def _get(self, key: str) -> str | None:
        # check first: a plain get blocks until the store's own timeout
        if not self.store.check([key]):
            return None
        return self.store.get(key).decode()

    def offer(self, receiver: str, timeout_s: float, stop: Callable[[], bool]) -> str:
        """Sender side: publish a fresh group key for (self -> receiver); returns the key."""
        inc_r = self._poll(lambda: self._get(f"inc/{receiver}"), timeout_s,
                           f"kv endpoint {receiver!r}", stop)
        # the counter is per endpoint, not per channel: a channel re-created after close() must not
        # repeat a key the receiver already used
        key = f"{self.name}.{self.incarnation}>{receiver}.{inc_r}.{next(self._seq)}"
        if self.shm and _store_call(lambda: self._get(f"cap/{receiver}"), "capabilities") == "shm":
            key += SHM_MARK
        _store_call(lambda: self.store.set(f"offer/{self.name}>{receiver}", key), "offer")
        return key

    def accept(self, sender: str, last_key: str | None, timeout_s: float, stop: Callable[[], bool]) -> str:
        """Receiver side: wait for a new offer from ``sender`` to this incarnation; returns its key."""
        mine = f">{self.name}.{self.incarnation}."
        self.publish()  # the sender looks this up first; it may have expired since the endpoint started

        def fresh() -> str | None:
            key = self._get(f"offer/{sender}>{self.name}")
            return key if key is not None and mine in key and key != last_key else None
        return self._poll(fresh, timeout_s, f"a pair offer from {sender!r}", stop)

    def group_store(self, key: str) -> tuple[dist.Store, str]:
        """The (store, prefix) the pair group for ``key`` is built on.

        A TCPStore client serializes its calls, and gloo's rendezvous blocks in ``wait``
        until the peer shows up: two pairs built at once through one client would stall each
        other (measured: half of concurrent in-process builds timed out). So each build gets
        its own client connection; the group keeps it alive as long as it needs it.
        """
        prefix = f"pg/{key}"
        if isinstance(self._base, dist.TCPStore):
            own = dist.TCPStore(self._base.host, self._base.port, is_master=False,
                                timeout=datetime.timedelta(seconds=60))
            return dist.PrefixStore(self._namespace, own), prefix
        return self.store, prefix
