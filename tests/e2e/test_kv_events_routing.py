"""Cache-aware routing from KV events with several routers: real workers, real routers, a real Redis.

Three colocated workers (real engines on ``tiny``, real gRPC servers) publish their prefix caches' KV events
to a real Redis and heartbeat into the real registry; three ``RouterServer``s (each with its own registry
reader and KV event consumer, as three ``pdserve router`` processes would have) route over them. The tests,
in order, on one shared set of processes:

1. a shared-system-prompt workload entering through all three routers in turn gets the prefix-hit rate it gets
   through one router (within ``HIT_RATE_POINTS``), no worker serves more than its share plus ``SPREAD_MARGIN``,
   every routing decision scored on the event index, and greedy output equals the offline engine's;
1b. (on a second deployment with room for every history) multi-turn conversations, bursts of new conversations
   per router and each turn through the next router, return to their history's worker through 3 routers about as
   often as through one (``CONV_HISTORY_POINTS``), no worker serves more than its share plus ``CONV_SPREAD_MARGIN``,
   and the routers hear each other's placements (replica sync);
2. an eviction on one worker (long prompts sent straight to it through a fourth, single-worker router) is seen
   by all three routers within ``SEEN_S``, so none routes on that worker's copy of the prefix any more;
3. a router started late catches up from the streams (replay): its index equals the others';
4. a worker that leaves the registry (deregistered, stopped) leaves every router's index.
"""
from __future__ import annotations

import random
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest

from cluster.registry import Registry
from decode_worker import ColocatedWorker, ColocatedWorkerConfig
from engine import prefix_block_hashes
from engine.sampling_params import SamplingParams
from proto import pdserve_pb2, pdserve_pb2_grpc
from router import RouterConfig, RouterServer, StaticWorkerSource
from tests.roles.harness import engine_config, offline
from tests.waiting import wait_until

N_WORKERS = 3
BS = 16
SYSTEM = 6 * BS  # system prompt tokens: 6 blocks
USER = 20
N_REQUESTS = 60
CONCURRENCY = 6
MAX_TOKENS = 24
"""Long enough that a request outlives a heartbeat or so: the reported loads mean something."""
HIT_RATE_POINTS = 0.06
"""Most the 3-router hit rate may fall below the 1-router one (fraction of prompt tokens)."""
SPREAD_MARGIN = 0.75
"""No worker serves more than (1 + SPREAD_MARGIN) x its share of a run's requests. Cache affinity may by design put
one of the two system prompts' requests, half of all, on one worker (1.5 x share: 30 of 60), while the load term
does not outweigh its 6 cached blocks (at most 6 requests in flight); seen through one router in the full suite on
27 Nov (15 / 15 / 30); likelier since a new prefix's first placement is pending before the next request of a burst is
scored (``router.kv.ties``). That worker may also take a few of the other prompt's requests when their worker looks
busier: 0 / 26 / 34 (1.7 x) in a fresh-clone CI run on 1 Dec, the two groups on two workers, so 0.6 (32 of 60) was
too tight. Herding still fails it: the pathologies this test was written against put 36 of 48 (2.25 x) and 59 of 96
(1.84 x) on one worker (docs/benchmarks.md, "Prefix routing with several routers")."""
SEEN_S = 30.0
"""How long the routers may take to hear of a worker's cache changing (milliseconds when the host is idle; a
generous deadline, since a wait returns as soon as the condition holds and a loaded host must not fail it)."""


class _Deployment:
    def __init__(self, redis_url: str, ns: str, num_kv_blocks: int = 48) -> None:
        self.registry = Registry(redis_url, ns, ttl_s=2.0)
        self.workers = [ColocatedWorker(ColocatedWorkerConfig(
            f"c{i}", engine=engine_config(num_kv_blocks=num_kv_blocks), serve_metrics=False, kv_events_url=redis_url,
            kv_events_namespace=ns)).start() for i in range(N_WORKERS)]
        self.live = {w.cfg.worker_id: w for w in self.workers}
        self._stop = threading.Event()
        self._beat()
        self._thread = threading.Thread(target=self._beats, daemon=True)
        self._thread.start()
        self.routers = [self.router() for _ in range(3)]
        self.channels = [grpc.insecure_channel(r.address) for r in self.routers]
        self.stubs = [pdserve_pb2_grpc.PDServeStub(c) for c in self.channels]

    def router(self) -> RouterServer:
        return RouterServer(RouterConfig(mode="colocated", serve_metrics=False, worker_view_refresh_s=0.1),
                            self.registry).start()

    def _beat(self) -> None:
        for w in list(self.live.values()):
            self.registry.heartbeat(w.info())

    def _beats(self) -> None:
        while not self._stop.wait(0.25):
            self._beat()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for c in self.channels:
            c.close()
        for r in self.routers:
            r.stop()
        for w in self.workers:
            w.stop()
        self.registry.close()


