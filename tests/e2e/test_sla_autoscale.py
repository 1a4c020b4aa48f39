"""``--planner sla`` on a real cluster: Ray actors, the Redis registry, gRPC on loopback, KV over gloo, the tiny model.

The workers' counters reach the registry (checked against three requests sent one by one), then a client sends
a low rate, a higher one, and the low one again, while the ``Planner`` with the ``sla`` policy runs on its
thread. The profile is hand-written and pretends the tiny model is slow (a 34-token prompt takes 0.33 s, a
decode step of B sequences 0.1 + 0.007 (B - 1) s), so that a couple of requests per second need two workers
in each pool while the real workers serve them easily on a loaded 2-core machine: what is checked is that
the pools move to the sizes the policy predicts for the rate it observed, and that no request fails while
they move. Every wait is on a condition, with a generous deadline.
"""
from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor

import pytest
import torch

from cluster.launcher import Cluster, ClusterConfig
from cluster.planner import Planner, PlannerConfig
from cluster.sla_planner import Load, SlaConfig, plan
from simulator.costs import LinkModel, Profile, StepModel
from tests.e2e.helpers import generate
from tests.waiting import wait_until

PROMPT = "def add(a, b):\n    return a + b\n\n\ndef mul(a, b):\n    return a * b\n\n\ndef main():\n"
MAX_TOKENS = 32
LOW, HIGH = 0.5, 2.0  # req/s: the policy wants 1P+1D below ~1.23 req/s and 2P+2D from ~1.33 to ~2.65
BOUNDS = dict(min_prefill=1, max_prefill=2, min_decode=1, max_decode=2)


def tiny_profile() -> Profile:
    return Profile(model="tiny", dtype="float32", quantization=None, kv_cache_dtype="auto", device="cpu", threads=1,
                   block_size=16, num_layers=2, kv_bytes_per_token=1024, max_model_len=2048,
                   step=StepModel(knots=[1, 1001], knot_s=[0.1, 7.1]), links={"gloo": LinkModel(0.001, 1e9)})


SLA = SlaConfig(profile=tiny_profile(), ttft_slo_ms=2500, tpot_slo_ms=150, headroom=1.2, window_s=8, min_window_s=4,
                scale_down_after_s=8)


class Client:
    """Sends PROMPT at ``rate`` req/s (evenly spaced) from a thread; keeps every request's outcome."""

    def __init__(self, address: str) -> None:
        self.address = address
        self.rate = 0.0
        self.futures: list[Future] = []
        self._pool = ThreadPoolExecutor(max_workers=32)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _one(self) -> tuple[int, str]:
        ids, _text, reason, _last = generate(self.address, timeout=120, prompt=PROMPT, max_tokens=MAX_TOKENS,
                                             ignore_eos=True, temperature=0.0)
        return len(ids), reason

    def _run(self) -> None:
        nxt = time.monotonic()
        while not self._stop.is_set():
            if self.rate <= 0:
                self._stop.wait(0.1)
                nxt = time.monotonic()
                continue
            now = time.monotonic()
            if now >= nxt:
                self.futures.append(self._pool.submit(self._one))
                nxt = max(nxt + 1.0 / self.rate, now - 1.0)  # a late thread catches up by at most a second
            self._stop.wait(min(0.05, max(0.0, nxt - time.monotonic())))

    def start(self) -> "Client":
        self._thread.start()
        return self

    def done(self) -> int:
        return sum(1 for f in list(self.futures) if f.done())

    def finish(self) -> list:
        self._stop.set()
        self._thread.join(timeout=10)
        outcomes = []
        for f in self.futures:
            try:
                outcomes.append(f.result(timeout=180))
            except Exception as e:  # a failed request: reported, never raised from here
                outcomes.append(e)
        self._pool.shutdown(wait=False)
        return outcomes


def _sizes(c: Cluster) -> tuple[int, int]:
    return len(c.worker_ids("prefill")), len(c.worker_ids("decode"))


def _predicted(load: Load) -> tuple[int, int]:
    s = plan(SLA, load).sizes
    return (min(max(s["prefill"], 1), 2), min(max(s["decode"], 1), 2))


@pytest.fixture(scope="module")
def cluster(ray_local, redis_url):
    torch.set_num_threads(1)
    cfg = ClusterConfig(model="tiny", num_prefill=1, num_decode=1, redis_url=redis_url,
                        engine_overrides=dict(num_kv_blocks=256, max_num_batched_tokens=512), start_timeout_s=600)
    c = Cluster(cfg).start()
    try:
        yield c
    finally:
        c.stop()


