"""Per-key quotas on a real router (gRPC and HTTP) in front of a real colocated worker, keys from a TOML file.

A flooding key is held to its limits (gRPC RESOURCE_EXHAUSTED with ``retry-after`` trailing metadata, HTTP 429
with ``Retry-After``, both naming the key and the limit) while another key's requests are all served; the worker
never holds more of the flooder's requests than its ``max_concurrent``. Editing the file adds, rotates and revokes
keys without a restart. Timing (the other key's TTFT under the flood) is a benchmark's business, not a test's:
here the checks are counts.
"""
from __future__ import annotations

import json
import os
import threading
import urllib.error
import urllib.request

import grpc
import pytest
import torch

from proto import pdserve_pb2, pdserve_pb2_grpc
from router import RouterConfig, RouterServer, StaticWorkerSource
from tests.waiting import wait_until

FLOOD, CALM = "pdk-flood-0001", "pdk-calm-00001"
KEYS = f'''
[[key]]
name = "flooder"
key = "{FLOOD}"
max_concurrent = 2
requests_per_s = 1000

[[key]]
name = "calm"
key = "{CALM}"
'''


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    from decode_worker import ColocatedWorker, ColocatedWorkerConfig
    from engine.config import EngineConfig

    torch.set_num_threads(1)
    path = tmp_path_factory.mktemp("keys") / "keys.toml"
    path.write_text(KEYS)
    worker = ColocatedWorker(ColocatedWorkerConfig("quota-c0", engine=EngineConfig(
        model="tiny", num_kv_blocks=256, num_threads=1))).start()
    router = None
    try:
        router = RouterServer(RouterConfig(mode="colocated", http_port=0, api_keys_file=str(path),
                                           serve_metrics=False), StaticWorkerSource([worker.info])).start()
        yield router, worker, path
    finally:
        if router is not None:
            router.stop()
        worker.stop()


