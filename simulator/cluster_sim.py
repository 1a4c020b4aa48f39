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
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

import grpc

from engine.block_manager import CLEARED, REMOVED, STORED
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from loadtest.stats import RequestRecord
from proto import worker_pb2
from proto.worker_pb2 import WorkerInfo
from router.admission import AdmissionQueue, RequestBound, Ticket
from router.config import RouterConfig
from router.events import FlowError
from router.kv_index import KVIndex
from router.placement import Hold, Placement, Placer, Route
from router.prefix_index import PrefixIndex
from router.scope import RequestScope
from router.selection import WorkerSelector
from router.validation import ValidatedRequest
from router.worker_calls import WorkerCalls
from simulator.costs import Profile, ProfileSet
from simulator.engine_sim import SIM_TOKEN, sim_engine
from transport.errors import StatusRpcError

MODES = ("disaggregated", "colocated")
DEFAULT_KV_CACHE_BYTES = EngineConfig.kv_cache_memory_bytes
"""What a worker of ``pdserve up`` gets without --num-kv-blocks: the engine's default budget."""
DEFAULT_MAX_NUM_SEQS = EngineConfig.max_num_seqs


@dataclass
class SimConfig:
    """One deployment, spelled as ``pdserve up`` spells it."""

    mode: str = "disaggregated"
    """'disaggregated' (prefill + decode pools) or 'colocated'."""
    prefill: int = 1
    decode: int = 1
    colocated: int = 0
    """Workers per pool (colocated mode uses ``colocated``)."""
    max_num_batched_tokens: int = 2048
    """Every engine's per-step token budget (the chunk size of chunked prefill)."""
    max_num_seqs: int = DEFAULT_MAX_NUM_SEQS
    num_kv_blocks: Optional[int] = None
    """KV blocks per worker; None: ``kv_cache_memory_bytes`` over the profile's bytes per block."""
    kv_cache_memory_bytes: int = DEFAULT_KV_CACHE_BYTES
    enable_prefix_caching: bool = True
    prefix_aware_routing: bool = True
    kv_delta_transfers: bool = True
    """The router's rule (issue 47): a decode reservation takes the prompt's leading blocks the decode worker's cache
    holds and only the rest is transferred (and priced on the link)."""
    decode_prefix_routing: bool = True
    """The router's rule: decode workers ranked by the prompt blocks they hold against their load."""
    kv_events: bool = True
    """The router scores prefixes on its KV-event index, as a deployed router does by default: every simulated
    engine's prefix-cache events (``BlockManager.enable_events``) reach the router's own ``KVIndex`` at the end of
    the step (or the command) that made them, and the router's placements count as pending there for
    ``kv_pending_s``. False (``pdserve router --no-kv-events``): on its mirror of where it sent what."""
    local_prefill_max_tokens: int = 0
    prefill_queue_max_tokens: Optional[int] = None
    max_num_requests: int = 192
    queue_timeout_s: float = 300.0
    kv_link: str = "gloo"
    workers_per_host: int = 1
    """Workers sharing one host's memory system, in creation order (one core or GPU each). Above 1 a step is
    slowed while its host's other workers run theirs, by the profile's co-run model (``Profile.corun``); 1 (the
    default, each worker alone on its host) prices no contention."""
    tensor_parallel_size: int = 1
    """Ranks of every worker (``pdserve up --tensor-parallel-size``); ``prefill_tp`` / ``decode_tp`` set a pool
    apart. A pool at TP k is priced by the profile taken at k (``simulator.costs.ProfileSet``), its KV blocks
    are each rank's budget over one rank's bytes per block, and a transfer between TP p and TP d runs on
    min(p, d) rank pairs at once (each source rank sends its heads, each destination rank receives its own)."""
    prefill_tp: Optional[int] = None
    decode_tp: Optional[int] = None
    rank_memory_bytes: Optional[int] = None
    """Memory of one rank (a GPU, or a process's share of a host) for its weights and KV cache: the cache gets
    what the profile's ``weight_bytes_per_rank`` leaves (the reason a model needs TP at all). None: the cache
    is ``kv_cache_memory_bytes`` per rank whatever the weights."""
    seed: int = 0
    """Seeds the router's random draws (ties between equally good workers): the same seed, configuration and
    requests give the same simulation, so two runs of one command line agree and a test's numbers are fixed."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        for name in ("prefill", "decode", "colocated"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 0:
                raise ValueError(f"--{name} must be an integer >= 0, got {v!r}")
        if self.mode == "colocated" and self.colocated < 1:
            raise ValueError("--colocated must be >= 1 in colocated mode (a budget of 0 workers serves nothing)")
        if self.mode == "disaggregated" and (self.prefill < 1 or self.decode < 1):
            raise ValueError("disaggregated mode needs --prefill >= 1 and --decode >= 1")
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_num_requests"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= 1, got {v!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 1:
            raise ValueError(f"--num-kv-blocks must be >= 1, got {self.num_kv_blocks}")
        if self.local_prefill_max_tokens < 0:
            raise ValueError(f"--local-prefill-max-tokens must be >= 0, got {self.local_prefill_max_tokens}")
        if not isinstance(self.workers_per_host, int) or self.workers_per_host < 1:
            raise ValueError(f"--workers-per-host must be an integer >= 1, got {self.workers_per_host!r}")
        for flag, v in (("--tensor-parallel-size", self.tensor_parallel_size), ("--prefill-tp", self.prefill_tp),
                        ("--decode-tp", self.decode_tp)):
            if v is not None and (not isinstance(v, int) or v < 1):
                raise ValueError(f"{flag} must be an integer >= 1, got {v!r}")
        if self.workers_per_host > 1 and any(self.pool_tp(r) > 1 for r in self.roles):
            raise ValueError("--workers-per-host > 1 prices one-rank workers sharing a host; with tensor "
                             "parallelism a worker is several ranks (co-running of TP workers is not modelled)")
        if self.rank_memory_bytes is not None and self.rank_memory_bytes < 1:
            raise ValueError(f"--rank-memory-bytes must be >= 1, got {self.rank_memory_bytes}")

    @property
    def roles(self) -> tuple[str, ...]:
        return ("colocated",) if self.mode == "colocated" else ("prefill", "decode")

    def pool_tp(self, role: str) -> int:
        """Ranks of each worker of ``role``'s pool (``cluster.config.pool_tp``'s rule)."""
        own = {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(role)
        return own if own is not None else self.tensor_parallel_size

    def pool_size(self, role: str) -> int:
        return {"prefill": self.prefill, "decode": self.decode, "colocated": self.colocated}[role]

    @property
    def num_ranks(self) -> int:
        """Engine ranks (cores or GPUs) of the deployment: a worker at TP k counts k. ``pdserve plan``'s budget."""
        return sum(self.pool_size(r) * self.pool_tp(r) for r in self.roles)

    def tp_flag(self, role: str) -> str:
        """The flag that sets ``role``'s TP, for messages."""
        own = {"prefill": self.prefill_tp, "decode": self.decode_tp}.get(role)
        return f"--{role}-tp" if own is not None else "--tensor-parallel-size"

    @property
    def num_workers(self) -> int:
        return self.colocated if self.mode == "colocated" else self.prefill + self.decode

    def _tp_label(self, role: str) -> str:
        return f"(TP{self.pool_tp(role)})" if any(self.pool_tp(r) > 1 for r in self.roles) else ""

    def label(self) -> str:
        if self.mode == "colocated":
            return f"colocated {self.colocated}{self._tp_label('colocated')} (chunk {self.max_num_batched_tokens})"
        cd = f", local<={self.local_prefill_max_tokens}" if self.local_prefill_max_tokens else ""
        if self.prefill_queue_max_tokens is not None:
            cd += f", backlog>={self.prefill_queue_max_tokens}"
        return (f"disaggregated {self.prefill}P{self._tp_label('prefill')}+{self.decode}D{self._tp_label('decode')} "
                f"(chunk {self.max_num_batched_tokens}{cd})")

    def kv_blocks(self, profile: Profile) -> int:
        """KV blocks per worker priced by ``profile`` (the one at the pool's TP): ``num_kv_blocks``, or each
        rank's cache budget over one rank's bytes per block (every rank holds the same block ids, its heads of
        them). The budget is ``kv_cache_memory_bytes``, or, with ``rank_memory_bytes``, what the rank's weights
        leave of it."""
        if self.num_kv_blocks:
            return self.num_kv_blocks
        per_block = profile.rank_kv_bytes_per_token * profile.block_size
        budget, flag = self.kv_cache_memory_bytes, "--kv-cache-memory-bytes"
        if self.rank_memory_bytes is not None:
            if profile.weight_bytes_per_rank is None:
                raise ValueError(f"--rank-memory-bytes needs the profile's weight_bytes_per_rank (TP "
                                 f"{profile.tensor_parallel_size}: take the profile again with this pdserve)")
            budget = self.rank_memory_bytes - profile.weight_bytes_per_rank
            flag = f"--rank-memory-bytes {self.rank_memory_bytes} at TP {profile.tensor_parallel_size}"
            if budget < per_block:
                raise ValueError(f"{flag}: a rank's weights ({profile.weight_bytes_per_rank} B) leave no room "
                                 f"for a KV block of {per_block} B (the model needs more tensor parallelism)")
        blocks = budget // per_block
        if blocks < 1:
            raise ValueError(f"{flag} {budget} holds no KV block of {per_block} bytes")
        return blocks

    def fits(self, profile: Profile) -> bool:
        """Whether a worker priced by ``profile`` has room for at least one KV block (``kv_blocks`` succeeds)."""
        try:
            self.kv_blocks(profile)
        except ValueError:
            return False
        return True

    def up_flags(self, profile: "Profile | ProfileSet") -> str:
        """The ``pdserve up`` flags that run this deployment (``pdserve up`` sizes KV by blocks: a cache budget
        other than the engine's default becomes ``--num-kv-blocks``, or each pool's where their TP differs).
        ``profile``: a ``Profile`` or a ``ProfileSet`` (one per TP the pools run)."""
        profiles = ProfileSet.of(profile)
        if self.mode == "colocated":
            f = f"--colocated {self.colocated}"
        else:
            f = f"--prefill {self.prefill} --decode {self.decode}"
            if self.local_prefill_max_tokens:
                f += f" --local-prefill-max-tokens {self.local_prefill_max_tokens}"
            if self.prefill_queue_max_tokens is not None:
                f += f" --prefill-queue-max-tokens {self.prefill_queue_max_tokens}"
            if not self.kv_delta_transfers:
                f += " --no-kv-delta-transfers"
            if not self.decode_prefix_routing:
                f += " --no-decode-prefix-routing"
        if not self.kv_events:
            f += " --no-kv-events"
        tps = {r: self.pool_tp(r) for r in self.roles}
        if len(set(tps.values())) == 1:
            tp = next(iter(tps.values()))
            f += f" --tensor-parallel-size {tp}" if tp > 1 else ""
        else:
            f += f" --prefill-tp {tps['prefill']} --decode-tp {tps['decode']}"
        f += f" --max-num-batched-tokens {self.max_num_batched_tokens}"
        if (self.num_kv_blocks is not None or self.kv_cache_memory_bytes != DEFAULT_KV_CACHE_BYTES
                or self.rank_memory_bytes is not None):
            blocks = {r: self.kv_blocks(profiles.at(t)) for r, t in tps.items()}
            if len(set(blocks.values())) == 1:
                f += f" --num-kv-blocks {next(iter(blocks.values()))}"
            else:  # pools at different TP hold different blocks in the same memory
                f += f" --prefill-num-kv-blocks {blocks['prefill']} --decode-num-kv-blocks {blocks['decode']}"
        if self.max_num_seqs != DEFAULT_MAX_NUM_SEQS:
            f += f" --max-num-seqs {self.max_num_seqs}"
        if not self.enable_prefix_caching:
            f += " --no-prefix-caching"
        return f


