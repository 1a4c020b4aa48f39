"""The router's Redis calls that a request waits on are bounded by 50 ms, then fall back to local state.

Only one such call exists: the cold-tie script (``router.kv.ties``). Against a real, paused Redis (SIGSTOP:
the socket stays open, nothing answers) it gives up after its socket timeout, the caller draws locally, the
draw is counted, and the next second skips Redis altogether. The whole-cluster behaviour (requests keep
their latency while Redis is paused or killed) is tests/fault_tolerance/test_redis_outage.py.
"""
from __future__ import annotations

import os
import signal

import pytest

from cluster.redis_server import EmbeddedRedis
from router.kv.ties import ColdTies

REDIS_BOUND_S = 0.05


class _Metrics:
    def __init__(self) -> None:
        self.ties: list[str] = []
        self.fallbacks: list[str] = []

    def inc_kv_cold_tie(self, result: str) -> None:
        self.ties.append(result)

    def inc_redis_fallback(self, use: str) -> None:
        self.fallbacks.append(use)


@pytest.fixture
def paused_redis():
    server = EmbeddedRedis().start()
    try:
        yield server
    finally:
        try:
            os.kill(server.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        server.stop()


def test_cold_tie_gives_up_on_a_paused_redis_within_the_bound_and_draws_locally(paused_redis):
    m = _Metrics()
    ties = ColdTies(paused_redis.url, "bounds", 1.0, lambda: m)
    try:
        # the default the router builds it with: one round trip of at most the bound
        kwargs = ties._redis.connection_pool.connection_kwargs
        assert kwargs["socket_timeout"] <= REDIS_BOUND_S and kwargs["socket_connect_timeout"] <= REDIS_BOUND_S
        assert ties.choose(["w0", "w1"]) in ("w0", "w1")  # Redis up: shared
        assert m.ties == ["shared"] and m.fallbacks == []
        os.kill(paused_redis.pid, signal.SIGSTOP)
        assert ties.choose(["w0", "w1"]) is None  # timed out: the caller draws locally
        assert ties.choose(["w0", "w1"]) is None  # within the backoff: Redis not even asked
        assert m.ties == ["shared", "local", "local"] and m.fallbacks == ["cold_tie", "cold_tie"]
        assert ties.local == 2 and ties.shared == 1
    finally:
        os.kill(paused_redis.pid, signal.SIGCONT)
        ties.stop()
