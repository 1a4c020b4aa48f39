"""router.worker_view against a real Redis registry: routing reads memory, survives a Redis outage on the
last view, picks up a restarted Redis, and drops a worker whose call failed until it heartbeats again."""
from __future__ import annotations

import time
import uuid

import pytest

from cluster.redis_server import EmbeddedRedis, RedisServerConfig
from cluster.registry import Registry
from proto.worker_pb2 import WorkerInfo
from router.worker_source import StaticWorkerSource
from router.worker_view import WorkerView


def _info(wid: str, role: str) -> WorkerInfo:
    return WorkerInfo(worker_id=wid, role=role, grpc_address=f"{wid}.invalid:1", ready=True)


def _wait(cond, timeout_s: float = 20.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(0.02)
    return cond()


def _ids(view: WorkerView, role: str) -> list[str]:
    return [w.worker_id for w in view.list(role)]


def test_view_serves_through_a_redis_restart():
    password = "view-test-password-0123"
    redis = EmbeddedRedis(RedisServerConfig(password=password)).start()
    port = redis.port
    ns = "view-" + uuid.uuid4().hex[:8]
    reg = Registry(redis.url, ns, ttl_s=30.0, socket_timeout_s=0.5, retries=0)
    view = WorkerView(reg, refresh_s=0.05, rejoin_grace_s=3.0)
    try:
        reg.register(_info("d0", "decode"))
        reg.register(_info("p0", "prefill"))
        view.start()
        assert view.background and _ids(view, "decode") == ["d0"]
        redis.stop()  # every refresh now fails: routing keeps the last view
        assert _wait(lambda: view.last_error is not None)
        assert _ids(view, "decode") == ["d0"] and _ids(view, "prefill") == ["p0"]
        # back on the same port, empty: the view follows what the workers write again
        redis = EmbeddedRedis(RedisServerConfig(port=port, password=password, spawn=True)).start()  # no fork of a threaded process
        reg.register(_info("d1", "decode"))
        # right after the restart the empty registry lists only d1; d0 and p0 stay routable for the grace
        assert _wait(lambda: view.last_error is None and "d1" in _ids(view, "decode"))
        assert sorted(_ids(view, "decode")) == ["d0", "d1"] and _ids(view, "prefill") == ["p0"]
        # past the grace, only what the registry lists (d0 and p0 never re-registered: they are gone)
        assert _wait(lambda: _ids(view, "decode") == ["d1"]), _ids(view, "decode")
        assert _ids(view, "prefill") == []
    finally:
        view.stop()
        reg.close()
        redis.stop()


def test_suspect_hides_a_worker_until_a_newer_heartbeat():
    redis = EmbeddedRedis().start()
    reg = Registry(redis.url, "view-" + uuid.uuid4().hex[:8], ttl_s=30.0)
    view = WorkerView(reg, refresh_s=0.05)
    try:
        reg.register(_info("d0", "decode"))
        reg.register(_info("d1", "decode"))
        view.start()
        assert _ids(view, "decode") == ["d0", "d1"]
        view.suspect("d0")
        assert _ids(view, "decode") == ["d1"]  # at once, long before d0's 30 s TTL
        time.sleep(0.01)  # the next heartbeat's wall-clock stamp must be later than the failure's
        reg.heartbeat(_info("d0", "decode"))  # d0 was alive after all
        assert _wait(lambda: _ids(view, "decode") == ["d0", "d1"])
    finally:
        view.stop()
        reg.close()
        redis.stop()


def test_in_process_source_is_read_directly():
    live = {"ready": True}

    def d0() -> WorkerInfo:
        info = _info("d0", "decode")
        info.ready = live["ready"]
        info.updated_at = time.time()
        return info

    view = WorkerView(StaticWorkerSource([d0]), refresh_s=10.0).start()
    assert not view.background
    assert [w.ready for w in view.list("decode")] == [True]
    live["ready"] = False
    assert [w.ready for w in view.list("decode")] == [False]  # no refresh period in between
    with pytest.raises(ValueError, match="role"):
        view.list("router")
    with pytest.raises(ValueError, match="refresh_s"):
        WorkerView(StaticWorkerSource(), refresh_s=0)


def test_an_adapter_is_served_where_every_worker_holds_the_same_weights():
    """``lora_roots``: an adapter counts once every listed worker publishes it with one root (``LoRAStatus.key_root``,
    its files' digest); a worker without it, or with other weights under the name (a reload half done), or whose
    load failed, keeps it out; with no workers nothing is served."""
    from proto.worker_pb2 import LoRAStatus

    def worker(wid: str, role: str, **adapters) -> WorkerInfo:
        info = _info(wid, role)
        for name, root in adapters.items():
            if isinstance(root, str):  # a refused load: published as an error, not served
                info.lora_status.append(LoRAStatus(name=name, load_id="l1", error=root))
                continue
            info.lora_adapters.append(name)
            info.lora_status.append(LoRAStatus(name=name, key_root=root))
        return info

    assert WorkerView(StaticWorkerSource([])).lora_roots() == {}
    view = WorkerView(StaticWorkerSource([worker("p0", "prefill", sql=7, chat=9, old=3, bad=5),
                                          worker("d0", "decode", sql=7, chat=9, old=4, bad="no adapter_config.json"),
                                          worker("d1", "decode", sql=7, chat=9, old=3)]))
    assert view.lora_roots() == {"sql": 7, "chat": 9} and view.lora_adapters() == ("chat", "sql")
    view = WorkerView(StaticWorkerSource([worker("p0", "prefill", sql=7), worker("d0", "decode")]))
    assert view.lora_roots() == {}
