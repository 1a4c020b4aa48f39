"""A multi-node Ray cluster on one machine: placement by node type, a lost node, the autoscaler.

Each test runs a private Ray head whose fake-multinode autoscaler starts worker
nodes as separate raylets (``tests/multinode/ray_nodes.py``): ``prefill`` nodes
offer only the ``prefill`` resource and ``decode`` nodes only ``decode``, the way
KubeRay's worker groups do (k8s/base/raycluster.yaml). ``pdserve up --address``
joins it from a subprocess, as on Kubernetes.

1. Pools land on their own node types; killing the raylet of the decode worker's
   node (the node is lost, with every process on it) makes the supervisor start a
   replacement on the surviving decode node, while a stream of greedy requests is
   served, every one equal to the offline engine.
2. The planner growing the decode pool past what the decode nodes hold leaves the
   new worker pending until the autoscaler adds a decode node, where it starts and
   serves; requests meanwhile are equal to offline.
"""
from __future__ import annotations

import signal
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

from cluster.registry import Registry
from engine.sampling_params import SamplingParams
from tests.e2e.helpers import generate, mixed_prompts, offline
from tests.e2e.test_pdserve_up import UpProcess
from tests.multinode.ray_nodes import ENV, autoscaling_head, raylet_of_port, wait_nodes
from tests.waiting import wait_until

GREEDY = dict(max_tokens=24, temperature=0.0, ignore_eos=True)


class Load:
    """Greedy requests sent one after another on ``n`` threads until stopped; every result is kept."""

    def __init__(self, router: str, n: int, prompts: list[str], **params) -> None:
        self.router, self.prompts, self.params = router, prompts, params
        self.results: list[tuple[str, list[int], str]] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(n)
        self._futures = [self._pool.submit(self._run, i) for i in range(n)]

    def _run(self, i: int) -> None:
        k = i
        while not self._stop.is_set():
            prompt = self.prompts[k % len(self.prompts)]
            k += 7
            try:
                tokens, _, finish, _ = generate(self.router, prompt=prompt, **self.params)
                self.results.append((prompt, tokens, finish))
            except Exception as e:  # grpc.RpcError: kept, the test fails on it
                self.errors.append(f"{type(e).__name__}: {e}")

    def stop(self) -> None:
        self._stop.set()
        for f in self._futures:
            f.result(timeout=300)
        self._pool.shutdown()

    def check_equal_offline(self) -> None:
        assert not self.errors, self.errors[:3]
        prompts = sorted({p for p, _, _ in self.results})
        want = dict(zip(prompts, offline(prompts, [SamplingParams(**self.params)] * len(prompts))))
        for prompt, tokens, finish in self.results:
            assert (tokens, finish) == (want[prompt][0], want[prompt][2]), prompt


def _node_of(registry: Registry, worker_id: str) -> str:
    info = registry.get(worker_id)
    assert info is not None, worker_id
    return info.node_id


def _serve_more_then_stop(load: Load, up: UpProcess, more: int) -> None:
    """``more`` requests served after the event, every result equal to offline, then a clean SIGTERM."""
    served = len(load.results)
    wait_until(lambda: len(load.results) >= served + more, timeout=180, interval=0.25,
               message="requests served after the event")
    load.stop()
    load.check_equal_offline()
    up.proc.send_signal(signal.SIGTERM)
    assert up.proc.wait(120) == 0, up.tail()


def _up(address: str, redis_url: str, ns: str, *args: str) -> UpProcess:
    return UpProcess("--address", address, "--namespace", ns, "--check-interval", "0.5", *args,
                     env=dict(ENV, PDSERVE_REDIS_URL=redis_url))


def test_pools_on_their_node_types_and_a_lost_node_is_replaced_on_a_survivor(redis_url):
    types = {"prefill": ({"CPU": 1, "prefill": 1}, 1, 1), "decode": ({"CPU": 1, "decode": 1}, 2, 2)}
    ns = f"mn-{uuid.uuid4().hex[:8]}"
    with autoscaling_head(types) as address, Registry(redis_url, ns) as registry:
        live = wait_nodes(address, {"prefill": 1, "decode": 2}, 180)
        offers = {n["id"]: n["resources"] for n in live}
        up = _up(address, redis_url, ns, "--prefill", "1", "--decode", "1", "--num-kv-blocks", "64")
        load = None
        try:
            up.wait_serving(300)
            assert "prefill" in offers[_node_of(registry, "prefill-0")]
            lost = _node_of(registry, "decode-0")
            assert "decode" in offers[lost]
            survivors = {i for i, r in offers.items() if "decode" in r} - {lost}

            load = Load(up.router, 3, mixed_prompts(12), **GREEDY)
            wait_until(lambda: len(load.results) >= 6, timeout=180, interval=0.25,
                       message="requests served before the fault")
            port = int(registry.get("decode-0").grpc_address.rpartition(":")[2])
            raylet = raylet_of_port(port)
            raylet.send_signal(signal.SIGKILL)
            wait_until(lambda: getattr(registry.get("decode-1"), "ready", False), timeout=180, interval=0.25,
                       message="decode-1 registered and ready")
            assert _node_of(registry, "decode-1") in survivors
            _serve_more_then_stop(load, up, 6)
        finally:
            if load is not None:
                load.stop()
            up.close()


def test_planner_growing_past_the_nodes_makes_the_autoscaler_add_a_node(redis_url):
    types = {"prefill": ({"CPU": 1, "prefill": 1}, 1, 1), "decode": ({"CPU": 1, "decode": 1}, 1, 2)}
    ns = f"mn-{uuid.uuid4().hex[:8]}"
    with autoscaling_head(types) as address, Registry(redis_url, ns) as registry:
        before = {n["id"] for n in wait_nodes(address, {"prefill": 1, "decode": 1}, 180)}
        # 16 blocks of 16 tokens per decode worker: four concurrent ~60-token prompts generating 64 tokens
        # fill it, so requests wait for blocks and the planner adds a decode worker (the cooldown keeps it).
        up = _up(address, redis_url, ns, "--prefill", "1", "--decode", "1", "--num-kv-blocks", "16",
                 "--autoscale", "--max-prefill", "1", "--max-decode", "2", "--planner-interval", "0.5",
                 "--planner-cooldown", "600")
        load = None
        try:
            up.wait_serving(300)
            prompts = [p for p in mixed_prompts(40) if 150 < len(p) < 300][:6]
            load = Load(up.router, 4, prompts, max_tokens=64, temperature=0.0, ignore_eos=True)
            wait_until(lambda: getattr(registry.get("decode-1"), "ready", False), timeout=300, interval=0.25,
                       message="decode-1 registered and ready")
            grown = wait_nodes(address, {"decode": 2}, 60)
            new_node = _node_of(registry, "decode-1")
            assert new_node not in before, "decode-1 should run on a node the autoscaler added"
            assert "decode" in {n["id"]: n["resources"] for n in grown}[new_node]
            assert new_node != _node_of(registry, "decode-0")
            _serve_more_then_stop(load, up, 4)
        finally:
            if load is not None:
                load.stop()
            up.close()