def _grpc(router, key: str, max_tokens: int = 24):
    with grpc.insecure_channel(router.address) as ch:
        call = pdserve_pb2_grpc.PDServeStub(ch).Generate(
            pdserve_pb2.GenerateRequest(prompt="def main(", max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
            metadata=(("authorization", f"Bearer {key}"),), timeout=120)
        try:
            return list(call), None
        except grpc.RpcError as e:
            return None, e


def _http(router, key: str, max_tokens: int = 2):
    req = urllib.request.Request(f"http://{router.http_address}/v1/completions", method="POST",
                                 data=json.dumps({"prompt": "import os", "max_tokens": max_tokens}).encode(),
                                 headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.load(r), r.headers
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read()), e.headers


def test_a_flooding_key_is_held_to_its_limit_and_the_other_key_is_served(deployment):
    router, worker, _ = deployment
    results: list = []
    peak = [0]
    stop = threading.Event()

    def watch() -> None:  # the worker's running + waiting while the flood lasts
        while not stop.is_set():
            info = worker.info()
            peak[0] = max(peak[0], info.num_running + info.num_waiting)
            stop.wait(0.005)

    def flood() -> None:
        for _ in range(4):
            results.append(_grpc(router, FLOOD))

    watcher = threading.Thread(target=watch)
    watcher.start()
    threads = [threading.Thread(target=flood) for _ in range(6)]
    for t in threads:
        t.start()
    calm = [_grpc(router, CALM, 4) for _ in range(4)]
    for t in threads:
        t.join(300)
    stop.set()
    watcher.join()
    refused = [e for ok, e in results if e is not None]
    served = [ok for ok, e in results if e is None]
    assert served and refused, (len(served), len(refused))
    for e in refused:
        assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "'flooder'" in e.details() and "max_concurrent" in e.details()
        assert dict(e.trailing_metadata()).get("retry-after") == "1"
    assert all(e is None for _, e in calm), [e.details() for _, e in calm if e is not None]
    rendered = router.core.metrics.render().decode()
    line = next(ln for ln in rendered.splitlines() if ln.startswith("pdserve:quota_rejections_total{")
                and 'key_name="flooder"' in ln and 'limit="max_concurrent"' in ln)
    assert float(line.rsplit(" ", 1)[1]) == len(refused)  # one count per refused request
    # the flooder's 2 plus at most the calm key's one request at a time
    assert peak[0] <= 3, peak[0]
    wait_until(lambda: router.quotas.in_flight("flooder") == 0, timeout=30, message="every lease released")


def test_http_answers_429_with_retry_after(deployment, tmp_path):
    router, _, _ = deployment
    leases = [router.quotas.admit(router.keys.identify(FLOOD.encode()), 1, 1) for _ in range(2)]
    try:
        status, body, headers = _http(router, FLOOD)
        assert status == 429 and headers["Retry-After"] == "1", body
        assert "flooder" in body["error"]["message"] and body["error"]["type"] == "rate_limit_error"
        status, body, _ = _http(router, CALM)
        assert status == 200 and body["usage"]["completion_tokens"] == 2
    finally:
        for lease in leases:
            lease.release(1)
    for _ in range(3):  # more than max_concurrent in a row: each answered request gave its lease back
        status, _, _ = _http(router, FLOOD)
        assert status == 200
    wait_until(lambda: router.quotas.in_flight("flooder") == 0, timeout=30, message="HTTP leases released")


def test_embeddings_are_held_to_the_keys_quota_too(deployment):
    """Embedding requests (HTTP and gRPC) take their key's quota like completions: refused at the limit, served
    under it, their leases given back."""
    router, _, _ = deployment
    leases = [router.quotas.admit(router.keys.identify(FLOOD.encode()), 1, 1) for _ in range(2)]

    def http(key: str) -> tuple[int, dict]:
        req = urllib.request.Request(f"http://{router.http_address}/v1/embeddings", method="POST",
                                     data=json.dumps({"input": ["import os", "def main("]}).encode(),
                                     headers={"Content-Type": "application/json", "Authorization": f"Bearer {key}"})
        try:
            with urllib.request.urlopen(req, timeout=120) as r:
                return r.status, json.load(r)
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def grpc_embed(key: str):
        with grpc.insecure_channel(router.address) as ch:
            return pdserve_pb2_grpc.PDServeStub(ch).Embed(pdserve_pb2.EmbedRequest(texts=["import os"]),
                                                          metadata=(("authorization", f"Bearer {key}"),), timeout=120)

    try:
        status, body = http(FLOOD)
        assert status == 429 and "max_concurrent" in body["error"]["message"], body
        with pytest.raises(grpc.RpcError) as e:
            grpc_embed(FLOOD)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "flooder" in e.value.details()
        status, body = http(CALM)
        assert status == 200 and len(body["data"]) == 2
    finally:
        for lease in leases:
            lease.release(1)
    assert http(FLOOD)[0] == 200 and len(grpc_embed(FLOOD).data) == 1
    wait_until(lambda: router.quotas.in_flight("flooder") == 0, timeout=30, message="embedding leases released")


def test_editing_the_keys_file_adds_rotates_and_revokes_without_a_restart(deployment):
    router, _, path = deployment
    new = "pdk-newkey-001"
    text = KEYS.replace(f'key = "{CALM}"', f'key = "{new}"')  # calm's key rotated, old one removed
    path.write_text(text)
    st = os.stat(path)
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns + 1_000_000_000))

    def rotated() -> bool:
        return _grpc(router, new, 2)[1] is None

    wait_until(rotated, timeout=30, message="the new key accepted after the file changed")
    ok, err = _grpc(router, CALM, 2)
    assert err is not None and err.code() == grpc.StatusCode.UNAUTHENTICATED
    status, _, _ = _http(router, CALM)
    assert status == 401
    assert _http(router, new)[0] == 200