@dataclass
class SimRequest:
    """One request of a simulated workload."""

    request_id: str
    arrival_s: float
    prompt_token_ids: list[int]
    max_tokens: int


class SimWorker:
    """One worker: an engine, its pending commands, and its step in progress."""

    def __init__(self, sim: "Simulation", worker_id: str, role: str, cfg: EngineConfig, num_blocks: int) -> None:
        self.sim = sim
        self.worker_id = worker_id
        self.role = role
        self.engine, self.runner = sim_engine(cfg, sim.role_profiles[role], num_blocks)
        self.busy_until: Optional[float] = None
        """End of the step in progress; None when idle."""
        self.host: list[SimWorker] = [self]
        """The workers on this one's host, itself included (``SimConfig.workers_per_host``)."""
        self._step: Optional[list] = None
        """With co-run pricing, the step in progress: [outputs, start, solo seconds, solo seconds left, segment
        start, stretch, generation]; its end event is rescheduled whenever a host mate starts or ends a step."""
        self._gen = 0
        self._commands: list[Callable[[], None]] = []
        self.handlers: dict[str, Callable[[Any, float], None]] = {}
        """Engine request id -> called with each of its outputs at the end of the step that made it."""
        self.unprefilled: dict[str, int] = {}
        """Requests whose first token is not out yet -> prompt tokens (the worker's queued_prompt_tokens)."""
        self._info: Optional[WorkerInfo] = None
        self._kick_due = False
        self.ready = True
        """In routing: False while its model loads (``Simulation.add_worker``) and once it drains."""
        self.requests_total = self.prompt_tokens_total = 0
        self.output_tokens_total = self.requests_finished_total = 0
        """WorkerInfo's cumulative counters, counted as a real worker counts them (worker_common/worker_base.py)."""
        if sim.cfg.kv_events and self.engine.block_manager.enable_caching:
            self.engine.block_manager.enable_events()  # published to the router's index (``publish``)

    def publish(self) -> None:
        """The prefix-cache events since the last call, into the router's KV-event index (a real worker publishes
        them after each loop pass; its router hears them a moment later)."""
        kv = self.sim.kv_events
        if kv is None:
            return
        kv.apply(self.worker_id, self.engine.block_manager.take_events())

    # -- what the router sees -----------------------------------------------------------------
    def info(self) -> WorkerInfo:
        if self._info is None:
            e = self.engine
            self._info = WorkerInfo(worker_id=self.worker_id, role=self.role, grpc_address=self.worker_id,
                                    kv_name=self.worker_id, num_total_blocks=e.num_total_blocks,
                                    num_free_blocks=e.num_free_blocks, num_running=e.num_running,
                                    num_waiting=e.num_waiting, queued_prompt_tokens=sum(self.unprefilled.values()),
                                    ready=self.ready, block_size=e.block_size, kv_cache_dtype=e.kv_cache_dtype,
                                    requests_total=self.requests_total, prompt_tokens_total=self.prompt_tokens_total,
                                    output_tokens_total=self.output_tokens_total,
                                    requests_finished_total=self.requests_finished_total)
        return self._info

    def changed(self) -> None:
        self._info = None

    # -- the engine loop -----------------------------------------------------------------------
    def submit(self, cmd: Callable[[], None]) -> None:
        """Run ``cmd`` (an engine call) now if idle, else at the end of the step in progress."""
        if self.busy_until is None:
            cmd()
            self.publish()
            self.changed()
            if not self._kick_due:  # step once every command of this instant is in (they batch together)
                self._kick_due = True
                self.sim.at(self.sim.now, self._due_kick)
        else:
            self._commands.append(cmd)

    def add_request(self, request_id: str, prompt: list[int], params: SamplingParams, **kw: Any) -> None:
        """A prompt this worker prefills (prefill-only, or a whole request): the engine's ``add_request`` at the next
        step boundary, counted in the arrival counters."""
        self.requests_total += 1
        self.prompt_tokens_total += len(prompt)
        self.submit(lambda: self.engine.add_request(request_id, prompt, params, **kw))

    def _due_kick(self) -> None:
        self._kick_due = False
        self._kick()

    def _kick(self) -> None:
        if self.busy_until is not None:
            return
        eng = self.engine
        if not eng.has_unfinished_requests():
            return
        steps = eng.num_steps
        outs = eng.step()
        self.changed()
        if eng.num_steps == steps:  # nothing could be scheduled: only outputs decided outside a step
            self.publish()
            self._deliver(outs, self.sim.now)
            return
        d = self.runner.last_seconds
        if self.sim.corun is None:
            self.busy_until = self.sim.now + d
            self.sim.at(self.busy_until, lambda: self._step_done(outs, d))
            return
        now = self.sim.now
        self._step = [outs, now, d, d, now, self._stretch(d), 0]
        self._schedule_end()
        self._host_changed()

    # -- co-run pricing (workers_per_host > 1 and a profile with a co-run model) ------------------
    def _stretch(self, solo_s: float) -> float:
        busy = sum(1 for w in self.host if w is not self and w.busy_until is not None)
        return self.sim.corun.stretch(solo_s, busy)

    def _schedule_end(self) -> None:
        st = self._step
        self._gen += 1
        st[6] = gen = self._gen
        self.busy_until = st[4] + st[3] * st[5]
        self.sim.at(self.busy_until, lambda: self._corun_end(gen))

    def _rescale(self) -> None:
        """A host mate started or ended a step: the rest of this one runs at the new pace."""
        st = self._step
        if st is None or self.busy_until is None:
            return
        now = self.sim.now
        st[3] = max(0.0, st[3] - (now - st[4]) / st[5])
        st[4] = now
        st[5] = self._stretch(st[2])
        self._schedule_end()

    def _host_changed(self) -> None:
        for w in self.host:
            if w is not self:
                w._rescale()

    def _corun_end(self, gen: int) -> None:
        st = self._step
        if st is None or gen != st[6]:
            return  # rescheduled since
        outs, start, solo = st[0], st[1], st[2]
        self._step = None
        actual = self.sim.now - start
        self.runner.busy_seconds += actual - solo
        self.busy_until = None
        self._host_changed()
        self._step_done(outs, actual)

    def _step_done(self, outs: list, duration: float) -> None:
        self.busy_until = None
        self.publish()  # what the step registered or evicted, heard at its end
        self._deliver(outs, self.sim.now, duration)
        cmds, self._commands = self._commands, []
        for c in cmds:
            c()
        self.publish()
        self.changed()
        self._kick()

    def _deliver(self, outs: list, now: float, duration: float = 0.0) -> None:
        for o in outs:
            h = self.handlers.get(o.request_id)
            if h is not None:
                self.output_tokens_total += len(o.new_token_ids)
                if o.finish_reason is not None and o.finish_reason != "prefill_done":
                    self.requests_finished_total += 1
                h(o, duration)


