"""Faults under load: one fault injected while a slice of the conversation trace replays through the router.

One real cluster for the module (Ray actors, gRPC on loopback, KV over gloo, the tiny model,
1 prefill + 1 decode, 256 KV blocks each) on a Redis of its own (an ``EmbeddedRedis`` this module
starts on a free port, so it can be killed and restarted on that port), and a ``Supervisor``
checking every 0.5 s. Each test replays its own 36-row slice of the trace (prompts ~20-120
tokens, outputs ~8-32, ~4 requests/s, greedy, ``ignore_eos``, token ids made from the trace
lengths; see ``load.py``) from a pool of gRPC clients, and a third of the way in:

(a) SIGKILLs the decode worker's process; (b) SIGKILLs the prefill worker's process;
(c) SIGKILLs the cluster's Redis and restarts it, empty, on the same port a few seconds later.

In each, every request either completes with the offline engine's greedy output (``engine.LLM``
on the same ids, computed once before the cluster starts) or ends UNAVAILABLE / RESOURCE_EXHAUSTED
and then, retried once after the fault is over, completes with that output; no other code
(UNKNOWN, INTERNAL, DEADLINE_EXCEEDED: a hang under the 60 s client deadline, or the router's own
"failed to serve it" UNAVAILABLE that masks a bug). Within 30 s of the fault (or 2.5 times what
this cluster's own start took, where the machine is so loaded that starting a worker is slower:
beside two CPU hogs a replacement took 30-80 s) the pools are back at one live ready worker each,
as the supervisor, the registry and the router's worker view all report; afterwards every KV block
of every live worker is free and the router holds nothing.
Waits are on conditions with deadlines; the one fixed pause is the deliberate Redis outage.
"""
from __future__ import annotations

import dataclasses
import os
import re
import signal
import time
from collections import Counter
from dataclasses import dataclass
from typing import Any, Callable, Optional

import pytest
import ray
import torch
from prometheus_client.parser import text_string_to_metric_families

from cluster.launcher import Cluster, ClusterConfig
from cluster.redis_server import EmbeddedRedis
from cluster.registry import Registry
from cluster.supervisor import Supervisor, SupervisorConfig
from engine.sampling_params import SamplingParams
from tests.e2e.helpers import offline
from tests.fault_tolerance.load import Replay, Result, TraceRequest, counts, heal_deadline_s, trace_requests
from tests.waiting import wait_until

ROLES = ("prefill", "decode")
N = 36                    # requests per scenario
RATE = 4.0                # mean arrivals per second
FAULT_AT = N // 3         # the fault comes once this many requests are sent (and, if it happens, one streams)
REDIS_DOWN_S = 3.0        # the deliberate outage before Redis comes back on its port
REQUEST_TIMEOUT_S = 60.0
RETRIABLE = ("UNAVAILABLE", "RESOURCE_EXHAUSTED")
SLICES = {"decode": 0, "prefill": N, "redis": 2 * N}  # each scenario replays its own rows of the trace


@pytest.fixture(scope="module")
def workload() -> dict[str, list[TraceRequest]]:
    return {case: trace_requests(start, N, RATE) for case, start in SLICES.items()}


@pytest.fixture(scope="module")
def reference(workload) -> dict[str, list[tuple[list[int], str, str]]]:
    """The offline engine's greedy outputs, computed before the cluster starts."""
    torch.set_num_threads(1)
    return {case: offline([list(r.token_ids) for r in reqs],
                          [SamplingParams(max_tokens=r.max_tokens, temperature=0.0, ignore_eos=True) for r in reqs])
            for case, reqs in workload.items()}


@dataclass
class Env:
    cluster: Cluster
    supervisor: Supervisor
    redis: EmbeddedRedis
    port: int
    registry: Registry
    start_s: float
    """How long this cluster took to start (its workers' start, on this machine at its present load)."""

    @property
    def heal_deadline_s(self) -> float:
        return heal_deadline_s(self.start_s)


@pytest.fixture(scope="module")
def env(ray_local, reference):
    redis = EmbeddedRedis().start()  # this module's own: (c) kills it, the session's shared one stays up
    cfg = ClusterConfig(model="tiny", num_prefill=1, num_decode=1, redis_url=redis.url,
                        engine_overrides=dict(num_kv_blocks=256), start_timeout_s=600)
    cluster = supervisor = None
    e = None
    try:
        t0 = time.monotonic()
        cluster = Cluster(cfg).start()
        start_s = time.monotonic() - t0
        supervisor = Supervisor(cluster, SupervisorConfig(check_interval_s=0.5, probe_timeout_s=10.0)).start()
        e = Env(cluster, supervisor, redis, redis.port, Registry(redis.url, cluster.namespace), start_s)
        yield e
    finally:
        if supervisor is not None:
            supervisor.stop()
        if cluster is not None:
            cluster.stop()
        if e is not None:
            e.registry.close()
            redis = e.redis  # (c) replaced it
        redis.stop()


