"""`pdserve up --address` joins an existing Ray cluster (as on KubeRay) and places pools by node resources.

A private Ray head (`ray start --head`, its own temp dir and a free GCS port) offers
the custom resources ``prefill`` and ``decode`` the way the KubeRay worker groups in
k8s/base/raycluster.yaml do. ``pdserve up --address`` must place one worker on each
(``ray status`` shows 0.01 of each in use), serve, and on SIGTERM remove its actors
while leaving the head it did not start running. The head is then stopped by the
ids of its own processes (found by its private temp dir), never by name.
"""
from __future__ import annotations

import os
import re
import signal
import subprocess
import tempfile

import pytest

from engine.sampling_params import SamplingParams
from tests.e2e.helpers import generate, offline
from tests.e2e.test_pdserve_up import UpProcess, _pdserve
from tests.multinode.ray_nodes import procs_of, start_head, stop_head
from tests.waiting import wait_until

# Token auth would need the head's token in the driver's environment; this private head is loopback-only.
ENV = dict(os.environ, RAY_AUTH_MODE="disabled", OMP_NUM_THREADS="1")


def _ray_cli() -> str:
    return os.path.join(os.path.dirname(_pdserve()[0]), "ray")


@pytest.fixture
def ray_head():
    """(GCS address, a function listing the head's processes)."""
    tmp = tempfile.mkdtemp(prefix="pdh", dir="/tmp")
    port = 0
    try:
        port = start_head(tmp, lambda _port: ["--num-cpus=4", "--resources", '{"prefill": 1, "decode": 1}',
                                              f"--temp-dir={tmp}", "--include-dashboard=false",
                                              "--disable-usage-stats"], env=ENV)
        yield f"127.0.0.1:{port}", lambda: procs_of(tmp, port)
    finally:
        stop_head(tmp, port)


def _ray_status(address: str) -> str:
    return subprocess.run([_ray_cli(), "status", f"--address={address}"], capture_output=True, text=True,
                          timeout=60, env=ENV).stdout


def _wait_status(address: str, patterns: tuple[str, ...], timeout: float) -> str:
    """`ray status` once every pattern matches it (polled); AssertionError with the status after `timeout`."""
    def matching() -> str | None:
        status = _ray_status(address)
        return status if all(re.search(p, status) for p in patterns) else None

    return wait_until(matching, timeout=timeout, interval=0.5,
                      message=lambda: f"`ray status` matching {patterns}:\n{_ray_status(address)}")


def test_pdserve_up_joins_ray_and_places_pools_by_resource(ray_head):
    address, head_procs = ray_head
    head_before = {p.pid for p in head_procs()}
    up = UpProcess("--address", address, "--num-kv-blocks", "64", env=ENV)
    try:
        up.wait_serving(240)
        # One prefill and one decode actor, each holding its sliver of the node label. `ray status`
        # reads the autoscaler's periodic snapshot, which can lag the placement by a few seconds.
        status = _wait_status(address, (r"0\.01\d*/1\.0 prefill", r"0\.01\d*/1\.0 decode"), 30)
        assert re.search(r"0\.01\d*/1\.0 prefill", status), status
        assert re.search(r"0\.01\d*/1\.0 decode", status), status
        ref = offline(["def f():"], [SamplingParams(max_tokens=8, temperature=0.0)])[0]
        assert generate(up.router, prompt="def f():", max_tokens=8, temperature=0.0)[:3] == ref
        up.proc.send_signal(signal.SIGTERM)
        assert up.proc.wait(timeout=15) == 0, up.tail()
    finally:
        up.close()
    # The head pdserve joined is still there, with its workers gone.
    assert head_before <= {p.pid for p in head_procs()}
    status = _wait_status(address, (r" 0\.0/1\.0 prefill", r" 0\.0/1\.0 decode"), 30)
    assert re.search(r" 0\.0/1\.0 prefill", status) and re.search(r" 0\.0/1\.0 decode", status), status
