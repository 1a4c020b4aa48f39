"""Authentication on the gRPC planes, with real servers on loopback:
- the public API over TLS with API keys: no key, a wrong key, the right key -> UNAUTHENTICATED, UNAUTHENTICATED,
  OK; a client trusting another CA and a plaintext client both fail; health stays open; mutual TLS refuses a
  client without a certificate;
- the cluster plane: a caller without the cluster secret (or with a wrong one) gets UNAUTHENTICATED from a
  worker's Reserve and nothing is reserved; the router, which presents it, serves requests equal to offline.
"""
from __future__ import annotations

import grpc
import pytest
import torch
import trustme
from grpc_health.v1 import health_pb2, health_pb2_grpc

from decode_worker import DecodeWorker, DecodeWorkerConfig
from engine import SamplingParams
from prefill_worker import PrefillWorker, PrefillWorkerConfig
from proto import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from router import RouterConfig, RouterServer, StaticWorkerSource
from router.wire import params_to_wire
from tests.roles.harness import engine_config, joined, make_store, offline

KEY = "test-api-key-0123456789"
SECRET = "cluster-secret-0123456789abcdef"
PROMPT = "def secure(channel):"


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    d = tmp_path_factory.mktemp("pki")
    ca, other_ca = trustme.CA(), trustme.CA()
    server = ca.issue_cert("127.0.0.1", "localhost")
    client = ca.issue_cert("client@pdserve.test")
    files = {"ca": d / "ca.pem", "other_ca": d / "other.pem", "cert": d / "cert.pem", "key": d / "key.pem",
             "client_cert": d / "client.pem", "client_key": d / "client.key"}
    ca.cert_pem.write_to_path(str(files["ca"]))
    other_ca.cert_pem.write_to_path(str(files["other_ca"]))
    server.private_key_pem.write_to_path(str(files["key"]))
    with open(files["cert"], "wb") as f:
        for blob in server.cert_chain_pems:
            f.write(blob.bytes())
    client.private_key_pem.write_to_path(str(files["client_key"]))
    with open(files["client_cert"], "wb") as f:
        for blob in client.cert_chain_pems:
            f.write(blob.bytes())
    return {k: str(v) for k, v in files.items()}


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _tls_channel(addr: str, ca: str, cert: str | None = None, key: str | None = None) -> grpc.Channel:
    creds = grpc.ssl_channel_credentials(root_certificates=_read(ca), private_key=_read(key) if key else None,
                                         certificate_chain=_read(cert) if cert else None)
    return grpc.secure_channel(addr, creds)


@pytest.fixture(scope="module")
def cluster(pki):
    """A prefill and a decode worker that require the cluster secret, and a TLS router with an API key."""
    torch.set_num_threads(1)
    store = make_store()
    common = dict(kv_store=store, kv_backend="gloo", serve_metrics=False, cluster_secret=SECRET)
    p = PrefillWorker(PrefillWorkerConfig("sec-p0", engine=engine_config(), **common)).start()
    d = DecodeWorker(DecodeWorkerConfig("sec-d0", engine=engine_config(), **common)).start()
    r = RouterServer(RouterConfig(serve_metrics=False, api_keys=(KEY, "second-key-abcdefgh"), cluster_secret=SECRET,
                                  ssl_certfile=pki["cert"], ssl_keyfile=pki["key"]),
                     StaticWorkerSource([p.info, d.info])).start()
    yield p, d, r
    r.stop()
    p.stop()
    d.stop()


def _generate(ch: grpc.Channel, metadata=None) -> tuple:
    stub = pdserve_pb2_grpc.PDServeStub(ch)
    return joined(list(stub.Generate(pdserve_pb2.GenerateRequest(prompt=PROMPT, max_tokens=8, temperature=0.0),
                                     timeout=60, metadata=metadata)))


def test_api_keys_over_tls(cluster, pki):
    _, _, r = cluster
    addr = r.address.replace("127.0.0.1", "localhost")  # the name the certificate was issued for
    want = offline([PROMPT], [SamplingParams(max_tokens=8, temperature=0.0)])[0][:3]
    with _tls_channel(addr, pki["ca"]) as ch:
        for md in (None, (("authorization", "Bearer wrong-key-0123456789"),), (("authorization", KEY),)):
            with pytest.raises(grpc.RpcError) as e:
                _generate(ch, md)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert KEY not in e.value.details()
        assert _generate(ch, (("authorization", f"Bearer {KEY}"),)) == want
        assert _generate(ch, (("authorization", "bearer second-key-abcdefgh"),)) == want  # either key
        # health stays open for probes
        health = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10)
        assert health.status == health_pb2.HealthCheckResponse.SERVING


def test_wrong_ca_and_plaintext_clients_fail(cluster, pki):
    _, _, r = cluster
    addr = r.address.replace("127.0.0.1", "localhost")
    md = (("authorization", f"Bearer {KEY}"),)
    with _tls_channel(addr, pki["other_ca"]) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pdserve_pb2_grpc.PDServeStub(ch).GetModelInfo(pdserve_pb2.GetModelInfoRequest(), timeout=10, metadata=md)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    with grpc.insecure_channel(r.address) as ch:
        with pytest.raises(grpc.RpcError) as e:
            pdserve_pb2_grpc.PDServeStub(ch).GetModelInfo(pdserve_pb2.GetModelInfoRequest(), timeout=10, metadata=md)
        assert e.value.code() == grpc.StatusCode.UNAVAILABLE