# ---- conditions ---------------------------------------------------------------------------------------
def _pools(env: Env) -> dict[str, dict[str, Any]]:
    """Each pool as the launcher, the supervisor, the registry and the router's worker view see it."""
    out = {}
    for role in ROLES:
        try:
            listed: Any = [w.worker_id for w in env.registry.list(role)]
        except Exception as err:  # Redis down or restarting
            listed = f"registry: {type(err).__name__}"
        out[role] = dict(members=env.cluster.worker_ids(role), live_ready=env.supervisor.live_ready(role),
                         registry=listed,
                         router_view=[w.worker_id for w in env.cluster.router.core.view.list(role) if w.ready])
    return out


def _at_size(pools: dict[str, dict[str, Any]], dead: Optional[str]) -> bool:
    """1 prefill + 1 decode, live and ready everywhere, the dead worker (if any) gone."""
    for p in pools.values():
        ids = p["members"]
        if len(ids) != 1 or dead in ids or not (p["live_ready"] == p["registry"] == p["router_view"] == ids):
            return False
    return True


def _kv(env: Env) -> dict[str, tuple[int, int]]:
    """worker id -> (free, total) KV blocks of every live worker."""
    out = {}
    for role in ROLES:
        for wid, handle in env.cluster.members(role):
            info = ray.get(handle.info.remote(), timeout=10)
            out[wid] = (info.num_free_blocks, info.num_total_blocks)
    return out


def _idle(env: Env) -> bool:
    kv = _kv(env)
    return env.cluster.router.num_in_flight == 0 and bool(kv) and all(f == t > 0 for f, t in kv.values())


def _router_counts(env: Env) -> Counter:
    """The router's migration and degraded-routing counters."""
    c: Counter = Counter()
    for fam in text_string_to_metric_families(env.cluster.router.metrics.render().decode()):
        if fam.name in ("pdserve:request_migrations", "pdserve:degraded_requests"):
            for smp in fam.samples:
                if smp.name.endswith("_total"):
                    reason = smp.labels.get("reason")
                    c[fam.name.split(":", 1)[1] + (f"[{reason}]" if reason else "")] += int(smp.value)
    return c


def _why(results: list[Result]) -> dict[str, int]:
    """Failures by code and message (request ids left out)."""
    return dict(Counter(f"{r.code}: {re.sub(r'request [^ :]+:? ?', '', r.details)[:300]}"
                        for r in results if r.code != "OK"))


# ---- one scenario -------------------------------------------------------------------------------------
@dataclass
class Outcome:
    results: list[Result]
    retried: list[Result]
    heal_s: Optional[float]
    streaming_at_fault: bool
    summary: str


def _healthy(env: Env, case: str) -> None:
    """A healthy, idle cluster (also the proof that the previous scenario left it so, its replacement included)."""
    wait_until(lambda: _at_size(_pools(env), None), timeout=max(60.0, env.heal_deadline_s), interval=0.1,
               message=lambda: f"{case}: not healthy before: {_pools(env)}")
    wait_until(lambda: _idle(env), timeout=30, interval=0.1, message=lambda: f"{case}: not idle before: {_kv(env)}")


def _replay_with_fault(env: Env, case: str, reqs: list[TraceRequest], want: list, inject: Callable[[], None],
                       dead: Optional[str]) -> Outcome:
    _healthy(env, case)
    counters = _router_counts(env)
    replay = Replay(env.cluster.router_address, reqs, timeout_s=REQUEST_TIMEOUT_S).start()
    try:
        streaming = replay.wait_for(submitted=FAULT_AT, streaming=1)
        t_fault = time.monotonic()
        inject()  # returns once the fault is in place (for Redis: killed, down for a while, restarted)
        try:  # not healed in time is reported with the replay's results (_check), not here
            wait_until(lambda: _at_size(_pools(env), dead), interval=0.1,
                       timeout=max(0.0, env.heal_deadline_s - (time.monotonic() - t_fault)))
            heal_s: Optional[float] = time.monotonic() - t_fault
        except AssertionError:
            heal_s = None
        results = replay.join(timeout_s=REQUEST_TIMEOUT_S + 30)
        # The fault is over once the pools are back: each refused request gets one more try.
        failed = [r for r in results if r.code in RETRIABLE]
        retried = replay.send_all([reqs[r.index] for r in failed]) if heal_s is not None else []
    finally:
        replay.close()
    ok = [r for r in results if r.code == "OK"]
    router = dict(_router_counts(env) - counters)
    summary = (f"{case}: {len(ok)}/{len(results)} OK first time, codes {counts(results)}, "
               f"{len(retried)} retried -> {counts(retried)}, "
               f"healed in {'-' if heal_s is None else f'{heal_s:.1f}'} s, a request streaming at the fault: "
               f"{streaming}, router {router or '{}'}; failures {_why(results)}; failed retries {_why(retried)}")
    print("\n" + summary)
    return Outcome(results, retried, heal_s, streaming, summary)


