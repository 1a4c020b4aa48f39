"""``--device``: how the pools' device is chosen and what a CUDA deployment asks of Ray and the roles.

No GPU runs here (CI has none): these check the decisions (auto resolution,
the actors' ``num_gpus``, the engine device and the NCCL backend handed to the
roles, a clear error for cuda without GPUs, nothing left behind). The CUDA path
itself runs only where a GPU is lent (docs/deploy.md says what was checked).
"""
from __future__ import annotations

import pytest

from cluster.config import ClusterConfig, build_role_worker, resolve_device
from cluster.launcher import Cluster
from cluster.registry import Registry
from cluster.worker_actor import actor_options
from kvtransfer import StoreConfig
from tests.cluster.stand_in_worker import StandInWorker


@pytest.mark.parametrize("device, gpus, want", [("auto", 0, "cpu"), ("auto", 2, "cuda"), ("cpu", 4, "cpu"),
                                                ("cuda", 1, "cuda")])
def test_resolve_device(device, gpus, want):
    assert resolve_device(device, gpus) == want


def test_cuda_without_gpus_and_unknown_devices_are_refused():
    with pytest.raises(ValueError, match="no GPU"):
        resolve_device("cuda", 0)
    with pytest.raises(ValueError, match="device must be one of"):
        ClusterConfig(device="gpu")


def test_actor_options_ask_ray_for_the_gpu():
    assert actor_options("decode", 1.0, cluster_resources={}, num_gpus=1)["num_gpus"] == 1
    assert actor_options("decode", 1.0, cluster_resources={})["num_gpus"] == 0
    with pytest.raises(ValueError, match="num_gpus"):
        actor_options("decode", 1.0, cluster_resources={}, num_gpus=-1)


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_cuda_roles_run_the_engine_on_cuda_and_move_kv_over_nccl(role):
    # Built, not started: nothing touches CUDA until start() loads the model.
    cfg = ClusterConfig(device="cuda", engine_overrides={"num_kv_blocks": 8, "cuda_graph_sizes": [1, 64],
                                                         "cuda_graph_token_sizes": [16, 64],
                                                         "async_scheduling": True})
    store = StoreConfig("redis://127.0.0.1:1/0", namespace="unused")  # never dialled: nothing starts
    worker = build_role_worker(role, f"{role}-0", cfg, store, "127.0.0.1", "node")
    assert worker.cfg.engine.device == "cuda"
    # decode graphs where steps decode; a prefill worker never decodes, so it captures none
    assert worker.cfg.engine.enforce_eager == (role == "prefill")
    assert worker.cfg.engine.cuda_graph_sizes == (None if role == "prefill" else [1, 64])
    assert worker.cfg.engine.cuda_graph_token_sizes == (None if role == "prefill" else [16, 64])
    assert worker.cfg.engine.async_scheduling == (role != "prefill")
    # a prefill worker's cache is one device allocation a same-node decode worker maps (CUDA IPC)
    assert worker.cfg.engine.kv_cache_shared == (role == "prefill")
    if role != "colocated":  # a colocated worker moves no KV
        assert worker.cfg.kv_backend == "nccl"
    cpu = build_role_worker(role, f"{role}-0", ClusterConfig(device="cpu"), store, "127.0.0.1", "node")
    assert cpu.cfg.engine.device == "cpu"
    if role != "colocated":
        assert cpu.cfg.kv_backend == "gloo"


def test_cluster_on_cuda_without_gpus_fails_before_any_worker_and_leaves_nothing(ray_local, redis_url,
                                                                                  redis_namespace):
    cfg = ClusterConfig(redis_url=redis_url, namespace=redis_namespace, device="cuda", worker_factory=StandInWorker,
                        router_factory=False)
    with pytest.raises(ValueError, match="offers no GPU"):
        Cluster(cfg).start()
    with Registry(redis_url, redis_namespace) as reg:
        assert reg.keys() == []


def test_auto_resolves_to_cpu_on_a_cpu_ray(ray_local, redis_url, redis_namespace):
    cfg = ClusterConfig(redis_url=redis_url, namespace=redis_namespace, num_prefill=1, num_decode=0,
                        worker_factory=StandInWorker, router_factory=False, ttl_s=2.0, heartbeat_interval_s=0.5)
    with Cluster(cfg) as cluster:
        assert cluster.config.device == "cpu"
        assert len(cluster.worker_ids("prefill")) == 1


def test_workers_may_share_a_gpu():
    """--gpus-per-worker 0.5: one prefill and one decode worker on one GPU (their KV over CUDA IPC)."""
    from cluster.cli import build_parser
    from cluster.up_checks import check_up_args
    from cluster.up_flags import pool_config_kwargs

    assert ClusterConfig(device="cuda", gpus_per_worker=0.5).gpus_per_worker == 0.5
    for bad in (0, 1.5, -1, True, "half"):
        with pytest.raises(ValueError, match="gpus_per_worker must be in"):
            ClusterConfig(gpus_per_worker=bad)
    args = build_parser().parse_args(["up", "--gpus-per-worker", "0.5", "--prefill", "1", "--decode", "1"])
    check_up_args(args)
    assert pool_config_kwargs(args)["gpus_per_worker"] == 0.5
    for bad in ("0", "1.5"):  # refused with the flags, before Redis or Ray starts
        with pytest.raises(ValueError, match="--gpus-per-worker must be in"):
            check_up_args(build_parser().parse_args(["up", "--gpus-per-worker", bad]))
