"""The worker registry in Redis: who is alive, where, and how loaded.

Lifecycle: a worker (its Ray actor) ``register``s its ``WorkerInfo`` once its
gRPC server is up, then ``heartbeat``s about once a second with live load
fields; each write refreshes the key's TTL, so a worker that stops
heartbeating (crash, partition, hang) vanishes from ``list`` within ``ttl_s``.
On a clean drain the worker ``deregister``s itself first, so routing stops at
once. The router reads the pool with ``list(role)`` (this class is the
router's ``router.worker_source.WorkerList``).

Layout (one namespace per cluster, so two clusters can share one Redis):

- ``{namespace}:worker:{worker_id}``: the serialized ``proto.worker_pb2.WorkerInfo``, with a TTL;
- ``{namespace}:workers``: a set of worker ids, an index so ``list`` never
  scans the whole keyspace; it carries the same TTL (refreshed by every live
  worker) and entries whose worker key expired are pruned by ``list``, so
  nothing of a cluster is left in Redis once its workers are gone.
- ``{namespace}:lora_adapters``: the cluster's LoRA adapters loaded at run time (a hash: name -> a serialized
  ``proto.worker_pb2.LoRARuntimeEntry``, path, load id and state; router/lora_admin.py writes it, every worker's heartbeat reads it and follows it,
  worker_common/lora_sync.py). It has no TTL: it is the cluster's configuration, kept while the cluster runs, so a
  worker started later (scaled up, replaced) loads the same adapters; ``clear`` removes it with the rest.

Transient connection errors are retried by redis-py with exponential backoff.
The URL may carry a password (``redis://:PASSWORD@host:port/db``) and TLS
(``rediss://``, with redis-py's ``ssl_ca_certs=`` query options); it is kept
only in the connection pool and shown masked (``cluster.redis_server.mask_url``).
"""
from __future__ import annotations

import logging
import re
import time
from typing import Iterable, Optional

import redis
from google.protobuf.message import DecodeError
from redis.backoff import ExponentialWithJitterBackoff
from redis.retry import Retry

from cluster.redis_server import mask_url
from proto import worker_pb2

log = logging.getLogger(__name__)

WorkerInfo = worker_pb2.WorkerInfo
ROLES = ("prefill", "decode", "colocated")
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,128}$")
_WORKER_ID_RE = re.compile(r"^[A-Za-z0-9_.\-]{1,256}$")


def _check_worker_id(worker_id: str) -> None:
    if not isinstance(worker_id, str) or not _WORKER_ID_RE.match(worker_id):
        raise ValueError(f"worker_id must be 1-256 characters of [A-Za-z0-9_.-], got {worker_id!r}")


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")