def test_worker_counters_reach_the_registry(cluster):
    reg = cluster.registry
    prompt_tokens = []
    for _ in range(3):
        ids, _t, _r, last = generate(cluster.router_address, prompt=PROMPT, max_tokens=MAX_TOKENS, ignore_eos=True,
                                     temperature=0.0)
        assert len(ids) == MAX_TOKENS
        prompt_tokens.append(last.usage.prompt_tokens)

    def settled():
        p, d = reg.list("prefill"), reg.list("decode")
        # each record refreshes on its worker's own heartbeat: wait for both to have seen the third request
        done = sum(w.requests_finished_total for w in d) == 3 and sum(w.output_tokens_total for w in p) == 3
        return (p, d) if done else None

    p, d = wait_until(settled, timeout=30, interval=0.1, message="the workers' records to count 3 requests")
    assert [w.requests_total for w in p] == [3] and [w.prompt_tokens_total for w in p] == [sum(prompt_tokens)]
    assert [w.requests_total for w in d] == [0]  # its requests were prefilled elsewhere
    assert [w.output_tokens_total for w in p] == [3]  # the first tokens
    assert [w.output_tokens_total for w in d] == [3 * (MAX_TOKENS - 1)]


def test_sla_planner_sizes_the_pools_for_the_observed_rate_and_no_request_fails(cluster):
    planner = Planner(cluster, PlannerConfig(policy="sla", sla=SLA, interval_s=1.0, cooldown_s=2.0, **BOUNDS))
    client = Client(cluster.router_address).start()
    planner.start()
    try:
        client.rate = LOW
        wait_until(lambda: planner.policy.last_load is not None, timeout=60, interval=0.1,
                   message="the planner's first load estimate")
        seen = client.done()
        wait_until(lambda: client.done() >= seen + 3, timeout=60, interval=0.1,
                   message="three more requests at the low rate")
        # the window holds only this rate's requests once their tokens per request read as one request's (on a
        # loaded host the previous test's requests stayed in the 8 s window: 70 tokens a finished request)
        wait_until(lambda: 0.7 * MAX_TOKENS <= planner.policy.last_load.output_tokens <= 1.3 * MAX_TOKENS,
                   timeout=60, interval=0.1, message=lambda: f"a settled window at the low rate: {planner.policy.last_load}")
        low = planner.policy.last_load
        assert _sizes(cluster) == (1, 1) == _predicted(low) and planner.decisions == [], (low, planner.decisions)

        client.rate = HIGH
        wait_until(lambda: _sizes(cluster) == (2, 2), timeout=150, interval=0.1,
                   message=lambda: f"2P+2D at {HIGH} req/s (decisions {planner.decisions})")
        high = planner.policy.last_load
        assert _predicted(high) == (2, 2), high
        seen = client.done()
        wait_until(lambda: client.done() >= seen + 8, timeout=60, interval=0.1,
                   message="eight requests on the grown pools")
        # the estimate the accuracy checks below read: a window of this rate's requests alone (just after the
        # pools grew, a loaded host's window still counts the slow requests of the move: 46 tokens a request)
        wait_until(lambda: 0.7 * MAX_TOKENS <= planner.policy.last_load.output_tokens <= 1.3 * MAX_TOKENS,
                   timeout=60, interval=0.1, message=lambda: f"a settled window at the high rate: {planner.policy.last_load}")
        high = planner.policy.last_load

        client.rate = LOW
        wait_until(lambda: _sizes(cluster) == (1, 1), timeout=150, interval=0.1,
                   message=lambda: f"1P+1D again at {LOW} req/s (decisions {planner.decisions})")
        assert _predicted(planner.policy.last_load) == (1, 1), planner.policy.last_load
    finally:
        planner.stop()
        outcomes = client.finish()
    t0 = planner.decisions[0][0] if planner.decisions else 0.0
    print(f"\nsla planner on tiny: low {low}, high {high}; moves "
          f"{[(round(t - t0, 1), role, old, new) for t, role, old, new in planner.decisions]}; {len(outcomes)} requests")
    failed = [o for o in outcomes if not (isinstance(o, tuple) and o == (MAX_TOKENS, "length"))]
    assert not failed, f"{len(failed)} of {len(outcomes)} requests failed while the pools moved: {failed[:3]}"
    moves = [(role, old, new) for _t, role, old, new in planner.decisions]
    assert sorted(moves[:2]) == [("decode", 1, 2), ("prefill", 1, 2)]  # up in one step each (one tick or two)
    assert sorted(moves[2:]) == [("decode", 2, 1), ("prefill", 2, 1)], moves
    # the observed rate is the client's (counted by the workers: arrivals at the prefill pool)
    assert 0.6 * HIGH <= high.rate <= 1.4 * HIGH and high.prompt_tokens > 10
    assert 0.7 * MAX_TOKENS <= high.output_tokens <= 1.3 * MAX_TOKENS  # tokens per finished request, in a window
