"""Rendezvous stores: RedisStore on a real Redis server, InprocStore, and store URL parsing."""
import datetime

import pytest
import torch.distributed as dist

from kvtransfer.store import InprocStore, RedisStore, StoreConfig, open_store


def _exercise(store: dist.Store, prefix: str) -> None:
    k = lambda name: f"{prefix}/{name}"  # noqa: E731
    store.set(k("a"), b"1")
    assert store.get(k("a")) == b"1"
    assert store.add(k("n"), 3) == 3 and store.add(k("n"), 4) == 7
    # torch semantics: swap only when the current value matches; the value now stored comes back
    assert store.compare_set(k("a"), b"1", b"2") == b"2"
    assert store.compare_set(k("a"), b"1", b"3") == b"2"
    assert store.compare_set(k("new"), b"", b"x") == b"x"
    assert store.check([k("a"), k("n")]) and not store.check([k("missing")])
    assert store.delete_key(k("a")) and not store.check([k("a")])
    with pytest.raises(dist.DistStoreError):
        store.wait([k("never")], datetime.timedelta(milliseconds=50))
    # through a PrefixStore, as the endpoints and gloo use it
    ps = dist.PrefixStore(k("p"), store)
    ps.set("x", "y")
    assert ps.get("x") == b"y" and store.check([f"{k('p')}/x"])


def test_redis_store_semantics(redis_url, redis_namespace):
    st, ns = open_store(StoreConfig(redis_url, namespace=f"{redis_namespace}:kvt"))
    assert isinstance(st, RedisStore) and ns == f"{redis_namespace}:kvt"
    _exercise(st, f"{redis_namespace}:t")


def test_inproc_store_semantics():
    _exercise(InprocStore(timeout_s=1.0), "t")


@pytest.mark.parametrize("url,match", [
    ("http://x:1", "rediss:// or tcp://"),
    ("tcp://hostonly", "tcp://host:port"),
])
def test_bad_store_urls(url, match):
    with pytest.raises(ValueError, match=match):
        open_store(url)
    with pytest.raises(ValueError, match="namespace"):
        open_store(StoreConfig("tcp://127.0.0.1:1", namespace="a/b"))


def test_redis_store_keys_expire(redis_url, redis_namespace):
    """Every key the rendezvous writes carries a TTL, so a killed cluster leaves nothing that outlives it."""
    import redis

    st = RedisStore(redis_url, timeout_s=1.0, key_ttl_s=120.0)
    prefix = f"{redis_namespace}:ttl"
    _exercise(st, prefix)
    st.add(f"{prefix}/counter", 1)
    dist.PrefixStore(f"{prefix}/pg", st).set("rank0", "addr")
    r = redis.Redis.from_url(redis_url)
    keys = list(r.scan_iter(match=f"{prefix}/*"))
    assert len(keys) >= 4
    ttls = {k.decode(): r.pttl(k) for k in keys}
    assert all(0 < t <= 120_000 for t in ttls.values()), ttls
    with pytest.raises(ValueError, match="key_ttl_s"):
        RedisStore(redis_url, timeout_s=30.0, key_ttl_s=10.0)