def _check(env: Env, out: Outcome, want: list, dead: Optional[str]) -> None:
    s = out.summary
    assert out.heal_s is not None, (f"pools not back at 1 prefill + 1 decode live ready within "
                                    f"{env.heal_deadline_s:.0f} s (the cluster started in {env.start_s:.0f} s; "
                                    f"dead: {dead}): {_pools(env)}; {s}")
    bad = {c: n for c, n in counts(out.results).items() if c != "OK" and c not in RETRIABLE}
    assert not bad, f"codes other than OK/UNAVAILABLE/RESOURCE_EXHAUSTED: {bad}; {s}"
    for r in out.results:
        if r.code == "OK":
            assert (r.token_ids, r.finish_reason) == (want[r.index][0], want[r.index][2]), (
                f"request {r.index}: greedy output differs from offline: got {r.token_ids} ({r.finish_reason}), "
                f"want {want[r.index][0]} ({want[r.index][2]}); {s}")
        else:  # what streamed before the failure (a migration included) was right as far as it went
            assert r.token_ids == want[r.index][0][:len(r.token_ids)], (
                f"request {r.index} ({r.code}): streamed {r.token_ids} before failing, offline {want[r.index][0]}; {s}")
    assert [r.code for r in out.retried] == ["OK"] * len(out.retried), f"a retry after the fault failed; {s}"
    for r in out.retried:
        assert (r.token_ids, r.finish_reason) == (want[r.index][0], want[r.index][2]), (
            f"retried request {r.index}: output differs from offline: got {r.token_ids}, want {want[r.index][0]}; {s}")
    wait_until(lambda: _idle(env), timeout=30, interval=0.1,
               message=lambda: (f"KV blocks not all free (worker -> (free, total)): {_kv(env)}, router in flight "
                                f"{env.cluster.router.num_in_flight}; {s}"))


def _kill_worker(env: Env, role: str) -> tuple[str, Callable[[], None]]:
    [(dead, handle)] = env.cluster.members(role)
    pid = ray.get(handle.pid.remote(), timeout=30)
    return dead, lambda: os.kill(pid, signal.SIGKILL)


# ---- the scenarios ------------------------------------------------------------------------------------
@pytest.mark.parametrize("role", ["decode", "prefill"])
def test_worker_sigkilled_mid_replay(env, workload, reference, role):
    """(a) the decode worker, (b) the prefill worker: SIGKILLed while requests stream."""
    _healthy(env, role)  # before counting replacements: the previous scenario's may still be under way
    dead, inject = _kill_worker(env, role)
    before = len(env.supervisor.replacements)
    out = _replay_with_fault(env, role, workload[role], reference[role], inject, dead)
    _check(env, out, reference[role], dead)
    # The supervisor replaced exactly the dead worker, under a new id, and left the other pool alone.
    new = env.supervisor.replacements[before:]
    assert [(r, f) for _, r, f, _ in new] == [(role, [dead])], f"replacements {new}; {out.summary}"
    other = "prefill" if role == "decode" else "decode"
    assert all(other not in r for _, r, _, _ in new), out.summary


def test_redis_sigkilled_and_restarted_mid_replay(env, workload, reference):
    """(c) the cluster's Redis: SIGKILLed, down for a few seconds, restarted empty on the same port."""
    _healthy(env, "redis")
    ids = {role: env.cluster.worker_ids(role) for role in ROLES}
    before = len(env.supervisor.replacements)

    def inject() -> None:
        os.kill(env.redis.pid, signal.SIGKILL)
        env.redis.stop()  # reaps the killed server and removes its directory
        time.sleep(REDIS_DOWN_S)  # the deliberate outage: workers and router go on without Redis
        # Same port and settings (its password, if it has one), no data. Launched with posix_spawn: a fork of
        # this busy, threaded process can abort in the child (test_redis_outage saw it on 29 Nov); the test's
        # teardown stops it
        env.redis = EmbeddedRedis(dataclasses.replace(env.redis.config, port=env.port, spawn=True)).start()

    out = _replay_with_fault(env, "redis", workload["redis"], reference["redis"], inject, None)
    _check(env, out, reference["redis"], None)
    # The outage was not mistaken for dead workers.
    assert env.supervisor.replacements[before:] == [], f"{env.supervisor.replacements[before:]}; {out.summary}"
    assert {role: env.cluster.worker_ids(role) for role in ROLES} == ids, out.summary