@pytest.fixture(scope="module")
def deployment(redis_url):
    ns = f"test-kvev-{uuid.uuid4().hex[:8]}"
    d = _Deployment(redis_url, ns)
    try:
        wait_until(lambda: all(r.core.kv_events.num_synced() == N_WORKERS for r in d.routers), timeout=20,
                   message="every router follows every worker's events")
        yield d
    finally:
        d.close()
        leftover = Registry(redis_url, ns)
        try:
            assert [k for k in leftover.keys() if ":kvev:" in k or ":kvsnap:" in k or k.endswith(":kvplace")] == []
            leftover.clear()
        finally:
            leftover.close()


@pytest.fixture(scope="module")
def roomy(redis_url):
    """A second deployment with room for every conversation's history (256 blocks per worker: no evictions)."""
    ns = f"test-kvconv-{uuid.uuid4().hex[:8]}"
    d = _Deployment(redis_url, ns, num_kv_blocks=256)
    try:
        wait_until(lambda: all(r.core.kv_events.num_synced() == N_WORKERS for r in d.routers), timeout=20,
                   message="every router follows every worker's events")
        yield d
    finally:
        d.close()
        leftover = Registry(redis_url, ns)
        try:
            assert [k for k in leftover.keys() if ":kvev:" in k or ":kvsnap:" in k or k.endswith(":kvplace")] == []
            leftover.clear()
        finally:
            leftover.close()


def _generate(stub, tokens: list[int], max_tokens: int = 4) -> pdserve_pb2.GenerateResponse:
    resps = list(stub.Generate(pdserve_pb2.GenerateRequest(token_ids=tokens, max_tokens=max_tokens, temperature=0.0),
                               timeout=60))
    out = pdserve_pb2.GenerateResponse()
    out.CopyFrom(resps[-1])
    del out.token_ids[:]
    out.token_ids.extend([t for r in resps for t in r.token_ids])
    return out


def _workload(seed: int) -> list[list[int]]:
    """Two system prompts, each request one of them plus its own user turn."""
    systems = [[(seed * 1000 + s * 100 + i) % 900 + 20 for i in range(SYSTEM)] for s in range(2)]
    return [systems[i % 2] + [(seed * 31 + i * 7 + j) % 900 + 20 for j in range(USER)] for i in range(N_REQUESTS)]


def _run(d: _Deployment, stubs: list, prompts: list[list[int]]) -> tuple[float, dict[str, int], list]:
    before = {wid: w.info().requests_total for wid, w in d.live.items()}
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        outs = list(pool.map(lambda i: _generate(stubs[i % len(stubs)], prompts[i], MAX_TOKENS), range(len(prompts))))
    cached = sum(o.usage.cached_tokens for o in outs)
    total = sum(o.usage.prompt_tokens for o in outs)
    served = {wid: w.info().requests_total - before[wid] for wid, w in d.live.items()}
    return cached / total, served, outs


def _counter(r: RouterServer, family: str, label: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.metrics.render().decode()):
        if fam.name == family:
            for s in fam.samples:
                if s.name.endswith("_total"):
                    out[s.labels[label]] = s.value
    return out


def _decisions(r: RouterServer) -> dict[str, float]:
    return _counter(r, "pdserve:routing_decisions", "reason")


def _all_scored_on_events(r: RouterServer) -> None:
    """Every routing decision ``r`` made was scored on the KV event index, and it made some (an empty count must not
    pass). The one exception is a decision made by load only because Redis did not answer within the router's
    bound, which the router counts apart (``redis_fallbacks_total{use="routing"}``): a host loaded past its cores
    delays Redis that long now and then (hog run 8, 29 Nov: 2 of 80). A fallback to the router-local mirror, or to
    load only for any other reason (an index out of sync), still fails."""
    got = _decisions(r)
    away = _counter(r, "pdserve:redis_fallbacks", "use").get("routing", 0.0)
    assert set(got) <= {"kv_events", "load_only"} and got.get("kv_events", 0) > 0, got
    assert got.get("load_only", 0.0) == away, (got, away)