class Registry:
    """Workers of one cluster (namespace) in one Redis, each key TTL'd and heartbeat-refreshed."""

    def __init__(self, redis_url: str, namespace: str, ttl_s: float = 3.0,
                 socket_timeout_s: float = 2.0, retries: int = 3) -> None:
        if not isinstance(redis_url, str) or not redis_url.startswith(("redis://", "rediss://", "unix://")):
            raise ValueError(f"redis_url must be a redis://, rediss:// or unix:// URL, "
                             f"got {mask_url(redis_url) if isinstance(redis_url, str) else type(redis_url).__name__}")
        if not isinstance(namespace, str) or not _NAMESPACE_RE.match(namespace):
            raise ValueError(f"namespace must be 1-128 characters of [A-Za-z0-9_.-], got {namespace!r}")
        if not isinstance(ttl_s, (int, float)) or isinstance(ttl_s, bool) or not (0.01 <= ttl_s <= 3600):
            raise ValueError(f"ttl_s must be a number in [0.01, 3600], got {ttl_s!r}")
        self.redis_url = redis_url
        self.namespace = namespace
        self.ttl_s = float(ttl_s)
        self._ttl_ms = max(1, int(round(self.ttl_s * 1000)))
        retry = Retry(ExponentialWithJitterBackoff(base=0.05, cap=1.0), retries)
        self._redis = redis.Redis.from_url(
            redis_url, socket_timeout=socket_timeout_s, socket_connect_timeout=socket_timeout_s,
            retry=retry, retry_on_error=[redis.ConnectionError, redis.TimeoutError])

    # keys -----------------------------------------------------------------
    def worker_key(self, worker_id: str) -> str:
        """Redis key holding one worker's record."""
        return f"{self.namespace}:worker:{worker_id}"

    @property
    def index_key(self) -> str:
        """Redis key of the set of worker ids in this namespace."""
        return f"{self.namespace}:workers"

    # writes ---------------------------------------------------------------
    def register(self, info: WorkerInfo) -> None:
        """Add (or replace) a worker's record; it expires after ttl_s without a heartbeat."""
        self._write(info)
        log.info("registered worker %s role=%s grpc=%s in %s", info.worker_id, info.role,
                 info.grpc_address, self.namespace)

    def heartbeat(self, info: WorkerInfo) -> None:
        """Refresh a worker's TTL and load fields (re-adds it if its key had expired)."""
        self._write(info)

    def _write(self, info: WorkerInfo) -> None:
        if not isinstance(info, WorkerInfo):
            raise ValueError(f"info must be a proto.worker_pb2.WorkerInfo, got {type(info).__name__}")
        _check_worker_id(info.worker_id)
        _check_role(info.role)
        if not info.grpc_address:
            raise ValueError(f"grpc_address must be set for worker {info.worker_id!r}")
        record = WorkerInfo()
        record.CopyFrom(info)
        record.updated_at = time.time()
        pipe = self._redis.pipeline(transaction=True)
        pipe.set(self.worker_key(info.worker_id), record.SerializeToString(), px=self._ttl_ms)
        pipe.sadd(self.index_key, info.worker_id)
        pipe.pexpire(self.index_key, self._ttl_ms)
        pipe.execute()

    def deregister(self, worker_id: str) -> None:
        """Remove a worker at once (clean drain); unknown ids are ignored."""
        _check_worker_id(worker_id)
        pipe = self._redis.pipeline(transaction=True)
        pipe.delete(self.worker_key(worker_id))
        pipe.srem(self.index_key, worker_id)
        pipe.execute()
        log.info("deregistered worker %s from %s", worker_id, self.namespace)

    # the runtime LoRA set ---------------------------------------------------------
    @property
    def lora_key(self) -> str:
        """Redis key of the cluster's runtime LoRA adapters (a hash)."""
        return f"{self.namespace}:lora_adapters"

    def lora_entries(self) -> dict[str, worker_pb2.LoRARuntimeEntry]:
        """The runtime LoRA adapters, name -> entry (an unreadable field is skipped, with a warning)."""
        out = {}
        for k, v in self._redis.hgetall(self.lora_key).items():
            try:
                out[k.decode()] = worker_pb2.LoRARuntimeEntry.FromString(v)
            except (DecodeError, UnicodeDecodeError) as e:
                log.warning("runtime LoRA entry %r in %s is unreadable (skipped): %s", k, self.lora_key, e)
        return out

    def lora_add(self, name: str, entry: worker_pb2.LoRARuntimeEntry) -> bool:
        """Add ``name`` to the runtime set unless it is there already (False then): one load of a name at a time,
        whichever router gets there first."""
        return bool(self._redis.hsetnx(self.lora_key, name, entry.SerializeToString()))

    def lora_update(self, name: str, entry: worker_pb2.LoRARuntimeEntry) -> bool:
        """Replace ``name``'s entry if it is still the same load (``entry.load_id``); False if not."""
        return self._lora_cas(name, entry.load_id, entry.SerializeToString())

    def lora_remove(self, name: str, load_id: str) -> bool:
        """Remove ``name`` from the runtime set if it is still load ``load_id``; False if not."""
        return self._lora_cas(name, load_id, None)

    def _lora_cas(self, name: str, load_id: str, value: Optional[bytes]) -> bool:
        with self._redis.pipeline(transaction=True) as pipe:
            while True:
                try:
                    pipe.watch(self.lora_key)
                    cur = pipe.hget(self.lora_key, name)
                    try:
                        same = cur is not None and worker_pb2.LoRARuntimeEntry.FromString(cur).load_id == load_id
                    except DecodeError:
                        same = False
                    if not same:
                        pipe.unwatch()
                        return False
                    pipe.multi()
                    if value is None:
                        pipe.hdel(self.lora_key, name)
                    else:
                        pipe.hset(self.lora_key, name, value)
                    pipe.execute()
                    return True
                except redis.WatchError:
                    continue

    # reads ----------------------------------------------------------------
    def list(self, role: Optional[str] = None) -> list[WorkerInfo]:
        """Live workers (all roles when role is None), sorted by worker_id; expired or garbled records are skipped."""
        if role is not None:
            _check_role(role)
        ids = sorted(i.decode() if isinstance(i, bytes) else i for i in self._redis.smembers(self.index_key))
        if not ids:
            return []
        blobs = self._redis.mget([self.worker_key(i) for i in ids])
        out: list[WorkerInfo] = []
        gone: list[str] = []
        for worker_id, blob in zip(ids, blobs):
            if blob is None:
                gone.append(worker_id)
                continue
            info = self._parse(worker_id, blob)
            if info is None:
                continue
            if role is None or info.role == role:
                out.append(info)
        if gone:
            self._prune(gone)
        return out

    def get(self, worker_id: str) -> Optional[WorkerInfo]:
        """One worker's record, or None if absent, expired or garbled."""
        _check_worker_id(worker_id)
        blob = self._redis.get(self.worker_key(worker_id))
        return None if blob is None else self._parse(worker_id, blob)

    def _parse(self, worker_id: str, blob: bytes) -> Optional[WorkerInfo]:
        info = WorkerInfo()
        try:
            info.ParseFromString(blob)
        except DecodeError:
            log.warning("skipping garbled registry record %s", self.worker_key(worker_id))
            return None
        # A parse can "succeed" on foreign bytes; a record we wrote always names itself.
        if info.worker_id != worker_id or info.role not in ROLES:
            log.warning("skipping inconsistent registry record %s", self.worker_key(worker_id))
            return None
        return info

    def _prune(self, worker_ids: Iterable[str]) -> None:
        # Only drop ids whose key is still absent: a worker may have re-registered meanwhile.
        for worker_id in worker_ids:
            if not self._redis.exists(self.worker_key(worker_id)):
                self._redis.srem(self.index_key, worker_id)

    # admin ----------------------------------------------------------------
    def keys(self) -> list[str]:
        """Every Redis key in this namespace (tests and shutdown checks use it)."""
        return sorted(k.decode() for k in self._redis.scan_iter(match=f"{self.namespace}:*", count=1000))

    def clear(self) -> int:
        """Delete every key of this namespace; returns how many were deleted."""
        keys = self.keys()
        return int(self._redis.delete(*keys)) if keys else 0

    def clear_stale(self, wait_s: float = 15.0, poll_s: float = 0.2) -> list[str]:
        """Remove what a dead run left in this namespace; returns the deleted keys.

        A run killed with SIGKILL leaves its kvtransfer rendezvous keys (``{ns}:kvt...``, no TTL) and, for a
        few seconds, its workers' records (their actors die with the driver, then the TTL drops the keys).
        Waits up to ``wait_s`` for live worker records to expire; if some still heartbeat after that, the
        namespace belongs to a running cluster and nothing is deleted (RuntimeError)."""
        if not wait_s >= 0:
            raise ValueError(f"wait_s must be >= 0, got {wait_s!r}")
        deadline = time.monotonic() + wait_s
        while True:
            live = [w.worker_id for w in self.list()]
            if not live:
                break
            if time.monotonic() >= deadline:
                raise RuntimeError(f"namespace {self.namespace} has live workers {live} (still heartbeating "
                                   f"after {wait_s:g} s): a running cluster uses it; stop that one first")
            time.sleep(poll_s)
        keys = self.keys()
        if keys:
            self._redis.delete(*keys)
            log.warning("removed %d stale key(s) of namespace %s: %s", len(keys), self.namespace, keys)
        return keys

    def ping(self) -> bool:
        """True when Redis answers."""
        return bool(self._redis.ping())

    def close(self) -> None:
        """Close the connection pool."""
        self._redis.close()

    def __enter__(self) -> "Registry":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