class _SimKVEvents:
    """The router's KV-event consumer in the simulation (what ``Placer`` reads of ``router.kv_index.KVEventConsumer``):
    the router's own ``KVIndex`` on the virtual clock, fed by every simulated engine's prefix-cache events as they
    happen (``SimWorker.publish``: no Redis hop, no lost events, so always in sync); worker loads as of now; one router,
    so no replica sync and no shared cold ties (``ties`` None, as a router without them)."""

    connected = True
    ties = None

    def __init__(self, sim: "Simulation", pending_s: float) -> None:
        self.sim = sim
        self.index = KVIndex(clock=lambda: sim.now)
        self.pending_s = pending_s

    def synced(self, worker_id: str) -> bool:
        return worker_id in self.sim.workers

    def load(self, worker_id: str) -> Optional[tuple[int, int, int]]:
        w = self.sim.workers.get(worker_id)
        if w is None:
            return None
        e = w.engine
        return e.num_running, e.num_waiting, sum(w.unprefilled.values())

    def placed(self, worker_id: str, hashes: Sequence[int]) -> None:
        if self.pending_s > 0:
            self.index.add_pending(worker_id, hashes, self.pending_s)

    def apply(self, worker_id: str, events: list[tuple]) -> None:
        """A worker's ``BlockManager.take_events()``, as the router's consumer applies their published form."""
        for ev in events:
            if ev[0] == STORED:
                self.index.store(worker_id, [ev[1][2]])
            elif ev[0] == REMOVED:
                self.index.remove(worker_id, [ev[1]])
            elif ev[0] == CLEARED:
                self.index.clear(worker_id)