def test_three_routers_hit_the_cache_as_one_does_and_spread_the_load(deployment):
    d = deployment
    one_rate, one_served, _ = _run(d, d.stubs[:1], _workload(1))
    three_rate, three_served, outs = _run(d, d.stubs, _workload(2))
    print(f"hit rate: 1 router {one_rate:.3f} {one_served}; 3 routers {three_rate:.3f} {three_served}")
    assert three_rate >= one_rate - HIT_RATE_POINTS
    assert three_rate > 0.6  # the system prompts are most of each prompt
    share = N_REQUESTS / N_WORKERS
    for served in (one_served, three_served):
        assert sum(served.values()) == N_REQUESTS
        assert max(served.values()) <= (1 + SPREAD_MARGIN) * share, served
    for r in d.routers:  # each routed some of the 3-router run, and never fell back: the index was in sync
        _all_scored_on_events(r)
    # greedy output is the offline engine's
    prompts = _workload(2)[:4]
    ref = offline(prompts, [SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)] * 4)
    assert [list(o.token_ids) for o in outs[:4]] == [r[0] for r in ref]


CONV_SYSTEMS = 3
CONV_PER_SYSTEM = 5
CONV_TURNS = 4
CONV_HISTORY_POINTS = 0.25
"""Most the two 3-router rounds' mean share of later turns that return to their history's worker may fall below the
1-router round's. That share, not the token hit rate, is what routing through several routers can lose (a turn
routed blind still hits the shared system prompt on most workers). Measured 29 Nov on the 2-core host: quiet, 1.00
in every round; beside the suite and a CPU hog (load ~8), 1 router 0.87-1.00, 3-router rounds 0.71-0.98 (means
0.71-0.97; token hit rates 0.705-0.831, so the old 0.06 token-rate margin failed beside hogs twice, 26-29 Nov); with
the index ignored (each router on its own mirror: the regression) 0.33 and 0.44 against 1.00."""
CONV_SPREAD_MARGIN = 0.6
"""No worker serves more than (1 + CONV_SPREAD_MARGIN) x its share of a round's requests. At this load (tiny, 24-token
answers: a worker runs 0 to 3 requests at a time) the score lets cache affinity win over requests served, so counts
vary from round to round: observed at most 30 of 60 (1.5 x share) over 20 rounds, with or without replica sync, on a
2-CPU host at load averages 1 to 11; one run of 8 at load ~7 failed with this margin at 0.5 (cause not recorded)."""


def _conversations(d: _Deployment, stubs: list, seed: int) -> tuple[float, dict[str, int], list[list[int]]]:
    """CONV_SYSTEMS x CONV_PER_SYSTEM conversations at once, each CONV_TURNS turns re-sending its history. The first
    turns of one system prompt's conversations all enter the same router (a burst each router must spread
    knowing what the others just placed); turn t of conversation c enters router (c + t) mod len(stubs)."""
    draw = random.Random(seed)  # every seed its own system prompts (a round run again must not find them cached)
    systems = [[draw.randrange(20, 920) for _ in range(SYSTEM)] for _ in range(CONV_SYSTEMS)]
    before = {wid: w.info().requests_total for wid, w in d.live.items()}

    def conversation(c: int) -> list:
        history, outs = list(systems[c % CONV_SYSTEMS]), []
        for t in range(CONV_TURNS):
            history += [(seed * 31 + c * 17 + t * 7 + j) % 900 + 20 for j in range(USER)]
            o = _generate(stubs[(c + t) % len(stubs)], history, MAX_TOKENS)
            outs.append(o)
            history += list(o.token_ids)
        return outs

    n = CONV_SYSTEMS * CONV_PER_SYSTEM
    with ThreadPoolExecutor(n) as pool:
        convs = list(pool.map(conversation, range(n)))
    outs = [o for conv in convs for o in conv]
    served = {wid: w.info().requests_total - before[wid] for wid, w in d.live.items()}
    rate = sum(o.usage.cached_tokens for o in outs) / sum(o.usage.prompt_tokens for o in outs)
    # a later turn that found more than the shared system prompt cached landed on the worker holding its history
    # (its user turns are its own from the first block past the system prompt on)
    later = [o for conv in convs for o in conv[1:]]
    history = sum(o.usage.cached_tokens > SYSTEM for o in later) / len(later)
    return rate, served, [list(o.token_ids) for o in outs], history


