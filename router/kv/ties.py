"""Cold ties broken through Redis: routers placing new prefixes at the same instant land them on different workers.

Why (measured, docs/benchmarks.md "Prefix routing with several routers"): when a prompt's prefix is cached nowhere
(a *cold* prefix: a new system prompt, the first turn of a conversation, a one-off prompt), every candidate scores
on load alone, and idle workers tie. Each router breaks the tie at random (``RouterConfig.kv_tie_blocks``). One
router spreads a burst of new prefixes because its own placements count at once; several routers deciding within the
replica sync's latency (``router.kv.replica``: a few milliseconds) do not see each other's placements and collide like
a birthday draw. Three routers each opening one system prompt's conversations put two of them on one worker in
2 of 3 draws (load spread 1.25-1.75 over three runs, where one router alone gives 1.00), and a conversation stays
on the worker holding its history for all its turns. Redis serialises the draws: that is what makes it shared.

What it does: for a cold placement with a tie, the placer asks ``ColdTies.choose(tied)``. One Lua script (one round
trip, atomic) counts, per candidate, the cold ties any router resolved onto it in the current and previous window
(``window_s``, half of ``RouterConfig.kv_pending_s``: about as long as a placement stays pending), returns the first
candidate with the fewest, and counts it. The caller shuffles the tied candidates first, so equal counts still spread
at random. State: one hash ``{ns}:kvties`` (fields ``<window>:<worker>`` for the current and previous window, and
``_b``, the current window; older fields are deleted when the window turns; the key expires two windows after the
last write, and ``stop()`` deletes it). Windows come from Redis's own clock (``TIME``), so routers' clocks do not
matter.

Cost and failure: one round trip per cold tie only (a warm prefix or a clear best never asks); a short socket
timeout (``timeout_s``, 0.05 s: Redis answers in well under a millisecond; 50 ms is the most a request may gain
while Redis is away, and a busy router that misses it only draws one tie locally); on any Redis error the caller
draws locally as before (counted: ``pdserve:kv_cold_ties_total{result="local"}`` and
``pdserve:redis_fallbacks_total{use="cold_tie"}``) and the next ``backoff_s`` (1 s) skips Redis altogether, so Redis away delays
at most one placement per second, by at most the timeout. Thread-safe (redis-py's pool); the placer serialises its
own cold decisions (``Placer``'s cold lock) so two of this router's requests sharing a new prefix do not split it.

Lifecycle: the router's ``KVEventConsumer`` builds one (when ``kv_events`` and ``kv_replica_sync`` are on and
``kv_pending_s`` > 0; its ``ties``), the placer calls ``choose`` from request threads, and the consumer's ``stop()``
calls ``stop()``, which deletes the key and closes the client.
"""
from __future__ import annotations

import logging
import threading
import time
from typing import Callable, Optional, Sequence, Any

import redis

log = logging.getLogger(__name__)

_CHOOSE = """
local key = KEYS[1]
local win = tonumber(ARGV[1])
local t = redis.call('TIME')
local b = math.floor((tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)) / win)
if redis.call('HGET', key, '_b') ~= tostring(b) then
  for _, f in ipairs(redis.call('HKEYS', key)) do
    local fb = tonumber(string.match(f, '^(%d+):'))
    if f ~= '_b' and (fb == nil or fb < b - 1) then redis.call('HDEL', key, f) end
  end
  redis.call('HSET', key, '_b', tostring(b))
end
local best, bestn = nil, nil
for i = 2, #ARGV do
  local n = tonumber(redis.call('HGET', key, tostring(b) .. ':' .. ARGV[i]) or '0')
          + tonumber(redis.call('HGET', key, tostring(b - 1) .. ':' .. ARGV[i]) or '0')
  if bestn == nil or n < bestn then best, bestn = ARGV[i], n end
end
redis.call('HINCRBY', key, tostring(b) .. ':' .. best, 1)
redis.call('PEXPIRE', key, 2 * win)
return best
"""


def kv_ties_key(namespace: str) -> str:
    """The hash of the cold ties resolved per worker (see module docstring)."""
    return f"{namespace}:kvties"


class ColdTies:
    """Shared tie-breaking of cold placements across routers (see module docstring)."""

    def __init__(self, redis_url: str, namespace: str, window_s: float, metrics: Callable[[], Any] = lambda: None,
                 timeout_s: float = 0.05, backoff_s: float = 1.0) -> None:
        if not window_s > 0 or not timeout_s > 0 or not backoff_s >= 0:
            raise ValueError("window_s and timeout_s must be > 0, backoff_s >= 0")
        self.key = kv_ties_key(namespace)
        self.window_ms = max(1, int(window_s * 1000))
        self.backoff_s = backoff_s
        self._redis = redis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._script = self._redis.register_script(_CHOOSE)
        self._metrics = metrics
        self._lock = threading.Lock()
        self._skip_until = 0.0
        self.shared = 0
        """Ties resolved through Redis (tests and metrics read it)."""
        self.local = 0
        """Ties left to the local draw (Redis unavailable)."""

    def choose(self, worker_ids: Sequence[str]) -> Optional[str]:
        """The first of ``worker_ids`` (already in random order) with the fewest cold ties resolved onto it by any
        router lately, counted as one more; None when Redis did not answer (the caller draws locally)."""
        if not worker_ids:
            return None
        if time.monotonic() < self._skip_until:
            self._count("local")
            return None
        try:
            got = self._script(keys=[self.key], args=[self.window_ms, *worker_ids])
        except redis.RedisError as e:
            with self._lock:
                self._skip_until = time.monotonic() + self.backoff_s
            self._count("local")
            if self.local == 1 or self.local % 100 == 0:
                log.warning("cold tie not shared with the other routers (drawn locally; %d so far): %s",
                            self.local, e)
            return None
        pick = got.decode() if isinstance(got, bytes) else str(got)
        if pick not in worker_ids:  # not possible with the script above; never route on a stranger
            self._count("local")
            return None
        self._count("shared")
        return pick

    def _count(self, result: str) -> None:
        with self._lock:
            if result == "shared":
                self.shared += 1
            else:
                self.local += 1
        m = self._metrics()
        if m is not None:
            m.inc_kv_cold_tie(result)
            if result == "local":
                m.inc_redis_fallback("cold_tie")

    def stop(self) -> None:
        """Delete the key (the ties it counts are seconds old; the next cold tie creates it again) and close."""
        try:
            self._redis.delete(self.key)
        except redis.RedisError as e:
            log.warning("could not delete %s (it expires by itself): %s", self.key, e)
        self._redis.close()
