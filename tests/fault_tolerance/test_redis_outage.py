"""Redis off the request path: requests keep their latency while the cluster's Redis is paused or killed.

One real cluster for the module (Ray actors, gRPC on loopback, KV over gloo, the tiny model, 2 prefill + 1
decode workers, so prefill placement has candidates to tie) on a Redis of its own, with the router's defaults:
the KV event index, cold ties through Redis and replica sync on. Two client threads send a steady stream of
greedy 16-token requests with fresh prompts (each at least two full KV blocks, so every placement scores
prefixes and, being cached nowhere, is a cold tie) through the router's gRPC API, each with a 60 s deadline so
that a stall shows as a latency, not a deadline. Scenarios, in this order:

1. cold: Redis paused (SIGSTOP) before any KV pair was ever built. New pairs rendezvous through Redis, so
   the router keeps requests off prefill workers with no pair up: the decode worker prefills them itself
   (``redis_fallbacks_total{use="kv_pair"}``). Redis resumed (SIGCONT) afterwards.
2. paused: the stream runs until both prefill workers' pairs with the decode worker carried a transfer, then
   Redis is paused for a few seconds mid-stream, then resumed.
3. killed: the same, Redis SIGKILLed mid-stream (connections refused instead of timeouts), then restarted
   empty on its port; the workers re-register.

In each, every request sent while Redis is away ends OK, with the offline engine's greedy tokens, within the
bound: its normal latency (the slowest request of a warm stream measured in the same run, on the same
cluster) plus the 50 ms a request may gain while Redis is away, plus SLACK_S for this 2-core box's noise (the
regression this catches stalled requests for seconds, until their deadline). Waits are on conditions with
deadlines; the fixed pauses are the outages themselves.
"""
from __future__ import annotations

import dataclasses
import os
import signal
import threading
import time
from dataclasses import dataclass

import grpc
import pytest
import torch

from cluster.launcher import Cluster, ClusterConfig
from cluster.redis_server import EmbeddedRedis
from engine.sampling_params import SamplingParams
from proto import pdserve_pb2, pdserve_pb2_grpc
from tests.e2e.helpers import offline
from tests.roles.harness import counter_values
from tests.waiting import wait_until

pytestmark = pytest.mark.solo  # latency bounds: scripts/test runs this module alone, after the rest of the suite

REDIS_BOUND_S = 0.05   # the bound: what a request may gain while Redis is away
SLACK_S = 0.5          # this box's scheduling noise on top of the measured normal latency
OUTAGE_S = 6.0         # how long Redis stays away in each scenario (at least: see _outage_s)
MAX_TOKENS = 16
NUM_IDS, FIRST_ID = 8000, 3


def _prompt(i: int) -> list[int]:
    """A prompt no other request shares a block with: 40 ids (2+ full blocks of 16)."""
    return [FIRST_ID + (i * 7919 + j * 104729) % NUM_IDS for j in range(40)]


@dataclass
class Result:
    index: int
    sent_at: float
    latency_s: float
    code: str
    token_ids: list[int]
    details: str = ""


class Stream:
    """Two client threads sending one request after another (fresh prompts) until stopped."""

    def __init__(self, address: str, first_index: int) -> None:
        self._ch = grpc.insecure_channel(address)
        self._stub = pdserve_pb2_grpc.PDServeStub(self._ch)
        self._next = first_index
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self.results: list[Result] = []
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(2)]

    def start(self) -> "Stream":
        for t in self._threads:
            t.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                i, self._next = self._next, self._next + 1
            t0 = time.monotonic()
            ids: list[int] = []
            try:
                req = pdserve_pb2.GenerateRequest(token_ids=_prompt(i), max_tokens=MAX_TOKENS, temperature=0.0,
                                                  ignore_eos=True, request_id=f"redis-outage-{i}")
                for resp in self._stub.Generate(req, timeout=60):
                    ids.extend(resp.token_ids)
                r = Result(i, t0, time.monotonic() - t0, "OK", ids)
            except grpc.RpcError as e:
                r = Result(i, t0, time.monotonic() - t0, e.code().name, ids, e.details() or "")
            with self._lock:
                self.results.append(r)

    def count(self) -> int:
        with self._lock:
            return len(self.results)

    def stop(self) -> list[Result]:
        self._stop.set()
        for t in self._threads:
            t.join(90)
        self._ch.close()
        return sorted(self.results, key=lambda r: r.index)