def test_conversations_through_three_routers_in_turn_hit_the_cache_as_through_one(roomy):
    """Multi-turn conversations (turns re-send their history) through one router, then twice through all three in
    turn (fresh system prompts each round): the 3-router rounds' turns return to their history's worker about as
    often as the 1-router round's (CONV_HISTORY_POINTS), no worker past its share + CONV_SPREAD_MARGIN in any round,
    and every router heard the others' placements (replica sync). Checked against broken versions: with the index
    ignored (each router on its own mirror) the history share falls to 0.33-0.44 and fails; with replica sync off
    only the last assertion failed (the token hit rate and spread
    stayed within the margins in 3 of 3 runs: on tiny a prefill takes milliseconds, so the workers' own events
    confirm a placement almost as soon as a shared one would arrive); the old load term and kv_pending_s 0 lower the
    1- and 3-router rates alike (tests/router/test_kv_replica.py catches those). Rounds during which Redis failed the
    routers (they then route by load only, by design) are run again: the property compares routers sharing an index."""
    d = roomy

    def trouble() -> int:
        """Times the routers found Redis away (a stream read failed, a cold tie was drawn locally): the designed
        fallback, routing by load only, which no longer compares routers sharing an index."""
        return sum(r.core.kv_events.redis_errors + (r.core.kv_events.ties.local if r.core.kv_events.ties else 0)
                   for r in d.routers)

    def clean_round(stubs: list, seeds: list[int]) -> tuple:
        """A round during which Redis always answered; on a starved host (two busy processes beside the suite,
        Redis timing out for seconds) a round that fell back is run again with the next seed, a few times."""
        for seed in seeds:
            before = trouble()
            got = _conversations(d, stubs, seed)
            if trouble() == before:
                return got
            print(f"conversations: round of seed {seed} fell back to load-only routing (Redis away); again")
        raise AssertionError(f"Redis failed the routers in each of {len(seeds)} rounds: nothing to compare")

    one_rate, one_served, _, one_hist = clean_round(d.stubs[:1], [11, 21, 31, 41])
    rounds = [clean_round(d.stubs, [seed, seed + 10, seed + 20, seed + 30]) for seed in (12, 13)]
    seen = (f"1 router {one_rate:.3f} (history {one_hist:.2f}) {one_served}; 3 routers "
            + "; ".join(f"{r:.3f} (history {h:.2f}) {s}" for r, s, _, h in rounds))
    print("conversations:", seen)
    n_req = CONV_SYSTEMS * CONV_PER_SYSTEM * CONV_TURNS
    share = n_req / N_WORKERS
    assert one_rate > 0.5  # the histories are most of each prompt
    for served in [one_served] + [s for _r, s, _o, _h in rounds]:
        assert sum(served.values()) == n_req, seen
        assert max(served.values()) <= (1 + CONV_SPREAD_MARGIN) * share, seen
    assert sum(h for _r, _s, _o, h in rounds) / len(rounds) >= one_hist - CONV_HISTORY_POINTS, seen
    for r in d.routers:
        _all_scored_on_events(r)
    assert sum(r.core.kv_events.placements_applied for r in d.routers) > 0  # the routers heard each other


def test_an_eviction_is_seen_by_every_router_and_stops_routing_on_it(deployment):
    d = deployment
    w0 = d.workers[0]
    system = _workload(3)[0][:SYSTEM]
    hashes = prefix_block_hashes(system + [1], BS)
    direct = RouterServer(RouterConfig(mode="colocated", serve_metrics=False), StaticWorkerSource([w0.info])).start()
    try:
        with grpc.insecure_channel(direct.address) as ch:
            stub = pdserve_pb2_grpc.PDServeStub(ch)
            _generate(stub, system + [1, 2, 3])
            wait_until(lambda: all(r.core.kv_index.match(["c0"], hashes)["c0"] == len(hashes) for r in d.routers),
                       timeout=SEEN_S, message="every router sees c0 cache the prefix")
            # two long prompts of other tokens need most of c0's 48 blocks: the prefix is evicted
            for k in range(2):
                _generate(stub, [900 + (k * 37 + i) % 90 for i in range(40 * BS)], max_tokens=1)
        wait_until(lambda: all(r.core.kv_index.match(["c0"], hashes)["c0"] == 0 for r in d.routers),
                   timeout=SEEN_S, message="every router sees the eviction")
    finally:
        direct.stop()


def test_a_router_started_late_catches_up_by_replay(deployment):
    d = deployment
    late = d.router()
    try:
        ref = d.routers[0].core.kv_index
        wait_until(lambda: late.core.kv_events.num_synced() == N_WORKERS
                   and all(late.core.kv_index.num_blocks(w) == ref.num_blocks(w) > 0 for w in d.live),
                   timeout=SEEN_S, message="the late router's index equals the others'")
        for w in d.live:
            assert late.core.kv_index.num_blocks(w) == d.routers[1].core.kv_index.num_blocks(w)
    finally:
        late.stop()


def test_a_worker_that_leaves_the_registry_leaves_every_index(deployment):
    d = deployment
    gone = d.live.pop("c2")
    d.registry.deregister("c2")
    gone.stop()
    wait_until(lambda: all("c2" not in r.core.kv_index.workers() and not r.core.kv_events.synced("c2")
                           for r in d.routers), timeout=SEEN_S, message="c2 gone from every router's index")
    assert all(r.core.kv_index.num_blocks("c2") == 0 for r in d.routers)
