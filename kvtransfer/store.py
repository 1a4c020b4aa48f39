"""Rendezvous stores: where pair channels find each other.

Lifecycle: ``KVEndpoint`` calls ``open_store(spec)`` once at start. The spec is
a URL, a ``StoreConfig`` or an existing ``torch.distributed.Store``:

- ``redis://[:password@]host:port/db`` (or ``rediss://`` for TLS): a
  ``RedisStore``, a ``torch.distributed.Store`` implemented on redis-py. The
  cluster already runs Redis for its registry, so workers need no extra
  rendezvous server, Redis outlives any worker (a TCPStore dies with the
  process that serves it), and the Redis password guards the rendezvous:
  whoever cannot write these keys cannot steer a worker's pair group to
  another address. The URL's password is never shown (``repr``, errors).
- ``tcp://host:port``: a client of a ``torch.distributed.TCPStore`` someone
  already serves (tests and benchmarks start one on port 0).
- ``InprocStore``: an in-memory store that also carries the hub of the
  ``inproc`` backend, for unit tests with several endpoints in one process.

Everything an endpoint writes lives under ``StoreConfig.namespace`` (through a
``PrefixStore``), so two clusters can share one Redis or TCPStore.
"""
from __future__ import annotations

import datetime
import threading
import time
from dataclasses import dataclass, field
from typing import Optional
from urllib.parse import urlparse, urlsplit, urlunsplit

import torch.distributed as dist

from kvtransfer.transport import InprocHub


