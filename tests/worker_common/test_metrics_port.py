"""A worker's /metrics on a fixed port (Kubernetes: one worker per pod, scraped by a PodMonitor), set through
PDSERVE_WORKER_METRICS_PORT on the node, or a free port by default."""
from __future__ import annotations

import httpx
import pytest

from cluster.config import WORKER_METRICS_PORT_ENV, worker_metrics_port
from cluster.redis_server import pick_free_port
from decode_worker import ColocatedWorker, ColocatedWorkerConfig
from engine.config import EngineConfig


def test_env_gives_the_port_and_bad_values_name_the_variable():
    assert worker_metrics_port({}) == 0
    assert worker_metrics_port({WORKER_METRICS_PORT_ENV: "9100"}) == 9100
    for bad in ("0", "70000", "http", "-1"):
        with pytest.raises(ValueError, match=WORKER_METRICS_PORT_ENV):
            worker_metrics_port({WORKER_METRICS_PORT_ENV: bad})
    with pytest.raises(ValueError, match="metrics_port"):
        ColocatedWorkerConfig("w", metrics_port=70000)


def test_worker_serves_metrics_on_the_fixed_port():
    port = pick_free_port()
    w = ColocatedWorker(ColocatedWorkerConfig("fixed-metrics", engine=EngineConfig(model="tiny", num_kv_blocks=32,
                                                                                  num_threads=1),
                                              metrics_port=port)).start()
    try:
        assert w.metrics_address == f"127.0.0.1:{port}"
        body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
        assert 'pdserve:kv_cache_usage_perc{model_name="tiny",role="colocated",worker="fixed-metrics"}' in body
    finally:
        w.stop()