class _SimSource:
    """The router's worker source: live records of the simulation's workers (those added later too)."""

    in_process = True

    def __init__(self, sim: "Simulation") -> None:
        self.sim = sim

    def list(self, role: str) -> list[WorkerInfo]:
        return [w.info() for w in self.sim.pools.get(role, [])]

    def suspect(self, worker_id: str) -> None:
        """A simulated call never fails as if its worker were gone: nothing to hide."""


class _SimStub:
    def __init__(self, worker: SimWorker) -> None:
        self.worker = worker

    def Reserve(self, req: worker_pb2.ReserveRequest, timeout: float = 0.0) -> worker_pb2.ReserveResponse:
        eng = self.worker.engine
        prompt = list(req.prompt_token_ids)
        got = eng.reserve_prompt(req.request_id, len(prompt), prompt if req.accept_cached_prefix else None)
        self.worker.changed()
        if got is None:
            raise StatusRpcError(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{self.worker.worker_id}: too few free blocks")
        return worker_pb2.ReserveResponse(block_ids=got[0], block_size=eng.block_size, kv_name=self.worker.worker_id,
                                          num_cached_tokens=got[1])


class _SimClients:
    """Stubs of the simulation's workers by address (a worker's address is its id)."""

    def __init__(self, sim: "Simulation") -> None:
        self.sim = sim

    def decode(self, address: str) -> _SimStub:
        return _SimStub(self.sim.workers[address])

    prefill = colocated = decode


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

    def utilisation(self, duration_s: float) -> float:
        return self.busy_s / (self.workers * duration_s) if self.workers and duration_s > 0 else 0.0


class Simulation:
    """The virtual clock, the workers and the router (see module docstring)."""

    def __init__(self, profile: "Profile | ProfileSet", cfg: SimConfig) -> None:
        profiles = ProfileSet.of(profile)
        self.profiles = profiles
        self.role_profiles: dict[str, Profile] = {r: profiles.at(cfg.pool_tp(r), cfg.tp_flag(r)) for r in cfg.roles}
        """Each pool's profile: the one taken at its TP."""
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
            pw.submit(lambda: pw.engine.release(wid))
            self.placer.release(p, f.scope, (Hold.PREFILL,))
            d.handlers[wid] = lambda out, _s: self._on_output(f, out)
            d.submit(lambda: d.engine.add_prefilled_request(wid, prompt, SIM_TOKEN, f.params))

        def send_prefill() -> None:
            pw.handlers[wid] = on_prefill
            pw.unprefilled[wid] = len(prompt)
            pw.add_request(wid, prompt, f.params, prefill_only=True)

        # the Reserve reply comes at once (the worker reserves beside its step in flight); a pair's RPCs cost
        # the router more than a whole request's (the profile's per_request_pair_s)
        pair = self.profile.router_per_request_pair_s
        t = self.now + (0.0 if pair is None else max(0.0, pair - self.profile.router_per_request_s))
        if t > self.now:
            self.at(t, send_prefill)
        else:
            send_prefill()

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
