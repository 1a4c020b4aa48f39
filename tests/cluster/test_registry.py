"""The Redis worker registry against a real redis-server."""
from __future__ import annotations

import threading
import time

import pytest
import redis

from cluster.redis_server import pick_free_port
from cluster.registry import Registry, WorkerInfo
from tests.waiting import wait_until


def _info(worker_id: str, role: str = "decode", **fields) -> WorkerInfo:
    defaults = dict(kv_name=f"kv-{worker_id}", num_total_blocks=100, num_free_blocks=100, ready=True)
    port = fields.pop("port", 1000)
    return WorkerInfo(worker_id=worker_id, role=role, grpc_address=f"127.0.0.1:{port}", **{**defaults, **fields})


def test_register_list_and_role_filter(redis_url, redis_namespace):
    reg = Registry(redis_url, redis_namespace)
    reg.register(_info("d0", "decode", num_free_blocks=7, model_name="tiny"))
    reg.register(_info("p0", "prefill", queued_prompt_tokens=42))
    reg.register(_info("p1", "prefill"))
    assert [w.worker_id for w in reg.list()] == ["d0", "p0", "p1"]
    assert [w.worker_id for w in reg.list("prefill")] == ["p0", "p1"]
    (d0,) = reg.list("decode")
    assert (d0.num_free_blocks, d0.model_name, d0.kv_name, d0.grpc_address) == (7, "tiny", "kv-d0", "127.0.0.1:1000")
    assert abs(d0.updated_at - time.time()) < 5
    assert reg.list("colocated") == []
    assert reg.get("p0").queued_prompt_tokens == 42
    # The record is stored as the serialized proto under {namespace}:worker:{id}.
    raw = redis.Redis.from_url(redis_url).get(f"{redis_namespace}:worker:d0")
    assert WorkerInfo.FromString(raw).worker_id == "d0"
    reg.close()


def test_silent_worker_expires_within_ttl(redis_url, redis_namespace):
    reg = Registry(redis_url, redis_namespace, ttl_s=1.0)
    reg.register(_info("w0"))
    assert [w.worker_id for w in reg.list()] == ["w0"]
    start = time.monotonic()
    wait_until(lambda: reg.list() == [], timeout=5.0,
               message="a worker that stopped heartbeating is still listed after 5 s")
    gone_after = time.monotonic() - start
    assert 0.5 < gone_after < 2.0
    # The index set expires too: nothing of this cluster stays in Redis.
    assert reg.keys() == []


def test_default_ttl_removes_silent_worker_within_5s(redis_url, redis_namespace):
    reg = Registry(redis_url, redis_namespace)  # the default ttl_s the workers use
    reg.register(_info("w0"))
    start = time.monotonic()
    wait_until(lambda: reg.list() == [], timeout=6.0, interval=0.1, message="the silent worker is still listed")
    assert time.monotonic() - start < 5.0


def test_heartbeat_refreshes_ttl_and_load(redis_url, redis_namespace):
    reg = Registry(redis_url, redis_namespace, ttl_s=1.0)
    info = _info("w0")
    reg.register(info)
    stop = threading.Event()

    def beat() -> None:
        n = 0
        while not stop.wait(0.25):
            n += 1
            info.num_free_blocks = 100 - n
            reg.heartbeat(info)

    t = threading.Thread(target=beat)
    t.start()
    try:
        seen_free = set()
        end = time.monotonic() + 2.5  # 2.5 x the TTL: only heartbeats keep it listed
        while time.monotonic() < end:
            listed = reg.list()
            assert [w.worker_id for w in listed] == ["w0"]
            seen_free.add(listed[0].num_free_blocks)
            time.sleep(0.1)
        assert len(seen_free) >= 3, f"load fields were not refreshed: {seen_free}"
    finally:
        stop.set()
        t.join()
    # heartbeats stopped: the record expires within the TTL (1 s), with 0.5 s to spare
    wait_until(lambda: reg.list() == [], timeout=1.5, message="the record outlived its TTL")


def test_namespaces_isolate_two_clusters(redis_url, redis_namespace):
    a = Registry(redis_url, redis_namespace + "-a")
    b = Registry(redis_url, redis_namespace + "-b")
    try:
        a.register(_info("w0", "prefill", port=1))
        b.register(_info("w0", "prefill", port=2))
        b.register(_info("w1", "decode", port=3))
        assert [w.grpc_address for w in a.list()] == ["127.0.0.1:1"]
        assert [w.grpc_address for w in b.list("prefill")] == ["127.0.0.1:2"]
        a.deregister("w0")
        assert a.list() == []
        assert [w.worker_id for w in b.list()] == ["w0", "w1"]
    finally:
        a.clear()
        b.clear()


