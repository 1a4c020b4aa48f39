"""A discrete-event simulation of one pdserve deployment on a virtual clock.

Lifecycle: ``Simulation(profile, SimConfig(...))`` builds the workers (each an engine from
``simulator.engine_sim``: pdserve's own ``Scheduler`` and ``BlockManager``) and the router's
own policy objects: a ``router.placement.Placer`` over a ``WorkerSelector``, a ``PrefixIndex``
and a ``RouterConfig``, reading live ``WorkerInfo`` records of the simulated workers. ``run(requests)``
replays ``SimRequest``s (arrival time, prompt token ids, forced output length) and returns one
``loadtest.stats.RequestRecord`` per request, the same records ``pdserve bench`` fills, so the
summary, the JSON and the goodput are computed by the same code as for a real run.

What happens to a request (times on the virtual clock):
1. It arrives; past ``max_num_requests`` held requests it fails with RESOURCE_EXHAUSTED (the router's own
   ``RequestBound``). After ``router_per_request_s`` (a pair's prefill starts ``router_per_request_pair_s`` after the
   arrival instead) the router's ``Placer.route`` decides: colocated, whole on a
   decode worker (conditional disaggregation), or a prefill/decode pair.
   Prefixes are scored as a deployed router scores them by default: on the router's ``KVIndex``, which every
   simulated engine's prefix-cache events reach at the end of the step that made them (``SimConfig.kv_events``).
2. A pair: ``Placer.try_pair`` ranks the decode workers and reserves the prompt's blocks on one (the
   router's ``WorkerCalls`` sends it; the simulated ``Reserve`` runs ``engine.reserve`` and answers at once, as the
   worker answers it beside the step in flight: ``EngineLoop.beside``). No room anywhere: the request joins the router's
   admission queue (its own ``AdmissionQueue``, driven without blocking on the virtual clock) and its head
   retries whenever a pair request's decode blocks are released.
3. The prefill worker adds the prompt as prefill-only; at the end of the step that completes it, the
   first token goes to the client and the KV transfer, which overlaps the
   last step layer by layer, completes at ``max(end + link(bytes / layers), start + link(bytes))``.
   The prefill worker releases the blocks then; the decode worker adds the request to its batch at
   its next step boundary after the KV arrived.
4. Whole requests (colocated, or conditional disaggregation) run on one engine from prompt to end.
5. Every token reaches the client at the end of the step that produced it (a step's duration includes
   the serving path's ``router_per_token_s`` for each token it streams: engine_sim.SimRunner); at the finish
   the router releases its counts (``Placer.release``), which may let the admission queue's head in.

Commands to a worker that is in the middle of a step wait for its end, as the real ``EngineLoop`` runs
commands between steps. With ``SimConfig.workers_per_host`` > 1 and a profile that measured co-running
(``Profile.corun``), workers share hosts in creation order and a step runs slower while its host mates run
theirs (memory bus, last-level cache): its remaining solo time is rescaled whenever a mate starts or ends a step
(a fluid model; the step's end event is moved). Not modelled: migration and failures, speculative decoding, n > 1, beam search,
the registry's heartbeat lag (the router reads live load), network latency other than the KV link,
CPU taken from the workers by the router and the clients.
"""
from __future__ import annotations

import heapq
import itertools
import math
import random
from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from loadtest.stats import RequestRecord
from proto.worker_pb2 import WorkerInfo
from router.admission import AdmissionQueue, RequestBound, Ticket
from router.config import RouterConfig
from router.events import FlowError
from router.placement import Placer
from router.placement_records import Hold, Placement, Route
from router.kv.prefix_index import PrefixIndex
from router.scope import RequestScope
from router.selection import WorkerSelector
from router.validation import ValidatedRequest
from router.worker_calls import WorkerCalls
from simulator.costs import Profile, ProfileSet
from simulator.engine_sim import SIM_TOKEN
# SimConfig, SimRequest and the workers live in their own modules; imported from here as before
from simulator.sim_config import DEFAULT_KV_CACHE_BYTES, DEFAULT_MAX_NUM_SEQS, MODES, SimConfig, SimRequest  # noqa: F401
from simulator.sim_worker import SimWorker, _SimClients, _SimKVEvents, _SimSource  # noqa: F401
from worker_common.request import prefix_fetch_id


