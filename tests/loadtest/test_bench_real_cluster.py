"""End to end: `pdserve bench` (loadtest.cli.main) against a real router + 1 prefill + 1 decode worker.

Real parts throughout: engines on the built-in ``tiny`` model, gRPC servers on free loopback ports, KV moved
by the real kvtransfer (gloo; rendezvous in a real Redis server on a free port, from tests/conftest.py).
A colocated router + worker run is here too, as the second serving mode the bench must drive. The router's own Prometheus counters are an
independent tally to check the client's counts against.
"""
from __future__ import annotations

import json
import urllib.request
import uuid
from pathlib import Path

import pytest
import torch
from prometheus_client.parser import text_string_to_metric_families

from loadtest.cli import main

TRACE = Path(__file__).resolve().parents[1] / "data/azure_llm_2023_conv_first400.csv"  # see tests/data/README.md

SUMMARY_KEYS = ["completed", "failed", "duration", "request_throughput", "output_throughput",
                "total_token_throughput", "total_input_tokens", "total_output_tokens", "input_lens", "output_lens",
                "ttfts", "itls", "errors"] + [f"{s}_{m}_ms" for m in ("ttft", "tpot", "itl", "e2el")
                                              for s in ("mean", "median", "std", "p99")]


def _engine(max_model_len: int | None = None):
    from engine.config import EngineConfig

    return EngineConfig(model="tiny", num_kv_blocks=256, num_threads=1, max_num_batched_tokens=512,
                        max_model_len=max_model_len)


class Cluster:
    """Router in front of real workers, started in this process; ``close()`` stops them all."""

    def __init__(self, mode: str, redis_url: str, http: bool = False, api_keys: tuple[str, ...] = (),
                 max_model_len: int | None = None) -> None:
        """``http``: the router serves the OpenAI-compatible HTTP API too, on a free port (``http_url``);
        ``max_model_len``: the workers' context length (the model's own by default)."""
        from router import RouterConfig, RouterServer, StaticWorkerSource

        self.workers: list = []
        self.router = None
        try:
            if mode == "disaggregated":
                from decode_worker import DecodeWorker, DecodeWorkerConfig
                from prefill_worker import PrefillWorker, PrefillWorkerConfig

                from kvtransfer import StoreConfig

                # The cluster's Redis is the rendezvous store, as in `pdserve up`; a fresh namespace per cluster.
                self.store = StoreConfig(redis_url, namespace=f"kvt-bench-{uuid.uuid4().hex[:8]}")
                self.workers.append(PrefillWorker(PrefillWorkerConfig(
                    "bench-p0", engine=_engine(max_model_len), kv_store=self.store, transfer_timeout_s=10.0)).start())
                self.workers.append(DecodeWorker(DecodeWorkerConfig(
                    "bench-d0", engine=_engine(max_model_len), kv_store=self.store, transfer_timeout_s=10.0)).start())
            else:
                from decode_worker import ColocatedWorker, ColocatedWorkerConfig

                self.workers.append(ColocatedWorker(ColocatedWorkerConfig(
                    "bench-c0", engine=_engine(max_model_len))).start())
            source = StaticWorkerSource([w.info for w in self.workers])
            # (the router learns a shorter ``max_model_len`` from the workers' records: RouterCore.limits)
            cfg = RouterConfig(mode=mode, http_port=0 if http else None, api_keys=api_keys)
            self.router = RouterServer(cfg, source).start()
        except BaseException:
            self.close()
            raise

    @property
    def target(self) -> str:
        return self.router.address

    @property
    def http_url(self) -> str:
        return f"http://{self.router.http_address}"

    def router_counters(self) -> dict[str, float]:
        """Sums of the router's request/token counters, scraped from its /metrics endpoint."""
        with urllib.request.urlopen(f"http://{self.router.metrics_address}/metrics", timeout=10) as resp:
            text = resp.read().decode()
        out: dict[str, float] = {}
        for fam in text_string_to_metric_families(text):
            for s in fam.samples:
                if s.name in ("pdserve:request_success_total", "pdserve:prompt_tokens_total",
                              "pdserve:generation_tokens_total"):
                    out[s.name] = out.get(s.name, 0.0) + s.value
        return out

    def close(self) -> None:
        if self.router is not None:
            self.router.stop()
        for w in self.workers:
            w.stop()


