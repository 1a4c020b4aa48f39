"""Fixtures of the kvtransfer tests: ``pair``, two endpoints ("p0", "d0") over the in-process backend, each test's
own store (nothing shared between tests), shut down after the test; ``store_url``, a TCPStore this test process
serves on a free port, for endpoints in other processes."""
from __future__ import annotations

import datetime

import pytest
import torch.distributed as dist

from kvtransfer import InprocStore, KVEndpoint


@pytest.fixture
def pair():
    st = InprocStore()
    p = KVEndpoint("p0", st, backend="inproc", timeout_s=3.0, chunk_bytes=4096)
    d = KVEndpoint("d0", st, backend="inproc", timeout_s=3.0, chunk_bytes=4096)
    try:
        yield p, d
    finally:
        p.shutdown()
        d.shutdown()


@pytest.fixture
def store_url():
    st = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                       timeout=datetime.timedelta(seconds=30))
    yield f"tcp://127.0.0.1:{st.port}"
    del st