def mask_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` (for reprs and errors)."""
    try:
        parts = urlsplit(url)
        if parts.password is None and parts.username is None:
            return url
        netloc = ":***@" + parts.netloc.rpartition("@")[2]
        return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
    except (ValueError, TypeError):
        return "<url hidden>"


@dataclass
class StoreConfig:
    """Where and under which namespace endpoints rendezvous."""

    url: str = field(repr=False)
    """redis://[:password@]host:port/db, rediss://... (TLS) or tcp://host:port. Shown masked."""
    namespace: str = "kvt"
    """Key prefix; one per cluster keeps clusters sharing a store apart."""
    connect_timeout_s: float = 10.0
    """How long to wait for the store server when connecting."""
    host: Optional[str] = None
    """Interface this endpoint's gloo pair groups bind and advertise to peers (the worker's ``host``);
    None: torch's default, the address the machine's hostname resolves to."""

    def __repr__(self) -> str:
        return (f"StoreConfig(url={mask_url(self.url)!r}, namespace={self.namespace!r}, "
                f"connect_timeout_s={self.connect_timeout_s!r}, host={self.host!r})")


def _poll_until(pred, timeout_s: float, what: str):
    """Call pred() until it returns non-None or timeout; backs off from 1 ms to 20 ms."""
    deadline = time.monotonic() + timeout_s
    pause = 0.001
    while True:
        got = pred()
        if got is not None:
            return got
        if time.monotonic() >= deadline:
            raise dist.DistStoreError(f"timed out after {timeout_s:.1f} s waiting for {what}")
        time.sleep(pause)
        pause = min(pause * 2, 0.02)


OP_TIMEOUT_S = 1.0
"""Socket timeout of one Redis command of the rendezvous (they answer in well under a millisecond)."""


class RedisStore(dist.Store):
    """A ``torch.distributed.Store`` on Redis (usable by ProcessGroupGloo's rendezvous).

    Every key it writes expires ``key_ttl_s`` after its last write: rendezvous keys are read only while a
    pair group is being built (seconds), so a cancelled or crashed rendezvous, or a whole cluster killed
    with SIGKILL, leaves nothing in Redis past the TTL."""

    def __init__(self, url: str, timeout_s: float = 30.0, key_ttl_s: float = 600.0):
        super().__init__()
        import redis  # the cluster's Redis client; imported here so gloo-only users need not load it

        if not key_ttl_s > timeout_s:
            raise ValueError(f"key_ttl_s must be > timeout_s ({timeout_s}), got {key_ttl_s!r}")
        # Each command is one round trip (the waits poll); a Redis that does not answer one within
        # OP_TIMEOUT_S is away (paused, partitioned), and the rendezvous says so instead of hanging.
        self._r = redis.Redis.from_url(url, socket_timeout=OP_TIMEOUT_S, socket_connect_timeout=OP_TIMEOUT_S)
        self._timeout_s = timeout_s
        self._ttl_ms = int(key_ttl_s * 1000)

    # torch's c10d calls these through its Python trampoline
    def set(self, key: str, value) -> None:
        self._r.set(key, value if isinstance(value, (bytes, bytearray)) else str(value).encode(), px=self._ttl_ms)

    def get(self, key: str) -> bytes:
        return _poll_until(lambda: self._r.get(key), self._timeout_s, f"key {key!r}")

    def add(self, key: str, value: int) -> int:
        pipe = self._r.pipeline(transaction=True)
        pipe.incrby(key, value)
        pipe.pexpire(key, self._ttl_ms)
        return int(pipe.execute()[0])

    def compare_set(self, key: str, expected, desired) -> bytes:
        expected = expected.encode() if isinstance(expected, str) else bytes(expected)
        desired = desired.encode() if isinstance(desired, str) else bytes(desired)
        # torch's semantics: set if the current value equals expected, or if the key is missing and
        # expected is empty; return the value now stored (or the current one on mismatch)
        script = ("local v = redis.call('GET', KEYS[1]) "
                  "if (v == false and ARGV[1] == '') or v == ARGV[1] then "
                  "redis.call('SET', KEYS[1], ARGV[2], 'PX', ARGV[3]) return ARGV[2] end "
                  "if v == false then return ARGV[1] end return v")
        return bytes(self._r.eval(script, 1, key, expected, desired, self._ttl_ms))

    def wait(self, keys, timeout=None) -> None:
        t = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else self._timeout_s
        _poll_until(lambda: True if self._r.exists(*keys) == len(keys) else None, t, f"keys {list(keys)}")

    def check(self, keys) -> bool:
        return self._r.exists(*keys) == len(keys)

    def delete_key(self, key: str) -> bool:
        return bool(self._r.delete(key))

    def num_keys(self) -> int:
        return int(self._r.dbsize())

    def set_timeout(self, timeout) -> None:
        self._timeout_s = timeout.total_seconds()

    def close(self) -> None:
        """Close the Redis connections now (not whenever garbage collection gets to them)."""
        self._r.close()


class InprocStore(dist.Store):
    """An in-memory store shared by same-process endpoints; carries the inproc backend's hub."""

    def __init__(self, timeout_s: float = 30.0):
        super().__init__()
        self.hub = InprocHub()
        self._d: dict[str, bytes] = {}
        self._cv = threading.Condition()
        self._timeout_s = timeout_s

    def set(self, key: str, value) -> None:
        with self._cv:
            self._d[key] = value if isinstance(value, bytes) else (
                bytes(value) if isinstance(value, bytearray) else str(value).encode())
            self._cv.notify_all()

    def get(self, key: str) -> bytes:
        with self._cv:
            if not self._cv.wait_for(lambda: key in self._d, timeout=self._timeout_s):
                raise dist.DistStoreError(f"timed out waiting for key {key!r}")
            return self._d[key]

    def add(self, key: str, value: int) -> int:
        with self._cv:
            n = int(self._d.get(key, b"0")) + value
            self._d[key] = str(n).encode()
            self._cv.notify_all()
            return n

    def compare_set(self, key: str, expected, desired) -> bytes:
        expected = expected.encode() if isinstance(expected, str) else bytes(expected)
        desired = desired.encode() if isinstance(desired, str) else bytes(desired)
        with self._cv:
            cur = self._d.get(key)
            if (cur is None and expected == b"") or cur == expected:
                self._d[key] = desired
                self._cv.notify_all()
                return desired
            return expected if cur is None else cur

    def wait(self, keys, timeout=None) -> None:
        t = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else self._timeout_s
        with self._cv:
            if not self._cv.wait_for(lambda: all(k in self._d for k in keys), timeout=t):
                raise dist.DistStoreError(f"timed out waiting for keys {list(keys)}")

    def check(self, keys) -> bool:
        with self._cv:
            return all(k in self._d for k in keys)

    def delete_key(self, key: str) -> bool:
        with self._cv:
            return self._d.pop(key, None) is not None

    def num_keys(self) -> int:
        with self._cv:
            return len(self._d)

    def set_timeout(self, timeout) -> None:
        self._timeout_s = timeout.total_seconds()


def open_store(spec: "str | StoreConfig | dist.Store") -> tuple[dist.Store, str]:
    """Connect to the rendezvous store; returns (store, namespace). ValueError for a bad spec."""
    if isinstance(spec, dist.Store):
        return spec, "kvt"
    cfg = StoreConfig(spec) if isinstance(spec, str) else spec
    if not isinstance(cfg, StoreConfig):
        raise ValueError(f"store must be a URL, StoreConfig or torch.distributed.Store, got {type(spec).__name__}")
    if not cfg.namespace or "/" in cfg.namespace:
        raise ValueError(f"store namespace must be non-empty without '/', got {cfg.namespace!r}")
    u = urlparse(cfg.url)
    if u.scheme in ("redis", "rediss", "unix"):
        return RedisStore(cfg.url, timeout_s=cfg.connect_timeout_s), cfg.namespace
    if u.scheme == "tcp":
        if not u.hostname or not u.port:
            raise ValueError(f"store url must be tcp://host:port, got {mask_url(cfg.url)!r}")
        st = dist.TCPStore(u.hostname, u.port, is_master=False,
                           timeout=datetime.timedelta(seconds=cfg.connect_timeout_s))
        return st, cfg.namespace
    raise ValueError(f"store url must start with redis://, rediss:// or tcp://, got {mask_url(cfg.url)!r}")
