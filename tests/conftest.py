"""Shared test fixtures: a real redis-server and a real local Ray instance.

Lifecycle: both are session-scoped and started lazily, only when a test asks
for them, and always torn down at the end of the session (the redis-server
process is killed, Ray is shut down and its temp dir removed). Each test gets
its own Redis namespace (``redis_namespace``) so tests never see each other's
keys, and nothing binds a fixed port.

Fixtures:
- ``redis_server``: a running ``cluster.redis_server.EmbeddedRedis`` (``.url``, ``.port``, ``.pid``);
- ``redis_url``: its URL;
- ``redis_namespace``: a fresh namespace per test; its keys are deleted after the test;
- ``ray_local``: a local Ray instance (6 logical CPUs, custom resources
  ``prefill``/``decode``, no dashboard) in this
  process; yields the Ray address. Code under test sees ``ray.is_initialized()``
  and reuses it instead of starting its own.
"""
from __future__ import annotations

import shutil
import tempfile
import uuid

import pytest


@pytest.fixture(scope="session")
def redis_server():
    from cluster.redis_server import EmbeddedRedis

    server = EmbeddedRedis().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_url(redis_server) -> str:
    return redis_server.url


@pytest.fixture
def redis_namespace(redis_url):
    import redis

    ns = f"test-{uuid.uuid4().hex[:12]}"
    yield ns
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{ns}:*"))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture(scope="session")
def ray_local():
    import ray

    if ray.is_initialized():  # someone (a test module) already owns one: share it
        yield ray.get_runtime_context().gcs_address
        return
    # A short private temp dir: Ray puts unix sockets under it (path length limits)
    # and a private one keeps side-by-side sessions apart.
    temp_dir = tempfile.mkdtemp(prefix="pdr", dir="/tmp")
    # 6 logical CPUs: a 2+2 cluster plus room to scale (actors are mostly idle; 2 real cores suffice).
    # The node offers the pool labels, so worker actors really request {"prefill"|"decode": 0.01}.
    from cluster.ray_lifecycle import NO_PRESTART

    ctx = ray.init(num_cpus=6, resources={"prefill": 1, "decode": 1}, include_dashboard=False,
                   _system_config=NO_PRESTART,
                   _temp_dir=temp_dir,
                   namespace=f"pdserve-test-{uuid.uuid4().hex[:8]}", logging_level="ERROR",
                   log_to_driver=False,
                   runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        yield ctx.address_info["gcs_address"]
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
