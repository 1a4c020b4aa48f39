"""The simulation's workers and what its router sees of them.

Lifecycle: ``Simulation`` (simulator/cluster_sim.py) creates one ``SimWorker`` per worker (a real ``LLMEngine`` on the
simulated runner, ``simulator.engine_sim``), submits engine calls to it as the real engine loop would (at once when
idle, else at the end of the step in progress) and moves it through its steps on the virtual clock. The router's
objects read the workers through the adapters here: ``_SimSource`` (the registry), ``_SimClients`` / ``_SimStub``
(the Reserve RPC, answered from the engine at once, as a worker answers it beside its step) and ``_SimKVEvents`` (the
KV-event consumer: the router's own ``KVIndex`` on the virtual clock, fed by every engine's prefix-cache events).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional, Sequence

import grpc

from engine.block_manager import CLEARED, REMOVED, STORED
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from proto import worker_pb2
from proto.worker_pb2 import WorkerInfo
from router.kv.index import KVIndex
from simulator.engine_sim import sim_engine
from transport.errors import StatusRpcError

if TYPE_CHECKING:
    from simulator.cluster_sim import Simulation

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
    """The router's KV-event consumer in the simulation (what ``Placer`` reads of ``router.kv.index.KVEventConsumer``):
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
