"""Each role serves Prometheus /metrics on its own free port and records its part of a request."""
from __future__ import annotations

import threading
import time
import urllib.request

import torch

from tests.roles.harness import KV, collect, joined, start_roles


def _scrape(address: str) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://{address}/metrics", timeout=5).read().decode()
    out: dict[str, float] = {}
    for line in text.splitlines():
        if line and not line.startswith("#"):
            name, _, value = line.rpartition(" ")
            out[name.split("{")[0] + ("{" + name.split("{", 1)[1] if "{" in name else "")] = float(value)
    return out


def _total(m: dict[str, float], metric: str) -> float:
    return sum(v for k, v in m.items() if k.split("{")[0] == metric)


def test_router_and_workers_export_their_series():
    torch.set_num_threads(1)
    roles = start_roles(kv=KV, tag="met-", metrics=True)
    try:
        addrs = [roles.router.metrics_address, roles.prefills[0].metrics_address, roles.decodes[0].metrics_address]
        assert all(addrs) and len(set(addrs)) == 3
        assert roles.prefills[0].info().metrics_address == addrs[1]
        for _ in range(2):
            assert joined(collect(roles.stub, prompt="def f(x):", max_tokens=5, temperature=0.0))[2] == "length"
        assert roles.wait_idle(1.0)
        r, p, d = (_scrape(a) for a in addrs)
        assert _total(r, "pdserve:time_to_first_token_seconds_count") == 2
        assert _total(r, "pdserve:generation_tokens_total") == 10
        assert r['pdserve:request_success_total{finished_reason="length",model_name="tiny",role="router",worker="router"}'] == 2
        assert _total(p, "pdserve:kv_transfer_time_seconds_count") == 2
        assert _total(p, "pdserve:kv_transfer_bytes_total") > 0
        assert _total(p, "pdserve:request_prefill_time_seconds_count") == 2
        assert _total(d, "pdserve:request_decode_time_seconds_count") == 2
        assert _total(d, "pdserve:inter_token_latency_seconds_count") == 2 * 4  # tokens 2..5 of each request
    finally:
        roles.close()
    # nothing of these workers keeps running: engine loops, gRPC and KV channel threads are gone
    time.sleep(0.2)
    assert [t.name for t in threading.enumerate() if "met-" in t.name and t.is_alive()] == []
