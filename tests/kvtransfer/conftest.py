"""Fixtures of the kvtransfer tests: ``pair``, two endpoints ("p0", "d0") over the in-process backend, each test's
own store (nothing shared between tests), shut down after the test."""
from __future__ import annotations

import pytest

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
