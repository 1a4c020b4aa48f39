"""Mutual TLS on the cluster plane (transport.cluster_tls): certificates made per run or read from files, and a
real router and colocated worker talking over it.

The worker must refuse a plaintext caller, a caller with no certificate and a caller whose certificate another CA
signed; the router with the cluster's TLS serves greedy output equal to the offline engine's.
"""
from __future__ import annotations

import argparse

import grpc
import pytest
import torch

from cluster.up_secrets import read_cluster_tls
from engine import LLM, SamplingParams
from proto import pdserve_pb2, pdserve_pb2_grpc, worker_pb2, worker_pb2_grpc
from router import RouterConfig, RouterServer, StaticWorkerSource
from transport import cluster_tls
from transport.cluster_tls import CHANNEL_OPTIONS, ClusterTls


def _write(tmp_path, tls: ClusterTls) -> tuple[str, str, str]:
    paths = []
    for name, data in (("ca.pem", tls.ca_pem), ("cert.pem", tls.cert_pem), ("key.pem", tls.key_pem)):
        p = tmp_path / name
        p.write_bytes(data)
        paths.append(str(p))
    return paths[0], paths[1], paths[2]


def test_generated_identity_checks_and_files_round_trip(tmp_path):
    tls = cluster_tls.generate()
    cluster_tls.check(tls)
    assert "key_pem" not in repr(tls) and b"PRIVATE KEY" in tls.key_pem
    assert cluster_tls.from_files(*_write(tmp_path, tls)) == tls


def test_bad_files_are_refused_naming_the_flag(tmp_path):
    a, b = cluster_tls.generate(), cluster_tls.generate()
    ca, cert, key = _write(tmp_path, a)
    with pytest.raises(ValueError, match="--cluster-key"):
        cluster_tls.from_files(ca, cert, None)
    (tmp_path / "other_key.pem").write_bytes(b.key_pem)
    with pytest.raises(ValueError, match="--cluster-key is not the key of --cluster-cert"):
        cluster_tls.from_files(ca, cert, str(tmp_path / "other_key.pem"))
    (tmp_path / "other_ca.pem").write_bytes(b.ca_pem)
    with pytest.raises(ValueError, match="not issued by any certificate in --cluster-ca"):
        cluster_tls.from_files(str(tmp_path / "other_ca.pem"), cert, key)
    with pytest.raises(ValueError, match="--cluster-cert: cannot read"):
        cluster_tls.from_files(ca, str(tmp_path / "missing.pem"), key)
    args = argparse.Namespace(cluster_tls=True, cluster_ca=ca, cluster_cert=cert, cluster_key=key)
    with pytest.raises(ValueError, match="not both"):
        read_cluster_tls(args)
    assert read_cluster_tls(argparse.Namespace(cluster_tls=False, cluster_ca=None, cluster_cert=None,
                                               cluster_key=None)) is None


@pytest.fixture(scope="module")
def tls_pair():
    from decode_worker import ColocatedWorker, ColocatedWorkerConfig
    from engine.config import EngineConfig

    torch.set_num_threads(1)
    tls = cluster_tls.generate()
    worker = ColocatedWorker(ColocatedWorkerConfig("tls-c0", engine=EngineConfig(model="tiny", num_kv_blocks=128,
                                                                                 num_threads=1),
                                                   cluster_tls=tls)).start()
    router = None
    try:
        router = RouterServer(RouterConfig(mode="colocated", cluster_tls=tls, serve_metrics=False),
                              StaticWorkerSource([worker.info])).start()
        yield tls, worker, router
    finally:
        if router is not None:
            router.stop()
        worker.stop()


def test_the_router_serves_over_mutual_tls(tls_pair):
    _, _, router = tls_pair
    prompt = "def main("
    ref = LLM(model="tiny", num_threads=1).generate([prompt], SamplingParams(max_tokens=8, temperature=0.0))[0]
    with grpc.insecure_channel(router.address) as ch:
        resps = list(pdserve_pb2_grpc.PDServeStub(ch).Generate(
            pdserve_pb2.GenerateRequest(prompt=prompt, max_tokens=8, temperature=0.0), timeout=120))
    assert [t for r in resps for t in r.token_ids] == list(ref.token_ids)


def _get_info(channel: grpc.Channel) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as e:
        worker_pb2_grpc.ColocatedWorkerStub(channel).GetInfo(worker_pb2.GetInfoRequest(), timeout=10)
    return e.value


def test_the_worker_refuses_callers_without_the_cluster_certificate(tls_pair):
    tls, worker, _ = tls_pair
    with grpc.insecure_channel(worker.address) as ch:  # plaintext
        assert _get_info(ch).code() == grpc.StatusCode.UNAVAILABLE
    no_cert = grpc.ssl_channel_credentials(root_certificates=tls.ca_pem)
    with grpc.secure_channel(worker.address, no_cert, options=CHANNEL_OPTIONS) as ch:  # trusts it, shows nothing
        assert _get_info(ch).code() == grpc.StatusCode.UNAVAILABLE
    stranger = cluster_tls.generate()  # a certificate of another CA
    creds = grpc.ssl_channel_credentials(root_certificates=tls.ca_pem, private_key=stranger.key_pem,
                                         certificate_chain=stranger.cert_pem)
    with grpc.secure_channel(worker.address, creds, options=CHANNEL_OPTIONS) as ch:
        assert _get_info(ch).code() == grpc.StatusCode.UNAVAILABLE
    with grpc.secure_channel(worker.address, tls.channel_credentials(), options=CHANNEL_OPTIONS) as ch:
        info = worker_pb2_grpc.ColocatedWorkerStub(ch).GetInfo(worker_pb2.GetInfoRequest(), timeout=30)
    assert info.worker_id == "tls-c0"