@dataclass
class _Flow:
    """One request's journey through the simulated cluster."""

    req: SimRequest
    record: RequestRecord
    scope: RequestScope
    params: SamplingParams
    placement: Optional[Placement] = None
    ticket: Optional[Ticket] = None
    """Its place in the router's admission queue while it waits for decode KV capacity."""
    kv_at: Optional[float] = None
    first_token_at: Optional[float] = None


@dataclass
class PoolStats:
    """Per-pool utilisation of one simulation."""

    workers: int
    busy_s: float
    steps: int
    tokens: int
    kv_bytes_received: float = 0.0
    """Decode pool: KV bytes that arrived by transfer (the prefill pool's ``kv_transfer_bytes_total``)."""
    kv_cached_tokens: int = 0
    """Decode pool: prompt tokens its reservations found cached, so not transferred (delta transfers)."""
    kv_fetched_tokens: int = 0
    """Prefill pool: prompt tokens it received from the decode worker holding them instead of computing them
    (prefix fetches; their bytes are in the decode pool's ``kv_bytes_received``, which counts every transfer)."""

    def utilisation(self, duration_s: float) -> float:
        return self.busy_s / (self.workers * duration_s) if self.workers and duration_s > 0 else 0.0


class Simulation:
    """The virtual clock, the workers and the router (see module docstring)."""

    def __init__(self, profile: "Profile | ProfileSet", cfg: SimConfig) -> None:
        profiles = ProfileSet.of(profile)
        self.profiles = profiles
        self.role_profiles: dict[str, Profile] = {r: profiles.at(cfg.pool_tp(r), cfg.tp_flag(r)) for r in cfg.roles}
        """Each pool's profile: the one taken at its TP (with the router's CPU per token added to a token's cost
        where the router runs on the workers' cores)."""
        if cfg.router_on_worker_cores and profiles.base.router_cpu_per_token_s > 0:
            extra = profiles.base.router_cpu_per_token_s
            self.role_profiles = {r: replace(p, router_per_token_s=p.router_per_token_s + extra)
                                  for r, p in self.role_profiles.items()}
        self.profile = profiles.base
        """The serving path's costs (router, pair RPCs), the KV link and bytes per token: the host's, any TP."""
        self.cfg = cfg
        self.now = 0.0
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._tick = itertools.count()
        self.num_blocks = {r: cfg.kv_blocks(p) for r, p in self.role_profiles.items()}
        """KV blocks of each pool's workers."""
        self.kv_bytes = 0.0
        """KV bytes every transfer so far shipped (all its rank pairs together)."""
        self.kv_cached_tokens = 0
        """Prompt tokens decode reservations found cached, so not shipped."""
        self.kv_fetched_tokens = 0
        """Prompt tokens prefill workers fetched from the decode worker holding them (decode -> prefill)."""
        self.transfer_ranks = min(cfg.pool_tp("prefill"), cfg.pool_tp("decode"))
        """Rank pairs a prefill-to-decode transfer runs on at once (its bytes split among them)."""
        self.workers: dict[str, SimWorker] = {}
        """Every worker up (draining ones too), by id."""
        self.pools: dict[str, list[SimWorker]] = {}
        """The same by role, oldest first: what the router lists."""
        self.added: dict[str, tuple[str, float]] = {}
        """Worker id -> (role, when it was added): the initial ones at 0, also after they are dropped."""
        self.removed: dict[str, float] = {}
        """Worker id -> when it started to drain (out of routing)."""
        self.dropped: dict[str, float] = {}
        """Worker id -> when it left, drained."""
        self._draining: list[SimWorker] = []
        self._next_id: dict[str, int] = {}
        self.corun = profile.corun if cfg.workers_per_host > 1 else None
        """The co-run model steps are priced with, or None (one worker per host, or a profile without one)."""
        self._hosts: dict[int, list[SimWorker]] = {}
        self._created = 0
        self._hooks = 0  # periodic events queued (they never keep a run going by themselves)
        self._reaping = False
        self._ecfg = {r: EngineConfig(model="sim", block_size=self.profile.block_size, num_kv_blocks=blocks,
                                      max_num_seqs=cfg.max_num_seqs, max_num_batched_tokens=cfg.max_num_batched_tokens,
                                      enable_prefix_caching=cfg.enable_prefix_caching)
                      for r, blocks in self.num_blocks.items()}
        pools = ({"colocated": cfg.colocated} if cfg.mode == "colocated"
                 else {"prefill": cfg.prefill, "decode": cfg.decode})
        for role, n in pools.items():
            for _ in range(n):
                self._new_worker(role)
        self.max_model_len = min(w.engine.max_model_len for w in self.workers.values())
        """The longest sequence every worker holds (a pool whose KV cache is short, by ``rank_memory_bytes``, holds
        shorter ones than the model allows): a longer prompt fails at arrival, as the engines would refuse it."""
        self.link = self.profile.link(cfg.kv_link) if cfg.mode == "disaggregated" else None
        rcfg = RouterConfig(model="sim", mode=cfg.mode, serve_metrics=False,
                            max_num_requests=cfg.max_num_requests,
                            max_rpc_threads=max(256, cfg.max_num_requests + 1),
                            local_prefill_max_tokens=cfg.local_prefill_max_tokens,
                            prefill_queue_max_tokens=cfg.prefill_queue_max_tokens,
                            queue_timeout_s=cfg.queue_timeout_s, prefix_aware_routing=cfg.prefix_aware_routing,
                            kv_delta_transfers=cfg.kv_delta_transfers, decode_prefix_routing=cfg.decode_prefix_routing,
                            kv_prefix_fetch_min_tokens=cfg.kv_prefix_fetch_min_tokens,
                            kv_events=cfg.kv_events)
        self.selector = WorkerSelector()
        self.kv_events = _SimKVEvents(self, rcfg.kv_pending_s) if cfg.kv_events else None
        # the router's own WorkerCalls builds the Reserve; the simulated stub answers it from the engine
        self.placer = Placer(rcfg, _SimSource(self), self.selector, WorkerCalls(rcfg, _SimClients(self)),
                             admission=None, prefixes=PrefixIndex(), kv_events=self.kv_events,
                             rng=random.Random(cfg.seed))
        # the router's own bound and admission queue, driven without blocking on the virtual clock
        self.bound = RequestBound(cfg.max_num_requests)
        self.admission = AdmissionQueue(clock=lambda: self.now)
        self._waiting: dict[int, _Flow] = {}
        """Arrival number -> the flow holding that ticket in ``admission``."""

    def _new_worker(self, role: str) -> SimWorker:
        n = self._next_id.get(role, 0)
        self._next_id[role] = n + 1
        w = SimWorker(self, f"{role}-{n}", role, self._ecfg[role], self.num_blocks[role])
        if self.cfg.workers_per_host > 1:  # hosts fill in creation order
            w.host = self._hosts.setdefault(self._created // self.cfg.workers_per_host, [])
            w.host.append(w)
        self._created += 1
        self.workers[w.worker_id] = w
        self.pools.setdefault(role, []).append(w)
        self.added[w.worker_id] = (role, self.now)
        return w

    # -- the clock ------------------------------------------------------------------------------
    def at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._tick), fn))

    def run(self, requests: list[SimRequest]) -> list[RequestRecord]:
        """Replay ``requests`` to the end; one record per request, in the given order."""
        flows = []
        for r in requests:
            if not r.prompt_token_ids or r.max_tokens < 1:
                raise ValueError(f"request {r.request_id}: needs a prompt and max_tokens >= 1")
            rec = RequestRecord(r.request_id, len(r.prompt_token_ids), r.max_tokens, scheduled_s=r.arrival_s,
                                start_s=r.arrival_s)
            vreq = ValidatedRequest(r.request_id, None, r.prompt_token_ids,
                                    SamplingParams(max_tokens=r.max_tokens, ignore_eos=True, temperature=0.0))
            scope = RequestScope(vreq, r.arrival_s, math.inf)
            flow = _Flow(r, rec, scope, vreq.params)
            flows.append(flow)
            self.at(r.arrival_s, lambda f=flow: self._arrive(f))
        while self._events:
            t, _, fn = heapq.heappop(self._events)
            self.now = t
            fn()
        return [f.record for f in flows]

    def pool_stats(self) -> dict[str, PoolStats]:
        out: dict[str, PoolStats] = {}
        for w in self.workers.values():
            s = out.setdefault(w.role, PoolStats(0, 0.0, 0, 0))
            s.workers += 1
            s.busy_s += w.runner.busy_seconds
            s.steps += w.engine.num_steps
            s.tokens += w.engine.num_scheduled_tokens
        if "decode" in out:
            out["decode"].kv_bytes_received = self.kv_bytes
            out["decode"].kv_cached_tokens = self.kv_cached_tokens
        if "prefill" in out:
            out["prefill"].kv_fetched_tokens = self.kv_fetched_tokens
        return out

    # -- a request ------------------------------------------------------------------------------
    def _arrive(self, f: _Flow) -> None:
        if len(f.req.prompt_token_ids) >= self.max_model_len:  # the engines would refuse it (a short KV cache)
            self._fail(f, f"INVALID_ARGUMENT: prompt of {len(f.req.prompt_token_ids)} tokens; the deployment's "
                          f"max_model_len is {self.max_model_len}", admitted=False)
            return
        if not self.bound.try_take():
            self._fail(f, "RESOURCE_EXHAUSTED: router queue is full", admitted=False)
            return
        f.scope.seq = self.admission.next_seq()
        self.at(self.now + self.profile.router_per_request_s, lambda: self._place(f))

    def _place(self, f: _Flow) -> None:
        try:
            route = self.placer.route(f.scope)
            if route is Route.PAIR:
                if self.admission.has_waiters():  # others wait for decode capacity: no overtaking
                    self._enqueue(f)
                    return
                p = self.placer.try_pair(f.scope, set())
                if p is None:
                    self._enqueue(f)
                    return
                self._start_pair(f, p)
            else:
                self._start_whole(f, self.placer.place_whole(f.scope, route.pool, set()))
        except FlowError as e:
            self._fail(f, f"{e.code.name}: {e}")

    def _enqueue(self, f: _Flow) -> None:
        f.ticket = self.admission.enter(f.scope.seq, f.scope.rid)
        self._waiting[f.scope.seq] = f

    def _dequeue(self, f: _Flow) -> None:
        self.admission.leave(f.ticket)
        del self._waiting[f.scope.seq]

    def _drain_queue(self) -> None:
        """Decode capacity was freed: the queue's head retries, and the next while they get in."""
        while (t := self.admission.head()) is not None:
            f = self._waiting[t.seq]
            if self.now - t.entered_at > self.cfg.queue_timeout_s:
                self._dequeue(f)
                self._fail(f, "RESOURCE_EXHAUSTED: waited past queue_timeout_s for decode KV capacity")
                continue
            try:
                p = self.placer.try_pair(f.scope, set())
            except FlowError as e:
                self._dequeue(f)
                self._fail(f, f"{e.code.name}: {e}")
                continue
            if p is None:
                return
            self._dequeue(f)
            self._start_pair(f, p)

    def _start_pair(self, f: _Flow, p: Placement) -> None:
        f.placement = p
        d, pw = self.workers[p.decode.worker_id], self.workers[p.prefill.worker_id]
        wid, prompt = p.request_id, f.req.prompt_token_ids

        def on_prefill(out: Any, step_s: float) -> None:
            if out.finish_reason != "prefill_done":
                return
            pw.handlers.pop(wid, None)
            pw.unprefilled.pop(wid, None)
            self._tokens(f, 1)
            # a delta transfer ships what the decode worker's cache lacked
            cached = p.reservation.num_cached_tokens
            self.kv_bytes += (len(prompt) - cached) * self.profile.kv_bytes_per_token
            self.kv_cached_tokens += cached
            nbytes = (len(prompt) - cached) * self.profile.kv_bytes_per_token / self.transfer_ranks
            L = self.profile.num_layers
            done = max(self.now + self.link.seconds(nbytes / L), self.now - step_s + self.link.seconds(nbytes))
            self.at(done, lambda: kv_arrived(done))

        def kv_arrived(t: float) -> None:
            f.kv_at = t

            def release() -> None:
                pw.engine.release(wid)
                pw.engine.release(prefix_fetch_id(wid))

            pw.submit(release)
            self.placer.release(p, f.scope, (Hold.PREFILL,))
            d.handlers[wid] = lambda out, _s: self._on_output(f, out)
            d.submit(lambda: d.engine.add_prefilled_request(wid, prompt, SIM_TOKEN, f.params))

        def send_prefill() -> None:
            pw.handlers[wid] = on_prefill
            pw.unprefilled[wid] = len(prompt)
            self._fetch_prefix(pw, wid, prompt, p.reservation.num_cached_tokens,
                               lambda: pw.add_request(wid, prompt, f.params, prefill_only=True))

        # the Reserve reply comes at once (the worker reserves beside its step in flight); a pair's RPCs cost
        # the router more than a whole request's (the profile's per_request_pair_s)
        pair = self.profile.router_per_request_pair_s
        t = self.now + (0.0 if pair is None else max(0.0, pair - self.profile.router_per_request_s))
        if t > self.now:
            self.at(t, send_prefill)
        else:
            send_prefill()

    def _fetch_prefix(self, pw: SimWorker, wid: str, prompt: list[int], held_by_decode: int,
                      then: Callable[[], None]) -> None:
        """The prefill worker's prefix fetch (``prefill_worker.worker``), then ``then`` (the prompt joins its engine):
        when the decode worker's reservation holds at least ``kv_prefix_fetch_min_tokens`` more leading tokens than
        this engine caches, their blocks are reserved here, arrive over the link (decode -> prefill, counted in the
        KV bytes) and are named in this cache, so the prefill computes only the rest, unless receiving them would
        take longer than computing them (the worker's ``FetchCost``, priced here on the profile: the link's time for
        their bytes against the step model's token term for them). The PrefixFetch/SendPrefix round trip through
        the router is not priced (loopback RPCs, well under a step)."""
        cfg, eng = self.cfg, pw.engine
        minimum = cfg.kv_prefix_fetch_min_tokens if cfg.kv_delta_transfers else 0
        held = held_by_decode // eng.block_size * eng.block_size
        if minimum <= 0 or held < minimum or not eng.block_manager.enable_caching:
            then()
            return

        def start() -> None:  # on the prefill worker's loop, as the Prefill RPC's call is
            fid = prefix_fetch_id(wid)
            have = eng.cached_prefix_tokens(prompt[:held])  # decided before a block is taken (none is evicted)
            nbytes = (held - have) * self.profile.kv_bytes_per_token
            if held - have < minimum or not self._fetch_pays(pw, len(prompt) - have, held - have, nbytes):
                then()
                return
            if eng.reserve_prompt(fid, held, prompt[:held], prefix=True) is None:  # (it finds the same `have`)
                then()
                return
            self.kv_bytes += nbytes
            self.kv_fetched_tokens += held - have

            def arrived() -> None:
                eng.commit_reserved(fid, prompt[:held])
                then()

            self.at(self.now + self.link.seconds(nbytes / self.transfer_ranks), lambda: pw.submit(arrived))

        pw.submit(start)

    def _fetch_pays(self, pw: SimWorker, to_compute: int, fetched: int, nbytes: float) -> bool:
        """Receiving ``fetched`` of the ``to_compute`` prompt tokens takes less time than computing them."""
        lin = self.role_profiles[pw.role].step.lin
        return self.link.seconds(nbytes / self.transfer_ranks) < lin(to_compute) - lin(to_compute - fetched)

    def _start_whole(self, f: _Flow, p: Placement) -> None:
        f.placement = p
        w = self.workers[p.decode.worker_id]
        wid = p.request_id
        w.handlers[wid] = lambda out, _s: self._on_output(f, out, w)
        w.unprefilled[wid] = len(f.req.prompt_token_ids)
        w.add_request(wid, f.req.prompt_token_ids, f.params)

    def _on_output(self, f: _Flow, out: Any, whole_on: Optional[SimWorker] = None) -> None:
        if whole_on is not None and f.first_token_at is None:
            whole_on.unprefilled.pop(out.request_id, None)
        if out.new_token_ids:
            self._tokens(f, len(out.new_token_ids))
        if out.finish_reason is not None:
            w = self.workers[f.placement.decode.worker_id]
            w.handlers.pop(out.request_id, None)
            self._finish(f, out.finish_reason)

    def _tokens(self, f: _Flow, n: int) -> None:
        t = self.now
        if f.first_token_at is None:
            f.first_token_at = t
        f.record.chunk_times_s.append(t)
        f.record.chunk_tokens.append(n)
        f.record.output_tokens += n

    def _finish(self, f: _Flow, reason: str) -> None:
        rec = f.record
        rec.end_s = rec.chunk_times_s[-1] if rec.chunk_times_s else self.now
        rec.success = True
        rec.finish_reason = reason
        self.bound.give_back()
        p = f.placement
        self.placer.release(p, f.scope)
        if p is not None and p.route is Route.PAIR:
            self._drain_queue()

    def _fail(self, f: _Flow, error: str, admitted: bool = True) -> None:
        rec = f.record
        rec.end_s = self.now
        rec.success = False
        rec.error = error
        if admitted:
            self.bound.give_back()

    # -- scaling (the planner's view): workers that come and go, a periodic hook ----------------------------
    def worker_infos(self, role: Optional[str] = None) -> list[WorkerInfo]:
        """The registry's view: every worker still up (draining ones too) with the counters a real worker reports."""
        return [w.info() for w in self.workers.values() if role is None or w.role == role]

    def live_worker_ids(self, role: str) -> list[str]:
        """Workers of ``role`` added and not removed (the pool's size as the planner counts it), oldest first."""
        return [w.worker_id for w in self.pools.get(role, []) if w.worker_id not in self.removed]

    def add_worker(self, role: str, ready_after_s: float = 0.0) -> str:
        """A new worker of ``role`` now; it takes requests after ``ready_after_s`` (its model load). Returns its id."""
        pools = ("colocated",) if self.cfg.mode == "colocated" else ("prefill", "decode")
        if role not in pools:
            raise ValueError(f"role must be one of {pools} in {self.cfg.mode} mode, got {role!r}")
        w = self._new_worker(role)
        if ready_after_s > 0:
            w.ready = False
            self.at(self.now + ready_after_s, lambda: self._set_ready(w, w.worker_id not in self.removed))
        return w.worker_id

    def remove_worker(self, role: str) -> Optional[str]:
        """Drain the newest live worker of ``role`` (as ``Cluster.scale_pool`` does): out of routing at once, dropped
        once it holds nothing. Returns its id, or None when the pool is empty."""
        live = self.live_worker_ids(role)
        if not live:
            return None
        w = self.workers[live[-1]]
        self.removed[w.worker_id] = self.now
        self._set_ready(w, False)
        self._draining.append(w)
        self._reap()
        return w.worker_id

    @staticmethod
    def _set_ready(w: SimWorker, ready: bool) -> None:
        w.ready = ready
        w.changed()

    def _reap(self) -> None:
        """Drop the draining workers that hold nothing; look again shortly while some still do."""
        keep = []
        for w in self._draining:
            idle = (w.busy_until is None and not w._commands and not w.handlers and not w.unprefilled
                    and self.selector.in_flight(w.worker_id) == 0 and not w.engine.has_unfinished_requests())
            if idle:
                del self.workers[w.worker_id]
                if self.kv_events is not None:
                    self.kv_events.index.clear(w.worker_id)  # (a deregistered worker leaves the router's index)
                self.pools[w.role].remove(w)
                w.host.remove(w)  # its host's core is free (a later worker does not take it: hosts fill in order)
                self.dropped[w.worker_id] = self.now
            else:
                keep.append(w)
        self._draining = keep
        # look again while other events are due (it counts as a periodic hook: it never keeps the run going)
        if keep and not self._reaping and len(self._events) > self._hooks:
            self._reaping = True
            self._hooks += 1

            def again() -> None:
                self._reaping = False
                self._hooks -= 1
                self._reap()

            self.at(self.now + 0.1, again)

    def every(self, interval_s: float, fn: Callable[[], None]) -> None:
        """Call ``fn()`` every ``interval_s`` virtual seconds from now on, while anything else is still to happen
        (arrivals, steps, transfers): the run ends when only such hooks are left."""
        if not interval_s > 0:
            raise ValueError(f"interval_s must be > 0, got {interval_s!r}")

        def tick() -> None:
            self._hooks -= 1
            fn()
            if len(self._events) > self._hooks:
                self._hooks += 1
                self.at(self.now + interval_s, tick)

        self._hooks += 1
        self.at(self.now + interval_s, tick)

    def worker_seconds(self, until: Optional[float] = None) -> dict[str, float]:
        """Per pool, the seconds each worker was up: from when it was added (0 for the initial ones) until it was
        dropped after its drain, or ``until`` (default: now)."""
        end = self.now if until is None else until
        out: dict[str, float] = {}
        for wid, (role, t0) in self.added.items():
            t1 = min(self.dropped.get(wid, end), end)
            out[role] = out.get(role, 0.0) + max(0.0, t1 - t0)
        return out