@dataclass
class Env:
    cluster: Cluster
    redis: EmbeddedRedis
    port: int
    normal_s: float = 0.0
    """The slowest request of a warm stream with Redis up (measured once, in scenario 2's warm-up)."""


@pytest.fixture(scope="module")
def env(ray_local):
    torch.set_num_threads(1)
    redis = EmbeddedRedis().start()
    cfg = ClusterConfig(model="tiny", num_prefill=2, num_decode=1, redis_url=redis.url,
                        engine_overrides=dict(num_kv_blocks=256), start_timeout_s=600)
    cluster = None
    e = None
    try:
        cluster = Cluster(cfg).start()
        e = Env(cluster, redis, redis.port)
        yield e
    finally:
        if e is not None:
            redis = e.redis
            if redis.pid:
                try:
                    os.kill(redis.pid, signal.SIGCONT)
                except ProcessLookupError:
                    pass
        if cluster is not None:
            cluster.stop()
        redis.stop()


def _placer(env: Env):
    return env.cluster.router.core.placer


def _fallbacks(env: Env) -> dict[str, float]:
    return counter_values(env.cluster.router.metrics, "pdserve:redis_fallbacks", "use")


def _check(env: Env, results: list[Result], away_from: float, away_to: float, what: str) -> list[Result]:
    """Every request sent while Redis was away: OK and offline-equal (those sent during its return too), and within
    the bound: each sent early enough to be answered within the bound before Redis came back. Returns those
    requests. One sent in the outage's last bound-length still runs as Redis returns and shares the host with the
    return (a restarted redis-server spawned by this process, workers and routers reconnecting and resyncing their
    KV-event streams): the quiet suite saw two such take 1.3-1.6 s once, beside the other pytest worker; their latency
    measures the recovery, not the outage. A request the outage stalls is still caught: sent early enough, it should
    have been answered before Redis came back."""
    bad = [r for r in results if r.code != "OK"]
    assert not bad, f"{what}: failed requests: {[(r.index, r.code, r.details[:200]) for r in bad[:5]]}"
    since = [r for r in results if r.sent_at >= away_from]  # the outage's and the recovery's requests
    want = offline([_prompt(r.index) for r in since],
                   [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)] * len(since))
    for r, w in zip(since, want):
        assert r.token_ids == w[0], f"{what}: request {r.index}: {r.token_ids} != offline {w[0]}"
    # normal: the warm stream's slowest, or this stream's slowest just before the outage where the host got slower
    # meanwhile (the suite's other worker starting a cluster); never requests after it, which a stall would slow
    before = [r.latency_s for r in results if r.sent_at < away_from and r.code == "OK"]
    normal = max([env.normal_s] + before)
    bound = normal + REDIS_BOUND_S + SLACK_S
    during = [r for r in results if away_from <= r.sent_at < away_to - bound]
    assert len(during) >= 4, f"{what}: only {len(during)} requests were sent during the outage"
    slow = [(r.index, round(r.latency_s, 3)) for r in during if r.latency_s > bound]
    assert not slow, (f"{what}: requests slower than normal ({normal:.3f} s; warm stream {env.normal_s:.3f} s) + "
                      f"{REDIS_BOUND_S} s + {SLACK_S} s slack while Redis was away: {slow}")
    return during


def _outage_s(env: Env) -> float:
    """How long Redis stays away mid-stream: OUTAGE_S, or longer where requests are slow (a loaded host), so that at
    least 4 are sent early enough to be judged. ``_check`` judges those sent before the outage's end less the bound
    (normal + REDIS_BOUND_S + SLACK_S), and the two threads each send one request per normal latency: beside two CPU
    hogs (29 Nov) normal was ~1.6 s and a 6 s outage left 2 judged requests."""
    return max(OUTAGE_S, 4 * env.normal_s + REDIS_BOUND_S + SLACK_S + 1.0)