def test_mutual_tls_requires_a_client_certificate(pki):
    r = RouterServer(RouterConfig(serve_metrics=False, ssl_certfile=pki["cert"], ssl_keyfile=pki["key"],
                                  ssl_ca_certs=pki["ca"]), StaticWorkerSource()).start()
    try:
        addr = r.address.replace("127.0.0.1", "localhost")
        with _tls_channel(addr, pki["ca"]) as ch:
            with pytest.raises(grpc.RpcError) as e:
                pdserve_pb2_grpc.PDServeStub(ch).GetModelInfo(pdserve_pb2.GetModelInfoRequest(), timeout=10)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with _tls_channel(addr, pki["ca"], pki["client_cert"], pki["client_key"]) as ch:
            info = pdserve_pb2_grpc.PDServeStub(ch).GetModelInfo(pdserve_pb2.GetModelInfoRequest(), timeout=10)
            assert info.model_name == "tiny"
    finally:
        r.stop()


def test_plaintext_health_port_mirrors_a_tls_router_and_offers_nothing_else(pki):
    """The kubelet's gRPC probes speak no TLS: a TLS router offers plaintext health on --health-port only."""
    r = RouterServer(RouterConfig(serve_metrics=False, ssl_certfile=pki["cert"], ssl_keyfile=pki["key"],
                                  api_keys=(KEY,), health_port=0), StaticWorkerSource()).start()
    try:
        assert r.health_address and r.health_address != r.address
        with grpc.insecure_channel(r.health_address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as e:  # the API is not there, key or no key
                pdserve_pb2_grpc.PDServeStub(ch).GetModelInfo(pdserve_pb2.GetModelInfoRequest(), timeout=10,
                                                              metadata=(("authorization", f"Bearer {KEY}"),))
            assert e.value.code() == grpc.StatusCode.UNIMPLEMENTED
            r.drain(timeout_s=1)  # draining (then stopped): probes see NOT_SERVING, then nothing
            with pytest.raises(grpc.RpcError) as e:
                health.Check(health_pb2.HealthCheckRequest(), timeout=5)
            assert e.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        r.stop()


def test_health_port_follows_draining(pki):
    r = RouterServer(RouterConfig(serve_metrics=False, health_port=0), StaticWorkerSource()).start()
    try:
        with grpc.insecure_channel(r.health_address) as ch:
            health = health_pb2_grpc.HealthStub(ch)
            r._set_serving(False)  # what drain() does first
            assert health.Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
                health_pb2.HealthCheckResponse.NOT_SERVING
    finally:
        r.stop()


def test_worker_refuses_callers_without_the_cluster_secret(cluster):
    p, d, _ = cluster
    free = d.info().num_free_blocks
    req = worker_pb2.ReserveRequest(request_id="intruder", prompt_token_ids=list(range(10, 60)),
                                    params=params_to_wire(SamplingParams(max_tokens=4)), prefill_kv_name="sec-p0")
    with grpc.insecure_channel(d.address) as ch:
        stub = worker_pb2_grpc.DecodeWorkerStub(ch)
        for md in (None, (("authorization", "Bearer not-the-cluster-secret-000"),)):
            with pytest.raises(grpc.RpcError) as e:
                stub.Reserve(req, timeout=10, metadata=md)
            assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
            assert SECRET not in e.value.details()
        assert d.info().num_free_blocks == free and not d.requests  # nothing reserved
        with pytest.raises(grpc.RpcError) as e:
            worker_pb2_grpc.PrefillWorkerStub(grpc.insecure_channel(p.address)).Abort(
                worker_pb2.AbortRequest(request_id="x"), timeout=10)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED
        # health stays open on workers too
        assert health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status == \
            health_pb2.HealthCheckResponse.SERVING
        # with the secret the same call works (and is given back)
        ok = stub.Reserve(req, timeout=10, metadata=(("authorization", f"Bearer {SECRET}"),))
        assert len(ok.block_ids) >= 1
        stub.Abort(worker_pb2.AbortRequest(request_id="intruder"), timeout=10,
                   metadata=(("authorization", f"Bearer {SECRET}"),))


def test_secrets_are_not_in_reprs():
    assert SECRET not in repr(RouterConfig(cluster_secret=SECRET, api_keys=(KEY,)))
    assert KEY not in repr(RouterConfig(cluster_secret=SECRET, api_keys=(KEY,)))
    assert SECRET not in repr(DecodeWorkerConfig("d", kv_store="tcp://127.0.0.1:1", cluster_secret=SECRET))
    with pytest.raises(ValueError) as e:
        DecodeWorkerConfig("d", kv_store="tcp://127.0.0.1:1", cluster_secret="short")
    assert "short" not in str(e.value)
    with pytest.raises(ValueError, match="ssl_certfile and ssl_keyfile"):
        RouterConfig(ssl_certfile="x.pem")


def test_http_api_serves_https_with_the_same_certificate_and_keys(pki):
    import ssl

    import httpx

    r = RouterServer(RouterConfig(serve_metrics=False, http_port=0, api_keys=(KEY,), ssl_certfile=pki["cert"],
                                  ssl_keyfile=pki["key"]), StaticWorkerSource()).start()
    try:
        base = "https://" + r.http_address.replace("127.0.0.1", "localhost")
        ok = httpx.get(f"{base}/v1/models", headers={"authorization": f"Bearer {KEY}"}, verify=ssl.create_default_context(cafile=pki["ca"]),
                       timeout=10)
        assert ok.status_code == 200 and ok.json()["data"][0]["id"] == "tiny"
        assert httpx.get(f"{base}/v1/models", verify=ssl.create_default_context(cafile=pki["ca"]),
                         timeout=10).status_code == 401
        with pytest.raises(httpx.ConnectError):
            httpx.get(f"{base}/health", verify=ssl.create_default_context(cafile=pki["other_ca"]), timeout=10)
        with pytest.raises(httpx.HTTPError):  # plaintext HTTP on the TLS port
            httpx.get(base.replace("https://", "http://") + "/health", timeout=10)
    finally:
        r.stop()