def test_deregister_removes_the_key(redis_url, redis_namespace):
    reg = Registry(redis_url, redis_namespace, ttl_s=30)
    reg.register(_info("w0"))
    reg.register(_info("w1"))
    client = redis.Redis.from_url(redis_url)
    assert client.exists(f"{redis_namespace}:worker:w0") == 1
    reg.deregister("w0")
    assert client.exists(f"{redis_namespace}:worker:w0") == 0
    assert [w.worker_id for w in reg.list()] == ["w1"]
    reg.deregister("w1")
    reg.deregister("never-registered")  # ignored
    assert reg.keys() == []  # the index set went with its last member
    client.close()


def test_garbled_entries_are_skipped(redis_url, redis_namespace):
    reg = Registry(redis_url, redis_namespace, ttl_s=30)
    reg.register(_info("good"))
    client = redis.Redis.from_url(redis_url)
    client.set(f"{redis_namespace}:worker:bad", b"\xff\xff\xff not a proto", px=30000)
    client.set(f"{redis_namespace}:worker:liar", _info("someone-else").SerializeToString(), px=30000)
    client.sadd(f"{redis_namespace}:workers", "bad", "liar", "ghost")  # ghost: no key at all
    assert [w.worker_id for w in reg.list()] == ["good"]
    assert reg.get("bad") is None
    # Ids whose key is gone are pruned from the index by list().
    assert b"ghost" not in client.smembers(f"{redis_namespace}:workers")
    client.close()


def test_bad_input_raises_value_error_naming_the_field(redis_url, redis_namespace):
    with pytest.raises(ValueError, match="redis_url"):
        Registry("http://localhost:1", redis_namespace)
    with pytest.raises(ValueError, match="namespace"):
        Registry(redis_url, "has space")
    with pytest.raises(ValueError, match="ttl_s"):
        Registry(redis_url, redis_namespace, ttl_s=0)
    reg = Registry(redis_url, redis_namespace)
    with pytest.raises(ValueError, match="role"):
        reg.register(_info("w0", role="router"))
    with pytest.raises(ValueError, match="worker_id"):
        reg.register(_info(""))
    with pytest.raises(ValueError, match="grpc_address"):
        reg.register(WorkerInfo(worker_id="w0", role="decode"))
    with pytest.raises(ValueError, match="role"):
        reg.list("router")
    with pytest.raises(ValueError, match="info"):
        reg.register({"worker_id": "w0"})
    assert reg.keys() == []


def test_unreachable_redis_fails_fast_instead_of_hanging():
    reg = Registry(f"redis://127.0.0.1:{pick_free_port()}/0", "ns", socket_timeout_s=0.5, retries=2)
    start = time.monotonic()
    with pytest.raises(redis.ConnectionError):
        reg.list()
    assert time.monotonic() - start < 5.0


def test_runtime_lora_set_adds_once_and_changes_only_the_same_load(redis_url, redis_namespace):
    """The cluster's runtime LoRA set (router/lora_admin.py writes it, workers follow it): a name is added once
    (a second add, from any router, is refused), changed or removed only by the load that added it (a later load of
    the name is not undone by an earlier one's cleanup), and ``clear`` removes it with the cluster's other keys."""
    from proto.worker_pb2 import LoRARuntimeEntry

    reg = Registry(redis_url, redis_namespace)
    first = LoRARuntimeEntry(path="/a", load_id="one", state="serving")
    assert reg.lora_add("sql", first) and not reg.lora_add("sql", LoRARuntimeEntry(path="/b", load_id="two"))
    assert reg.lora_entries() == {"sql": first}
    assert not reg.lora_update("sql", LoRARuntimeEntry(path="/a", load_id="two", state="unloading"))
    assert reg.lora_update("sql", LoRARuntimeEntry(path="/a", load_id="one", state="unloading"))
    assert reg.lora_entries()["sql"].state == "unloading"
    assert not reg.lora_remove("sql", "two") and reg.lora_remove("sql", "one") and reg.lora_entries() == {}
    assert not reg.lora_remove("sql", "one")
    reg.lora_add("chat", first)
    reg._redis.hset(reg.lora_key, "garbled", b"\xff\xfe not a message")
    assert list(reg.lora_entries()) == ["chat"]  # (the unreadable field skipped, with a warning)
    assert reg.lora_key in reg.keys()
    reg.clear()
    assert reg.lora_entries() == {} and reg.keys() == []
