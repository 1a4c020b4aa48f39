"""The response store alone (router/response_store.py), in memory (a router with a static worker list) and in a
real Redis: kept responses expire after the TTL, memory keeps at most ``max_local`` (least recently stored dropped
first), a response is its owner's only, an id not of the server's shape or an unreadable record is "none", and an
unreachable Redis is ``StoreUnavailable``, not an exception of its own."""
from __future__ import annotations

import uuid

import pytest
import redis

from router.response_store import ResponseStore, StoredResponse, StoreUnavailable, owner_of
from tests.waiting import wait_until


def _rid() -> str:
    return f"resp_{uuid.uuid4().hex}"


def _stored(text: str, owner: str = "a") -> StoredResponse:
    return StoredResponse({"id": "x", "output_text": text}, [{"role": "user", "content": text}], owner)


@pytest.fixture(params=["memory", "redis"])
def store(request):
    if request.param == "memory":
        s = ResponseStore(60, max_local=3)
    else:
        s = ResponseStore(60, request.getfixturevalue("redis_url"), request.getfixturevalue("redis_namespace"))
    yield s
    s.close()


def test_kept_owned_deleted_and_expired(store):
    rid = _rid()
    store.put(rid, _stored("hello"))
    got = store.get(rid, "a")
    assert got is not None and got.conversation == [{"role": "user", "content": "hello"}]
    assert store.get(rid, "b") is None and not store.delete(rid, "b")  # another owner's: as if absent
    assert store.get(rid, "a") is not None
    assert store.delete(rid, "a") and store.get(rid, "a") is None and not store.delete(rid, "a")
    assert store.get("nope", "a") is None and store.get("resp_" + "G" * 32, "a") is None
    store.ttl_s = 3.0  # (long enough to read it back at once, even on a loaded machine)
    late = _rid()
    store.put(late, _stored("soon gone"))
    assert store.get(late, "a") is not None
    wait_until(lambda: store.get(late, "a") is None, timeout=30, message="a kept response to expire")


def test_memory_keeps_the_most_recent_and_owners_are_key_digests():
    s = ResponseStore(60, max_local=3)
    ids = [_rid() for _ in range(4)]
    for rid in ids:
        s.put(rid, _stored(rid))
    assert s.get(ids[0], "a") is None and all(s.get(r, "a") is not None for r in ids[1:])
    assert owner_of(None) == "" and owner_of(b"k1") != owner_of(b"k2") and b"k1".hex() not in owner_of(b"k1")
    assert owner_of(b"k1") == owner_of(b"k1")


def test_an_unreadable_record_is_none_and_an_unreachable_redis_is_store_unavailable(redis_url, redis_namespace):
    s = ResponseStore(60, redis_url, redis_namespace)
    rid = _rid()
    r = redis.Redis.from_url(redis_url)
    try:
        r.set(f"{redis_namespace}:response:{rid}", b"{not json")
        assert s.get(rid, "a") is None
    finally:
        r.close()
        s.close()
    down = ResponseStore(60, "redis://127.0.0.1:1/0", "gone", timeout_s=0.5)
    for call in (lambda: down.put(_rid(), _stored("x")), lambda: down.get(_rid(), "a")):
        with pytest.raises(StoreUnavailable, match="unreachable"):
            call()
    with pytest.raises(ValueError, match="ttl_s"):
        ResponseStore(0)