@pytest.fixture(scope="module", params=["disaggregated", "colocated"])
def cluster(request, redis_url):
    torch.set_num_threads(1)
    c = Cluster(request.param, redis_url)
    yield c
    c.close()


def _run(cluster: Cluster, tmp_path: Path, extra: list[str]) -> tuple[dict, dict]:
    """Run the bench; returns (result JSON, change in the router's counters over the run)."""
    before = cluster.router_counters()
    out = tmp_path / "result.json"
    rc = main(["--target", cluster.target, "--save-result", str(out), "--plot", str(tmp_path / "plots"),
               "--disable-tqdm", "--request-timeout", "60", *extra])
    after = cluster.router_counters()
    res = json.loads(out.read_text())
    assert rc == 0, res["errors"]
    delta = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}
    return res, delta


def test_bench_synthetic(cluster, tmp_path):
    res, delta = _run(cluster, tmp_path, ["--num-prompts", "8", "--input-len", "40", "--output-len", "6",
                                          "--request-rate", "20", "--max-concurrency", "4",
                                          "--goodput", "ttft:60000", "tpot:60000"])
    for key in SUMMARY_KEYS + ["request_goodput"]:
        assert key in res, key
    assert res["completed"] == 8 and res["failed"] == 0, res["errors"]
    # ignore_eos + max_tokens force the output length: 6 tokens each, prompts of exactly 40 ids
    assert res["output_lens"] == [6] * 8 and res["input_lens"] == [40] * 8
    assert res["total_output_tokens"] == 48 and res["total_input_tokens"] == 320
    assert res["mean_ttft_ms"] > 0 and res["mean_itl_ms"] > 0 and res["p99_e2el_ms"] >= res["median_e2el_ms"]
    assert res["max_concurrent_requests"] <= 4
    assert res["request_goodput"] == pytest.approx(res["request_throughput"])  # SLOs of a minute: all pass
    # the router counted the same requests and tokens on its side
    assert delta["pdserve:request_success_total"] == 8
    assert delta["pdserve:prompt_tokens_total"] == 320
    assert delta["pdserve:generation_tokens_total"] == 48
    assert (tmp_path / "plots" / "latency_cdf.png").stat().st_size > 5000
    # the server's breakdown of its TTFT (gRPC Timings): every phase, adding up to no more than the client's TTFT
    phases = res["ttft_phases_ms"]
    assert list(phases) == ["placement", "worker_queue", "prefill", "delivery"]
    assert phases["prefill"]["median"] > 0 and all(st["mean"] >= 0 for st in phases.values())
    assert sum(st["mean"] for st in phases.values()) <= res["mean_ttft_ms"]


def test_bench_trace_slice(cluster, tmp_path):
    # conversation trace rows 0..5, lengths x0.05 (374 -> 19 prompt tokens ...), arrival gaps x0.02
    res, delta = _run(cluster, tmp_path, ["--trace", str(TRACE), "--trace-start", "0", "--num-prompts", "6",
                                          "--length-scale", "0.05", "--time-scale", "0.02"])
    for key in SUMMARY_KEYS:
        assert key in res, key
    assert res["dataset"] == "trace" and res["length_scale"] == 0.05 and res["time_scale"] == 0.02
    assert res["completed"] > 0
    assert res["completed"] == 6 and res["failed"] == 0, res["errors"]
    # first rows' lengths x0.05, rounded: (374, 44) -> (19, 2), (396, 109) -> (20, 5), (879, 55) -> (44, 3)
    assert res["input_lens"][:3] == [19, 20, 44] and res["output_lens"][:3] == [2, 5, 3]
    assert delta["pdserve:request_success_total"] == 6
    assert delta["pdserve:generation_tokens_total"] == res["total_output_tokens"]