def _pause(env: Env) -> None:
    os.kill(env.redis.pid, signal.SIGSTOP)


def _resume(env: Env) -> None:
    os.kill(env.redis.pid, signal.SIGCONT)
    wait_until(lambda: not _placer(env).store_away(), timeout=60, interval=0.05,
               message="the router still sees Redis as away after SIGCONT")


def test_paused_before_any_pair_was_built_decode_prefills_itself(env):
    """Scenario 1 (runs first: no KV pair exists yet)."""
    placer = _placer(env)
    assert not placer._pairs, "a KV pair was built before the first request"
    before = _fallbacks(env).get("kv_pair", 0)
    _pause(env)
    try:
        wait_until(placer.store_away, timeout=60, interval=0.05, message="the router never noticed Redis paused")
        t0 = time.monotonic()
        stream = Stream(env.cluster.router_address, 0).start()
        time.sleep(OUTAGE_S)  # the outage itself
        t1 = time.monotonic()
        results = stream.stop()
    finally:
        _resume(env)
    # no baseline exists yet on this fresh cluster: bound it by a later warm stream's normal latency
    env.normal_s = _warm_normal(env)
    _check(env, results, t0, t1, "paused, no pair built")
    assert _fallbacks(env).get("kv_pair", 0) > before, _fallbacks(env)


def _warm_normal(env: Env) -> float:
    """Run a stream with Redis up until both prefill workers have a pair up with the decode worker (transfers
    went through both) and 20 requests are done; the slowest request's latency is the normal latency."""
    if env.normal_s:
        return env.normal_s
    placer = _placer(env)
    stream = Stream(env.cluster.router_address, 10_000).start()
    try:
        wait_until(lambda: len(placer._pairs) == 2 and stream.count() >= 20, timeout=120, interval=0.05,
                   message=lambda: f"pairs up: {sorted(placer._pairs)}, {stream.count()} requests done")
    finally:
        results = stream.stop()
    assert all(r.code == "OK" for r in results), [(r.code, r.details) for r in results if r.code != "OK"]
    return max(r.latency_s for r in results)


@pytest.mark.parametrize("outage", ["paused", "killed"])
def test_requests_keep_their_latency_while_redis_is_away(env, outage):
    """Scenarios 2 and 3: Redis paused, then killed, under a steady stream over pairs already up."""
    env.normal_s = _warm_normal(env)
    placer = _placer(env)
    base = 20_000 if outage == "paused" else 30_000
    stream = Stream(env.cluster.router_address, base).start()
    try:
        wait_until(lambda: stream.count() >= 6 and len(placer._pairs) == 2, timeout=120, interval=0.05,
                   message="the stream did not get going")
        t0 = time.monotonic()
        if outage == "paused":
            _pause(env)
        else:
            os.kill(env.redis.pid, signal.SIGKILL)
            env.redis.stop()
        try:
            time.sleep(_outage_s(env))  # the outage itself
            t1 = time.monotonic()
            assert placer.store_away(), "the router did not notice the outage"
        finally:
            if outage == "paused":
                _resume(env)
            else:
                # posix_spawn: a fork of this busy, threaded process aborted in the child once (29 Nov suite)
                env.redis = EmbeddedRedis(dataclasses.replace(env.redis.config, port=env.port, spawn=True)).start()
                wait_until(lambda: not placer.store_away(), timeout=60, interval=0.05,
                           message="the router still sees Redis as away after its restart")
        # a few requests after it is back, too
        n = stream.count()
        wait_until(lambda: stream.count() >= n + 4, timeout=120, interval=0.05, message="the stream stalled")
    finally:
        results = stream.stop()
    during = _check(env, results, t0, t1, outage)
    print(f"\n{outage}: {len(during)} requests while Redis was away, slowest "
          f"{max(r.latency_s for r in during):.3f} s (normal {env.normal_s:.3f} s); fallbacks {_fallbacks(env)}")
