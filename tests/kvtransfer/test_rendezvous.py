"""An endpoint's first publish outlasts a store that stalls at its start (a real Redis, paused), within its bound."""
from __future__ import annotations

import os
import signal
import threading
import time

import pytest

from cluster.redis_server import EmbeddedRedis
from kvtransfer.rendezvous import Rendezvous, StoreUnavailable
from kvtransfer.store import RedisStore


@pytest.fixture
def paused_redis():
    """A Redis of this test's own, paused (SIGSTOP): every command times out until it is resumed."""
    server = EmbeddedRedis().start()
    os.kill(server.pid, signal.SIGSTOP)
    try:
        yield server
    finally:
        os.kill(server.pid, signal.SIGCONT)
        server.stop()


def test_the_first_publish_waits_for_a_stalled_store_then_publishes(paused_redis):
    store = RedisStore(paused_redis.url)
    resume = threading.Timer(2.5, os.kill, (paused_redis.pid, signal.SIGCONT))
    t0 = time.monotonic()
    resume.start()
    try:
        rv = Rendezvous(store, "kvt", "p0", publish_retry_s=60.0)
    finally:
        resume.cancel()
    assert time.monotonic() - t0 >= 2.0  # it waited for the store (each command times out after 1 s)
    assert store.get("kvt/inc/p0").decode() == rv.incarnation


def test_a_store_that_stays_away_fails_the_start_within_its_bound(paused_redis):
    store = RedisStore(paused_redis.url)
    t0 = time.monotonic()
    with pytest.raises(StoreUnavailable, match="publish"):
        Rendezvous(store, "kvt", "p0", publish_retry_s=2.0)
    assert time.monotonic() - t0 < 2.0 + 1.0 + 2.0  # the bound, one command's timeout, slack for a busy machine
