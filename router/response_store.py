"""Stored responses of OpenAI's Responses API: ``store``, ``previous_response_id``, ``GET`` and ``DELETE
/v1/responses/{id}``, ``GET /v1/responses/{id}/input_items`` (router/openai/http_api.py,
router/openai/responses_api.py).

Lifecycle: ``RouterCore`` builds one ``ResponseStore`` when ``RouterConfig.responses_store_ttl_s`` is set (off by
default, as vLLM's ``VLLM_ENABLE_RESPONSES_API_STORE``: every stored response holds its whole conversation). A
finished response asked to be kept (``store`` true, OpenAI's default) is ``put`` with its conversation: the input
items it was answered from (a previous response's conversation first) followed by its own output items, so a
request naming it as ``previous_response_id`` continues from one read. With the cluster's Redis (the router's
worker source is the Redis registry) a stored response is one key, ``{namespace}:response:<id>``, expiring after
the TTL, so every router of the cluster finds what any of them stored and the namespace's clearing removes them;
without Redis (a static worker list) it lives in this router's memory (at most ``max_local`` of them, least
recently stored dropped first). ``close`` drops the connection.

A response belongs to the API key that made it (``owner_of``: a digest of the key, never the key): another key
asking for it gets "not found", as if it did not exist. An id not of this server's shape is "not found" without a
round trip. Redis unreachable is ``StoreUnavailable`` (the HTTP API answers 503); a response whose storing failed
is still answered, with ``store: false``.
"""
from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Optional

log = logging.getLogger(__name__)

ID_SHAPE = re.compile(r"resp_[0-9a-f]{32}")
"""This server's response ids (``ResponseCollector.id``)."""


class StoreUnavailable(Exception):
    """The store (Redis) could not be reached; nothing was read or changed."""


@dataclass
class StoredResponse:
    response: dict
    """The ``response`` object as it was answered."""
    conversation: list[dict]
    """The input items it answered, then its output items: what a follow-up continues from."""
    owner: str
    """``owner_of`` the key that made it."""

    def to_bytes(self) -> bytes:
        return json.dumps({"response": self.response, "conversation": self.conversation, "owner": self.owner},
                          separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, raw: bytes) -> "StoredResponse":
        d = json.loads(raw)
        return cls(d["response"], d["conversation"], d["owner"])


def owner_of(secret: Optional[bytes]) -> str:
    """Who a stored response belongs to: a digest of the API key's secret ("" with no key)."""
    return hashlib.blake2b(secret, digest_size=16).hexdigest() if secret else ""


class ResponseStore:
    """Stored responses, in the cluster's Redis (``redis_url`` and ``namespace``) or in memory (see module
    docstring). Thread-safe; a call is one Redis round trip (``delete``: two, the owner read first)."""

    def __init__(self, ttl_s: float, redis_url: Optional[str] = None, namespace: Optional[str] = None,
                 max_local: int = 1024, timeout_s: float = 2.0) -> None:
        if not ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {ttl_s}")
        self.ttl_s = ttl_s
        self._redis: Any = None
        self._prefix = f"{namespace}:response:"
        if redis_url is not None:
            import redis

            self._redis = redis.Redis.from_url(redis_url, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self._local: OrderedDict[str, tuple[float, bytes]] = OrderedDict()
        self._max_local = max_local
        self._lock = threading.Lock()

    def put(self, rid: str, stored: StoredResponse) -> None:
        raw = stored.to_bytes()
        if self._redis is None:
            with self._lock:
                self._local[rid] = (time.monotonic() + self.ttl_s, raw)
                self._local.move_to_end(rid)
                while len(self._local) > self._max_local:
                    self._local.popitem(last=False)
            return
        self._call(self._redis.set, self._prefix + rid, raw, px=int(self.ttl_s * 1000))

    def get(self, rid: str, owner: str) -> Optional[StoredResponse]:
        """The stored response ``rid`` of ``owner``; None when there is none (unknown, expired, deleted, another
        key's)."""
        if not ID_SHAPE.fullmatch(rid):
            return None
        if self._redis is None:
            with self._lock:
                entry = self._local.get(rid)
                if entry is not None and entry[0] <= time.monotonic():
                    del self._local[rid]
                    entry = None
            raw = entry[1] if entry is not None else None
        else:
            raw = self._call(self._redis.get, self._prefix + rid)
        if raw is None:
            return None
        try:
            stored = StoredResponse.from_bytes(raw)
        except (ValueError, KeyError, TypeError) as e:
            log.warning("stored response %s is unreadable (treated as absent): %s", rid, e)
            return None
        return stored if stored.owner == owner else None

    def delete(self, rid: str, owner: str) -> bool:
        """Delete ``owner``'s stored response ``rid``; False when there is none."""
        if self.get(rid, owner) is None:
            return False
        if self._redis is None:
            with self._lock:
                return self._local.pop(rid, None) is not None
        return bool(self._call(self._redis.delete, self._prefix + rid))

    def _call(self, fn: Any, *args: Any, **kw: Any) -> Any:
        import redis

        try:
            return fn(*args, **kw)
        except redis.RedisError as e:
            raise StoreUnavailable(f"the response store (Redis) is unreachable: {type(e).__name__}") from None

    def close(self) -> None:
        if self._redis is not None:
            self._redis.close()
