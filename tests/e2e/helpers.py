"""Helpers of the end-to-end tests: prompts, a streaming client, the offline reference, metric scraping.

The reference for every output comparison is ``engine.LLM("tiny")`` run in the
test process (one instance, built on first use), never a recorded value.
"""
from __future__ import annotations

import threading
import urllib.request
import uuid
from contextlib import contextmanager
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Iterator, Optional, Sequence

import grpc
from prometheus_client.parser import text_string_to_metric_families

from proto import pdserve_pb2, pdserve_pb2_grpc

# Source text to cut prompts of many lengths from (code, like the tiny tokenizer's training data).
_SOURCE = '''import os
import sys
from dataclasses import dataclass


@dataclass
class Config:
    """Settings of one run."""

    path: str = "."
    retries: int = 3

    def validate(self) -> None:
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")


def walk(root: str):
    for dirpath, dirnames, filenames in os.walk(root):
        for name in sorted(filenames):
            if name.endswith(".py"):
                yield os.path.join(dirpath, name)


def main(argv=None) -> int:
    cfg = Config(*(argv or sys.argv[1:2]))
    cfg.validate()
    total = 0
    for path in walk(cfg.path):
        with open(path, "rb") as f:
            total += len(f.read())
    print(total)
    return 0
'''


def mixed_prompts(n: int) -> list[str]:
    """n prompts from 1 character to the whole source (~1 to ~250 tokens), in a shuffled length order."""
    lengths = [1 + (i * 997) % len(_SOURCE) for i in range(n)]
    return [_SOURCE[:k] for k in lengths]


_REF: dict = {}
_REF_LOCK = threading.Lock()


def offline(prompts: Sequence[str], params: Sequence[Any]) -> list[tuple[list[int], str, str]]:
    """engine.LLM("tiny").generate: (token_ids, text, finish_reason) per prompt."""
    from engine import LLM

    with _REF_LOCK:
        llm = _REF.get("tiny")
        if llm is None:
            llm = _REF["tiny"] = LLM(model="tiny", num_kv_blocks=512, num_threads=1)
        outs = llm.generate(list(prompts), list(params))
    return [(list(o.token_ids), o.text, o.finish_reason) for o in outs]


def generate(address: str, timeout: float = 120.0, **fields: Any) -> tuple[list[int], str, str, Any]:
    """One streamed Generate: (token_ids, text, finish_reason, last response)."""
    with grpc.insecure_channel(address) as ch:
        resps = list(pdserve_pb2_grpc.PDServeStub(ch).Generate(pdserve_pb2.GenerateRequest(**fields),
                                                                timeout=timeout))
    return ([t for r in resps for t in r.token_ids], "".join(r.text for r in resps), resps[-1].finish_reason,
            resps[-1])


def run_concurrently(fn: Callable[..., Any], calls: Sequence[tuple]) -> list[Any]:
    """Run fn(*args) for every args at once (one thread each); re-raise the first error."""
    with ThreadPoolExecutor(max_workers=len(calls)) as pool:
        futures = [pool.submit(fn, *args) for args in calls]
        return [f.result(timeout=300) for f in futures]


def metric_value(metrics_address: str, sample_name: str, **labels: str) -> float:
    """Sum of one sample over all label sets (those with ``labels``), scraped from http://{address}/metrics."""
    with urllib.request.urlopen(f"http://{metrics_address}/metrics", timeout=5) as r:
        text = r.read().decode()
    total = 0.0
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


@contextmanager
def registry_deployment(redis_url: str, prefix: str, start_workers: Callable[[dict], list],
                        router_kw: Optional[dict] = None, sync_timeout_s: float = 30.0) -> Iterator[tuple[Any, list]]:
    """A deployment as `pdserve up` wires it, in this process: ``start_workers(common)`` starts real workers with
    ``common`` (KV events to ``redis_url`` under a fresh namespace, a gloo KV store) and returns them; they register
    and heartbeat into the real registry; a ``RouterServer`` reads it and follows every worker's KV events before
    this yields (router, workers). Everything is stopped and the namespace's keys removed afterwards."""
    from cluster.registry import Registry
    from router import RouterConfig, RouterServer
    from tests.roles.harness import make_store
    from tests.waiting import wait_until

    ns = f"{prefix}-{uuid.uuid4().hex[:8]}"
    common = dict(kv_events_url=redis_url, kv_events_namespace=ns, kv_store=make_store("gloo"), kv_backend="gloo",
                  transfer_timeout_s=10.0)
    workers: list = []
    registry = Registry(redis_url, ns, ttl_s=2.0)
    stop = threading.Event()
    router = None
    try:
        workers += start_workers(common)
        for w in workers:
            registry.register(w.info())

        def beats() -> None:
            while not stop.wait(0.25):
                for w in workers:
                    registry.heartbeat(w.info())

        threading.Thread(target=beats, daemon=True).start()
        router = RouterServer(RouterConfig(worker_view_refresh_s=0.1, **(router_kw or {})), registry).start()
        wait_until(lambda: router.core.kv_events.num_synced() == len(workers), timeout=sync_timeout_s,
                   message=f"the router follows {len(workers)} workers' KV events")
        yield router, workers
    finally:
        stop.set()
        if router is not None:
            router.stop()
        for w in workers:
            w.stop()
        registry.clear()
        registry.close()
